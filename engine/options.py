"""Engine options: one frozen tree, filled once, from one registry; the one module that reads the
environment.

Contract: `EngineOptions` holds the engine's placement and sizes at its root and one frozen
sub-tree per tunable concern: `gpu` (`GpuOptions`, the GPU expert cache's decode steps), `kernels`
(`KernelOptions`, the fused Triton kernels) and `native` (`NativeOptions`, the native CPU
executor). The fields are the registry: each option's name (unique across the tree), type,
default, help, environment variable and CLI flags live in its dataclass field (`options()` lists
them as `Option`s). Three ways to make a tree, all validated at construction (`ConfigError`):
`EngineOptions.of(**flat)` (flat names, defaults for the rest), `opts.replace(**flat)` (a changed
copy) and `EngineOptions.resolve(given, environ=os.environ)`, which fills every option once: its
value in `given` (flat name -> value, e.g. what a CLI was explicitly given), else its environment
variable's (a bad value is a `ConfigError` naming the variable), else its default. No other module
of the engine reads the environment (`triton_interpreted()` answers for Triton's own switch).
`markdown()` is the table of docs/options.md (`python -m engine.options` prints it).

Sizes are budgets the engine never exceeds: `kv_tokens` KV slots (tokens across all requests and the
prefix cache), `max_running` concurrently decoding requests, `prefill_chunk` prompt tokens per step.
Recurrent state (hybrid models only): `checkpoint_slots` device checkpoint slots (snapshots attached
to the radix tree; -1, the default, is sized when the engine starts: 32, or under a GPU cap as many
as fit in 1/16 of it, between 2 and 32, since a checkpoint restores from the host tier in
milliseconds and the cap's room is worth more as expert slots); `host_checkpoint_slots` the
host-memory spill tier for checkpoints (pinned when on CUDA); `state_slots` the device state pool,
shared by live requests' working states and device checkpoints (0 sizes it `max_running +
checkpoint_slots`, so working states never compete with checkpoints; an explicit value caps both
together: a live request always gets a slot first, a checkpoint is spilled to the host tier to make
room). `max_model_len` 0 means the model's `max_position_embeddings`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.errors import ConfigError

_SWITCH = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False, "no": False}


def _switch(text: str) -> bool:
    value = _SWITCH.get(text.strip().lower())
    if value is None:
        raise ValueError("expected one of 1/0, true/false, on/off, yes/no")
    return value


def _auto_switch(text: str) -> bool | None:
    return None if text.strip().lower() == "auto" else _switch(text)


def _int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError("expected an integer") from None


def _at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = _int(text)
        if value < low:
            raise ValueError(f"must be at least {low}, got {value}")
        return value

    return parse


def _float(text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ValueError("expected a number") from None


def _choice(*names: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip()
        if value not in names:
            raise ValueError(f"expected one of {', '.join(names)}")
        return value

    parse.choices = names  # type: ignore[attr-defined]
    return parse


def _opt(default: Any, help: str, parse: Callable[[str], Any] | None = None, env: str | None = None,
         cli: tuple[str, ...] = ()) -> Any:
    """A registry entry: the field's default, its help, how a text value parses (for the environment
    and the CLI), its environment variable and its CLI flags."""
    return field(default=default, metadata={"help": help, "parse": parse, "env": env, "cli": cli})


@dataclass(frozen=True)
class GpuOptions:
    """The GPU expert cache's decode steps (engine/gpu/; docs/gpu-tier.md has the measurements)."""

    host_embed: bool = _opt(True, "under a GPU cap, an embedding table that is not also the LM head lives in "
                            "page-locked host memory (its room becomes expert slots)", _switch, "FREETOKEN_HOST_EMBED")
    plan: str = _opt("fused", "the per-layer cache plan: one Triton program (fused, up to 16 routed entries) or "
                     "~25 torch ops (torch)", _choice("fused", "torch"), "FREETOKEN_PLAN")
    split_expert: bool | None = _opt(None, "split one miss per decode step by rows between a partial fetch and the "
                                     "CPU (auto: wherever it can run; on: insist, a ConfigError where it cannot)",
                                     _auto_switch, "FREETOKEN_SPLIT_EXPERT")
    adapt_ratio: bool | None = _opt(None, "correct the fetch ratio online from which branch finishes last "
                                    "(auto: on with the split expert)", _auto_switch, "FREETOKEN_ADAPT_RATIO")


@dataclass(frozen=True)
class KernelOptions:
    """The fused Triton kernels of the decoder's layers on CUDA (engine/model/ops.py); off, the
    torch ops compute the same."""

    fused_ops: bool = _opt(True, "RMSNorm and rotary as one Triton kernel each", _switch, "FREETOKEN_FUSED_OPS")
    fused_gdn: bool = _opt(True, "the Gated DeltaNet decode step and its gated norm as Triton kernels", _switch,
                           "FREETOKEN_FUSED_GDN")
    fused_router: bool = _opt(True, "the router's softmax, top-k and renormalisation as one Triton kernel", _switch,
                              "FREETOKEN_FUSED_ROUTER")
    fused_shared: bool = _opt(False, "the shared expert's gate, product and sum as one Triton kernel (no gain "
                              "measured)", _switch, "FREETOKEN_FUSED_SHARED")
    gdn: str = _opt("auto", "Gated DeltaNet prompt chunks: fla's chunked kernel for bf16 / fp16 on CUDA (auto), "
                    "or either path forced", _choice("auto", "torch", "fla"), "FREETOKEN_GDN")


@dataclass(frozen=True)
class NativeOptions:
    """The native CPU expert executor (native/)."""

    native_isa: str = _opt("", "force a SIMD path (empty: the best this CPU has)",
                           _choice("", "avx512bf16", "avx512", "avx2", "scalar"), "FREETOKEN_NATIVE_ISA")
    native_threads: int = _opt(0, "the native pool's threads (0: `threads`)", _int, "FREETOKEN_NATIVE_THREADS")
    native_prefetch: int = _opt(1024, "float kernels' software prefetch distance along a weight row, bytes (packed "
                                "kernels: two tiles ahead); 0: both off; benchmarks",
                                _int, "FREETOKEN_NATIVE_PREFETCH")

    def __post_init__(self) -> None:
        if self.native_threads < 0 or self.native_prefetch < 0:
            raise ConfigError("native_threads and native_prefetch must be >= 0")


SECTIONS = {"gpu": GpuOptions, "kernels": KernelOptions, "native": NativeOptions}


@dataclass(frozen=True)
class EngineOptions:
    device: str = _opt("cpu", "compute device: cpu, cuda, cuda:N (each command has its own --device)")
    dtype: str | None = _opt(None, "compute dtype (default: the checkpoint's)",
                             _choice("bfloat16", "float32", "float16"), cli=("--dtype",))
    executor: str = _opt("auto", "routed-expert executor (auto: native on a CPU engine when built, else torch)",
                         _choice("auto", "native", "torch"), cli=("--executor",))
    threads: int = _opt(0, "CPU threads for torch and the native expert executor (0: one per physical core)",
                        _at_least(0), cli=("--threads",))
    kv_tokens: int = _opt(65536, "KV cache size in tokens (all requests and the prefix cache together)", _at_least(1),
                          cli=("--kv-tokens",))
    state_slots: int = _opt(0, "device recurrent-state slots, working states and checkpoints together (0: "
                            "max_running + checkpoint_slots)", _int)
    checkpoint_slots: int = _opt(-1, "recurrent-state checkpoints kept on the device (hybrid models; -1: 32, "
                                 "under a GPU cap as many as fit in 1/16 of it, 2 to 32)", _int,
                                 cli=("--checkpoint-slots",))
    host_checkpoint_slots: int = _opt(128, "checkpoints spilled to host memory before they are dropped (hybrid "
                                      "models)", _int, cli=("--host-checkpoint-slots",))
    max_running: int = _opt(8, "requests decoded together", _at_least(1), cli=("--max-running",))
    prefill_chunk: int = _opt(1024, "prompt tokens per step (a streamed prefill reads every non-resident expert "
                              "once per chunk)", _int, "FREETOKEN_PREFILL_CHUNK", ("--prefill-chunk",))
    max_model_len: int = _opt(0, "longest sequence (0: the model's max_position_embeddings)", _int)
    gpu_memory: int = _opt(0, "bytes: the engine's whole GPU footprint, an expert cache in the room left (0: no "
                           "cache; the CLI's --gpu-memory also takes auto and off)", cli=("--gpu-memory",))
    fetch_ratio: float = _opt(-1.0, "share of cache misses fetched over PCIe, the rest on the CPU (< 0: from the "
                              "stored calibration of this machine, measured at first start)", _float,
                              cli=("--fetch-ratio",))
    calibration_file: str = _opt("", "where measured bandwidths are stored per machine")
    cuda_graphs: bool = _opt(True, "replay decode steps from captured CUDA graphs (off: eagerly, for debugging)",
                             _switch, cli=("--cuda-graphs",))
    overlap_decode: bool = _opt(False, "queue the next captured decode pass before this pass's tokens are read "
                                "(experimental, opt-in until its concurrent GPU test has run: docs/gpu-tier.md)",
                                _switch, "FREETOKEN_OVERLAP_DECODE", ("--overlap-decode",))
    overlap_width: int = _opt(1, "the most sequences an overlapped pass may have", _at_least(1),
                              "FREETOKEN_OVERLAP_WIDTH")
    follow_free_memory: float = _opt(0.0, "seconds between looks at the device's free memory, the expert cache "
                                     "following it (0: the cap stays; the CLI turns it on for --gpu-memory auto)",
                                     _float)
    step_watch_s: float = _opt(120.0, "a step past this many seconds is logged with the engine thread's stack and "
                               "/health says stalled (0: off)", _float, "FREETOKEN_STEP_WATCH_S")
    gpu: GpuOptions = field(default_factory=GpuOptions)
    kernels: KernelOptions = field(default_factory=KernelOptions)
    native: NativeOptions = field(default_factory=NativeOptions)

    def __post_init__(self) -> None:
        for name in ("kv_tokens", "max_running", "prefill_chunk", "overlap_width"):
            if getattr(self, name) < 1:
                raise ConfigError(f"engine option {name} must be >= 1, got {getattr(self, name)}")
        if self.gpu_memory < 0 or self.fetch_ratio > 1 or self.follow_free_memory < 0 or self.step_watch_s < 0:
            raise ConfigError("gpu_memory, follow_free_memory and step_watch_s must be >= 0 and fetch_ratio <= 1")
        for name in ("state_slots", "host_checkpoint_slots", "max_model_len", "threads"):
            if getattr(self, name) < 0:
                raise ConfigError(f"engine option {name} must be >= 0, got {getattr(self, name)}")
        if self.checkpoint_slots < -1:
            raise ConfigError(f"engine option checkpoint_slots must be >= 0 (or -1: sized by the engine), got "
                              f"{self.checkpoint_slots}")
        if self.state_slots and self.state_slots < self.max_running:
            raise ConfigError(f"state_slots ({self.state_slots}) must be >= max_running ({self.max_running})")

    @property
    def device_state_slots(self) -> int:
        """Size of the device state pool (working states + device checkpoints); `checkpoint_slots`
        must be resolved (engine/gpu/budget.py `resolve_checkpoint_slots`)."""
        if self.checkpoint_slots < 0:
            raise ConfigError("checkpoint_slots -1 is sized when the engine starts; these options were not resolved")
        return self.state_slots or self.max_running + self.checkpoint_slots

    @property
    def native_pool_threads(self) -> int:
        """The native pool's threads (0: one per physical core)."""
        return self.native.native_threads or self.threads

    # ------------------------------------------------------------------ construction
    @classmethod
    def of(cls, **flat: Any) -> EngineOptions:
        """A tree from flat option names; the others keep their defaults."""
        return cls().replace(**flat)

    def replace(self, **flat: Any) -> EngineOptions:
        """A copy with the named options (flat names) changed; ConfigError for an unknown name."""
        known = {o.name: o for o in options()}
        unknown = sorted(set(flat) - set(known))
        if unknown:
            raise ConfigError(f"unknown engine option {', '.join(unknown)}")
        root = {k: v for k, v in flat.items() if known[k].section is None}
        sections = {}
        for section in SECTIONS:
            changes = {k: v for k, v in flat.items() if known[k].section == section}
            if changes:
                sections[section] = dataclasses.replace(getattr(self, section), **changes)
        return dataclasses.replace(self, **root, **sections)

    @classmethod
    def resolve(cls, given: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> EngineOptions:
        """Every option once: `given[name]`, else its environment variable, else its default."""
        given = dict(given or {})
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for o in options():
            if o.name in given:
                values[o.name] = given.pop(o.name)
            elif o.env is not None and environ.get(o.env, "").strip():
                values[o.name] = o.parse_env(environ[o.env])
        if given:
            raise ConfigError(f"unknown engine option {', '.join(sorted(given))}")
        return cls.of(**values)


@dataclass(frozen=True)
class Option:
    """One registry entry, read from its dataclass field."""

    name: str
    section: str | None  # None: the root of the tree
    type: str
    default: Any
    help: str
    env: str | None
    cli: tuple[str, ...]
    parse: Callable[[str], Any] | None

    @property
    def path(self) -> str:
        return self.name if self.section is None else f"{self.section}.{self.name}"

    def parse_env(self, text: str) -> Any:
        assert self.env is not None and self.parse is not None
        try:
            return self.parse(text)
        except ValueError as e:
            raise ConfigError(f"{self.env}={text!r}: {e}") from None

    @property
    def choices(self) -> tuple[str, ...] | None:
        return getattr(self.parse, "choices", None)


def _entries(cls: type, section: str | None) -> Iterator[Option]:
    for f in dataclasses.fields(cls):
        if f.name in SECTIONS:
            continue
        m = f.metadata
        yield Option(f.name, section, str(f.type), f.default, m["help"], m["env"], m["cli"], m["parse"])


def options() -> list[Option]:
    """Every option of the tree, root first, then each section's."""
    out = list(_entries(EngineOptions, None))
    for section, cls in SECTIONS.items():
        out.extend(_entries(cls, section))
    return out


def triton_interpreted() -> bool:
    """Whether Triton runs its kernels in its interpreter (TRITON_INTERPRET=1, Triton's own switch:
    the CPU tests of the kernels)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _shown(value: Any) -> str:
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f'"{value}"' if isinstance(value, str) else str(value)


def markdown() -> str:
    """docs/options.md: every option, once."""
    lines = ["# Engine options", "",
             "Generated from the registry in `engine/options.py` (`python -m engine.options > docs/options.md`;",
             "a test checks that this file is up to date). Each option is set once when the engine starts: a",
             "CLI flag given explicitly, else the environment variable, else the default. Switches take",
             "1/0, true/false, on/off or yes/no; `auto` options also take `auto`.", "",
             "| option | CLI | environment | type | default | what it does |",
             "| --- | --- | --- | --- | --- | --- |"]
    kinds = {"bool": "switch", "bool | None": "switch or `auto`"}
    for o in options():
        flags = [f"--[no-]{c[2:]}" if o.type == "bool" else c for c in o.cli]
        cli = ", ".join(f"`{c}`" for c in flags) or "-"
        env = f"`{o.env}`" if o.env else "-"
        kind = (" \\| ".join(f"`{c}`" if c else '`""`' for c in o.choices) if o.choices
                else kinds.get(o.type, f"`{o.type}`"))
        lines.append(f"| `{o.path}` | {cli} | {env} | {kind} | {_shown(o.default)} | {o.help} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
