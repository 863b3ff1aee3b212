"""gpt-oss in the generic decoder equals transformers' GptOssForCausalLM on tiny random configs.

Configurations: 3 layers [sliding, full, sliding] with a window of 8 (prompts of 40 tokens run far
past it), 6 query heads over 2 KV heads (3 per group), attention biases, learned sinks, YaRN rope
(truncate off) beyond its original length, top-4 of 6 experts with router bias, expert biases, and
expert weights large enough that the clamped SwiGLU clamps. Checked: prefill logits at every
position (one pass, continued from cached KV across the window boundary, a ragged batch), the
engine's decode steps against the reference's cached decode, prefix reuse (a cached prefix plus a
suffix equals the full prefill), and the CUDA decode kernel's sinks under Triton's interpreter.
MXFP4 experts (kept packed): tests/engine/test_gpt_oss_packed.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import hf_prefill_logits, hf_step_logits, rel_err
from triton_interpreter import run_in_interpreter

from engine.cache.pools import KVPool, StatePool
from engine.config import ModelConfig
from engine.model.batch import ForwardBatch, SeqEntry
from engine.model.load import load_decoder
from engine.sampling import SamplingParams

TOL = 1e-4
VOCAB = 96


def tiny_config(**over: object) -> object:
    from transformers import GptOssConfig

    kw: dict[str, object] = dict(
        vocab_size=VOCAB, hidden_size=40, intermediate_size=24, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=4, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=64,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 16, "rope_theta": 150000.0},
        attn_implementation="eager", eos_token_id=[VOCAB - 1])
    kw.update(over)
    return GptOssConfig(**kw)


def build(out: Path, seed: int, **over: object) -> torch.nn.Module:
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(tiny_config(**over)).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if name.endswith(("sinks", "bias")) else 0.6 if ".experts." in name else 0.25
            p.copy_(torch.randn(p.shape, generator=g) * scale)
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    out = tmp_path_factory.mktemp("gpt_oss") / "ckpt"
    return out, build(out, seed=3)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def pools(cfg: ModelConfig, kv_tokens: int, seqs: int = 2) -> tuple[KVPool, StatePool]:
    """The KV pool (full-attention layers) and the state pool (the sliding-window layers' rings)."""
    cpu = torch.device("cpu")
    return KVPool(cfg, kv_tokens, torch.float32, cpu), StatePool(cfg, seqs, torch.float32, cpu)


def decoder_pass(dec, kv, states, seqs: list[tuple[list[int], int, torch.Tensor]]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """One forward pass; sequence i of `seqs` owns state slot i (its rings)."""
    ids, pos, entries = [], [], []
    for i, (toks, cached, slots) in enumerate(seqs):
        entries.append(SeqEntry(len(ids), len(toks), cached, slots, i))
        ids.extend(toks)
        pos.extend(range(cached, cached + len(toks)))
    batch = ForwardBatch(torch.tensor(ids), torch.tensor(pos), entries)
    return dec.logits(dec.forward(batch, kv, states))


def test_config_map() -> None:
    cfg = ModelConfig.from_dict(tiny_config().to_dict())  # type: ignore[attr-defined]
    assert cfg.family == "gpt_oss" and cfg.full_attention_layer_ids == (1,) and cfg.is_hybrid
    assert cfg.sliding_attention_layer_ids == (0, 2)
    assert [cfg.window_of(i) for i in range(3)] == [8, None, 8]
    assert (cfg.router_kind, cfg.moe_intermediate_size, cfg.attention_bias, cfg.qk_norm) == ("topk_softmax", 24,
                                                                                              True, False)
    assert cfg.rope_scaling.rope_type == "yarn" and cfg.rope_scaling.truncate is False


def test_bf16_norm_scales_in_float32_like_transformers() -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    from engine.model.ops import rms_norm

    g = torch.Generator().manual_seed(0)
    ref = GptOssRMSNorm(64, eps=1e-5)  # transformers keeps gpt-oss's norms in float32
    with torch.no_grad():
        ref.weight.copy_(1 + 0.3 * torch.randn(64, generator=g))
    x = (torch.randn(32, 64, generator=g) * 3).to(torch.bfloat16)
    got = rms_norm(x, ref.weight.detach(), 1e-5, False)
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref(x))
    assert not torch.equal(rms_norm(x, ref.weight.detach().to(torch.bfloat16), 1e-5, False), ref(x))


def test_bench_shapes() -> None:
    from engine.weights.dummy import dummy_config, dummy_decoder

    small = dummy_config("gpt-oss-20b")
    assert (small.num_layers, small.num_experts, small.top_k, small.moe_intermediate_size, small.num_heads,
            small.num_kv_heads, small.head_dim, small.vocab_size) == (24, 32, 4, 2880, 64, 8, 64, 201088)
    assert small.layer_types[:2] == ("sliding_attention", "full_attention") and small.rope_scaling.factor == 32.0
    dec = dummy_decoder(dummy_config("tiny-gpt-oss"), "cpu", torch.float32, 0, executor="torch")
    kv, states = pools(dec.cfg, 32)
    logits = decoder_pass(dec, kv, states, [(list(range(10)), 0, kv.alloc(10))])
    assert logits.shape == (10, 512) and torch.isfinite(logits).all()


def test_prefill_logits_every_position(tiny: tuple[Path, torch.nn.Module]) -> None:
    path, model = tiny
    dec = load_decoder(path)
    a, b = tokens(40, 1), tokens(11, 2)
    ref_a, ref_b = hf_prefill_logits(model, a), hf_prefill_logits(model, b)
    kv, states = pools(dec.cfg, 128)
    assert rel_err(decoder_pass(dec, kv, states, [(a, 0, kv.alloc(40))]), ref_a) <= TOL
    # continued from the cache: 13 cached tokens (past the window of 8), then 27 more
    kv, states = pools(dec.cfg, 128)
    first = kv.alloc(13)
    got1 = decoder_pass(dec, kv, states, [(a[:13], 0, first)])
    got2 = decoder_pass(dec, kv, states, [(a[13:], 13, torch.cat([first, kv.alloc(27)]))])
    assert rel_err(torch.cat([got1, got2]), ref_a) <= TOL
    kv, states = pools(dec.cfg, 128)
    got = decoder_pass(dec, kv, states, [(b, 0, kv.alloc(11)), (a, 0, kv.alloc(40))])
    assert rel_err(got[:11], ref_b) <= TOL and rel_err(got[11:], ref_a) <= TOL


def test_decode_and_prefix_reuse(tiny: tuple[Path, torch.nn.Module], make_engine) -> None:  # type: ignore[no-untyped-def]
    path, model = tiny
    engine = make_engine(path, device="cpu", executor="torch")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt = tokens(14, 5)
    h1 = engine.submit(prompt, params, capture_logits=True)
    out1 = h1.result(timeout=120)
    ref = hf_step_logits(model, prompt, out1[:-1])
    assert rel_err(torch.stack(list(h1.logits)), ref) <= TOL
    assert out1 == ref.argmax(-1).tolist()
    # a cached prefix (prompt + output, 25 tokens: three windows) plus a new suffix
    ext = prompt + out1 + tokens(5, 6)
    h2 = engine.submit(ext, params, capture_logits=True)
    out2 = h2.result(timeout=120)
    assert h2.cached_tokens == len(prompt) + len(out1) - 1
    ref2 = hf_step_logits(model, ext, out2[:-1])
    assert rel_err(torch.stack(list(h2.logits)), ref2) <= TOL
    assert rel_err(torch.stack(list(h2.logits))[:1], hf_prefill_logits(model, ext)[-1:]) <= TOL


def test_decode_kernel_sinks_in_triton_interpreter() -> None:
    run_in_interpreter(__file__)


def _kernel_check() -> None:
    """The split-K decode kernel with sinks and a window equals `attention_core` (float32)."""
    from types import SimpleNamespace

    from engine.model.attention import attention_core
    from engine.model.decode_attention import DecodeMeta, decode_attention

    heads, kv_heads, dim, slots = 6, 2, 16, 128
    g = torch.Generator().manual_seed(0)
    cfg = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim)
    sinks = torch.randn(heads, generator=g) * 2
    kc = torch.randn(slots, kv_heads, dim, generator=g)
    vc = torch.randn(slots, kv_heads, dim, generator=g)
    perm = torch.randperm(slots, generator=g)
    entries = [SeqEntry(0, 1, 30, perm[:31], -1), SeqEntry(1, 1, 4, perm[40:45], -1)]
    batch = ForwardBatch(torch.zeros(2, dtype=torch.long), torch.tensor([30, 4]), entries)
    q = torch.randn(2, heads, dim, generator=g)
    k, v = torch.randn(2, kv_heads, dim, generator=g), torch.randn(2, kv_heads, dim, generator=g)
    for window in (None, 8):
        kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        got = decode_attention(q, k, v, kc1, vc1, DecodeMeta.build(batch, torch.device("cpu")), window, dim**-0.5,
                               sinks)
        ref = attention_core(q, k, v, cfg, batch, kc2, vc2, window, sinks)  # type: ignore[arg-type]
        assert rel_err(got, ref) <= 1e-5, (window, rel_err(got, ref))
        assert rel_err(got, attention_core(q, k, v, cfg, batch, kc.clone(), vc.clone(), window)) > 1e-2  # type: ignore[arg-type]


if __name__ == "__main__":  # the interpreter test's child
    _kernel_check()
    print("ok")
