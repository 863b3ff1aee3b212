"""`GET /health` says "stalled" while an engine step has run past its step_watch_s (engine/
watchdog.py), and "ok" again once it returns. The app is the real one (adapters/server.py) over a
real engine on the demo model, in process; the step is held by a listener that blocks (emission
runs on the engine thread), as a device wait that nothing answers would hold it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from fastapi.testclient import TestClient

from adapters.server import create_app
from adapters.state import AppState
from engine.engine import Engine
from engine.options import EngineOptions
from engine.sampling import SamplingParams
from freetoken_agent.service import ChatService
from freetoken_agent.tokenizer import ChatTokenizer


def test_health_reports_a_stalled_step(demo_model: Callable[[str], Path]) -> None:
    model = demo_model("qwen3_moe")
    release = threading.Event()
    with Engine(model, EngineOptions(dtype="float32", kv_tokens=512, max_running=2, prefill_chunk=64,
                                     step_watch_s=0.3)) as eng:
        service = ChatService(eng, ChatTokenizer.from_dir(model), "freetoken-demo", 0, 64)
        client = TestClient(create_app(AppState(service=service, model_name="freetoken-demo")))
        before = client.get("/health").json()
        assert before["status"] == "ok" and "stalled_step_s" not in before
        handle = eng.submit(list(range(300, 320)), SamplingParams(max_tokens=2, ignore_eos=True),
                            listener=lambda t: t is not None and release.wait(timeout=30))
        deadline = time.monotonic() + 20
        body = client.get("/health").json()
        while body["status"] != "stalled" and time.monotonic() < deadline:
            time.sleep(0.05)
            body = client.get("/health").json()
        release.set()
        assert body["status"] == "stalled" and body["stalled_step_s"] >= 0.3, body
        assert len(handle.result(timeout=60)) == 2
        after = client.get("/health").json()
        assert after["status"] == "ok" and "stalled_step_s" not in after
