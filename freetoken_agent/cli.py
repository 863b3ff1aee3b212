"""The `freetoken-agent` command line.

Contract: `main(argv)` parses the sub-command and returns an exit status. Every user error (bad
arguments, a broken model directory, an invalid request) is printed as one line on stderr,
`error: ...`, with a non-zero status and no traceback. `--version` prints `freetoken-agent X.Y.Z`.
`build_parser()` defines every sub-command without importing torch or the engine (each command's
module loads them inside its `run` function), so `--help` and `--version` answer at once. Every
option has a help text, and the help shows each option's default.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from freetoken_agent import __version__
from freetoken_agent.argtypes import add_engine_arguments, non_negative_float, positive_int


class HelpFormatter(argparse.HelpFormatter):
    """Appends `(default: X)` to an option's help unless the help already names its default, the
    default is empty (None, False) or the option is a flag."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default is argparse.SUPPRESS or "default" in text.lower()
                or action.nargs == 0 or not action.option_strings):
            return text
        shown = ",".join(str(v) for v in default) if isinstance(default, list | tuple) else default
        return f"{text} (default: {str(shown).replace('%', '%%')})"


class Parser(argparse.ArgumentParser):
    """Reports argument errors as one line, like every other error of the CLI."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    gen = sub.add_parser("generate", help="generate text for one prompt, no server",
                         description="Run one prompt through the model and stream the reply to stdout "
                                     "(reasoning, when the model thinks, goes to stderr).")
    gen.add_argument("--model", default="demo", metavar="PATH|HF_ID|demo",
                     help="a model directory, a Hugging Face id in the local cache (see `pull`), or demo")
    gen.add_argument("--prompt", required=True, help="the user message (the raw text with --raw)")
    gen.add_argument("--max-tokens", type=positive_int, default=128, help="tokens to generate at most")
    gen.add_argument("--temperature", type=non_negative_float, default=None,
                     help="sampling temperature (greedy when not given)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (random when not given)")
    gen.add_argument("--raw", action="store_true",
                     help="feed the prompt as is, without the chat template, and print every generated token")
    gen.add_argument("--no-think", action="store_true", help="chat template with thinking disabled")
    gen.add_argument("--output-ids", action="store_true", help="print the generated ids as a JSON list last")
    gen.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                     help="compute device (auto: cuda when a CUDA device is present, else cpu)")
    add_engine_arguments(gen)


def build_parser() -> argparse.ArgumentParser:
    from freetoken_agent.bench import add_bench_parser
    from freetoken_agent.calibrate import add_calibrate_parser
    from freetoken_agent.configure import add_configure_parser
    from freetoken_agent.demo import ARCHES
    from freetoken_agent.eval.cli import add_eval_parser
    from freetoken_agent.pull import add_pull_parser
    from freetoken_agent.serve import add_serve_parser
    from freetoken_agent.sessions.cli import add_sessions_parser

    parser = Parser(prog="freetoken-agent",
                    description="A local runtime for large Mixture-of-Experts models under coding agents: "
                                "serves OpenAI, Anthropic and Responses APIs on loopback.")
    parser.add_argument("--version", action="version", version=f"freetoken-agent {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    add_serve_parser(sub)
    add_pull_parser(sub)
    add_configure_parser(sub)
    _add_generate_parser(sub)
    add_sessions_parser(sub)
    demo = sub.add_parser("demo-model", help="write the small random demo model (Hugging Face layout)")
    demo.add_argument("out_dir", help="directory to write it to (created if missing)")
    demo.add_argument("--arch", default=ARCHES[0], choices=ARCHES, help="model family")
    add_calibrate_parser(sub)
    add_bench_parser(sub)
    add_eval_parser(sub)
    return parser


def _run(args: argparse.Namespace) -> int:
    if args.command == "demo-model":
        from freetoken_agent.demo import write_demo_model
        from freetoken_agent.progress import load_progress

        with load_progress(f"writing the {args.arch} demo model") as progress:
            out = write_demo_model(args.out_dir, args.arch, progress=progress)
        print(f"wrote {args.arch} demo model to {out}")
        return 0
    if args.command == "configure":
        return int(args.func(args))
    if args.command == "serve":
        from freetoken_agent.serve import run_serve

        return run_serve(args)
    if args.command == "pull":
        from freetoken_agent.pull import run_pull

        return run_pull(args)
    if args.command == "bench":
        from freetoken_agent.bench import run_bench

        return run_bench(args)
    if args.command == "calibrate":
        from freetoken_agent.calibrate import run_calibrate

        return run_calibrate(args)
    if args.command == "sessions":
        from freetoken_agent.sessions.cli import run_sessions

        return run_sessions(args)
    if args.command == "eval":
        from freetoken_agent.eval.cli import run_eval

        return run_eval(args)
    if args.command == "generate":
        from freetoken_agent.generate import run_generate

        return run_generate(args)
    return 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from engine.errors import EngineError
    from freetoken_agent.models import UsageError

    try:
        return _run(args)
    except (EngineError, UsageError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
