"""GPU paths of the engine (run on the lent GPU machine; skipped without CUDA).

Proves: the engine on CUDA gives the reference's logits for prefill and 32 decode steps, both with
the torch Gated DeltaNet ops and with fla-core's Triton kernels (chunked for prefill, fused
recurrent for decode, one varlen call per batch), and that concurrent requests batched through the
fla varlen path give the same tokens as each alone.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import (
    FULL,
    LIN,
    TinySpec,
    hf_prefill_logits,
    hf_step_logits,
    qwen3_5_moe_text,
    qwen3_moe_text,
    rel_err,
)

from engine.model.linear_attention import _import_fla
from engine.sampling import SamplingParams

pytestmark = pytest.mark.gpu

SPECS = [
    TinySpec("gpu_q35", "qwen3_5_moe", qwen3_5_moe_text(layer_types=[LIN, FULL, LIN, FULL])),
    TinySpec("gpu_q3", "qwen3_moe", qwen3_moe_text()),
]


@pytest.mark.parametrize("gdn", ["torch", "fla"])
@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_cuda_logits_match_reference(spec: TinySpec, gdn: str, tiny_checkpoint, make_engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    if gdn == "fla":
        if spec.family != "qwen3_5_moe":
            pytest.skip("no linear attention in this family")
        if _import_fla() is None:
            pytest.fail("fla-core is not importable on this CUDA machine")
    monkeypatch.setenv("FREETOKEN_GDN", gdn)
    # fp32 reference matmuls, no TF32, on both sides.
    torch.backends.cuda.matmul.allow_tf32 = False
    path, hf = tiny_checkpoint(spec)
    prompt = [int(t) for t in torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(3))]
    engine = make_engine(path, device="cuda")
    handle = engine.submit(prompt, SamplingParams(max_tokens=32, ignore_eos=True), capture_logits=True)
    out = handle.result()
    ref = hf_step_logits(hf, prompt, out[:-1])
    got = torch.stack(handle.logits)
    tol = 1e-4 if gdn == "torch" else 2e-3  # fla's Triton dots run in tf32
    assert rel_err(got, ref) <= tol
    full = hf_prefill_logits(hf, prompt + out[:-1])
    assert rel_err(got[0], full[len(prompt) - 1]) <= tol


def test_fla_varlen_batch_equals_single(tiny_checkpoint, make_engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    if _import_fla() is None:
        pytest.fail("fla-core is not importable on this CUDA machine")
    monkeypatch.setenv("FREETOKEN_GDN", "fla")
    path, _ = tiny_checkpoint(SPECS[0])
    engine = make_engine(path, device="cuda")
    gen = torch.Generator().manual_seed(5)
    prompts = [[int(t) for t in torch.randint(0, 128, (n,), generator=gen)] for n in (7, 70, 130, 33)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    alone = [engine.submit(p, params).result() for p in prompts]
    with engine._step_lock:
        engine.scheduler.cache.reset()
    together = [engine.submit(p, params) for p in prompts]
    assert [h.result() for h in together] == alone
