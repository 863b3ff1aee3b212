"""`freetoken-agent bench ...`: measurement commands (see docs/benchmarks.md for how they are run).

Contract: `add_bench_parser(sub)` registers `bench` and its sub-commands (cpu-experts, decode,
prefill); each sub-command's module exposes `add_parser(sub)` and `run(args) -> int`, and the heavy
imports (torch kernels, the engine) happen inside `run`.
"""

from __future__ import annotations

import argparse
import importlib

# sub-command -> module under freetoken_agent.bench
_COMMANDS = {"cpu-experts": "cpu_experts", "decode": "decode", "prefill": "prefill"}


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="measure speed (CPU expert executor, decode, prefill)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH",
                                     parser_class=type(bench))
    for module in _COMMANDS.values():
        importlib.import_module(f"freetoken_agent.bench.{module}").add_parser(bench_sub)


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command not in _COMMANDS:
        raise ValueError(f"unknown bench {args.bench_command!r}")
    return int(importlib.import_module(f"freetoken_agent.bench.{_COMMANDS[args.bench_command]}").run(args))
