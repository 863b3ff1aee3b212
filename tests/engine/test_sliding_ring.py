"""Sliding-window layers keep a ring of the window per sequence (engine/cache/pools.py), not every
token's keys and values, and give the logits of transformers' GptOssForCausalLM all the same.

A tiny gpt-oss (layers [sliding, full, sliding], window 8: rings of 8 + 7 rows) through the engine:
- concurrent requests of different lengths, prompts past the window prefilled in chunks that cross
  it, decode far past it, against transformers' own cached decode (f32, rel. err <= 1e-4);
- prefix reuse past the window: a request that shares a prefix resumes at the anchor checkpoint
  (the rings are part of the snapshot) or the previous request's end, and its logits equal a cold
  prefill's; the rings survive the host spill tier;
- the memory: the KV pool holds only the full-attention layer; a long context's sliding-layer bytes
  are one ring per sequence whatever its length, as `memory_report()["kv_bytes"]` says;
- the CUDA path under Triton's interpreter: the decode kernel over rings (several tokens of one
  sequence in a pass, rings wrapped) equals the per-sequence core, and the decoder with the kernel
  tables (the captured pass's ring table from its state slots included) equals transformers;
- on the GPU machine (marked gpu): the engine on CUDA, captured graphs and overlapped decode.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from checkpoints import assert_no_leaks, hf_prefill_logits, hf_step_logits, rel_err
from test_gpt_oss import build, tokens
from triton_interpreter import run_in_interpreter

from engine.anchors import Anchor
from engine.cache.pools import HostStatePool, KVPool, StatePool, ring_length
from engine.model.batch import ForwardBatch, SeqEntry
from engine.sampling import SamplingParams

TOL = 1e-4
WINDOW = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    out = tmp_path_factory.mktemp("gpt_oss_ring") / "ckpt"
    return out, build(out, seed=11, max_position_embeddings=512)


def _logits(handle) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return torch.stack(list(handle.logits))


def test_concurrent_chunked_requests_past_the_window(tiny: tuple[Path, torch.nn.Module], make_engine) -> None:  # type: ignore[no-untyped-def]
    path, model = tiny
    engine = make_engine(path, device="cpu", executor="torch", prefill_chunk=6, max_running=3)
    assert engine.scheduler.states.ring == ring_length(engine.decoder.cfg) == WINDOW + 7
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = [tokens(33, 21), tokens(5, 22), tokens(17, 23)]
    handles = [engine.submit(p, params, capture_logits=True) for p in prompts]
    for prompt, h in zip(prompts, handles, strict=True):
        out = h.result(timeout=300)
        ref = hf_step_logits(model, prompt, out[:-1])
        assert rel_err(_logits(h), ref) <= TOL
    assert_no_leaks(engine)


def test_reuse_past_the_window_equals_a_cold_prefill(tiny: tuple[Path, torch.nn.Module], make_engine) -> None:  # type: ignore[no-untyped-def]
    path, model = tiny
    engine = make_engine(path, device="cpu", executor="torch", prefill_chunk=7)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    first = tokens(36, 31)
    engine.submit(first, params, anchors=[Anchor(26, "user_start", 1)]).result(timeout=120)
    # shares 30 tokens: resumes at the anchor (26, past three windows), not at the divergence
    second = first[:30] + tokens(9, 32)
    h = engine.submit(second, params, capture_logits=True)
    out = h.result(timeout=120)
    assert h.reuse is not None and (h.reuse.kv_tokens, h.reuse.checkpoint_kind) == (26, "user_start")
    assert rel_err(_logits(h), hf_step_logits(model, second, out[:-1])) <= TOL
    # resumes at the second request's end (prompt + output less the last token)
    third = second + out + tokens(4, 33)
    h3 = engine.submit(third, params, capture_logits=True)
    out3 = h3.result(timeout=120)
    assert h3.reuse is not None and h3.reuse.kv_tokens == len(second) + len(out) - 1
    assert rel_err(_logits(h3)[:1], hf_prefill_logits(model, third)[-1:]) <= TOL
    # the same request cold gives the same logits
    engine.reset_cache()
    cold = engine.submit(third, params, capture_logits=True)
    assert cold.result(timeout=120) == out3 and cold.reuse is not None and cold.reuse.kv_tokens == 0
    assert rel_err(_logits(h3), _logits(cold)) <= TOL
    assert_no_leaks(engine)


def test_rings_move_with_snapshots_and_spills(tiny: tuple[Path, torch.nn.Module]) -> None:
    from engine.config import ModelConfig

    cfg = ModelConfig.from_file(tiny[0] / "config.json")
    cpu = torch.device("cpu")
    pool, host = StatePool(cfg, 3, torch.float32, cpu), HostStatePool(cfg, 2, torch.float32, cpu)
    assert pool.ring_k.shape == (2, 3, WINDOW + 7, cfg.num_kv_heads, cfg.head_dim) == pool.ring_v.shape
    pool.ring_k.normal_()
    pool.ring_v.normal_()
    k1, v1 = pool.ring_k[:, 1].clone(), pool.ring_v[:, 1].clone()
    pool.copy(0, 1)
    host.store(1, pool, 0)
    pool.reset(0)
    assert not pool.ring_k[:, 0].any() and not pool.ring_v[:, 0].any()
    host.load(pool, 2, 1)
    assert torch.equal(pool.ring_k[:, 2], k1) and torch.equal(pool.ring_v[:, 2], v1)
    rows_k, _ = pool.ring_rows(1)
    assert torch.equal(rows_k[2 * pool.ring:3 * pool.ring], k1[1])  # slot 2's ring of layer 1


def test_a_long_context_keeps_one_ring_per_sequence(tiny: tuple[Path, torch.nn.Module], make_engine) -> None:  # type: ignore[no-untyped-def]
    path, model = tiny
    engine = make_engine(path, device="cpu", executor="torch", kv_tokens=512, prefill_chunk=128, max_running=2,
                         checkpoint_slots=2)
    cfg, s = engine.decoder.cfg, engine.scheduler
    prompt = tokens(300, 41)
    h = engine.submit(prompt, SamplingParams(max_tokens=3, ignore_eos=True), capture_logits=True)
    out = h.result(timeout=300)
    assert rel_err(_logits(h), hf_step_logits(model, prompt, out[:-1])) <= TOL
    per_layer_token = 2 * cfg.num_kv_heads * cfg.head_dim * 4  # K and V, float32
    report = engine.memory_report()["kv_bytes"]
    assert report == {"full_per_token": per_layer_token, "sliding_per_sequence": 2 * (WINDOW + 7) * per_layer_token,
                      "state_slot": 2 * (WINDOW + 7) * per_layer_token}
    # the KV pool holds the one full-attention layer; the rings did not grow with the context
    assert s.kv.k.shape[0] == 1 and s.kv.capacity == 512
    assert s.states.ring_k.shape == (2, s.states.capacity, WINDOW + 7, cfg.num_kv_heads, cfg.head_dim)
    # what the context holds now: every token's KV on the full layer, one ring set (the request's
    # end snapshot) on the sliding ones; keeping every token there too would cost 20 times more
    held = s.cache.cached_tokens
    assert held == len(prompt) + len(out) - 1 and s.cache.num_snapshots == 1
    every_token = held * 2 * per_layer_token
    assert report["sliding_per_sequence"] == (WINDOW + 7) * 2 * per_layer_token < every_token / 20
    assert_no_leaks(engine)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_rings_match_transformers(tiny: tuple[Path, torch.nn.Module], make_engine, overlap: bool) -> None:  # type: ignore[no-untyped-def]
    """On CUDA (captured decode graphs, the split-K kernel over rings, optionally the overlapped
    decode): concurrent requests past the window, then reuse past it, against transformers (f32)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    path, model = tiny
    engine = make_engine(path, device="cuda", executor="torch", prefill_chunk=6, max_running=3,
                         overlap_decode=overlap)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [tokens(33, 61), tokens(5, 62), tokens(17, 63)]
    handles = [engine.submit(p, params, capture_logits=True, anchors=[Anchor(len(p) - 2, "user_start", 1)])
               for p in prompts]
    outs = [h.result(timeout=300) for h in handles]
    for prompt, h, out in zip(prompts, handles, outs, strict=True):
        assert rel_err(_logits(h), hf_step_logits(model, prompt, out[:-1])) <= TOL
    ext = prompts[0] + outs[0] + tokens(3, 64)
    h = engine.submit(ext, params, capture_logits=True)
    out = h.result(timeout=300)
    assert h.reuse is not None and h.reuse.kv_tokens == len(prompts[0]) + len(outs[0]) - 1
    assert rel_err(_logits(h), hf_step_logits(model, ext, out[:-1])) <= TOL
    assert_no_leaks(engine)


def test_ring_kernel_and_decoder_in_triton_interpreter() -> None:
    run_in_interpreter(__file__)


def _kernel_check() -> None:
    """The split-K kernel over rings equals the per-sequence core over them (float32), rows
    written included: a wrapped ring, several tokens of one sequence crossing the window."""
    from types import SimpleNamespace

    from engine.model.attention import attention_core
    from engine.model.decode_attention import DecodeMeta, decode_attention

    heads, kv_heads, dim, ring = 6, 2, 16, WINDOW + 7
    g = torch.Generator().manual_seed(0)
    cfg = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim)
    sinks = torch.randn(heads, generator=g)
    kc, vc = torch.randn(4 * ring, kv_heads, dim, generator=g), torch.randn(4 * ring, kv_heads, dim, generator=g)
    shape = [(40, 1, 3), (12, 4, 1), (3, 2, 2)]  # (cached, new, state slot)
    entries: list[SeqEntry] = []
    pos: list[int] = []
    start = 0
    for cached, new, slot in shape:
        entries.append(SeqEntry(start, new, cached, torch.zeros(cached + new, dtype=torch.long), slot))
        pos.extend(range(cached, cached + new))
        start += new
    batch = ForwardBatch(torch.zeros(start, dtype=torch.long), torch.tensor(pos), entries)
    q = torch.randn(start, heads, dim, generator=g)
    k, v = torch.randn(start, kv_heads, dim, generator=g), torch.randn(start, kv_heads, dim, generator=g)
    slots = torch.tensor([slot for _, new, slot in shape for _ in range(new)])
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    meta = DecodeMeta.for_ring(batch.positions, slots, ring)
    got = decode_attention(q, k, v, kc1, vc1, meta, WINDOW, dim**-0.5, sinks, ring)
    ref = attention_core(q, k, v, cfg, batch, kc2, vc2, WINDOW, sinks, ring)  # type: ignore[arg-type]
    assert rel_err(got, ref) <= 1e-5, rel_err(got, ref)
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2) and not torch.equal(kc1, kc)


def _decoder_check() -> None:
    """The decoder's sliding layers through the kernel tables equal transformers: a prompt past the
    window, then a 4-token chunk (eager tables) and single tokens (the ring table the captured pass
    derives from its state slots), every row against one full forward pass."""
    import tempfile

    from engine.model.load import load_decoder

    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp) / "ckpt", seed=11, max_position_embeddings=512, num_hidden_layers=2,
                      layer_types=["sliding_attention", "full_attention"])  # both kinds; each interpreted layer costs
        dec = load_decoder(Path(tmp) / "ckpt")
    seq = tokens(26, 51)
    ref = hf_prefill_logits(model, seq)
    cpu = torch.device("cpu")
    kv, states = KVPool(dec.cfg, 64, torch.float32, cpu), StatePool(dec.cfg, 2, torch.float32, cpu)
    slots = kv.alloc(len(seq))
    assert slots is not None

    def run(lo: int, hi: int, eager_ring: bool) -> torch.Tensor:
        batch = ForwardBatch(torch.tensor(seq[lo:hi]), torch.arange(lo, hi), [SeqEntry(0, hi - lo, lo, slots[:hi], 1)])
        decode, ring = dec.kernel_metas(batch)
        meta = dataclasses.replace(dec.pass_meta(batch), decode=decode, ring=ring if eager_ring else None, batch=None)
        return dec.logits(dec.run(batch.input_ids, meta, kv, states))

    got = [dec.logits(dec.forward(ForwardBatch(torch.tensor(seq[:20]), torch.arange(20),
                                               [SeqEntry(0, 20, 0, slots[:20], 1)]), kv, states))]
    got.append(run(20, 24, True))
    got += [run(p, p + 1, False) for p in range(24, 26)]
    assert rel_err(torch.cat(got), ref) <= TOL, rel_err(torch.cat(got), ref)


if __name__ == "__main__":  # the interpreter test's child
    _kernel_check()
    _decoder_check()
    print("ok")
