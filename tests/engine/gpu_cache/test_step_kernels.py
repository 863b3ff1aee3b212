"""The decode step's hand-off and combine kernels (engine/gpu/kernels.py):
- `hand_off` writes exactly x, the CPU's ids (-1 where the entry has a slot) and float32 weights,
  and the copy list (sources, then destinations) when given one;
- `combine_experts` sums each token's rows in ascending expert id, rounded after every add, then
  adds the CPU's part: bit for bit the reference's torch ops (a rank, a scatter, k adds, one more
  add) in float32 and float16 (and bf16 on CUDA; Triton's interpreter truncates bf16 casts, so
  there to one ulp per add), for k from 1 to 8 and ids in any order;
- on CUDA with page-locked host buffers, inside a replayed CUDA graph: new host contents between
  replays are read again (no stale cached line), and the hand-off's host writes are there.
On CUDA directly; on a CPU through Triton's interpreter, when triton is installed; the PTX of both
kernels for sm_90 is checked without a GPU (the host read is volatile). The gate/up GEMV's
REDUCE_ONCE form against its default (CUDA; it compiles for sm_90 here)."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import run_in_interpreter


def reference_combine(y: torch.Tensor, ids: torch.Tensor, cpu: torch.Tensor | None) -> torch.Tensor:
    """The torch ops the kernel replaces: each token's rows in ascending id, a running sum in y's dtype."""
    n, k = ids.shape
    order = torch.argsort(ids, dim=1)
    rows = y.view(n, k, -1).gather(1, order[:, :, None].expand(n, k, y.shape[1]))
    out = rows[:, 0]
    for j in range(1, k):
        out = out + rows[:, j]
    return out if cpu is None else out + cpu


def _case(n: int, k: int, hidden: int, dtype: torch.dtype, device: str, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(64, generator=g)[:k] for _ in range(n)])
    y = (torch.randn(n * k, hidden, generator=g) * torch.rand(n * k, 1, generator=g) * 4).to(dtype)
    y[torch.rand(n * k, generator=g) < 0.3] = 0  # entries left to the CPU add zeros
    cpu = torch.randn(n, hidden, generator=g).to(dtype)
    return ids.to(device), y.to(device), cpu.to(device)


def check(device: str, dtypes: tuple[torch.dtype, ...], exact_bf16: bool) -> None:
    from engine.gpu.kernels import combine_experts, hand_off

    cases = 0
    for dtype in dtypes:
        for n, k, hidden in ((1, 8, 300), (3, 4, 256), (2, 1, 70), (8, 8, 512), (5, 3, 129)):
            ids, y, cpu = _case(n, k, hidden, dtype, device, seed=n * 100 + k)
            for part in (None, cpu):
                out = torch.full((n, hidden), float("nan"), dtype=dtype, device=device)
                combine_experts(y, ids, out, part)
                want = reference_combine(y, ids, part)
                if dtype != torch.bfloat16 or exact_bf16:
                    assert torch.equal(out, want), (dtype, n, k, hidden, part is None)
                else:  # one truncation per add instead of a rounding: k ulps of the largest partial sum
                    scale = y.float().abs().view(n, k, hidden).sum(1) + (0 if part is None else part.float().abs())
                    assert ((out.float() - want.float()).abs() <= (k + 1) * 2 ** -7 * scale).all()
                cases += 1
            # the hand-off: copies and a select, exact in every dtype
            g = torch.Generator().manual_seed(k)
            x = torch.randn(n, hidden, generator=g).to(dtype).to(device)
            slot_ids = torch.where(torch.rand(n, k, generator=g) < 0.5, torch.randint(0, 9, (n, k), generator=g),
                                   -1).to(device)
            w = torch.rand(n, k, generator=g).to(dtype).to(device)
            pin = device == "cuda"
            x_h = torch.zeros(n, hidden, dtype=dtype, pin_memory=pin)
            ids_h = torch.zeros(n, k, dtype=torch.int64, pin_memory=pin)
            w_h = torch.zeros(n, k, dtype=torch.float32, pin_memory=pin)
            hand_off(x, ids, slot_ids, w, x_h, ids_h, w_h)
            if device == "cuda":
                torch.cuda.synchronize()
            assert torch.equal(x_h, x.cpu())
            assert torch.equal(ids_h, torch.where(slot_ids < 0, ids, -1).cpu())
            assert torch.equal(w_h, w.float().cpu())
            # with the copy list for a host-issued fetch: the same, plus (src, dst) in one buffer
            copies = n * k
            src = torch.randint(-1, 50, (copies,), generator=g).to(device)
            dst = torch.randint(0, 9, (copies,), generator=g).to(device)
            copy_h = torch.full((2 * copies,), -7, dtype=torch.int64, pin_memory=pin)
            x_h.zero_()
            hand_off(x, ids, slot_ids, w, x_h, ids_h, w_h, src, dst, copy_h)
            if device == "cuda":
                torch.cuda.synchronize()
            assert torch.equal(x_h, x.cpu()) and torch.equal(copy_h, torch.cat([src, dst]).cpu())
            # with the split expert: its entries (in the scratch slot, 9 here) go to the CPU too, and
            # its entry (flat id, rows) follows the copy list
            scratch = 9
            split_ids = torch.where(torch.rand(n, k, generator=g) < 0.3, scratch, slot_ids.cpu()).to(device)
            split = torch.tensor([4321, 96], dtype=torch.int64).to(device)
            copy_h = torch.full((2 * copies + 2,), -7, dtype=torch.int64, pin_memory=pin)
            hand_off(x, ids, split_ids, w, x_h, ids_h, w_h, src, dst, copy_h, split=split, scratch=scratch)
            if device == "cuda":
                torch.cuda.synchronize()
            on_cpu = (split_ids < 0) | (split_ids == scratch)
            assert torch.equal(ids_h, torch.where(on_cpu, ids, -1).cpu())
            assert torch.equal(copy_h, torch.cat([src, dst, split]).cpu())
    assert cases == 2 * 5 * len(dtypes)


@pytest.mark.gpu
def test_step_kernels_match_reference_cuda() -> None:
    check("cuda", (torch.float32, torch.float16, torch.bfloat16), exact_bf16=True)


@pytest.mark.gpu
def test_host_memory_is_read_fresh_in_a_replayed_graph() -> None:
    """The CPU branch writes its part between replays; each replay must read what is there now."""
    from engine.gpu.kernels import combine_experts, hand_off

    n, k, hidden = 2, 8, 2048
    ids, y, _ = _case(n, k, hidden, torch.bfloat16, "cuda", seed=7)
    cpu_h = torch.zeros(n, hidden, dtype=torch.bfloat16, pin_memory=True)
    out = torch.empty(n, hidden, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(n, hidden, device="cuda").bfloat16()
    slot_ids = torch.full((n, k), -1, dtype=torch.int64, device="cuda")
    x_h = torch.zeros(n, hidden, dtype=torch.bfloat16, pin_memory=True)
    ids_h = torch.zeros(n, k, dtype=torch.int64, pin_memory=True)
    w_h = torch.zeros(n, k, dtype=torch.float32, pin_memory=True)
    w = torch.rand(n, k, device="cuda").bfloat16()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # compile outside the capture
        hand_off(x, ids, slot_ids, w, x_h, ids_h, w_h)
        combine_experts(y, ids, out, cpu_h)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        hand_off(x, ids, slot_ids, w, x_h, ids_h, w_h)
        combine_experts(y, ids, out, cpu_h)
    for seed in range(4):
        cpu = torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)).bfloat16()
        cpu_h.copy_(cpu)  # the host writes, as the native task does
        x.copy_(torch.randn(n, hidden, device="cuda").bfloat16())
        x_h.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), reference_combine(y, ids, cpu.cuda()).cpu()), seed
        assert torch.equal(x_h, x.cpu()), seed


def test_step_kernels_compile_for_hopper() -> None:
    """Both kernels compile for sm_90 (no GPU needed); the CPU part is a volatile load (not a cached line)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.gpu import kernels

    target = GPUTarget("cuda", 90, 32)
    for has_cpu in (True, False):
        sig = {"y_ptr": "*bf16", "ids_ptr": "*i64", "cpu_ptr": "*bf16", "out_ptr": "*bf16", "H": "i32"}
        consts = {"K": 8, "K_P": 8, "HAS_CPU": has_cpu, "BLOCK_O": 256}
        src = ASTSource(fn=kernels._combine_kernel, signature={**sig, **dict.fromkeys(consts, "constexpr")},
                        constexprs=consts)
        ptx = triton.compile(src, target=target, options={"num_warps": 4}).asm["ptx"]
        assert ("ld.volatile.global" in ptx) == has_cpu
        assert ".local" not in ptx
    sig = {"x_ptr": "*bf16", "ids_ptr": "*i64", "slot_ptr": "*i64", "w_ptr": "*bf16", "x_h": "*bf16", "ids_h": "*i64",
           "w_h": "*fp32", "src_ptr": "*i64", "dst_ptr": "*i64", "copy_h": "*i64", "split_ptr": "*i64"}
    # without and with the copy list of a host-issued fetch, and with the split expert's entry
    for copies, scratch in ((0, -2), (8, -2), (8, 1000)):
        consts = {"H": 2048, "K": 8, "K_P": 8, "BLOCK_H": 1024, "COPIES": copies, "COPIES_P": max(copies, 1),
                  "SCRATCH": scratch}
        src = ASTSource(fn=kernels._handoff_kernel, signature={**sig, **dict.fromkeys(consts, "constexpr")},
                        constexprs=consts)
        assert "st.global" in triton.compile(src, target=target, options={"num_warps": 4}).asm["ptx"]
    # the gate/up GEMV both ways: the REDUCE_ONCE form is another program, without spills
    sig = {"x_ptr": "*bf16", "slot_ptr": "*i64", "w13_ptr": "*bf16", "h_ptr": "*bf16", "dst_ptr": "*i64",
           "split_ptr": "*i64"}
    ptx = {}
    for once in (False, True):  # each at the block shape it runs (expert_rows; the probe's former default)
        consts = {"H": 2048, "INTER": 768, "K": 8, "BLOCK_I": 16, "BLOCK_H": 128 if once else 256,
                  "REDUCE_ONCE": once, "PHASE": 0, "COPIES": 1, "COPIES_P": 1, "SCRATCH": -2}
        src = ASTSource(fn=kernels._gate_up_kernel, signature={**sig, **dict.fromkeys(consts, "constexpr")},
                        constexprs=consts)
        ptx[once] = triton.compile(src, target=target, options={"num_warps": 4}).asm["ptx"]
        assert ".local" not in ptx[once]
    assert ptx[False] != ptx[True]
    # both slot GEMVs in each phase of a split around a host-issued fetch (PHASE 1: the entries not
    # being fetched, 2: the fetched ones): they compile, without spills
    sig2 = {"h_ptr": "*bf16", "slot_ptr": "*i64", "w2_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "dst_ptr": "*i64",
            "split_ptr": "*i64"}
    for phase, scratch in ((1, -2), (2, -2), (1, 1000), (2, 1000)):  # and with a split expert's scratch slot
        split = {"PHASE": phase, "COPIES": 8, "COPIES_P": 8, "SCRATCH": scratch}
        for fn, signature, consts in (
                (kernels._gate_up_kernel, sig, {"H": 2048, "INTER": 512, "K": 8, "BLOCK_I": 16, "BLOCK_H": 128,
                                                "REDUCE_ONCE": True, **split}),
                (kernels._down_kernel, sig2, {"H": 2048, "INTER": 512, "BLOCK_O": 16, "BLOCK_K": 256, **split})):
            src = ASTSource(fn=fn, signature={**signature, **dict.fromkeys(consts, "constexpr")}, constexprs=consts)
            assert ".local" not in triton.compile(src, target=target, options={"num_warps": 4}).asm["ptx"]


@pytest.mark.gpu
def test_gate_up_reduce_once_matches_the_default() -> None:
    """The gate/up GEMV's REDUCE_ONCE form (evals/gpu/gemv_probe.py times it) computes what the
    default does, up to the float32 order of each dot product: float32 to 1e-5, for the block shapes
    the probe tries, entries without a slot left at zero."""
    import triton

    from engine.gpu.kernels import _gate_up_kernel

    k, hidden, inter = 8, 512, 96
    g = torch.Generator().manual_seed(5)
    w13 = (torch.randn(12, 2 * inter, hidden, generator=g) / 16).cuda()
    x = torch.randn(1, hidden, generator=g).cuda()
    slot_ids = torch.tensor([3, -1, 7, 0, -1, 11, -1, 5], device="cuda")
    outs = []
    for once, bi, bh, warps in ((False, 16, 256, 4), (True, 16, 128, 4), (True, 16, 256, 4), (True, 8, 512, 4),
                                (True, 32, 128, 8)):
        h = torch.full((k, inter), float("nan"), device="cuda")
        _gate_up_kernel[(k, triton.cdiv(inter, bi))](x, slot_ids, w13, h, slot_ids, slot_ids, hidden, inter, K=k, BLOCK_I=bi,
                                                     BLOCK_H=bh, REDUCE_ONCE=once, num_warps=warps)
        outs.append(h)
    assert torch.all(outs[0][slot_ids < 0] == 0)
    for h in outs[1:]:
        torch.testing.assert_close(h, outs[0], rtol=1e-5, atol=1e-5)


def test_step_kernels_match_reference_in_triton_interpreter() -> None:
    run_in_interpreter(__file__)


if __name__ == "__main__":  # the interpreter test's child
    check("cpu", (torch.float32, torch.float16, torch.bfloat16), exact_bf16=False)
    print("ok")
