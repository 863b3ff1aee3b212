"""`freetoken-agent serve`: load the model once and serve every protocol over HTTP.

Contract: binds 127.0.0.1:8000 by default; `--model` is a directory, a Hugging Face id in the local
cache or `demo` (freetoken_agent/models.py); `--device auto` (the default) is CUDA when a CUDA
device is present (the expert cache then under `--gpu-memory auto`), else the CPU, and the banner
names the device it chose; `--api-key` turns on authentication; the served model name defaults to
`freetoken-demo` for the demo model, to the id for a Hugging Face id and to the directory name
otherwise; `--anchor-policy` picks where prefill checkpoints go (freetoken_agent/sessions/anchors.py).
Hardening (docs/security.md): `--max-request-bytes` caps a request body (default: sized for the
context window), `--allowed-hosts` extends the Host names served (loopback names only by default
when bound to a loopback address; any when bound elsewhere, unless this is given), `--admin-key`
gates `POST /v1/memory`, `--shutdown-grace` is how long running generations get after SIGTERM.
`--warmup` (auto: on CUDA) runs engine/warmup.py's requests before the port opens.
The HTTP layer lives in `adapters/` (the top layer); this command is the composition root that
wires it to the engine and the chat service. Defining the parser imports neither torch nor the
engine: `run_serve` does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from freetoken_agent.argtypes import add_engine_arguments, positive_int

# --gpu-memory auto: how often the server looks at the device's free memory, the expert cache following it
FOLLOW_S = 5.0
# the values of freetoken_agent.sessions.AnchorPolicy (spelt here so that --help imports no engine)
ANCHOR_POLICIES = ("semantic", "positional", "user-only")


def resolve_device(choice: str) -> str:
    """--device: `auto` is cuda when torch sees a CUDA device, else cpu; `cuda` without one is an error."""
    import torch

    from freetoken_agent.models import UsageError

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available here (use --device cpu or auto)")
    return choice


def add_serve_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="serve the model over HTTP (OpenAI, Anthropic and Responses protocols)")
    p.add_argument("--model", default="demo", metavar="PATH|HF_ID|demo",
                   help="a model directory, a Hugging Face id in the local cache (see `pull`), or demo "
                        "(a small random model, written on first use)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: reachable from this machine only)")
    p.add_argument("--port", type=positive_int, default=8000, help="TCP port")
    p.add_argument("--api-key", default=None, help="require this key (Authorization: Bearer or x-api-key)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: freetoken-demo for the demo, else the id or "
                        "the directory name)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="compute device (auto: cuda when a CUDA device is present, else cpu)")
    p.add_argument("--context-window", type=positive_int, default=None, help="tokens per request (default: the model's)")
    p.add_argument("--max-output-tokens", type=positive_int, default=32768,
                   help="output limit of a request that names none")
    add_engine_arguments(p, pools=True)
    p.add_argument("--ping-interval", type=float, default=5.0, help="seconds between keep-alive events")
    p.add_argument("--anchor-policy", default="semantic", choices=ANCHOR_POLICIES,
                   help="where prefill keeps state checkpoints: semantic (client-aware, default), positional "
                        "(every 8192 tokens + request end) or user-only (user-turn starts + request end); "
                        "the last two are benchmark baselines")
    p.add_argument("--max-request-bytes", type=positive_int, default=None,
                   help="largest request body in bytes (default: 1 MiB + 32 bytes per context-window token)")
    p.add_argument("--allowed-hosts", default=None, metavar="NAME[,NAME...]",
                   help="Host header names to answer besides localhost, 127.0.0.1 and ::1 (* for any); "
                        "default: those three when --host is a loopback address, any otherwise")
    p.add_argument("--admin-key", default=None,
                   help="require this key (instead of --api-key) for POST /v1/memory, which resizes the pools")
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds running generations get to finish after SIGTERM before their streams end")
    p.add_argument("--warmup", default="auto", choices=["auto", "on", "off"],
                   help="before serving, run a few requests of random tokens so that kernels compile and "
                        "decode graphs are captured then, not in the first clients' time to first token "
                        "(auto: on CUDA only; the prefix cache is emptied after)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="server log level (info: one line per request)")


def default_model_name(spec: str, model_dir: Path) -> str:
    """The served name when --served-model-name is not given."""
    if spec == "demo" or spec.startswith("demo:"):
        return "freetoken-demo"
    return spec if not Path(spec).expanduser().exists() else model_dir.name


def allowed_hosts(bind: str, extra: str | None) -> tuple[str, ...] | None:
    """Host names to answer: loopback names (plus `extra`); None (any) for a non-loopback bind
    without `extra`."""
    from adapters.guard import LOOPBACK_HOSTS, host_name

    names = tuple(host_name(h) for h in (extra or "").split(",") if h.strip())
    if not names and bind not in ("127.0.0.1", "localhost", "::1") and not bind.startswith("127."):
        return None
    return (*LOOPBACK_HOSTS, *names)


def run_serve(args: argparse.Namespace) -> int:
    from adapters.guard import Limits
    from adapters.server import create_app
    from adapters.state import AppState
    from adapters.transport import serve
    from engine.engine import Engine
    from freetoken_agent.argtypes import engine_options, resolve_gpu_memory
    from freetoken_agent.calibrate import calibration_path
    from freetoken_agent.models import load_tokenizer, resolve_model
    from freetoken_agent.progress import load_progress
    from freetoken_agent.service import ChatService
    from freetoken_agent.sessions import AnchorPolicy, SessionManager

    model_dir = resolve_model(args.model)
    device = resolve_device(args.device)
    name = args.served_model_name or default_model_name(args.model, model_dir)
    with load_progress("reading the tokenizer"):
        tokenizer = load_tokenizer(model_dir)
    opts = engine_options(args, device=device, gpu_memory=resolve_gpu_memory(args.gpu_memory, device),
                          follow_free_memory=FOLLOW_S if args.gpu_memory is None else 0.0,
                          calibration_file=str(calibration_path()))
    with load_progress("loading weights") as progress:
        engine = Engine(model_dir, opts, progress=progress)
    if args.warmup == "on" or (args.warmup == "auto" and device == "cuda"):
        from engine.warmup import warm_up

        with load_progress("warming up (compiling kernels, capturing decode graphs)"):
            done = warm_up(engine)
        print(f"freetoken-agent: warm-up: {done['requests']} requests, {done['prompt_tokens']} prompt tokens "
              f"in {done['seconds']:.1f} s", file=sys.stderr, flush=True)
        from engine import late_work

        late_work.watch(lambda kind, what, s: print(f"freetoken-agent: {kind} after the warm-up: {what} ({s:.2f} s)",
                                                    file=sys.stderr, flush=True))
    sessions = SessionManager(tokenizer, AnchorPolicy(args.anchor_policy), engine=engine)
    service = ChatService(engine, tokenizer, name, args.context_window, args.max_output_tokens, sessions=sessions)
    limits = Limits(max_request_bytes=args.max_request_bytes, allowed_hosts=allowed_hosts(args.host, args.allowed_hosts),
                    api_key=args.api_key, admin_key=args.admin_key)
    state = AppState(service=service, model_name=name, api_key=args.api_key, aliases=(str(model_dir),),
                     ping_interval=args.ping_interval, limits=limits)
    app = create_app(state)
    chosen = f"{device}, chosen by --device auto" if args.device == "auto" else device
    print(f"freetoken-agent: serving {name!r} ({engine.cfg.family}, {chosen}) on http://{args.host}:{args.port}"
          f" (context {service.context_window} tokens, anchor policy {sessions.policy.value}, experts: "
          f"{engine.decoder.executor.describe()})", file=sys.stderr,
          flush=True)
    try:
        serve(app, state, args.host, args.port, args.log_level, args.shutdown_grace)
    finally:
        engine.close()
    return 0
