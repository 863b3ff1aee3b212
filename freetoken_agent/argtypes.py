"""argparse value types shared by the sub-commands: they reject bad numbers with a message that
names the expectation, which the CLI prints as its one-line error."""

from __future__ import annotations

import argparse


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


def add_engine_arguments(p: argparse.ArgumentParser, threads_flags: tuple[str, ...] = ("--threads",)) -> None:
    """The engine flags `serve`, `generate` and the model benches share: CPU threads (spelt
    `threads_flags`), expert executor, compute dtype, GPU memory cap, fetch ratio, CUDA graphs."""
    p.add_argument(*threads_flags, dest="threads", type=int, default=0,
                   help="CPU threads for torch and the native expert executor (default: one per physical core)")
    p.add_argument("--executor", default="auto", choices=["auto", "native", "torch"],
                   help="routed-expert executor (auto: native on a CPU engine when built, else torch)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32", "float16"],
                   help="compute dtype (default: the checkpoint's)")
    p.add_argument("--gpu-memory", type=gpu_memory_size, default=None, metavar="SIZE|auto|off",
                   help="cap on the engine's whole GPU footprint, e.g. 24GiB; the room left after dense weights, "
                        "KV cache, states and workspace holds a GPU expert cache (CUDA only). Default auto: what "
                        "is free on the device less a margin (5 %%, at least 1 GiB); off (or 0): no expert cache")
    p.add_argument("--fetch-ratio", type=float, default=-1.0,
                   help="share of cache misses fetched over PCIe, the rest run on the CPU (default: from the "
                        "stored calibration of this machine, measured at first start)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run decode steps eagerly instead of replaying captured CUDA graphs (debugging)")
    p.add_argument("--overlap-decode", action=argparse.BooleanOptionalAction, default=False,
                   help="queue the next captured decode pass before this pass's tokens are read (experimental, "
                        "opt-in until its concurrent GPU test has run: docs/gpu-tier.md; "
                        "FREETOKEN_OVERLAP_DECODE=1 does the same)")
