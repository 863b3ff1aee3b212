"""The segmented decode pass (engine/model/decode_graph.py) computes what the plain pass does.

Off CUDA its segments run eagerly (nothing captured), which is what this CPU test checks: for both
families, teacher-forced generation through segmented decode steps gives bit-identical float32
logits, and the segmented path really ran. The captured version is checked on the GPU machine
(tests/engine/gpu_cache/test_device_step_cuda.py: graphs on vs off, bit-identical logits)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from engine.options import EngineOptions
from engine.sampling import SamplingParams
from freetoken_agent.demo import write_demo_model


class CaptureSafe:
    """Marks an executor's call as safe to run inside a segment (on the CPU nothing is captured)."""

    capture_safe = True

    def __init__(self, inner) -> None:  # type: ignore[no-untyped-def]
        self.inner = inner
        self.calls = 0

    def __call__(self, x, ids, weights, moe_index):  # type: ignore[no-untyped-def]
        self.calls += 1
        return self.inner(x, ids, weights, moe_index)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_segmented_decode_equals_plain(tmp_path: Path, arch: str) -> None:
    model = write_demo_model(tmp_path / "m", arch=arch)
    prompt = list(range(300, 330))
    forced = [(5 * i + 3) % 200 + 300 for i in range(10)]

    def logits(segmented: bool) -> tuple[torch.Tensor, int]:
        with Engine(model, EngineOptions(dtype="float32", kv_tokens=1024, max_running=2, prefill_chunk=64)) as eng:
            wrapper = CaptureSafe(eng.decoder.executor)
            eng.decoder.executor = wrapper
            eng.decoder.cuda_graphs = segmented
            h = eng.submit(prompt, SamplingParams(max_tokens=len(forced), ignore_eos=True), capture_logits=True,
                           forced_output=forced)
            h.result(timeout=300)
            graphs = eng.decoder._graphs.get(1)
            if segmented:  # every decode step went through the graph pass
                assert graphs is not None and graphs.steps == len(forced) - 1
            return torch.stack([t.float() for t in h.logits]), len(eng.decoder._graphs)

    plain, used_plain = logits(False)
    seg, used_seg = logits(True)
    assert used_plain == 0 and used_seg == 1  # one segmented pass object, for 1-token steps
    assert torch.equal(plain, seg)


def test_gpu_report_is_none_without_a_cap(tmp_path: Path) -> None:
    model = write_demo_model(tmp_path / "m", arch="qwen3_moe")
    with Engine(model, EngineOptions(dtype="float32", kv_tokens=256, max_running=1, prefill_chunk=64)) as eng:
        assert eng.gpu_report() is None

