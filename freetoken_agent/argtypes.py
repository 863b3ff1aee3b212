"""argparse value types shared by the sub-commands: they reject bad numbers with a message that
names the expectation, which the CLI prints as its one-line error. `add_engine_arguments` makes the
engine flags from the options' registry (engine/options.py) and `engine_options` turns a command's
arguments into the engine's options: an explicit flag beats the environment, which beats the default."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.options import EngineOptions


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def byte_size(text: str) -> int:
    """'24GiB', '24G' (10^9), '512MiB', '1.5gib' or a plain byte count -> bytes."""
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 24GiB, 512MiB)") from None
    if unit not in _UNITS or value < 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (units: B, KiB, MiB, GiB, TiB, K, M, G, T)")
    return int(value * _UNITS[unit])


def gpu_memory_size(text: str) -> int | None:
    """--gpu-memory: 'auto' -> None (resolved by `resolve_gpu_memory`), 'off' -> 0, else a `byte_size`."""
    word = text.strip().lower()
    if word == "auto":
        return None
    return 0 if word == "off" else byte_size(text)


def resolve_gpu_memory(value: int | None, device: str) -> int:
    """The engine's GPU cap from --gpu-memory: `value` when given; for 'auto', what is free on a CUDA
    device less a margin (engine/gpu/budget.py, said on stderr), 0 (no expert cache) elsewhere."""
    if value is not None:
        return value
    if not device.startswith("cuda"):
        return 0
    import sys

    from engine.gpu.budget import auto_cap, auto_margin, device_memory

    free, reserved, total = device_memory(device)
    cap = auto_cap(free, reserved, total)
    print(f"--gpu-memory auto: {cap / 2**30:.2f} GiB (free on {device} less {auto_margin(total) / 2**30:.2f} GiB)",
          file=sys.stderr)
    return cap


def positive_int_list(text: str) -> list[int]:
    """'1024,4096' -> [1024, 4096]: a comma list of integers >= 1."""
    items = [t.strip() for t in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}")
    return [positive_int(t) for t in items]


# the engine options every engine command takes as flags; `serve` adds the pool sizes
ENGINE_FLAGS = ("threads", "executor", "dtype", "gpu_memory", "fetch_ratio", "cuda_graphs", "overlap_decode")
POOL_FLAGS = ("kv_tokens", "max_running", "prefill_chunk", "checkpoint_slots", "host_checkpoint_slots")


def _argtype(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An option's parser (engine/options.py, ValueError) as an argparse type (its one-line error)."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def add_engine_arguments(p: argparse.ArgumentParser, threads_flags: tuple[str, ...] = ("--threads",),
                         pools: bool = False) -> None:
    """The engine flags `serve`, `generate` and the model benches share, made from the options'
    registry (engine/options.py: name, help, default); with `pools` the pool sizes too. Each flag
    stores None unless given, so `engine_options` tells a given flag (which beats the environment)
    from an absent one."""
    from engine.options import options

    wanted = ENGINE_FLAGS + (POOL_FLAGS if pools else ())
    for o in options():
        if o.name not in wanted:
            continue
        flags = threads_flags if o.name == "threads" else o.cli
        shown = "auto" if o.name == "gpu_memory" else ("on" if o.default is True else "off" if o.default is False
                                                        else o.default)
        help_text = f"{o.help} (default: {shown}" + (f"; env {o.env}" if o.env else "") + ")"
        kw: dict[str, Any] = {"dest": o.name, "default": None, "help": help_text.replace("%", "%%")}
        if o.name == "gpu_memory":
            kw.update(type=gpu_memory_size, metavar="SIZE|auto|off")
        elif o.type == "bool":
            kw.update(action=argparse.BooleanOptionalAction)
        elif o.choices:
            kw.update(choices=[c for c in o.choices if c])
        elif o.parse is not None:
            kw.update(type=_argtype(o.parse))
        p.add_argument(*flags, **kw)


def engine_options(args: argparse.Namespace, **fixed: Any) -> EngineOptions:
    """The engine's options for a command: what `fixed` says (the command's own decisions), else
    each flag given explicitly, else the environment, else the default (engine/options.py)."""
    from engine.options import EngineOptions, options

    given = {o.name: getattr(args, o.name) for o in options() if getattr(args, o.name, None) is not None}
    return EngineOptions.resolve({**given, **fixed})
