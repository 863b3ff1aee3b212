"""The engine (scheduler, radix prefix cache, latent KV pool) serving MLA and Qwen3-Next checkpoints.

Requests that share a prefix reuse its cached latent rows (or recurrent checkpoint) and still give
the reference's logits at every step; concurrent requests of different lengths batch together;
no KV slot leaks.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import assert_no_leaks, hf_step_logits, rel_err
from families import FAMILY_SPECS, build_family

from engine.sampling import SamplingParams

SPECS = [s for s in FAMILY_SPECS if s.name in ("deepseek_v3_qlora_yarn", "qwen3_next")]
PROMPT = [int(t) for t in torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(7))]
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_prefix_reuse_and_concurrency(spec, make_engine, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path, model = build_family(spec, tmp_path / "ckpt")
    engine = make_engine(path, prefill_chunk=64)
    hybrid = spec.name == "qwen3_next"
    first = engine.submit(PROMPT, GREEDY, checkpoints=[16] if hybrid else None)
    first.result(timeout=120)
    prompts = [[*PROMPT[:16], 3, 1, 4], [*PROMPT, 9], PROMPT[:5]]
    handles = [engine.submit(p, GREEDY, capture_logits=True) for p in prompts]  # batched together
    for p, h in zip(prompts, handles, strict=True):
        out = h.result(timeout=120)
        ref = hf_step_logits(model, p, out[:-1])
        assert rel_err(torch.stack(h.logits), ref) <= 1e-4, p
        assert out == ref.argmax(-1).tolist()
    assert handles[0].cached_tokens == 16 and handles[1].cached_tokens == (16 if hybrid else 24)
    assert_no_leaks(engine)
