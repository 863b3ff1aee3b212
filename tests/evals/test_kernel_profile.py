"""evals/gpu/kernel_profile.py on the GPU machine: a tiny model's decode tokens under the profiler
give kernel rows whose time sums to about no more than the wall time, and the JSON file."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_profile_of_a_tiny_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from evals.gpu.kernel_profile import main

    r = main(["--shape", "tiny-qwen3", "--dummy", "--device", "cuda", "--tokens", "8", "--zero-experts",
              "--out", str(tmp_path / "k.json")])
    assert r["rows"] and all(row["us_per_token"] > 0 for row in r["rows"])
    assert 0 < r["kernel_ms_per_token"] <= r["profiled_wall_s"] * 1e3 / r["tokens"] * 1.5
    assert (tmp_path / "k.json").exists()
