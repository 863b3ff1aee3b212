"""The engine is lossless against `transformers` on tiny random models of both families.

Configurations: qwen3_moe with MHA / GQA 2:1 / 4:1 / MQA + sliding window, norm_topk_prob on and
off, decoder_sparse_step 2 and mlp_only_layers (dense MLP layers), tied embeddings; qwen3_5_moe
with layer_types [lin,lin,lin,full] / [full,lin] / [lin,full,lin,full], several shared-expert
sizes, head dims 16 / 32, linear value heads = 2x key heads, tied embeddings, and the
vision-language wrapper (`model.language_model.` tensors, nested text_config). Experts are stored
per expert, fused, fused-transposed, and sharded over several files. For each this proves:
(i) prefill logits at every position (one pass, a pass continued from cached KV/state, and two
    sequences in one ragged batch) equal the reference within 1e-4 relative;
(ii) the logits of each of 32 decode steps equal the reference's own cached step-by-step decode;
(iii) greedy generation equals `generate(do_sample=False)` token for token;
(iv) prefix reuse (extending a finished request, sharing part of its prompt, repeating it, a
     growing conversation, and under memory pressure with eviction) gives reference logits and
     tokens, and reuses exactly the prefix the cache contract promises;
(v) two and four concurrent requests of different lengths give the tokens each gives alone;
and no KV or state slot leaks across any of it. Also: a checkpoint exactly as `save_pretrained`
writes it loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from checkpoints import (
    FULL,
    LIN,
    TinySpec,
    assert_no_leaks,
    hf_greedy,
    hf_prefill_logits,
    hf_step_logits,
    qwen3_5_moe_text,
    qwen3_moe_text,
    rel_err,
)

from engine.cache.pools import KVPool, StatePool
from engine.model.batch import ForwardBatch, SeqEntry
from engine.model.load import load_decoder
from engine.sampling import SamplingParams

TOL = 1e-4
DECODE_STEPS = 32

_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
          "mrope_section": [2, 1, 1], "mrope_interleaved": True}

SPECS = [
    # ---- qwen3_moe
    TinySpec("q3_mha_perexpert", "qwen3_moe", qwen3_moe_text(
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, norm_topk_prob=True), seed=1),
    TinySpec("q3_gqa4_sparse2_fused", "qwen3_moe", qwen3_moe_text(
        hidden_size=48, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
        norm_topk_prob=False, decoder_sparse_step=2, intermediate_size=40), layout="fused", seed=2,
        engine=dict(prefill_chunk=16)),
    TinySpec("q3_mlponly_tied_sharded", "qwen3_moe", qwen3_moe_text(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, mlp_only_layers=[0], intermediate_size=56,
        num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, tie_word_embeddings=True),
        layout="fused_t", shards=3, seed=3, engine=dict(max_running=2, prefill_chunk=24)),
    TinySpec("q3_mqa_swa", "qwen3_moe", qwen3_moe_text(
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, use_sliding_window=True, sliding_window=8,
        num_hidden_layers=2), seed=8),
    # ---- qwen3_5_moe
    TinySpec("q35_lllf_perexpert", "qwen3_5_moe", qwen3_5_moe_text(
        layer_types=[LIN, LIN, LIN, FULL], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        shared_expert_intermediate_size=24), seed=4),
    TinySpec("q35_fl_gqa4_tied_fused", "qwen3_5_moe", qwen3_5_moe_text(
        num_hidden_layers=2, layer_types=[FULL, LIN], num_attention_heads=8, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=8,
        shared_expert_intermediate_size=16, tie_word_embeddings=True), layout="fused", seed=5,
        engine=dict(prefill_chunk=16, max_running=2, state_slots=2)),
    TinySpec("q35_vl_lflf_sharded", "qwen3_5_moe", qwen3_5_moe_text(
        layer_types=[LIN, FULL, LIN, FULL], num_attention_heads=4, num_key_value_heads=4, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        shared_expert_intermediate_size=40, num_experts=8, num_experts_per_tok=4, rope_parameters=_MROPE),
        vl=True, layout="fused", shards=2, seed=6),
]


@dataclass
class Case:
    spec: TinySpec
    dir: Path
    model: torch.nn.Module

    @property
    def vocab(self) -> int:
        return int(self.spec.text["vocab_size"])

    @property
    def hybrid(self) -> bool:
        """Per-sequence state (recurrent layers, sliding-window rings): reuse only at snapshots."""
        return self.spec.family == "qwen3_5_moe" or bool(self.spec.text.get("use_sliding_window"))

    def tokens(self, n: int, seed: int) -> list[int]:
        return torch.randint(0, self.vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=SPECS, ids=[s.name for s in SPECS])
def case(request: pytest.FixtureRequest, tiny_checkpoint) -> Case:  # type: ignore[no-untyped-def]
    spec: TinySpec = request.param
    path, model = tiny_checkpoint(spec)
    return Case(spec, path, model)


@pytest.fixture
def engine(case: Case, make_engine):  # type: ignore[no-untyped-def]
    return make_engine(case.dir, **case.spec.engine)


def _assert_rows_close(got: list[torch.Tensor] | torch.Tensor, ref: torch.Tensor, what: str) -> None:
    got_t = torch.stack(list(got)) if not isinstance(got, torch.Tensor) else got
    assert got_t.shape == ref.shape, f"{what}: {tuple(got_t.shape)} rows vs reference {tuple(ref.shape)}"
    errs = [rel_err(got_t[j], ref[j]) for j in range(ref.shape[0])]
    worst = max(range(len(errs)), key=errs.__getitem__)
    assert errs[worst] <= TOL, f"{what}: row {worst} differs from the reference by {errs[worst]:.2e} (relative)"


def _check_against_reference(case: Case, prompt: list[int], handle, what: str) -> list[int]:  # type: ignore[no-untyped-def]
    """Engine logits of every sampled token equal the reference's cached decode over the same tokens,
    and every greedy token is the reference's argmax."""
    out = handle.result(timeout=120)
    assert handle.finish_reason == "length", f"{what}: finished with {handle.finish_reason!r}"
    ref = hf_step_logits(case.model, prompt, out[:-1])
    _assert_rows_close(handle.logits, ref, what)
    assert out == ref.argmax(-1).tolist(), f"{what}: greedy tokens differ from the reference argmax"
    return out


# ------------------------------------------------------------------------------------------ (i)
def _decoder_pass(dec, kv, st, seqs: list[tuple[list[int], int, torch.Tensor, int]]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """seqs: (new tokens, cached_len, kv slots of all tokens, state slot) -> logits of all new tokens."""
    ids, pos, entries = [], [], []
    for toks, cached, slots, state in seqs:
        entries.append(SeqEntry(len(ids), len(toks), cached, slots, state))
        ids.extend(toks)
        pos.extend(range(cached, cached + len(toks)))
    batch = ForwardBatch(torch.tensor(ids), torch.tensor(pos), entries)
    return dec.logits(dec.forward(batch, kv, st))


def test_prefill_logits_every_position(case: Case) -> None:
    dec = load_decoder(case.dir)
    a, b = case.tokens(80, seed=11), case.tokens(33, seed=12)  # 80 > one 64-token GDN chunk
    ref_a, ref_b = hf_prefill_logits(case.model, a), hf_prefill_logits(case.model, b)

    def pools() -> tuple[KVPool, StatePool]:
        return (KVPool(dec.cfg, 256, torch.float32, torch.device("cpu")),
                StatePool(dec.cfg, 4, torch.float32, torch.device("cpu")))

    def state(st: StatePool) -> int:
        if not dec.cfg.is_hybrid:
            return -1
        slot = st.alloc()
        st.reset(slot)
        return slot

    # One pass over the whole prompt.
    kv, st = pools()
    got = _decoder_pass(dec, kv, st, [(a, 0, kv.alloc(80), state(st))])
    _assert_rows_close(got, ref_a, "single prefill pass")

    # The same prompt in two passes: the second resumes from cached KV and recurrent state.
    kv, st = pools()
    s = state(st)
    first = kv.alloc(37)
    got1 = _decoder_pass(dec, kv, st, [(a[:37], 0, first, s)])
    got2 = _decoder_pass(dec, kv, st, [(a[37:], 37, torch.cat([first, kv.alloc(43)]), s)])
    _assert_rows_close(torch.cat([got1, got2]), ref_a, "prefill continued from cache")

    # Two sequences of different lengths in one ragged batch.
    kv, st = pools()
    got = _decoder_pass(dec, kv, st, [(b, 0, kv.alloc(33), state(st)), (a, 0, kv.alloc(80), state(st))])
    _assert_rows_close(got[:33], ref_b, "ragged batch, sequence 0")
    _assert_rows_close(got[33:], ref_a, "ragged batch, sequence 1")


# ------------------------------------------------------------------------------------------ (ii)
def test_decode_step_logits(case: Case, engine) -> None:  # type: ignore[no-untyped-def]
    prompt = case.tokens(20, seed=21)
    h = engine.submit(prompt, SamplingParams(max_tokens=DECODE_STEPS, ignore_eos=True), capture_logits=True)
    out = _check_against_reference(case, prompt, h, "decode")
    assert len(out) == DECODE_STEPS and len(h.logits) == DECODE_STEPS
    assert h.cached_tokens == 0
    assert_no_leaks(engine)


# ------------------------------------------------------------------------------------------ (iii)
@pytest.mark.parametrize("prompt_len", [1, 9, 70])
def test_greedy_matches_generate(case: Case, engine, prompt_len: int) -> None:  # type: ignore[no-untyped-def]
    prompt = case.tokens(prompt_len, seed=30 + prompt_len)
    n = 24
    ref = hf_greedy(case.model, prompt, n)
    assert len(ref) == n
    got = engine.submit(prompt, SamplingParams(max_tokens=n, ignore_eos=True)).result(timeout=120)
    assert got == ref
    assert_no_leaks(engine)


# ------------------------------------------------------------------------------------------ (iv)
def test_prefix_reuse(case: Case, engine) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompt = case.tokens(20, seed=41)
    h1 = engine.submit(prompt, params, capture_logits=True)
    out1 = _check_against_reference(case, prompt, h1, "first request")
    assert h1.cached_tokens == 0

    # Extends the first request's prompt and output: everything the first request computed (its
    # prompt and all output tokens but the last, never fed back) is reusable, for both families
    # (the hybrid one has a state snapshot exactly there).
    ext = prompt + out1 + case.tokens(3, seed=42)
    h2 = engine.submit(ext, params, capture_logits=True)
    _check_against_reference(case, ext, h2, "extension of the first request")
    assert h2.cached_tokens == len(prompt) + len(out1) - 1

    # Shares only the first 10 prompt tokens: full-attention models reuse them; a hybrid model
    # (recurrent state or sliding-window rings) has no snapshot there and must recompute from scratch.
    partial = prompt[:10] + [(t + 1) % case.vocab for t in prompt[10:22]]
    h3 = engine.submit(partial, params, capture_logits=True)
    _check_against_reference(case, partial, h3, "partial prefix")
    assert h3.cached_tokens == (0 if case.hybrid else 10)

    # The first prompt again: all but its last token are cached KV, but there is no snapshot inside it.
    h4 = engine.submit(prompt, params, capture_logits=True)
    out4 = _check_against_reference(case, prompt, h4, "repeated prompt")
    assert out4 == out1
    assert h4.cached_tokens == (0 if case.hybrid else len(prompt) - 1)
    assert_no_leaks(engine)


def test_prefix_reuse_across_many_requests(case: Case, engine) -> None:  # type: ignore[no-untyped-def]
    """A conversation that grows turn by turn reuses the whole previous turn every time."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    seq = case.tokens(12, seed=51)
    expected_cached = 0
    for turn in range(4):
        h = engine.submit(seq, params, capture_logits=True)
        out = _check_against_reference(case, seq, h, f"turn {turn}")
        assert h.cached_tokens == expected_cached, f"turn {turn}"
        expected_cached = len(seq) + len(out) - 1
        seq = seq + out + case.tokens(2 + turn, seed=52 + turn)
    assert_no_leaks(engine)


def test_prefix_cache_under_memory_pressure(case: Case, make_engine) -> None:  # type: ignore[no-untyped-def]
    """With room for only a few requests, admitting new ones evicts older cache entries (and
    snapshots); every request still gives the reference's output and nothing leaks."""
    opts = {**case.spec.engine, "kv_tokens": 96}
    engine = make_engine(case.dir, **opts)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    shared = case.tokens(10, seed=71)
    prompts = [shared + case.tokens(20, seed=72 + i) for i in range(5)]
    outs = []
    for i, prompt in enumerate(prompts):
        h = engine.submit(prompt, params, capture_logits=True)
        outs.append(_check_against_reference(case, prompt, h, f"request {i}"))
        assert_no_leaks(engine)
    assert engine.scheduler.cache.cached_tokens < sum(len(p) + 7 for p in prompts)  # something was evicted
    ext = prompts[-1] + outs[-1] + [1]
    h = engine.submit(ext, params, capture_logits=True)
    _check_against_reference(case, ext, h, "extension of the last request")
    assert h.cached_tokens == len(prompts[-1]) + len(outs[-1]) - 1
    assert_no_leaks(engine)


# ------------------------------------------------------------------------------------------ (v)
_CONCURRENT = [(3, 12), (17, 20), (40, 8), (70, 16)]  # (prompt length, max_tokens)


@pytest.mark.parametrize("n", [2, 4])
def test_concurrent_requests_match_solo(case: Case, make_engine, n: int) -> None:  # type: ignore[no-untyped-def]
    reqs = [(case.tokens(plen, seed=60 + i), SamplingParams(max_tokens=mt, ignore_eos=True))
            for i, (plen, mt) in enumerate(_CONCURRENT[:n])]
    solo_engine = make_engine(case.dir, **case.spec.engine)
    solo = []
    for prompt, params in reqs:
        h = solo_engine.submit(prompt, params, capture_logits=True)
        solo.append((h.result(timeout=120), torch.stack(h.logits)))
    assert_no_leaks(solo_engine)

    together = make_engine(case.dir, **case.spec.engine)
    handles = [together.submit(prompt, params, capture_logits=True) for prompt, params in reqs]
    for i, (h, (tokens, logits)) in enumerate(zip(handles, solo, strict=True)):
        assert h.result(timeout=120) == tokens, f"request {i} of {n}"
        assert h.finish_reason == "length"
        _assert_rows_close(h.logits, logits, f"request {i} of {n}")
    assert_no_leaks(together)


def test_identical_concurrent_prompts(case: Case, make_engine) -> None:  # type: ignore[no-untyped-def]
    """Requests computing the same tokens at once: the later finisher's duplicate KV (and snapshot)
    is given back, not leaked or double-freed, and the survivor is reusable."""
    # Enough state slots that no snapshot is evicted (eviction is covered by the pressure test).
    engine = make_engine(case.dir, **{**case.spec.engine, "state_slots": 8})
    prompt = case.tokens(25, seed=81)
    handles = [engine.submit(prompt, SamplingParams(max_tokens=mt, ignore_eos=True), capture_logits=True)
               for mt in (6, 6, 3)]
    outs = [_check_against_reference(case, prompt, h, f"copy {i}") for i, h in enumerate(handles)]
    assert outs[0] == outs[1] and outs[2] == outs[0][:3]
    assert_no_leaks(engine)
    ext = prompt + outs[0] + [3]
    h = engine.submit(ext, SamplingParams(max_tokens=6, ignore_eos=True), capture_logits=True)
    _check_against_reference(case, ext, h, "extension")
    assert h.cached_tokens == len(prompt) + len(outs[0]) - 1
    assert_no_leaks(engine)


# ------------------------------------------------------------------------------------------ config
def test_loads_config_as_saved_by_transformers(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """`save_pretrained` of transformers 5 writes Qwen3-MoE's expert count as `num_local_experts`
    (an attribute_map alias that `from_pretrained` accepts); the engine must accept it too."""
    spec = TinySpec("q3_raw_config", "qwen3_moe", qwen3_moe_text(), raw_config=True, seed=7)
    path, model = tiny_checkpoint(spec)
    raw = json.loads((path / "config.json").read_text())
    assert raw.get("num_local_experts") == 6 and "num_experts" not in raw  # what transformers wrote
    dec = load_decoder(path)
    assert dec.cfg.num_experts == 6
    ids = list(range(0, 120, 7))
    kv = KVPool(dec.cfg, 64, torch.float32, torch.device("cpu"))
    st = StatePool(dec.cfg, 0, torch.float32, torch.device("cpu"))
    got = _decoder_pass(dec, kv, st, [(ids, 0, kv.alloc(len(ids)), -1)])
    _assert_rows_close(got, hf_prefill_logits(model, ids), "raw save_pretrained checkpoint")
