"""The decode GEMV over packed slots (engine/gpu/quant/gemv.py), against a float64 MoE over the
reference-dequantised experts (quant_reference.py, independent of the kernels):
- every format on CUDA, a few mixes in the interpreter (Q4_K_M's: q4_k gate_up, q6_k down; nvfp4 with per-slot global scales):
  entry rows weight * down(silu(gate x) * up x) to float32 rounding, zeros for entries without a slot;
- split around a fetch (`copy_dst`, `between`): the fetched slots hold garbage (NaN) until
  `between()` lands them, and the rows equal the unsplit call's bit for bit;
- `packed_slot_experts`: the per-token sum in ascending expert id, plus the CPU branch's part.
On a CPU through Triton's interpreter; on CUDA directly, and there also at Qwen3-30B-A3B's expert
shape (H 2048, I 768) per format, with the GEMV's time against the HBM read bound (printed)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from quant_reference import ALL, random_rows, reference_dequant, reference_moe
from triton_interpreter import run_in_interpreter

from engine.gpu.quant.formats import packed_format, row_bytes


def make_slots(fmt_gu: str, fmt_d: str, hidden: int, inter: int, slots: int, rng: np.random.Generator,
               device: str) -> tuple[object, list[np.ndarray], list[np.ndarray]]:
    """A PackedSlots of random valid experts and their reference float32 weights per slot."""
    from engine.gpu.quant.slots import PackedSlots

    gu = np.stack([random_rows(fmt_gu, 2 * inter, hidden, rng) for _ in range(slots)])
    d = np.stack([random_rows(fmt_d, hidden, inter, rng) for _ in range(slots)])
    gs = np.ones((slots, 3), dtype=np.float32)
    if packed_format(fmt_gu).has_global:
        gs[:, :2] = rng.uniform(0.5, 2, (slots, 2))
    if packed_format(fmt_d).has_global:
        gs[:, 2] = rng.uniform(0.5, 2, slots)
    dense_gu = [np.concatenate([reference_dequant(gu[s, :inter], fmt_gu, hidden, gs[s, 0]),
                                reference_dequant(gu[s, inter:], fmt_gu, hidden, gs[s, 1])]) for s in range(slots)]
    dense_d = [reference_dequant(d[s], fmt_d, inter, gs[s, 2]) for s in range(slots)]
    pool = PackedSlots(torch.from_numpy(gu).to(device), torch.from_numpy(d).to(device),
                       torch.from_numpy(gs).to(device), fmt_gu, fmt_d)
    return pool, dense_gu, dense_d


def shape_for(fmt_gu: str, fmt_d: str) -> tuple[int, int]:
    b = max(packed_format(fmt_gu).block, packed_format(fmt_d).block)
    return max(b, 64), max(b, 32)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-6 * float(want.abs().max()))


# the interpreter's share (its time is scarce; the dequant test covers every format bit for bit)
FEW = [("q4_k", "q6_k"), ("q8_0", "nvfp4"), ("mxfp4", "fp8"), ("iq4_nl", "q5_1")]
EVERY = [(f, f) for f in ALL] + FEW


def check(device: str, pairs: list[tuple[str, str]]) -> int:
    from engine.gpu.quant.gemv import packed_expert_rows

    rng = np.random.default_rng(21)
    g = torch.Generator().manual_seed(21)
    cases = 0
    for fmt_gu, fmt_d in pairs:
        hidden, inter = shape_for(fmt_gu, fmt_d)
        pool, dgu, dd = make_slots(fmt_gu, fmt_d, hidden, inter, 3, rng, device)
        x = torch.randn(2, hidden, generator=g)
        slot_ids = torch.tensor([[2, -1], [-1, 1]])
        w = torch.rand(2, 2, generator=g)
        got = packed_expert_rows(x.to(device), slot_ids.to(device), w.to(device), pool).cpu()
        _close(got, reference_moe(x, slot_ids, w, dgu, dd))
        assert torch.all(got[1] == 0) and torch.all(got[2] == 0)
        cases += 1
    return cases


def check_phases_and_combine(device: str) -> int:
    from engine.gpu.quant.gemv import packed_expert_rows, packed_slot_experts
    from engine.gpu.quant.slots import PackedSlots

    rng = np.random.default_rng(22)
    g = torch.Generator().manual_seed(22)
    pool, dgu, dd = make_slots("q4_0", "q8_0", 64, 32, 4, rng, device)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[5, 1, 9], [2, 7, 1], [0, 3, 4]])
    slot_ids = torch.tensor([[0, 3, -1], [1, 2, 3], [-1, 0, 2]])
    w = torch.rand(3, 3, generator=g)
    dev = [t.to(device) for t in (x, ids, slot_ids, w)]
    whole = packed_expert_rows(dev[0], dev[2], dev[3], pool)
    fetched = [0, 2]
    garbage = PackedSlots(pool.gate_up.clone(), pool.down.clone(), pool.gscale.clone(), "q4_0", "q8_0")
    garbage.gate_up[fetched] = 0xFF  # f16 NaN scales
    garbage.down[fetched] = 0xFF
    calls: list[int] = []

    def land() -> None:
        calls.append(1)
        for s in fetched:
            garbage.copy_in(s, pool.gate_up[s], pool.down[s], pool.gscale[s])

    copy_dst = torch.tensor(fetched + [-1] * 7, device=device)
    split = packed_expert_rows(dev[0], dev[2], dev[3], garbage, copy_dst, land)
    assert calls == [1] and torch.equal(split, whole)
    cpu = torch.randn(3, 64, generator=g)
    out = packed_slot_experts(dev[0], dev[1], dev[2], dev[3], pool, cpu.to(device)).cpu()
    rows = reference_moe(x.float(), slot_ids, w, dgu, dd).view(3, 3, 64)
    want = rows.sum(dim=1) + cpu.double()
    _close(out, want)
    return 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_gemv_cuda() -> None:
    assert check("cuda", EVERY) == 19
    assert check_phases_and_combine("cuda") == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", [*ALL, "q4_k+q6_k"])
def test_packed_gemv_qwen3_30b_shape_cuda(fmt: str) -> None:
    """H 2048, I 768, top-8 of 64 slots; 1 and 8 tokens: rows against the float64 reference for two
    entries, then the GEMV's time (1 token) against the HBM bound of the packed bytes it reads."""
    from engine.gpu.quant.gemv import packed_expert_rows
    from engine.gpu.quant.slots import PackedSlots

    fmt_gu, fmt_d = fmt.split("+") if "+" in fmt else (fmt, fmt)
    hidden, inter, slots, k = 2048, 768, 64, 8
    rng = np.random.default_rng(3)
    small, dgu, dd = make_slots(fmt_gu, fmt_d, hidden, inter, 2, rng, "cuda")
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    sid = torch.tensor([[1, 0]], device="cuda")
    w = torch.rand(1, 2, device="cuda")
    got = packed_expert_rows(x, sid, w, small).cpu()
    _close(got, reference_moe(x.float().cpu(), sid.cpu(), w.cpu(), dgu, dd))
    big = PackedSlots(torch.randint(0, 256, (slots, 2 * inter, row_bytes(fmt_gu, hidden)), dtype=torch.uint8,
                                    device="cuda"),
                      torch.randint(0, 256, (slots, hidden, row_bytes(fmt_d, inter)), dtype=torch.uint8,
                                    device="cuda"), torch.ones(slots, 3, device="cuda"), fmt_gu, fmt_d)
    big.gate_up[:, :, :] = small.gate_up[0].repeat(slots, 1, 1)  # valid scales everywhere
    big.down[:, :, :] = small.down[0].repeat(slots, 1, 1)
    for tokens in (1, 8):
        xs = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(slots, device="cuda")[:k] for _ in range(tokens)])
        ws = torch.rand(tokens, k, device="cuda")
        for _ in range(3):
            packed_expert_rows(xs, ids, ws, big)
        torch.cuda.synchronize()
        reps = 50
        t0 = time.perf_counter()
        for _ in range(reps):
            packed_expert_rows(xs, ids, ws, big)
        torch.cuda.synchronize()
        sec = (time.perf_counter() - t0) / reps
        read = len(set(ids.view(-1).tolist())) * (big.gate_up[0].numel() + big.down[0].numel())
        print(f"\n{fmt} tokens {tokens}: {sec * 1e6:.1f} us, {read / sec / 1e9:.0f} GB/s of packed bytes")


def test_packed_gemv_in_triton_interpreter() -> None:
    run_in_interpreter(__file__)


if __name__ == "__main__":  # the interpreter test's child
    assert check("cpu", FEW) == 4
    assert check_phases_and_combine("cpu") == 2
    print("ok")
