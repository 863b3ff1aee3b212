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

from collections.abc import Callable
from functools import partial

import numpy as np
import pytest
import torch
from quant_reference import ALL, random_rows, reference_dequant, reference_moe
from triton_interpreter import run_in_interpreter

from engine.gpu.quant.formats import packed_format
from engine.gpu.quant.slots import ExpertFormat, PackedSlots


def make_slots(fmt_gu: str, fmt_d: str, hidden: int, inter: int, slots: int, rng: np.random.Generator,
               device: str, spare: int = 0) -> tuple[PackedSlots, ExpertFormat, list[np.ndarray], list[np.ndarray]]:
    """A PackedSlots of random valid experts (slot rows `spare` bytes longer than the expert, garbage
    there: the pool's stride fits a larger layer) and their reference float32 weights per slot."""

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
    fmt = ExpertFormat(fmt_gu, fmt_d, hidden, inter)
    data = np.concatenate([gu.reshape(slots, -1), d.reshape(slots, -1),
                           rng.integers(0, 256, (slots, spare), dtype=np.uint8)], axis=1)
    pool = PackedSlots(torch.from_numpy(data).to(device), torch.from_numpy(gs).to(device))
    return pool, fmt, dense_gu, dense_d


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
        pool, fmt, dgu, dd = make_slots(fmt_gu, fmt_d, hidden, inter, 3, rng, device, spare=cases * 7)
        x = torch.randn(2, hidden, generator=g)
        slot_ids = torch.tensor([[2, -1], [-1, 1]])
        w = torch.rand(2, 2, generator=g)
        got = packed_expert_rows(x.to(device), slot_ids.to(device), w.to(device), pool, fmt).cpu()
        _close(got, reference_moe(x, slot_ids, w, dgu, dd))
        assert torch.all(got[1] == 0) and torch.all(got[2] == 0)
        cases += 1
    return cases


def check_phases_and_combine(device: str) -> int:
    from engine.gpu.quant.gemv import packed_expert_rows, packed_slot_experts

    rng = np.random.default_rng(22)
    g = torch.Generator().manual_seed(22)
    pool, fmt, dgu, dd = make_slots("q4_0", "q8_0", 64, 32, 4, rng, device)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[5, 1, 9], [2, 7, 1], [0, 3, 4]])
    slot_ids = torch.tensor([[0, 3, -1], [1, 2, 3], [-1, 0, 2]])
    w = torch.rand(3, 3, generator=g)
    dev = [t.to(device) for t in (x, ids, slot_ids, w)]
    whole = packed_expert_rows(dev[0], dev[2], dev[3], pool, fmt)
    fetched = [0, 2]
    garbage = PackedSlots(pool.data.clone(), pool.gscale.clone())
    garbage.data[fetched] = 0xFF  # f16 NaN scales
    calls: list[int] = []

    def land() -> None:
        calls.append(1)
        for s in fetched:
            garbage.copy_in(s, fmt, pool.gate_up(fmt)[s], pool.down(fmt)[s], pool.gscale[s])

    copy_dst = torch.tensor(fetched + [-1] * 7, device=device)
    split = packed_expert_rows(dev[0], dev[2], dev[3], garbage, fmt, copy_dst, land)
    assert calls == [1] and torch.equal(split, whole)
    cpu = torch.randn(3, 64, generator=g)
    out = packed_slot_experts(dev[0], dev[1], dev[2], dev[3], pool, fmt, cpu.to(device)).cpu()
    rows = reference_moe(x.float(), slot_ids, w, dgu, dd).view(3, 3, 64)
    _close(out, rows.sum(dim=1) + cpu.double())
    return 2


def _graph_time(fn: Callable[[], object], reps: int = 20) -> float:
    """Seconds per call of fn replayed from a CUDA graph (no launch overhead), median of 5."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compile, warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return sorted(times)[2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_gemv_cuda() -> None:
    assert check("cuda", EVERY) == 19
    assert check_phases_and_combine("cuda") == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", [*ALL, "q4_k+q6_k"])
def test_packed_gemv_qwen3_30b_shape_cuda(fmt: str) -> None:
    """H 2048, I 768, top-8 of 64 slots: rows against the float64 reference for two entries, then
    the GEMV's time for 1 and 8 tokens (CUDA graph replay) in GB/s of the packed bytes it reads,
    printed beside the device's copy bandwidth and the bf16 slot GEMV's (engine/gpu/kernels.py)."""
    from engine.gpu.kernels import expert_rows
    from engine.gpu.quant.gemv import packed_expert_rows

    fmt_gu, fmt_d = fmt.split("+") if "+" in fmt else (fmt, fmt)
    hidden, inter, slots, k = 2048, 768, 64, 8
    rng = np.random.default_rng(3)
    small, efmt, dgu, dd = make_slots(fmt_gu, fmt_d, hidden, inter, 2, rng, "cuda")
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    sid = torch.tensor([[1, 0]], device="cuda")
    w = torch.rand(1, 2, device="cuda")
    _close(packed_expert_rows(x, sid, w, small, efmt).cpu(), reference_moe(x.float().cpu(), sid.cpu(), w.cpu(), dgu, dd))
    big = PackedSlots(small.data[:1].repeat(slots, 1), small.gscale[:1].repeat(slots, 1))  # valid scales everywhere
    w13 = torch.randn(slots, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(slots, hidden, inter, device="cuda", dtype=torch.bfloat16)
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    copy = 2 * src.numel() / _graph_time(src.clone, reps=3)
    print(f"\n{torch.cuda.get_device_name()}: copy {copy / 1e9:.0f} GB/s (read + write)")
    for tokens in (1, 8):
        xs = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(slots, device="cuda")[:k] for _ in range(tokens)])
        ws = torch.rand(tokens, k, device="cuda")
        experts = len(set(ids.view(-1).tolist()))
        sec = _graph_time(partial(packed_expert_rows, xs, ids, ws, big, efmt))
        ref = _graph_time(partial(expert_rows, xs, ids, ws.to(xs.dtype), w13, w2))
        read = experts * efmt.nbytes
        print(f"{fmt} tokens {tokens}: {sec * 1e6:.1f} us, {read / sec / 1e9:.0f} GB/s of packed bytes "
              f"({read / copy * 2e6:.1f} us at the copy bandwidth); bf16 slots {ref * 1e6:.1f} us, "
              f"{experts * 3 * hidden * inter * 2 / ref / 1e9:.0f} GB/s")


def test_packed_gemv_in_triton_interpreter() -> None:
    run_in_interpreter(__file__)


if __name__ == "__main__":  # the interpreter test's child
    assert check("cpu", FEW) == 4
    assert check_phases_and_combine("cpu") == 2
    print("ok")
