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


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine flags `serve` and `generate` share: CPU threads, expert executor, compute dtype."""
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for torch and the native expert executor (default: one per physical core)")
    p.add_argument("--executor", default="auto", choices=["auto", "native", "torch"],
                   help="routed-expert executor (auto: native on a CPU engine when built, else torch)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32", "float16"],
                   help="compute dtype (default: the checkpoint's)")
