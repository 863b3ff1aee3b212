"""The `freetoken-agent` command line.

Contract: `main(argv)` parses the sub-command and returns an exit status. Every user error (bad
arguments, a broken model directory, an invalid request) is printed as one line on stderr,
`error: ...`, with a non-zero status and no traceback.
"""

from __future__ import annotations

import argparse
import sys

from engine.errors import EngineError
from freetoken_agent.argtypes import add_engine_arguments, non_negative_float, positive_int
from freetoken_agent.models import UsageError


class _Parser(argparse.ArgumentParser):
    """Reports argument errors as one line, like every other error of the CLI."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="freetoken-agent", description="Local MoE runtime for coding agents.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    demo = sub.add_parser("demo-model", help="write the small random demo model (Hugging Face layout)")
    demo.add_argument("out_dir")
    demo.add_argument("--arch", default="qwen3_5_moe", choices=["qwen3_5_moe", "qwen3_moe"])

    from freetoken_agent.serve import add_serve_parser

    add_serve_parser(sub)

    from freetoken_agent.configure import add_configure_parser

    add_configure_parser(sub)

    from freetoken_agent.bench import add_bench_parser

    add_bench_parser(sub)

    from freetoken_agent.sessions.cli import add_sessions_parser

    add_sessions_parser(sub)

    from freetoken_agent.calibrate import add_calibrate_parser

    add_calibrate_parser(sub)

    gen = sub.add_parser("generate", help="generate text for one prompt, no server")
    gen.add_argument("--model", default="demo", help="model directory, or 'demo' (default)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=positive_int, default=128)
    gen.add_argument("--temperature", type=non_negative_float, default=None,
                     help="sampling temperature (greedy when not given)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    gen.add_argument("--no-think", action="store_true", help="chat template with thinking disabled")
    gen.add_argument("--output-ids", action="store_true", help="print the generated ids as a JSON list last")
    gen.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    add_engine_arguments(gen)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo-model":
            from freetoken_agent.demo import write_demo_model

            out = write_demo_model(args.out_dir, args.arch)
            print(f"wrote {args.arch} demo model to {out}")
            return 0
        if args.command == "configure":
            return int(args.func(args))
        if args.command == "serve":
            from freetoken_agent.serve import run_serve

            return run_serve(args)
        if args.command == "bench":
            from freetoken_agent.bench import run_bench

            return run_bench(args)

        if args.command == "calibrate":
            from freetoken_agent.calibrate import run_calibrate

            return run_calibrate(args)
        if args.command == "sessions":
            from freetoken_agent.sessions.cli import run_sessions

            return run_sessions(args)
        if args.command == "generate":
            from freetoken_agent.generate import run_generate

            return run_generate(args)
    except (EngineError, UsageError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 1
