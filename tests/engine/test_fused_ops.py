"""The fused RMSNorm and rotary kernels (engine/model/fused_ops.py) against a float64 reference and
the torch ops they replace (engine/model/ops.py: `rms_norm`, `Rotary.apply`).

- float32: within 1e-5 relative of float64 (rotary: relative to |x*cos| + |rotated*sin|, the
  scale of the sum), and the rotary bit-identical to `Rotary.apply`;
- bf16, against float64: within the output's roundings (one for the zero-centered norm, two for
  the plain norm and for the rotary's sum of rounded products);
- bf16 rotary: bit-identical to `Rotary.apply` (the same three elementwise roundings);
- bf16 norm against torch: only the sum of squares (and rsqrt) differ, which moves the float32
  value y a few float32 ulps; a bf16 rounding flips only where a rounding boundary lies between the
  two values, about (a few float32 ulps) / (one bf16 ulp) = a few * 2^-16 of the elements. Allowed:
  at most 1 + numel / 1024 elements differ (over ten times that rate; a misplaced rounding flips a
  quarter to a half of them), by at most one bf16 ulp for the zero-centered norm (its one rounding)
  and two for the plain norm (y one ulp off, times w up to ~1.3, rounded again);
- norm shapes with a last dim of 128, 2048, 96 (not a power of two) and 8192 (CUDA), rows of a
  non-contiguous view; rotary partial (64 of 256) and full (128 of 128), on contiguous x and a
  slice of a wider projection, for 1 and 5 tokens at unsorted positions up to 3000.
- the router's softmax / top-k / renormalisation (`route_topk`) against `moe.route`'s torch ops on
  distinct logits: the same experts in the same order, weights within one bf16 rounding (float32
  1e-6), and against a float64 softmax's top-k, for 128 / 96 / 256 experts, top-2 and top-8, with
  and without renormalisation; on ties, the lowest index first and the same weights;
- on CUDA, both captured once in a CUDA graph and replayed with new inputs and positions: the eager
  results, bit for bit.

On CUDA directly; on a CPU through Triton's interpreter. The interpreter converts float32 to bf16 by
truncating the mantissa (triton/runtime/interpreter.py `_convert_float`, no rounding mode) where a
GPU rounds to nearest even, so there the torch side is the same formulas with that truncation
emulated (`_trunc`): the same bounds then hold exactly as on CUDA; the formulas are checked to equal
the torch ops bit for bit with round-to-nearest, and the float64 bounds use a whole ulp per rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from triton_interpreter import run_in_interpreter

from engine.model import ops

Round = Callable[[torch.Tensor, torch.dtype], torch.Tensor]
EPS = 1e-6
POSITIONS = {1: [3000], 5: [3000, 17, 2999, 0, 1234]}
NORM_DIMS = [128, 2048, 96]
ROTARY_SHAPES = [(4, 256, 64), (2, 128, 128)]  # (heads, head_dim, rotary_dim)


def _nearest(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return v.to(dtype)


def _trunc(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 -> bf16 by dropping the low 16 bits, as Triton's interpreter converts."""
    if dtype != torch.bfloat16:
        return v.to(dtype)
    return (v.float().contiguous().view(torch.int32) & -65536).view(torch.float32).to(dtype)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 ulps (counting representable values between, across binades and signs)."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)
    return (ordered(a.cpu()) - ordered(b.cpu())).abs()


def _rms_formula(x: torch.Tensor, w: torch.Tensor, zc: bool, rnd: Round) -> torch.Tensor:
    """ops.rms_norm with its roundings spelled out (rnd = round to nearest: the same bits)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    if zc:
        return rnd(y * (1.0 + w.float()), x.dtype)
    return rnd(w.float() * rnd(y, x.dtype).float(), x.dtype)


def _rotary_formula(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int, rnd: Round) -> torch.Tensor:
    """Rotary.apply with its roundings spelled out; cos / sin [T, 1, rd]."""
    x_rot, half = x[..., :rd].float(), rd // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = rnd(rnd(x_rot * cos.float(), x.dtype).float() + rnd(rotated * sin.float(), x.dtype).float(), x.dtype)
    return torch.cat((out, x[..., rd:]), dim=-1)


def _check_norm(x: torch.Tensor, w: torch.Tensor, zc: bool, rnd: Round, ulp: float) -> None:
    from engine.model.fused_ops import rms_norm

    out = rms_norm(x, w, EPS, zc)
    assert out.shape == x.shape and out.dtype == x.dtype
    x64, w64 = x.double().cpu(), w.double().cpu()
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    ref = y64 * (1 + w64) if zc else w64 * y64
    err = (out.double().cpu() - ref).abs()
    case = (tuple(x.shape), x.dtype, zc)
    if x.dtype == torch.float32:
        assert (err <= 1e-5 * ref.abs()).all(), (case, (err / ref.abs()).max().item())
        return
    roundings = 1 if zc else 2
    tol = ((1 + ulp * 2**-7) ** roundings - 1 + 1e-5) * ref.abs()  # ulp(v) <= 2^-7 |v| in bf16
    assert (err <= tol).all(), (case, (err / ref.abs()).max().item())
    torch_out = ops.rms_norm(x, w, EPS, zc)
    assert torch.equal(_rms_formula(x, w, zc, _nearest), torch_out), case  # the formula is the op
    ulps = _ulps(out, _rms_formula(x, w, zc, rnd))
    assert ulps.max() <= (1 if zc else 2), (case, ulps.max().item())
    assert (ulps > 0).sum() <= 1 + out.numel() // 1024, (case, int((ulps > 0).sum()), out.numel())


def _check_rotary(x: torch.Tensor, positions: torch.Tensor, rd: int, rnd: Round, ulp: float) -> None:
    from engine.model.fused_ops import apply_rotary

    rotary = ops.Rotary(rd, 10_000.0)
    limit = int(positions.max()) + 1  # test-side only: the kernel never reads positions on the host
    cos_t, sin_t = rotary._tables(limit, x.device, x.dtype)
    out = apply_rotary(x, cos_t, sin_t, positions, rd)
    assert out.shape == x.shape and out.is_contiguous()
    case = (tuple(x.shape), x.stride(), rd, x.dtype, positions.tolist())
    torch_out = rotary.apply(x, positions, limit)
    cos, sin = cos_t[positions][:, None, :], sin_t[positions][:, None, :]
    assert torch.equal(_rotary_formula(x, cos, sin, rd, _nearest), torch_out), case  # the formula is the op
    assert torch.equal(out, _rotary_formula(x, cos, sin, rd, rnd)), case
    if rnd is _nearest:
        assert torch.equal(out, torch_out), case
    x64, c64, s64 = x.double().cpu(), cos.double().cpu(), sin.double().cpu()
    half = rd // 2
    a = x64[..., :rd] * c64
    b = torch.cat((-x64[..., half:rd], x64[..., :half]), dim=-1) * s64
    got = out.double().cpu()
    assert torch.equal(got[..., rd:], x64[..., rd:]), case
    scale = a.abs() + b.abs()
    u = 1e-5 if x.dtype == torch.float32 else (1 + ulp * 2**-7) ** 2 - 1 + 1e-5
    assert ((got[..., :rd] - (a + b)).abs() <= u * scale).all(), case


def _route_torch(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """engine.model.moe.route after its matmul (the ops it runs on any device)."""
    top_w, top_i = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), top_k, dim=-1)
    if renormalize:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_i, top_w.to(logits.dtype)


def _weights_agree(w: torch.Tensor, ref: torch.Tensor) -> bool:
    """float32: to 1e-6 relative (the sums' order differs); bf16: within one rounding."""
    if w.dtype == torch.float32:
        return torch.allclose(w, ref, rtol=1e-6, atol=0)
    return bool(_ulps(w, ref).max() <= 1)


def _check_route(device: str, dtype: torch.dtype, experts: int, top_k: int, renormalize: bool,
                 g: torch.Generator) -> None:
    """route_topk against the torch ops of moe.route (the same ids in the same order; weights within
    one bf16 rounding, float32 to 1e-6) and a float64 softmax's top-k. The logits are distinct
    (multiples of 1/16, a permutation per token): equal ones leave torch.topk's order open; then the
    kernel takes the lowest index first, and the weights still agree (checked on a tie)."""
    from engine.model.fused_ops import route_topk

    for tokens in (1, 5):
        logits = torch.stack([torch.randperm(experts, generator=g) for _ in range(tokens)]).sub(experts // 2).div(16)
        logits = logits.to(device, dtype)
        ids, w = route_topk(logits, top_k, renormalize)
        ref_ids, ref_w = _route_torch(logits, top_k, renormalize)
        case = (dtype, experts, top_k, renormalize, tokens)
        assert ids.dtype == torch.int64 and w.dtype == dtype and torch.equal(ids, ref_ids), case
        assert _weights_agree(w, ref_w), case
        top64, ids64 = logits.double().cpu().softmax(-1).topk(top_k, dim=-1)
        if renormalize:
            top64 = top64 / top64.sum(-1, keepdim=True)
        assert torch.equal(ids.cpu(), ids64), case
        tol = 1e-6 if dtype == torch.float32 else 2**-7  # one bf16 ulp (the interpreter truncates)
        assert ((w.double().cpu() - top64).abs() <= tol * top64).all(), case
    tied = torch.zeros(1, experts, dtype=dtype, device=device)
    tied[0, 3] = tied[0, experts - 1] = 1.0  # two equal winners, the rest equal too
    ids, w = route_topk(tied, top_k, renormalize)
    rest = [i for i in range(experts) if i not in (3, experts - 1)][:top_k - 2]
    assert ids[0].tolist() == [3, experts - 1, *rest], (dtype, experts, top_k)
    assert _weights_agree(w, _route_torch(tied, top_k, renormalize)[1]), (dtype, experts, top_k, renormalize)


def _check_graph_replay(dtype: torch.dtype) -> None:
    """Captured once in a CUDA graph, both kernels serve new inputs and positions as eager calls do."""
    from engine.model.fused_ops import apply_rotary, rms_norm

    g = torch.Generator().manual_seed(3)
    cos_t, sin_t = ops.Rotary(64, 10_000.0)._tables(4096, torch.device("cuda"), dtype)
    x = torch.randn(5, 4, 256, generator=g).to("cuda", dtype)
    w = torch.randn(256, generator=g).to("cuda", dtype)
    positions = torch.zeros(5, dtype=torch.long, device="cuda")

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, w, EPS, False), apply_rotary(x, cos_t, sin_t, positions, 64)

    step()  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        norm_out, rot_out = step()
    for pos in ([3000, 17, 2999, 0, 1234], [1, 2, 3, 4000, 5]):
        x.copy_(torch.randn(x.shape, generator=g).to("cuda", dtype))
        positions.copy_(torch.tensor(pos))
        graph.replay()
        torch.cuda.synchronize()
        norm_eager, rot_eager = step()
        assert torch.equal(norm_out, norm_eager) and torch.equal(rot_out, rot_eager), (dtype, pos)


def check(device: str, norm_dims: list[int] = NORM_DIMS) -> None:
    """On "cpu" the kernels run under Triton's interpreter, which truncates to bf16 (a whole ulp).
    The torch side is ops' torch kernels: on CUDA ops would dispatch to the fused kernels themselves."""
    enabled = ops.fused_ops_enabled
    ops.fused_ops_enabled = lambda: False  # type: ignore[assignment]
    try:
        _check(device, norm_dims)
    finally:
        ops.fused_ops_enabled = enabled  # type: ignore[assignment]


def _check(device: str, norm_dims: list[int]) -> None:
    from engine.model import fused_ops

    assert ops.FUSED_NORM_MAX_DIM == fused_ops.MAX_NORM_DIM  # ops dispatches only the rows the kernel takes
    interpreted = device == "cpu"
    rnd: Round = _trunc if interpreted else _nearest
    ulp = 1.0 if interpreted else 0.5
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for dim in norm_dims:
            for rows in (1, 5):
                x = (3 * torch.randn(rows, dim, generator=g)).to(device, dtype)
                for zc in (True, False):
                    w = (0.1 * torch.randn(dim, generator=g) + (0.0 if zc else 1.0)).to(device, dtype)
                    _check_norm(x, w, zc, rnd, ulp)
        # q-norm shape: the per-head rows of a slice of a wider projection (row stride 2 * head_dim)
        proj = torch.randn(5, 4 * 2 * 128, generator=g).to(device, dtype)
        q = proj.view(5, 4, 2 * 128).chunk(2, -1)[0]
        for zc in (True, False):
            _check_norm(q, (0.1 * torch.randn(128, generator=g) + (0.0 if zc else 1.0)).to(device, dtype),
                        zc, rnd, ulp)
        for heads, head_dim, rd in ROTARY_SHAPES:
            for tokens, pos in POSITIONS.items():
                positions = torch.tensor(pos, dtype=torch.long, device=device)
                x = torch.randn(tokens, heads, head_dim, generator=g).to(device, dtype)
                _check_rotary(x, positions, rd, rnd, ulp)
                wide = torch.randn(tokens, heads * 2 * head_dim, generator=g).to(device, dtype)
                view = wide.view(tokens, heads, 2 * head_dim).chunk(2, -1)[0]
                assert not view.is_contiguous()
                _check_rotary(view, positions, rd, rnd, ulp)
        for experts, top_k in ((128, 8), (96, 2), (256, 8)):
            for renormalize in (True, False):
                _check_route(device, dtype, experts, top_k, renormalize, g)
        if device == "cuda":
            _check_graph_replay(dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_ops_match_torch_and_float64_cuda() -> None:
    check("cuda", [*NORM_DIMS, 8192])


def test_fused_ops_match_torch_and_float64_in_triton_interpreter() -> None:
    run_in_interpreter(__file__)


if __name__ == "__main__":  # the interpreter test's child
    check("cpu")
    print("ok")


def test_fused_switches_take_on_off_and_refuse_the_rest() -> None:
    """FREETOKEN_FUSED_* (and FREETOKEN_HOST_EMBED) are on/off switches; another value stops the
    options' resolution (the engine's start) with an error that names the variable, instead of
    failing each forward pass; the engine hands the kernel switches to the ops
    (`use_kernels`), which every pass reads."""
    from engine.errors import ConfigError
    from engine.options import EngineOptions

    switches = {"FREETOKEN_FUSED_OPS": ("fused_ops", ops.fused_ops_enabled),
                "FREETOKEN_FUSED_GDN": ("fused_gdn", ops.fused_gdn_enabled),
                "FREETOKEN_FUSED_ROUTER": ("fused_router", ops.fused_router_enabled),
                "FREETOKEN_FUSED_SHARED": ("fused_shared", ops.fused_shared_enabled)}
    before = ops.kernel_options()
    try:
        for name, (field, read) in switches.items():
            for raw, value in (("Yes", True), ("off", False), ("1", True), (" 0 ", False)):
                opts = EngineOptions.resolve({}, {name: raw})
                assert getattr(opts.kernels, field) is value, (name, raw)
                ops.use_kernels(opts.kernels)
                assert read() is value, (name, raw)
            with pytest.raises(ConfigError, match=name):
                EngineOptions.resolve({}, {name: "maybe"})
    finally:
        ops.use_kernels(before)
    assert EngineOptions.resolve({}, {"FREETOKEN_HOST_EMBED": "off"}).gpu.host_embed is False
    with pytest.raises(ConfigError, match="FREETOKEN_HOST_EMBED"):
        EngineOptions.resolve({}, {"FREETOKEN_HOST_EMBED": "maybe"})
