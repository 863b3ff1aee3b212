"""`GET /v1/memory` and `POST /v1/memory` through real servers (CPU engines here: no GPU expert cache,
which both routes say in the caller's protocol shape); the resize itself is tested on the engine
(tests/engine/gpu_cache/test_elastic.py, CPU and `gpu`). Bad bodies are 400s that change nothing,
the server keeps serving, and the routes need the API key like every /v1 route."""

from __future__ import annotations

import httpx
from server_fixture import ServerProcess, assert_openai_error


def test_get_reports_the_device_and_no_cache(q3: ServerProcess) -> None:
    r = httpx.get(q3.url("/v1/memory"), timeout=30)
    assert r.status_code == 200, r.text
    assert r.json() == {"object": "memory", "device": "cpu", "gpu_memory": None}


def test_post_without_a_cache_or_with_a_bad_size_is_a_400(q3: ServerProcess) -> None:
    cases = [({"gpu_memory": "8GiB"}, "no GPU expert cache"), ({"gpu_memory": "lots"}, "not a size: 'lots'"),
             ({"gpu_memory": True}, "expected a size"), ({}, "expected a size"),
             ({"gpu_memory": 0}, "must be positive"), ({"gpu_memory": "off"}, "must be positive")]
    for body, message in cases:
        r = httpx.post(q3.url("/v1/memory"), json=body, timeout=30)
        err = assert_openai_error(r, 400)
        assert message in err["message"] and err["param"] == "gpu_memory", (body, err)
    r = httpx.post(q3.url("/v1/memory"), content=b"not json", headers={"content-type": "application/json"},
                   timeout=30)
    assert_openai_error(r, 400)
    assert httpx.get(q3.url("/v1/memory"), timeout=30).json()["gpu_memory"] is None  # nothing changed
    assert httpx.get(q3.url("/health"), timeout=30).status_code == 200


def test_memory_routes_need_the_key(locked: ServerProcess) -> None:
    assert_openai_error(httpx.get(locked.url("/v1/memory"), timeout=30), 401)
    assert_openai_error(httpx.post(locked.url("/v1/memory"), json={"gpu_memory": "1GiB"}, timeout=30), 401)
    r = httpx.get(locked.url("/v1/memory"), headers=locked.headers(), timeout=30)
    assert r.status_code == 200 and r.json()["object"] == "memory"
