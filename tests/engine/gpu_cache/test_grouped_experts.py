"""The grouped expert kernels (engine/gpu/grouped.py) against a float64 reference.

- per token, the sum over its k entries of weight * down(silu(gate) * up), computed in float64
  from the same (float32 or bf16) inputs, expert e's weights from slot slot_of[e]: slots in
  permuted, non-contiguous positions of a pool whose other slots hold other random weights;
- ragged groups: experts with no token, with exactly one, with more than a block (every token of
  the chunk), H and I not multiples of the tiles, int32 and int64 ids, float32 and bf16 weights;
- float32: to summation order (1e-5 of the terms' magnitude); bf16: every element within a few
  bf16 roundings of the terms' magnitude (the bound of the roundings the reference also makes),
  and the error over the whole output about one bf16 ulp (relative RMS <= 2 * 2^-7);
- on CUDA: the same, two calls are bit-identical (no atomics), and the computation captured in a
  CUDA graph serves new routing and new inputs with the eager result (no host read);
- without a GPU, when triton is installed: both kernels compile for sm_90 (tensor-core dots,
  pipelined loads, no spills, shared memory within an H200 block's).
On CUDA (the GPU machine) directly; on a CPU through Triton's interpreter, when triton is installed.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import run_in_interpreter


def _routing(n: int, k: int, experts: int, g: torch.Generator) -> torch.Tensor:
    """[n, k] distinct ids per token: expert 0 takes every token (a group larger than a block when
    n > 64), expert E-2 exactly one token, expert E-1 none, the rest random."""
    ids = torch.empty(n, k, dtype=torch.int64)
    for t in range(n):
        rest = (torch.randperm(experts - 3, generator=g)[:k - 1] + 1).tolist()
        ids[t] = torch.tensor([0, *rest][:k])
    if k > 1 and experts > 3:
        ids[n // 2, -1] = experts - 2
    # shuffle each token's entries so expert 0 is not always the first
    return ids.gather(1, torch.stack([torch.randperm(k, generator=g) for _ in range(n)]))


def _reference(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, slot_of: torch.Tensor, w13: torch.Tensor,
               w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over entries of weight * down(silu(gate) * up), the same with every term's absolute
    value: the magnitude the roundings scale with), float64 on the CPU."""
    x, w, w13, w2 = (t.double().cpu() for t in (x, w, w13, w2))
    ids, slot_of = ids.cpu().long(), slot_of.cpu()
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    mag = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            s = int(slot_of[ids[t, j]])
            gu = w13[s] @ x[t]
            gate, up = gu[:inter], gu[inter:]
            h = torch.nn.functional.silu(gate) * up
            out[t] += w[t, j] * (w2[s] @ h)
            mag[t] += (w[t, j] * (w2[s].abs() @ h.abs())).abs()
    return out, mag


def check(device: str, dtype: torch.dtype, cases: list[tuple[int, int, int, int, int]], ulps: float = 8.0,
          rms_ulps: float = 2.0) -> None:
    """bf16 bounds: `ulps` per element, in unit roundoffs (2^-8) of the terms' magnitude (about one
    for each rounding: gate, up, silu, the product, the down output, the weighted term, the sum);
    `rms_ulps` over the output, in ulps at 1 (2^-7) relative to its RMS. TorchExpertExecutor's own
    bf16 arithmetic measures about 2 and 0.7 on these cases; Triton's interpreter truncates instead
    of rounding (biased), about 5 and 2.3, so its child allows twice both."""
    from engine.gpu.grouped import grouped_experts

    g = torch.Generator().manual_seed(0)
    for i, (n, k, experts, hidden, inter) in enumerate(cases):
        pool = experts + 5
        w13 = (torch.randn(pool, 2 * inter, hidden, generator=g) / hidden**0.5).to(device, dtype)
        w2 = (torch.randn(pool, hidden, inter, generator=g) / inter**0.5).to(device, dtype)
        slot_of = torch.randperm(pool, generator=g)[:experts].to(device)
        x = torch.randn(n, hidden, generator=g).to(device, dtype)
        ids = _routing(n, k, experts, g).to(device, torch.int32 if i % 2 else torch.int64)
        w = torch.rand(n, k, generator=g).to(device, dtype if i % 3 else torch.float32)
        out = grouped_experts(x, ids, w, slot_of, w13, w2)
        assert out.dtype == dtype and out.shape == x.shape and out.device.type == torch.device(device).type
        ref, mag = _reference(x, ids, w, slot_of, w13, w2)
        err = (out.double().cpu() - ref).abs()
        if dtype == torch.float32:
            tol, rms_tol = 1e-5 * mag + 1e-12, 1e-6
        else:
            tol, rms_tol = ulps * 2**-8 * mag + 1e-12, rms_ulps * 2**-7
        worst = int((err - tol).argmax())
        assert (err <= tol).all(), ((n, k, experts, hidden, inter), dtype, err.flatten()[worst].item(),
                                    tol.flatten()[worst].item(), ref.flatten()[worst].item())
        rms = (err.square().mean() / ref.square().mean()).sqrt().item()
        assert rms <= rms_tol, ((n, k, experts, hidden, inter), dtype, rms)
        if device == "cuda":
            again = grouped_experts(x, ids, w, slot_of, w13, w2)
            assert torch.equal(out, again)


CUDA_CASES = [(1, 1, 4, 32, 16), (5, 2, 8, 48, 40), (100, 2, 4, 64, 32), (300, 8, 64, 256, 96),
              (1024, 8, 32, 512, 200), (2048, 8, 128, 256, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_match_float64_reference_cuda(dtype: torch.dtype) -> None:
    check("cuda", dtype, CUDA_CASES)


@pytest.mark.gpu
def test_grouped_experts_in_a_cuda_graph() -> None:
    from engine.gpu.grouped import grouped_experts

    n, k, experts, hidden, inter, dtype = 512, 8, 64, 256, 128, torch.bfloat16
    g = torch.Generator().manual_seed(3)
    w13 = (torch.randn(experts + 3, 2 * inter, hidden, generator=g) / hidden**0.5).to("cuda", dtype)
    w2 = (torch.randn(experts + 3, hidden, inter, generator=g) / inter**0.5).to("cuda", dtype)
    slot_of = torch.randperm(experts + 3, generator=g)[:experts].cuda()
    x = torch.zeros(n, hidden, dtype=dtype, device="cuda")
    ids = torch.zeros(n, k, dtype=torch.int64, device="cuda")
    w = torch.zeros(n, k, dtype=dtype, device="cuda")

    def fill(seed: int) -> None:
        gg = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(n, hidden, generator=gg).to(dtype))
        ids.copy_(torch.rand(n, experts, generator=gg).topk(k, dim=-1).indices)
        w.copy_(torch.rand(n, k, generator=gg).to(dtype))

    fill(0)
    out = torch.empty_like(x)
    out.copy_(grouped_experts(x, ids, w, slot_of, w13, w2))  # compiles before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(grouped_experts(x, ids, w, slot_of, w13, w2))
    for seed in (1, 2, 3):
        fill(seed)
        eager = grouped_experts(x, ids, w, slot_of, w13, w2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), seed


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kernels_compile_for_hopper(dtype: str) -> None:
    """Both kernels compile for sm_90 (Triton's compiler and its ptxas, no GPU needed), at every
    BLOCK_M, with 16-byte aligned pointers as the launcher specialises them: bf16 dots on the
    tensor cores (wgmma at BLOCK_M 64, one warpgroup; mma.sync below), loads pipelined
    (cp.async), no register spills to local memory, shared memory within an H200 block's 227 KiB."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.gpu import grouped

    ptr = f"*{dtype}"
    kernels = [
        (grouped._gate_up_kernel, {"x_ptr": ptr, "w13_ptr": ptr, "row_entry_ptr": "*i64", "block_slot_ptr": "*i64",
                                   "h_ptr": ptr, "K": "i32"}, grouped._GATE_UP_N, grouped._GATE_UP_K),
        (grouped._down_kernel, {"h_ptr": ptr, "w2_ptr": ptr, "weight_ptr": ptr, "row_entry_ptr": "*i64",
                                "block_slot_ptr": "*i64", "y_ptr": ptr}, grouped._DOWN_N, grouped._DOWN_K),
    ]
    for fn, sig, block_n, block_k in kernels:
        for block in (16, 32, 64):
            consts = {"H": 2048, "INTER": 768, "BLOCK_M": block, "BLOCK_N": block_n, "BLOCK_K": block_k,
                      "PRECISION": "ieee" if dtype == "fp32" else "tf32", "WIDEN": False}
            signature = {**sig, **dict.fromkeys(consts, "constexpr")}
            attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values()) if t.startswith("*")}
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs),
                                      target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": grouped._WARPS, "num_stages": grouped._STAGES})
            ptx = compiled.asm["ptx"]
            assert compiled.metadata.shared <= 227 * 1024, (fn.__name__, block, compiled.metadata.shared)
            assert "cp.async" in ptx, (fn.__name__, block)
            assert ".local" not in ptx, (fn.__name__, block)
            if dtype == "bf16":
                assert ("wgmma" if block == 64 else "mma.sync") in ptx, (fn.__name__, block)


def test_grouped_experts_match_float64_reference_in_triton_interpreter() -> None:
    run_in_interpreter(__file__)


if __name__ == "__main__":  # the interpreter test's child: small cases keep it quick
    small = [(1, 1, 4, 32, 16), (5, 2, 8, 48, 40), (100, 2, 4, 64, 32), (40, 4, 16, 80, 72)]
    check("cpu", torch.float32, small)
    check("cpu", torch.bfloat16, small, ulps=16.0, rms_ulps=4.0)
    print("ok")
