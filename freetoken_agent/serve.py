"""`freetoken-agent serve`: load the model once and serve every protocol over HTTP.

Contract: binds 127.0.0.1:8000 by default; `--api-key` turns on authentication; the served model
name defaults to `freetoken-demo` for the demo model and to the directory name otherwise;
`--anchor-policy` picks where prefill checkpoints go (freetoken_agent/sessions/anchors.py). The HTTP
layer lives in `adapters/` (the top layer); this command is the composition root that wires it to
the engine and the chat service, so it imports it lazily.
"""

from __future__ import annotations

import argparse
import sys

from engine.engine import Engine
from freetoken_agent.argtypes import add_engine_arguments, engine_options, positive_int, resolve_gpu_memory
from freetoken_agent.calibrate import calibration_path
from freetoken_agent.models import resolve_model
from freetoken_agent.progress import load_progress
from freetoken_agent.service import ChatService
from freetoken_agent.sessions import AnchorPolicy, SessionManager
from freetoken_agent.tokenizer import ChatTokenizer

# --gpu-memory auto: how often the server looks at the device's free memory, the expert cache following it
FOLLOW_S = 5.0


def add_serve_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="serve the model over HTTP (OpenAI, Anthropic and Responses protocols)")
    p.add_argument("--model", default="demo", help="model directory, or 'demo' (default)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=positive_int, default=8000)
    p.add_argument("--api-key", default=None, help="require this key (Authorization: Bearer or x-api-key)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    p.add_argument("--context-window", type=positive_int, default=None, help="tokens per request (default: the model's)")
    p.add_argument("--max-output-tokens", type=positive_int, default=32768)
    add_engine_arguments(p, pools=True)
    p.add_argument("--ping-interval", type=float, default=5.0, help="seconds between keep-alive events")
    p.add_argument("--anchor-policy", default="semantic", choices=[a.value for a in AnchorPolicy],
                   help="where prefill keeps state checkpoints: semantic (client-aware, default), positional "
                        "(every 8192 tokens + request end) or user-only (user-turn starts + request end); "
                        "the last two are benchmark baselines")
    p.add_argument("--log-level", default="warning")


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from adapters.server import create_app
    from adapters.state import AppState

    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = resolve_model(args.model)
    name = args.served_model_name or ("freetoken-demo" if args.model.startswith("demo") else model_dir.name)
    tokenizer = ChatTokenizer.from_dir(model_dir)
    opts = engine_options(args, device=device, gpu_memory=resolve_gpu_memory(args.gpu_memory, device),
                          follow_free_memory=FOLLOW_S if args.gpu_memory is None else 0.0,
                          calibration_file=str(calibration_path()))
    with load_progress("loading weights") as progress:
        engine = Engine(model_dir, opts, progress=progress)
    sessions = SessionManager(tokenizer, AnchorPolicy(args.anchor_policy), engine=engine)
    service = ChatService(engine, tokenizer, name, args.context_window, args.max_output_tokens, sessions=sessions)
    state = AppState(service=service, model_name=name, api_key=args.api_key, aliases=(str(model_dir),),
                     ping_interval=args.ping_interval)
    app = create_app(state)
    print(f"freetoken-agent: serving {name!r} ({engine.cfg.family}, {device}) on http://{args.host}:{args.port}"
          f" (context {service.context_window} tokens, anchor policy {sessions.policy.value}, experts: "
          f"{engine.decoder.executor.describe()})", file=sys.stderr,
          flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    finally:
        engine.close()
    return 0
