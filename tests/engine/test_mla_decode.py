"""MLA's decode kernel (engine/model/mla_decode.py) against a float64 reference, and in a whole pass.

- every absorbed query attends causally over its sequence's latent rows read through the slot
  table, the rows' first kv_lora_rank values as values, for ragged batches and long contexts, with
  a latent of 576 dims (not a power of two: DeepSeek-V3 / GLM-4.7-Flash's 512 + 64) and tiny ones;
  new rows land in their slots exactly; float32 to 1e-5;
- a decoder pass of an MLA model with the device-side decode form gives the per-sequence pass's
  logits (float32, 1e-4), so decode steps on CUDA (captured or not) compute what prefill does.
On CUDA directly; on a CPU through Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import run_in_interpreter

SLOTS = 3000


def _batch(lengths: list[tuple[int, int]], device: str, seed: int = 0):  # type: ignore[no-untyped-def]
    from engine.model.batch import ForwardBatch, SeqEntry

    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(SLOTS, generator=g)
    seqs, start, used, positions = [], 0, 0, []
    for cached, new in lengths:
        total = cached + new
        seqs.append(SeqEntry(start, new, cached, perm[used:used + total].to(device), state_slot=0))
        positions.extend(range(cached, total))
        start, used = start + new, used + total
    return ForwardBatch(torch.zeros(start, dtype=torch.long, device=device), torch.tensor(positions, device=device),
                        seqs)


def check_kernel(device: str, heads: int, latent: int, rope: int, cases: list[list[tuple[int, int]]]) -> None:
    from engine.model.decode_attention import DecodeMeta
    from engine.model.mla_decode import mla_decode

    g = torch.Generator().manual_seed(heads + latent)
    dim = latent + rope
    scale = 0.7 * dim**-0.5
    for i, lengths in enumerate(cases):
        batch = _batch(lengths, device, seed=i)
        n = batch.num_tokens
        cache = torch.randn(SLOTS, 1, dim, generator=g).to(device)
        q = torch.randn(n, heads, dim, generator=g).to(device)
        rows = torch.randn(n, 1, dim, generator=g).to(device)
        ref_cache = cache.double().cpu()
        for s in batch.seqs:
            ref_cache[s.kv_slots[s.cached_len:].cpu()] = rows[s.start:s.end].double().cpu()
        out = mla_decode(q, rows, cache, DecodeMeta.build(batch, torch.device(device)), scale, latent)
        assert torch.equal(cache.double().cpu(), ref_cache)
        for s in batch.seqs:
            for j in range(s.length):
                keys = ref_cache[s.kv_slots[:s.cached_len + j + 1].cpu(), 0]  # [S, dim]
                p = (q[s.start + j].double().cpu() @ keys.T * scale).softmax(-1)
                ref = p @ keys[:, :latent]
                err = (out[s.start + j].double().cpu() - ref).abs().max().item()
                assert err <= 1e-5, (lengths, heads, latent, err)


def check_pass(device: str) -> None:
    """A tiny MLA model's decode-sized pass with the kernel equals its per-sequence pass."""
    from engine.cache.pools import KVPool, StatePool
    from engine.model.batch import PassMeta
    from engine.model.decode_attention import DecodeMeta
    from engine.weights.dummy import dummy_config, dummy_decoder

    dec = dummy_decoder(dummy_config("tiny-mla"), device, torch.float32, seed=1, executor="torch", threads=1)
    kv = KVPool(dec.cfg, SLOTS, torch.float32, torch.device(device))
    states = StatePool(dec.cfg, 1, torch.float32, torch.device(device))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    slots = [torch.arange(0, 9, device=device), torch.arange(100, 107, device=device)]
    from engine.model.batch import ForwardBatch, SeqEntry

    prefill = ForwardBatch(torch.tensor(prompts[0] + prompts[1], device=device),
                           torch.tensor(list(range(8)) + list(range(6)), device=device),
                           [SeqEntry(0, 8, 0, slots[0][:8]), SeqEntry(8, 6, 0, slots[1][:6])])
    dec.forward(prefill, kv, states)
    step = ForwardBatch(torch.tensor([7, 3], device=device), torch.tensor([8, 6], device=device),
                        [SeqEntry(0, 1, 8, slots[0]), SeqEntry(1, 1, 6, slots[1])])
    eager_kv = KVPool(dec.cfg, SLOTS, torch.float32, torch.device(device))
    eager_kv.k.copy_(kv.k)
    eager = dec.logits(dec.run(step.input_ids, PassMeta(step.positions, 9, step), eager_kv, states))
    meta = PassMeta(step.positions, 9, None, DecodeMeta.build(step, torch.device(device)))
    kernel = dec.logits(dec.run(step.input_ids, meta, kv, states))
    assert float((kernel - eager).abs().max() / eager.abs().max()) <= 1e-4
    # the new rows landed in the same slots (later layers' rows differ by the attention's rounding)
    torch.testing.assert_close(kv.k, eager_kv.k, rtol=1e-4, atol=1e-5)
    assert torch.equal(kv.k[0], eager_kv.k[0])


CASES = [[(0, 1)], [(40, 1), (5, 3), (0, 2)], [(700, 1)]]


@pytest.mark.gpu
def test_mla_decode_cuda() -> None:
    check_kernel("cuda", 20, 512, 64, CASES)
    check_kernel("cuda", 128, 512, 64, [[(2000, 1), (3, 1)]])
    check_pass("cuda")


def test_mla_decode_in_triton_interpreter() -> None:
    run_in_interpreter(__file__)


if __name__ == "__main__":  # the interpreter test's child: small cases keep it quick
    check_kernel("cpu", 20, 512, 64, [[(0, 1)], [(70, 1), (3, 2)]])
    check_kernel("cpu", 4, 16, 8, CASES)
    check_pass("cpu")
    print("ok")
