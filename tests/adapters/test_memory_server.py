"""`GET /v1/memory` and `POST /v1/memory` through real servers (CPU engines here: the KV pool resized
while idle with the same replies after, a 409 while a request runs; no GPU expert cache,
which both routes say in the caller's protocol shape); the resize itself is tested on the engine
(tests/engine/gpu_cache/test_elastic.py, CPU and `gpu`). Bad bodies are 400s that change nothing,
the server keeps serving, and the routes need the API key like every /v1 route."""

from __future__ import annotations

import httpx
from server_fixture import ServerProcess, assert_openai_error


def test_get_reports_the_device_and_no_cache(q3: ServerProcess) -> None:
    r = httpx.get(q3.url("/v1/memory"), timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "memory" and body["device"] == "cpu" and body["gpu_memory"] is None
    assert set(body["pools"]) == {"kv_tokens", "checkpoint_slots", "host_checkpoint_slots"}


def test_post_resizes_the_pools_and_the_answers_stay(q3: ServerProcess) -> None:
    """Another KV pool size, then the old size back: the same greedy reply each time; a count that
    is not one, or a pool below the advertised context window, is a 400, nothing changed."""
    def reply() -> str:
        r = httpx.post(q3.url("/v1/chat/completions"), timeout=120, json={
            "model": "freetoken-demo", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "count"}]})
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])

    before = httpx.get(q3.url("/v1/memory"), timeout=30).json()["pools"]
    window = _window(q3)  # the smallest pool the server takes: the context window it advertises
    first = reply()
    try:  # the server is shared: its pools go back whatever happens here
        r = httpx.post(q3.url("/v1/memory"), json={"kv_tokens": window + 64}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["pools"]["kv_tokens"] == window + 64
        assert reply() == first
        for bad in ({"kv_tokens": 0}, {"kv_tokens": "many"}, {"checkpoint_slots": -1}, {"kv_tokens": 1.5},
                    {"kv_tokens": 10**13}):  # the last: more than the host holds
            err = assert_openai_error(httpx.post(q3.url("/v1/memory"), json=bad, timeout=30), 400)
            assert err["param"] == next(iter(bad)), err
        err = assert_openai_error(httpx.post(q3.url("/v1/memory"), json={"kv_tokens": window - 1}, timeout=30), 400)
        assert str(window) in err["message"] and err["param"] == "kv_tokens", err
        assert httpx.get(q3.url("/v1/memory"), timeout=30).json()["pools"]["kv_tokens"] == window + 64
    finally:
        r = httpx.post(q3.url("/v1/memory"), json={"kv_tokens": before["kv_tokens"]}, timeout=60)
    assert r.status_code == 200 and r.json()["pools"] == before
    assert reply() == first


def test_post_without_a_cache_or_with_a_bad_size_is_a_400(q3: ServerProcess) -> None:
    cases = [({"gpu_memory": "8GiB"}, "no GPU expert cache"), ({"gpu_memory": "lots"}, "not a size: 'lots'"),
             ({"gpu_memory": True}, "expected a size"), ({"gpu_memory": None}, "expected a size"),
             ({"gpu_memory": 0}, "must be positive"), ({"gpu_memory": "off"}, "must be positive")]
    for body, message in cases:
        r = httpx.post(q3.url("/v1/memory"), json=body, timeout=30)
        err = assert_openai_error(r, 400)
        assert message in err["message"] and err["param"] == "gpu_memory", (body, err)
    r = httpx.post(q3.url("/v1/memory"), content=b"not json", headers={"content-type": "application/json"},
                   timeout=30)
    assert_openai_error(r, 400)
    assert_openai_error(httpx.post(q3.url("/v1/memory"), json={}, timeout=30), 400)  # nothing to change
    assert httpx.get(q3.url("/v1/memory"), timeout=30).json()["gpu_memory"] is None  # nothing changed
    assert httpx.get(q3.url("/health"), timeout=30).status_code == 200


def test_memory_routes_need_the_key(locked: ServerProcess) -> None:
    assert_openai_error(httpx.get(locked.url("/v1/memory"), timeout=30), 401)
    assert_openai_error(httpx.post(locked.url("/v1/memory"), json={"gpu_memory": "1GiB"}, timeout=30), 401)
    r = httpx.get(locked.url("/v1/memory"), headers=locked.headers(), timeout=30)
    assert r.status_code == 200 and r.json()["object"] == "memory"


def test_pools_while_a_request_runs_are_a_409(endless: ServerProcess) -> None:
    import time

    body = {"max_tokens": 4000, "stream": True,
            "messages": [{"role": "user", "content": "go on"}]}
    with httpx.Client(timeout=120) as client, client.stream("POST", endless.url("/v1/chat/completions"),
                                                             json={**body, "model": _model(endless)}) as stream:
        chunks = stream.iter_lines()
        next(chunks)  # generating now
        deadline = time.monotonic() + 30
        while httpx.get(endless.url("/health"), timeout=30).json()["running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        pools = httpx.get(endless.url("/v1/memory"), timeout=30).json()["pools"]
        err = assert_openai_error(httpx.post(endless.url("/v1/memory"), json={"kv_tokens": _window(endless) + 8},
                                             timeout=60), 409)
        assert "while requests are queued or running" in err["message"] and err["code"] == "engine_busy"
    assert httpx.get(endless.url("/v1/memory"), timeout=30).json()["pools"] == pools  # unchanged


def _window(server: ServerProcess) -> int:
    return int(httpx.get(server.url("/v1/models"), timeout=30).json()["data"][0]["context_window"])


def _model(server: ServerProcess) -> str:
    return str(httpx.get(server.url("/v1/models"), timeout=30).json()["data"][0]["id"])


def test_metrics_carry_the_pools_and_the_gpu_split(q3: ServerProcess) -> None:
    kv = httpx.get(q3.url("/v1/memory"), timeout=30).json()["pools"]["kv_tokens"]
    text = httpx.get(q3.url("/metrics"), timeout=30).text
    assert f"freetoken_kv_pool_tokens {float(kv)}" in text
    assert "freetoken_gpu_memory_bytes{" not in text  # a CPU engine: no cap, no split

    from adapters.state import Metrics

    class Cached:  # what an engine with a GPU expert cache reports (Engine.memory_report)
        def memory_report(self) -> dict[str, object]:
            return {"device": "cuda", "pools": {"kv_tokens": 4096}, "gpu_memory": {
                "cap_bytes": 100, "peak_allocated_bytes": 90,
                "budget": {"dense": 10, "kv": 20, "states": 5, "workspace": 15, "experts": 50},
                "expert_cache": {"hits": 3, "misses": 1, "fetched": 1, "hit_rate": 0.75}}}

    m = Metrics()
    m.observe_engine(Cached())
    got = {s.labels.get("part", s.name): s.value for metric in m.registry.collect() for s in metric.samples
           if s.name in ("freetoken_gpu_memory_bytes", "freetoken_expert_cache_hit_rate", "freetoken_kv_pool_tokens")}
    assert got == {"cap": 100, "peak": 90, "dense": 10, "kv": 20, "states": 5, "workspace": 15, "experts": 50,
                   "freetoken_expert_cache_hit_rate": 0.75, "freetoken_kv_pool_tokens": 4096}
