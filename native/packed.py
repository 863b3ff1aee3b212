"""Packed expert banks on the native CPU executor: one MoE layer per call over block-quantized rows.

Contract (the packed layout of QUANT_LAYOUT.md): an expert matrix [N, K] is N rows of K / B blocks
of `block_bytes` bytes (`FORMATS`: q8_0 .. q6_k, iq4_nl, iq4_xs as ggml's block structs; mxfp4,
fp8, nvfp4 as the layout defines them). `moe_packed(x, ids, weights, gate_up, fmt_gu, down, fmt_d,
gscale, out)` adds to out[t] the sum over j of weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t),
e = ids[t, j] (-1: skipped), dequantizing blocks in registers with float32 accumulation; gate_up
[E, 2I, row_bytes(fmt_gu, H)] (gate rows, then up rows), down [E, H, row_bytes(fmt_d, I)], gscale
float32 [E, 3] (gate, up, down global scales; None = 1). Keyword-only, the experts' epilogue
(gpt-oss): `bias_gu` float32 [E, 2I] (gate biases, then up biases) added to the projections,
`bias_d` float32 [E, H] added to down's output before the routing weight, and `activation`
"silu" or "swiglu_clamped" (g = min(g, limit), u = clamp(u, -limit, limit), h = (u + 1) * g *
sigmoid(alpha * g); `alpha`, `limit`). Every argument is checked here (the
extension takes raw addresses); a bad one raises ValueError naming it. The SIMD path is the one
`native.ftnative.set_isa` selects. `PackedHostTask` is the same call prepared once for the
doorbell poller (ftnative.HostTask; its runs overwrite out). `dequantize` is the scalar decoder
(float32), `random_blocks` makes valid random blocks of any format (tests, benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from native import ftnative

_ext = ftnative._ext
ACTIVATIONS = ("silu", "swiglu_clamped")  # by code (native/src/moe_layer.h Act)


@dataclass(frozen=True)
class PackedFormat:
    name: str
    code: int
    block: int  # values per block
    block_bytes: int


FORMATS: dict[str, PackedFormat] = {
    name: PackedFormat(name, code, block, nbytes) for code, (name, block, nbytes) in enumerate(_ext.packed_formats())
}


def _fail(msg: str) -> None:
    raise ValueError(msg)


def packed_format(name: str, arg: str = "fmt") -> PackedFormat:
    if name not in FORMATS:
        _fail(f"{arg}: unknown packed format {name!r} (known: {', '.join(FORMATS)})")
    return FORMATS[name]


def row_bytes(fmt: str, k: int, arg: str = "fmt") -> int:
    """Bytes of one row of k values; k must be a multiple of the block size."""
    f = packed_format(fmt, arg)
    if k % f.block:
        _fail(f"{arg}: {fmt} rows need a multiple of {f.block} values, got {k}")
    return k // f.block * f.block_bytes


def _check(name: str, t: object, dtype: torch.dtype, dims: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    assert isinstance(t, torch.Tensor)
    if not t.is_cpu:
        _fail(f"{name} must be on the CPU, got {t.device}")
    if name == "x" and t.dtype not in (torch.bfloat16, torch.float32):
        _fail(f"x must be torch.bfloat16 or torch.float32, got {t.dtype}")
    if name != "x" and t.dtype != dtype:
        _fail(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != dims:
        _fail(f"{name} must have {dims} dims, got shape {tuple(t.shape)}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        _fail(f"{name} rows must be contiguous (stride(-1) == 1), got strides {t.stride()}")
    return t


def _check_bank(name: str, bank: object, fmt: str, rows: int | None, k: int | None) -> torch.Tensor:
    t = _check(name, bank, torch.uint8, 3)
    if t.stride(1) != t.shape[2] and t.shape[1] > 1:
        _fail(f"{name} rows must be packed back to back (stride(1) == {t.shape[2]}), got strides {t.stride()}")
    if rows is not None and t.shape[1] != rows:
        _fail(f"{name} must have {rows} rows per expert, got shape {tuple(t.shape)}")
    if k is not None and t.shape[2] != row_bytes(fmt, k, name):
        _fail(f"{name} rows must be {row_bytes(fmt, k, name)} bytes ({fmt}, {k} values), got {t.shape[2]}")
    return t


def _check_bias(name: str, bias: torch.Tensor | None, shape: tuple[int, int]) -> int:
    """The address of a float32 contiguous bias of `shape`, or 0 for None."""
    if bias is None:
        return 0
    t = _check(name, bias, torch.float32, 2)
    if tuple(t.shape) != shape or not t.is_contiguous():
        _fail(f"{name} must be contiguous {list(shape)}, got shape {tuple(t.shape)}")
    return int(t.data_ptr())


def _raw_args(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, fmt_gu: str,
              down: torch.Tensor, fmt_d: str, gscale: torch.Tensor | None, out: torch.Tensor,
              bias_gu: torch.Tensor | None, bias_d: torch.Tensor | None, activation: str, alpha: float,
              limit: float) -> tuple[Any, ...]:
    """Every argument checked; the extension's raw argument tuple."""
    fgu, fd = packed_format(fmt_gu, "fmt_gu"), packed_format(fmt_d, "fmt_d")
    _check("x", x, torch.float32, 2)
    t_count, hidden = x.shape
    _check("ids", ids, torch.int32, 2)
    if ids.shape[0] != t_count or ids.shape[1] == 0 or not ids.is_contiguous():
        _fail(f"ids must be contiguous [T={t_count}, k>0], got shape {tuple(ids.shape)}")
    _check("weights", weights, torch.float32, 2)
    if weights.shape != ids.shape or not weights.is_contiguous():
        _fail(f"weights must be contiguous {tuple(ids.shape)}, got shape {tuple(weights.shape)}")
    gu = _check_bank("gate_up", gate_up, fmt_gu, None, hidden)
    if gu.shape[1] % 2 or gu.shape[1] == 0:
        _fail(f"gate_up must have 2I > 0 rows per expert, got shape {tuple(gu.shape)}")
    experts, inter = gu.shape[0], gu.shape[1] // 2
    dn = _check_bank("down", down, fmt_d, hidden, inter)
    if dn.shape[0] != experts:
        _fail(f"down must have {experts} experts like gate_up, got shape {tuple(dn.shape)}")
    if gscale is not None:
        _check("gscale", gscale, torch.float32, 2)
        if gscale.shape != (experts, 3) or not gscale.is_contiguous():
            _fail(f"gscale must be contiguous [{experts}, 3], got shape {tuple(gscale.shape)}")
    _check("out", out, torch.float32, 2)
    if out.shape != x.shape:
        _fail(f"out must be {tuple(x.shape)}, got {tuple(out.shape)}")
    b_gu = _check_bias("bias_gu", bias_gu, (experts, 2 * inter))
    b_d = _check_bias("bias_d", bias_d, (experts, hidden))
    if activation not in ACTIVATIONS:
        _fail(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    return (x.data_ptr(), x.dtype == torch.bfloat16, x.stride(0), out.data_ptr(), out.stride(0), t_count, hidden,
            inter, ids.shape[1], ids.data_ptr(), weights.data_ptr(), experts, gu.data_ptr(), gu.stride(0),
            gu.shape[2], fgu.code, dn.data_ptr(), dn.stride(0), dn.shape[2], fd.code,
            0 if gscale is None else gscale.data_ptr(), b_gu, b_d, ACTIVATIONS.index(activation), float(alpha),
            float(limit))


def moe_packed(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, fmt_gu: str,
               down: torch.Tensor, fmt_d: str, gscale: torch.Tensor | None, out: torch.Tensor, *,
               bias_gu: torch.Tensor | None = None, bias_d: torch.Tensor | None = None, activation: str = "silu",
               alpha: float = 1.702, limit: float = 7.0) -> None:
    """out[t] += sum_j weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t); see the module docstring."""
    args = _raw_args(x, ids, weights, gate_up, fmt_gu, down, fmt_d, gscale, out, bias_gu, bias_d, activation, alpha,
                     limit)
    if x.shape[0]:
        _ext.moe_packed(*args)  # ValueError naming ids / gate_up / down on a bad id or size


class PackedHostTask(ftnative.HostTask):
    """`ftnative.HostTask` (run later, or by the native poller on a doorbell) over packed banks:
    moe_packed's arguments, fixed buffers checked once and kept alive by the task; each run
    overwrites `out` with the layer's result (the GPU adds it), ids < 0 skipped."""

    def __init__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                 fmt_gu: str, down: torch.Tensor, fmt_d: str, gscale: torch.Tensor | None,
                 out: torch.Tensor, *, bias_gu: torch.Tensor | None = None, bias_d: torch.Tensor | None = None,
                 activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> None:
        if isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] == 0:
            _fail("x must have T > 0 rows")
        args = _raw_args(x, ids, weights, gate_up, fmt_gu, down, fmt_d, gscale, out, bias_gu, bias_d, activation,
                         alpha, limit)
        self._buffers = (x, ids, weights, out, gate_up, down, gscale, bias_gu, bias_d)  # type: ignore[assignment]
        self._words = None
        self._fetch_buffers = None
        self.address = _ext.host_task_create_packed(*args)


def dequantize(fmt: str, data: torch.Tensor) -> torch.Tensor:
    """Packed rows [..., row_bytes] (uint8, contiguous) -> float32 [..., values] (scalar decoder)."""
    f = packed_format(fmt)
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or not data.is_cpu or data.dim() == 0:
        _fail("data must be a uint8 CPU tensor of packed rows")
    if data.shape[-1] % f.block_bytes:
        _fail(f"data rows of {data.shape[-1]} bytes are not whole {fmt} blocks of {f.block_bytes}")
    data = data.contiguous()
    blocks = data.numel() // f.block_bytes
    out = torch.empty(*data.shape[:-1], data.shape[-1] // f.block_bytes * f.block, dtype=torch.float32)
    _ext.packed_dequantize(f.code, data.data_ptr(), blocks, out.data_ptr())
    return out


# Scale fields of each format's block (offset, kind): random_blocks gives them sane values.
_SCALES: dict[str, tuple[tuple[int, str], ...]] = {
    "q8_0": ((0, "f16"),), "q4_0": ((0, "f16"),), "q4_1": ((0, "f16"), (2, "f16")), "q5_0": ((0, "f16"),),
    "q5_1": ((0, "f16"), (2, "f16")), "q2_k": ((80, "f16"), (82, "f16")), "q3_k": ((108, "f16"),),
    "q4_k": ((0, "f16"), (2, "f16")), "q5_k": ((0, "f16"), (2, "f16")), "q6_k": ((208, "f16"),),
    "iq4_nl": ((0, "f16"),), "iq4_xs": ((0, "f16"),), "mxfp4": ((0, "e8m0"),), "fp8": ((0, "f32"),),
    "nvfp4": ((0, "e4m3"),),
}


def random_blocks(fmt: str, shape: tuple[int, ...], k: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """uint8 [*shape, row_bytes(fmt, k)] of random valid blocks: random codes, scales of random sign
    and magnitude around 1/64 (fp8 codes without NaN, positive e4m3 scales, e8m0 near 2^-6)."""
    f = packed_format(fmt)
    nb = row_bytes(fmt, k) // f.block_bytes
    n = nb
    for s in shape:
        n *= s
    blocks = torch.randint(0, 256, (n, f.block_bytes), dtype=torch.uint8, generator=gen)
    for off, kind in _SCALES[fmt]:
        if kind in ("f16", "f32"):
            mag = torch.rand(n, generator=gen) * 0.03 + 0.002
            val = torch.where(torch.rand(n, generator=gen) < 0.5, -mag, mag)
            dt = torch.float16 if kind == "f16" else torch.float32
            blocks[:, off:off + dt.itemsize] = val.to(dt).view(torch.uint8).view(n, dt.itemsize)
        elif kind == "e8m0":
            blocks[:, off] = torch.randint(118, 128, (n,), dtype=torch.uint8, generator=gen)
        else:  # positive e4m3: exponents 1..14 (0x08..0x77)
            blocks[:, off] = torch.randint(0x08, 0x78, (n,), dtype=torch.uint8, generator=gen)
    if fmt == "fp8":  # e4m3 NaN codes 0x7f / 0xff -> 0
        codes = blocks[:, 4:]
        codes[(codes & 0x7F) == 0x7F] = 0
    return blocks.view(*shape, nb * f.block_bytes)
