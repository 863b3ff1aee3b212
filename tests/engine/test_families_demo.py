"""`demo-model --arch glm4_moe_lite`: a GLM-4.7-Flash-shaped checkpoint transformers loads as is.

The written directory loads in transformers' Glm4MoeLiteForCausalLM without missing or unexpected
tensors, and the engine's logits on it equal transformers' (float32, 1e-4 relative).
"""

from __future__ import annotations

import torch
from checkpoints import hf_prefill_logits, rel_err
from families import Runner

from engine.model.load import load_decoder
from freetoken_agent.demo import write_demo_model


def test_glm4_moe_lite_demo_matches_transformers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import transformers as tf

    path = write_demo_model(tmp_path / "demo", "glm4_moe_lite")
    model, info = tf.Glm4MoeLiteForCausalLM.from_pretrained(path, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    dec = load_decoder(path, "cpu", torch.float32, executor="torch")
    assert dec.cfg.attention_kind == "mla" and dec.cfg.moe_layers == (False, True, True, True)
    ids = [int(t) for t in torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(2))]
    ref = hf_prefill_logits(model.eval(), ids)
    assert rel_err(Runner(dec).step([(ids, 0, torch.arange(len(ids)), 0)]), ref) <= 1e-4
