"""The native executor's SIMD paths a bench names with `--isa`: `auto` (the one in force), `all`
(every supported one but scalar), or a comma list, each checked against what this CPU supports."""

from __future__ import annotations

from typing import Any


def resolve_isas(arg: str, ft: Any) -> list[str]:
    """The SIMD paths `--isa` names (auto: the one in force; all: every supported one but scalar)."""
    supported = ft.supported_isas()
    isas = ([i for i in supported if i != "scalar"] if arg == "all" else
            [ft.get_isa()] if arg == "auto" else arg.split(","))
    for i in isas:
        if i not in supported:
            raise ValueError(f"ISA {i!r} is not supported here (supported: {', '.join(supported)})")
    return isas
