"""DeepSeek-V3 / Kimi-K2, GLM-4.7-Flash, GLM-4.5 and Qwen3-Next against transformers 5.23 (float32).

Per family (tests/engine/families.py: odd tiny shapes), the engine's logits must equal the
reference's within 1e-4 relative to the largest logit, for: a whole-prompt prefill (every
position), prefix reuse (a cached prefix, then the rest: a short suffix, which MLA attends in the
absorbed form, and a long one, in the expanded form), decode steps, and two sequences in one pass.
MLA's KV pool holds kv_lora_rank + qk_rope_head_dim values per token and layer, nothing more.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import hf_prefill_logits, rel_err
from families import FAMILY_SPECS, FamilySpec, Runner, build_family

from engine.cache.pools import KVPool
from engine.config import ModelConfig
from engine.model.load import load_decoder
from engine.model.mla import absorbs

TOL = 1e-4
PROMPT = [int(t) for t in torch.randint(0, 96, (36,), generator=torch.Generator().manual_seed(5))]


@pytest.fixture(scope="module")
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    spec: FamilySpec = request.param
    path, model = build_family(spec, tmp_path_factory.mktemp(spec.name) / "ckpt")
    return spec, path, model


def _slots(n: int, offset: int = 0) -> torch.Tensor:
    return torch.arange(offset, offset + n)


@pytest.mark.parametrize("family", FAMILY_SPECS, ids=repr, indirect=True)
def test_prefill_reuse_decode_and_batching(family) -> None:  # type: ignore[no-untyped-def]
    _, path, model = family
    dec = load_decoder(path, "cpu", torch.float32, executor="torch")
    ref = hf_prefill_logits(model, PROMPT)
    n = len(PROMPT)

    run = Runner(dec)
    assert rel_err(run.step([(PROMPT, 0, _slots(n), 0)]), ref) <= TOL  # whole prompt

    for cut in (6, n - 5):  # long suffix after a short prefix; short suffix after a long one
        run = Runner(dec)
        run.step([(PROMPT[:cut], 0, _slots(cut), 0)])
        out = run.step([(PROMPT[cut:], cut, _slots(n), 0)])
        assert rel_err(out, ref[cut:]) <= TOL, cut
    if dec.cfg.attention_kind == "mla":  # both forms ran above
        assert not absorbs(dec.cfg, n - 6) and absorbs(dec.cfg, 5) and absorbs(dec.cfg, 1)

    # decode steps: one token at a time after a prefill; and a second sequence prefilling alongside
    run = Runner(dec)
    first = 20
    run.step([(PROMPT[:first], 0, _slots(first), 0)])
    other = PROMPT[::-1][:9]
    other_ref = hf_prefill_logits(model, other)
    for i in range(first, first + 4):
        seqs = [([PROMPT[i]], i, _slots(i + 1), 0)]
        if i == first + 1:  # a new request prefills in the same pass as a decode step
            seqs.append((other, 0, _slots(len(other), 64), 1))
        out = run.step(seqs)
        assert rel_err(out[:1], ref[i:i + 1]) <= TOL, i
        if i == first + 1:
            assert rel_err(out[1:], other_ref) <= TOL


@pytest.mark.parametrize("family", [s for s in FAMILY_SPECS if s.name.startswith(("deepseek", "glm4_moe_lite"))],
                         ids=repr, indirect=True)
def test_mla_kv_bytes_are_the_latent(family) -> None:  # type: ignore[no-untyped-def]
    spec, path, _ = family
    cfg = ModelConfig.from_file(path / "config.json")
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert cfg.attention_kind == "mla" and latent == spec.kw["kv_lora_rank"] + spec.kw["qk_rope_head_dim"]
    assert KVPool.bytes_per_slot(cfg, torch.bfloat16) == cfg.num_layers * latent * 2
    pool = KVPool(cfg, 5, torch.float32, torch.device("cpu"))
    assert pool.k.shape == (cfg.num_layers, 5, 1, latent) and pool.v.numel() == 0
