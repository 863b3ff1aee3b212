"""`freetoken-agent bench ...`: measurement commands (see docs/benchmarks.md for how they are run).

Contract: `add_bench_parser(sub)` registers `bench` and its sub-commands; each sub-command's module
exposes `add_parser(sub)` and `run(args) -> int` and is imported only when used.
"""

from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="measure speed (CPU expert executor, ...)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH",
                                     parser_class=type(bench))
    from freetoken_agent.bench import cpu_experts

    cpu_experts.add_parser(bench_sub)


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "cpu-experts":
        from freetoken_agent.bench import cpu_experts

        return cpu_experts.run(args)
    raise ValueError(f"unknown bench {args.bench_command!r}")
