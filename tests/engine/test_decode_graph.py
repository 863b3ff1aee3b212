"""The segmented decode pass (engine/model/decode_graph.py) computes what the plain pass does.

Off CUDA its segments run eagerly (nothing captured), which is what this CPU test checks: for both
families, teacher-forced generation through segmented decode steps gives bit-identical float32
logits, and the segmented path really ran. The captured version is checked on the GPU machine
(tests/engine/gpu_cache/test_device_step_cuda.py: graphs on vs off, bit-identical logits)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from engine.moe.base import ExpertExecutor
from engine.options import EngineOptions
from engine.sampling import SamplingParams


class CaptureSafe(ExpertExecutor):
    """Marks an executor's call as safe to run inside a segment (on the CPU nothing is captured)."""

    def __init__(self, inner) -> None:  # type: ignore[no-untyped-def]
        self.inner = inner
        self.calls = 0

    def capturable(self, tokens: int) -> bool:
        return True

    def __call__(self, x, ids, weights, moe_index):  # type: ignore[no-untyped-def]
        self.calls += 1
        return self.inner(x, ids, weights, moe_index)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_segmented_decode_equals_plain(demo_model: Callable[[str], Path], arch: str) -> None:
    model = demo_model(arch)
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
            graphs = eng.decoder.graphs.get(1)
            if segmented:  # every decode step went through the graph pass
                assert graphs is not None and graphs.steps == len(forced) - 1
            return torch.stack([t.float() for t in h.logits]), len(eng.decoder.graphs)

    plain, used_plain = logits(False)
    seg, used_seg = logits(True)
    assert used_plain == 0 and used_seg == 1  # one segmented pass object, for 1-token steps
    assert torch.equal(plain, seg)


def test_gpu_report_is_none_without_a_cap(demo_model: Callable[[str], Path]) -> None:
    model = demo_model("qwen3_moe")
    with Engine(model, EngineOptions(dtype="float32", kv_tokens=256, max_running=1, prefill_chunk=64)) as eng:
        assert eng.gpu_report() is None



@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_segmented_decode_of_two_sequences_equals_plain(demo_model: Callable[[str], Path], arch: str) -> None:
    """Two sequences decoding together, driven at the decoder (so both runs see the same batches):
    2-token steps, one token per sequence with its own KV slots and state slot, through the
    one-graph pass give the plain pass's logits bit for bit."""
    from engine.cache.pools import KVPool, StatePool
    from engine.model.batch import ForwardBatch, SeqEntry
    from engine.model.load import load_decoder

    model = demo_model(arch)
    prompts = [list(range(300, 321)), list(range(400, 409))]

    def run(segmented: bool) -> tuple[torch.Tensor, int]:
        dec = load_decoder(model, "cpu", torch.float32, executor="torch")
        dec.executor = CaptureSafe(dec.executor)
        dec.cuda_graphs = segmented
        kv = KVPool(dec.cfg, 128, torch.float32, torch.device("cpu"))
        states = StatePool(dec.cfg, 2, torch.float32, torch.device("cpu"))
        slots = [torch.arange(0, 64), torch.arange(64, 128)]  # each sequence's KV slots, in position order
        lengths = [len(p) for p in prompts]
        for i, p in enumerate(prompts):  # prefills, one sequence each
            dec.forward(ForwardBatch(torch.tensor(p), torch.arange(len(p)),
                                     [SeqEntry(0, len(p), 0, slots[i][:len(p)], state_slot=i)]), kv, states)
        out = []
        for step in range(6):
            ids = torch.tensor([(5 * step + 3) % 200 + 300, (7 * step + 1) % 200 + 300])
            seqs = [SeqEntry(i, 1, lengths[i], slots[i][:lengths[i] + 1], state_slot=i) for i in range(2)]
            out.append(dec.logits(dec.forward(ForwardBatch(ids, torch.tensor(lengths), seqs), kv, states)))
            lengths = [n + 1 for n in lengths]
        graphs = dec.graphs.get(2)
        return torch.stack(out), graphs.steps if graphs is not None else 0

    plain, steps_plain = run(False)
    seg, steps_seg = run(True)
    assert steps_plain == 0 and steps_seg == 6  # every 2-token step went through the graph pass
    assert torch.equal(plain, seg)
