"""The decode attention kernel (engine/model/decode_attention.py) against a float64 reference.

- every query attends causally over its own sequence's keys, read through the KV slot table, with
  and without a sliding window, for ragged batches (one-token and multi-token sequences) and long
  contexts (many keys per split); the new keys and values land in their cache slots exactly;
- float32 to 1e-5, bf16 within one rounding of the output;
- captured once in a CUDA graph, the kernel serves later steps whose lengths and slots changed
  (the lengths are read on the device), with the eager result.
On CUDA (the GPU machine) directly; on a CPU through Triton's interpreter, when triton is installed.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import run_in_interpreter

HEADS, KV_HEADS, DIM, SLOTS = 8, 2, 32, 6000


def _batch(lengths: list[tuple[int, int]], device: str, seed: int = 0):  # type: ignore[no-untyped-def]
    """A ForwardBatch of sequences given as (cached, new) token counts, slots scattered over the pool."""
    from engine.model.batch import ForwardBatch, SeqEntry

    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(SLOTS, generator=g)
    seqs, start, used = [], 0, 0
    positions: list[int] = []
    for cached, new in lengths:
        total = cached + new
        seqs.append(SeqEntry(start, new, cached, perm[used:used + total].to(device)))
        positions.extend(range(cached, total))
        start, used = start + new, used + total
    ids = torch.zeros(start, dtype=torch.long, device=device)
    return ForwardBatch(ids, torch.tensor(positions, device=device), seqs)


def _reference(q, k, v, kc, vc, batch, window):  # type: ignore[no-untyped-def]
    kr, vr = kc.double().cpu(), vc.double().cpu()
    for s in batch.seqs:
        new = s.kv_slots[s.cached_len:].cpu()
        kr[new] = k[s.start:s.end].double().cpu()
        vr[new] = v[s.start:s.end].double().cpu()
    out = torch.empty(q.shape, dtype=torch.float64)
    groups = q.shape[1] // k.shape[1]
    for s in batch.seqs:
        slots = s.kv_slots.cpu()
        for j in range(s.length):
            length = s.cached_len + j + 1
            lo = max(0, length - window) if window else 0
            keys = kr[slots[lo:length]].repeat_interleave(groups, dim=1)
            vals = vr[slots[lo:length]].repeat_interleave(groups, dim=1)
            scores = torch.einsum("hd,lhd->hl", q[s.start + j].double().cpu(), keys) * DIM**-0.5
            out[s.start + j] = torch.einsum("hl,lhd->hd", scores.softmax(-1), vals)
    return out.reshape(q.shape[0], -1), kr, vr


def check(device: str, dtype: torch.dtype, cases: list[list[tuple[int, int]]], ulps: float = 0.5) -> None:
    """`ulps`: the bf16 output's allowed rounding (half an ulp on CUDA; Triton's interpreter
    truncates to bf16, a whole ulp)."""
    from engine.model.decode_attention import DecodeMeta, decode_attention

    g = torch.Generator().manual_seed(1)
    for case_index, lengths in enumerate(cases):
        batch = _batch(lengths, device, seed=case_index)
        n = batch.num_tokens
        kc = torch.randn(SLOTS, KV_HEADS, DIM, generator=g).to(device, dtype)
        vc = torch.randn(SLOTS, KV_HEADS, DIM, generator=g).to(device, dtype)
        q, k, v = (torch.randn(n, h, DIM, generator=g).to(device, dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
        for window in (None, 5, 700):
            kc_w, vc_w = kc.clone(), vc.clone()
            out = decode_attention(q, k, v, kc_w, vc_w, DecodeMeta.build(batch, torch.device(device)), window,
                                   DIM**-0.5)
            ref, kr, vr = _reference(q, k, v, kc, vc, batch, window)
            assert torch.equal(kc_w.cpu().double(), kr) and torch.equal(vc_w.cpu().double(), vr)
            err = (out.double().cpu() - ref).abs()
            # float32: accumulation order only; bf16: the output's one rounding (ulp(x) <= 2^-7 |x|)
            tol = 1e-5 if dtype == torch.float32 else ulps * 2**-7 * ref.abs() + 1e-4
            i = int((err - tol).argmax())
            assert (err <= tol).all(), (lengths, window, dtype, err.flatten()[i].item(), ref.flatten()[i].item())


CASES = [[(0, 1)], [(40, 1)], [(40, 1), (5, 3), (0, 2), (17, 1)], [(4999, 1)], [(1200, 1), (3000, 1)]]


def test_metadata_refuses_a_batch_it_cannot_hold() -> None:
    pytest.importorskip("triton")  # the module defines the kernels
    from engine.model.decode_attention import DecodeMeta

    meta = DecodeMeta.empty(2, 16, torch.device("cpu"))
    meta.fill(_batch([(3, 1), (9, 1)], "cpu"))
    assert meta.lengths.tolist() == [4, 10] and meta.table[1, :10].tolist() == _batch([(3, 1), (9, 1)], "cpu").seqs[
        1].kv_slots.tolist()
    with pytest.raises(ValueError, match="for 2 tokens, the batch has 3"):
        meta.fill(_batch([(3, 1), (9, 2)], "cpu"))
    with pytest.raises(ValueError, match="a sequence of 21 tokens exceeds the table's 16"):
        meta.fill(_batch([(3, 1), (20, 1)], "cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_float64_reference_cuda(dtype: torch.dtype) -> None:
    check("cuda", dtype, CASES)


@pytest.mark.gpu
def test_captured_kernel_reads_lengths_on_the_device() -> None:
    from engine.model.decode_attention import DecodeMeta, decode_attention

    g = torch.Generator().manual_seed(2)
    kc = torch.randn(SLOTS, KV_HEADS, DIM, generator=g).to("cuda", torch.bfloat16)
    vc = torch.randn(SLOTS, KV_HEADS, DIM, generator=g).to("cuda", torch.bfloat16)
    meta = DecodeMeta.empty(2, SLOTS, torch.device("cuda"))
    q, k, v = (torch.zeros(2, h, DIM, dtype=torch.bfloat16, device="cuda") for h in (HEADS, KV_HEADS, KV_HEADS))
    out = torch.zeros(2, HEADS * DIM, dtype=torch.bfloat16, device="cuda")

    def step() -> None:
        out.copy_(decode_attention(q, k, v, kc, vc, meta, None, DIM**-0.5))

    meta.fill(_batch([(3, 1), (9, 1)], "cuda"))
    step()  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i, lengths in enumerate([[(10, 1), (2000, 1)], [(600, 1), (0, 1)], [(4000, 1), (50, 1)]]):
        batch = _batch(lengths, "cuda", seed=10 + i)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=g).to("cuda", torch.bfloat16))
        kc_eager, vc_eager = kc.clone(), vc.clone()
        eager = decode_attention(q, k, v, kc_eager, vc_eager, DecodeMeta.build(batch, torch.device("cuda")), None,
                                 DIM**-0.5)
        meta.fill(batch)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), lengths
        assert torch.equal(kc, kc_eager) and torch.equal(vc, vc_eager)


def test_kernel_matches_float64_reference_in_triton_interpreter() -> None:
    run_in_interpreter(__file__)


if __name__ == "__main__":  # the interpreter test's child: small cases keep it quick
    check("cpu", torch.float32, [[(0, 1)], [(40, 1), (5, 3), (0, 2)], [(300, 1)]])
    check("cpu", torch.bfloat16, [[(70, 1), (2, 2)]], ulps=1.0)
    print("ok")
