"""Expert weight formats the native executor reads, with quantizers and float64 dequantizers.

Contract: `ExpertWeights(fmt, w13, w2, s13, s2, block)` describes a bank of R experts, each a
gate+up matrix w13 [2I, H] (gate rows first) and a down matrix w2 [H, I]; construction checks
every dtype, shape and stride once and keeps the raw call arguments (`native_args`), so per-call
checks stay cheap. Formats:

- "bf16" / "f32": w13 [R, 2I, H], w2 [R, H, I] in that dtype, no scales.
- "fp8": e4m3 (torch.float8_e4m3fn or its uint8 bytes), block-scaled as in Qwen3 / DeepSeek FP8
  checkpoints: float32 scales (the checkpoint's `weight_scale_inv`, i.e. value = code * scale) per
  block of `block` = (bn rows, bk columns). s13 [R, 2 * ceil(I/bn), ceil(H/bk)] holds the gate's
  block rows then the up's (exactly the two checkpoint tensors stacked when I % bn == 0);
  s2 [R, ceil(H/bn), ceil(I/bk)]. bn % 4 == 0 and bk % 16 == 0.
- "mxfp4": OCP MX FP4 as in gpt-oss: two e2m1 codes per uint8 (element 2i in the low nibble),
  w13 [R, 2I, H/2], w2 [R, H, I/2]; one e8m0 scale (2^(s-127)) per 32 elements along a row,
  s13 [R, 2I, H/32], s2 [R, H, I/32]. H and I must be multiples of 32.

`quantize(w13, w2, fmt, block)` makes any format from dense weights (round to nearest);
`dequantize(ew)` returns the exact float64 weights a kernel must compute with (the tests'
reference); `random_experts(...)` fills a bank of a given shape with random valid codes quickly
(benchmarks). Rows of every tensor must be contiguous; experts and rows may be strided (slices).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FORMATS = ("bf16", "f32", "fp8", "mxfp4")
FMT_CODE = {"bf16": 0, "f32": 1, "fp8": 2, "mxfp4": 3}
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                          dtype=torch.float64)
FP8_MAX = 448.0


def _fail(msg: str) -> None:
    raise ValueError(msg)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ExpertWeights:
    fmt: str
    w13: torch.Tensor
    w2: torch.Tensor
    s13: torch.Tensor | None = None
    s2: torch.Tensor | None = None
    block: tuple[int, int] = (128, 128)

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            _fail(f"unknown weight format {self.fmt!r} (known: {', '.join(FORMATS)})")
        if self.fmt == "fp8":
            for name in ("w13", "w2"):
                t = getattr(self, name)
                if isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn:
                    object.__setattr__(self, name, t.view(torch.uint8))
        for name in ("w13", "w2", "s13", "s2"):
            t = getattr(self, name)
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.device.type != "cpu":
                _fail(f"{name} must be in CPU memory, got {t.device}")
            if t.dim() != 3:
                _fail(f"{name} must have 3 dims [experts, rows, cols], got shape {tuple(t.shape)}")
            if t.shape[2] > 1 and t.stride(2) != 1:
                _fail(f"{name} rows must be contiguous (stride(2) == 1), got strides {t.stride()}")
            if t.stride(1) < t.shape[2] or t.stride(0) < 0:
                _fail(f"{name} has overlapping or negative strides {t.stride()}")
        getattr(self, f"_check_{self.fmt}")()
        # The raw addresses and strides the extension takes, computed once: a bank's tensors must not
        # be reallocated afterwards (the engine never does; slices and views are fine).
        s13, s2 = self.s13, self.s2
        self.native_args: tuple[int, ...]
        object.__setattr__(self, "native_args", (
            FMT_CODE[self.fmt],
            self.w13.data_ptr(), self.w13.stride(0) * self.w13.element_size(), self.w13.stride(1) * self.w13.element_size(),
            0 if s13 is None else s13.data_ptr(), 0 if s13 is None else s13.stride(0), 0 if s13 is None else s13.stride(1),
            self.w2.data_ptr(), self.w2.stride(0) * self.w2.element_size(), self.w2.stride(1) * self.w2.element_size(),
            0 if s2 is None else s2.data_ptr(), 0 if s2 is None else s2.stride(0), 0 if s2 is None else s2.stride(1),
            self.block[0], self.block[1], self.rows,
        ))  # fmt: skip

    # ---------------------------------------------------------------- shape checks per format
    @property
    def rows(self) -> int:
        return self.w13.shape[0]

    @property
    def inter(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def hidden(self) -> int:
        return self.w2.shape[1]

    def _check_dense(self, dtype: torch.dtype) -> None:
        if self.w13.dtype != dtype or self.w2.dtype != dtype:
            _fail(f"{self.fmt} expert weights must be {dtype}, got w13 {self.w13.dtype}, w2 {self.w2.dtype}")
        if self.s13 is not None or self.s2 is not None:
            _fail(f"{self.fmt} weights take no scales")
        self._check_shapes(self.w13.shape[2], self.w2.shape[2])

    def _check_shapes(self, w13_cols: int, w2_cols: int) -> None:
        r, two_i, _ = self.w13.shape
        if two_i == 0 or two_i % 2:
            _fail(f"w13 dim 1 must be 2*I > 0, got {two_i}")
        h, i = self.w2.shape[1], two_i // 2
        if h == 0:
            _fail("hidden size must be > 0")
        if tuple(self.w13.shape) != (r, 2 * i, w13_cols) or tuple(self.w2.shape) != (r, h, w2_cols):
            _fail(f"w13 {tuple(self.w13.shape)} and w2 {tuple(self.w2.shape)} do not describe one bank")

    def _check_bf16(self) -> None:
        self._check_dense(torch.bfloat16)
        self._check_shapes(self.hidden, self.inter)

    def _check_f32(self) -> None:
        self._check_dense(torch.float32)
        self._check_shapes(self.hidden, self.inter)

    def _check_fp8(self) -> None:
        bn, bk = self.block
        if bn <= 0 or bk <= 0 or bn % 4 or bk % 16:
            _fail(f"fp8 block must be (bn, bk) with bn % 4 == 0 and bk % 16 == 0, got {self.block}")
        if self.w13.dtype != torch.uint8 or self.w2.dtype != torch.uint8:
            _fail(f"fp8 weights must be float8_e4m3fn or uint8, got w13 {self.w13.dtype}, w2 {self.w2.dtype}")
        h, i, r = self.hidden, self.inter, self.rows
        self._check_shapes(h, i)
        want13, want2 = (r, 2 * _cdiv(i, bn), _cdiv(h, bk)), (r, _cdiv(h, bn), _cdiv(i, bk))
        for name, t, want in (("s13", self.s13, want13), ("s2", self.s2, want2)):
            if t is None or t.dtype != torch.float32 or tuple(t.shape) != want:
                _fail(f"fp8 {name} must be float32 {want}, got "
                      f"{None if t is None else (t.dtype, tuple(t.shape))}")

    def _check_mxfp4(self) -> None:
        if self.w13.dtype != torch.uint8 or self.w2.dtype != torch.uint8:
            _fail(f"mxfp4 weights must be uint8 (packed e2m1 pairs), got {self.w13.dtype}, {self.w2.dtype}")
        h, i, r = self.hidden, self.inter, self.rows
        if h % 32 or i % 32:
            _fail(f"mxfp4 needs hidden ({h}) and expert ({i}) sizes that are multiples of 32")
        self._check_shapes(h // 2, i // 2)
        for name, t, want in (("s13", self.s13, (r, 2 * i, h // 32)), ("s2", self.s2, (r, h, i // 32))):
            if t is None or t.dtype != torch.uint8 or tuple(t.shape) != want:
                _fail(f"mxfp4 {name} must be uint8 {want}, got {None if t is None else (t.dtype, tuple(t.shape))}")

    # ---------------------------------------------------------------- sizes
    def expert_nbytes(self) -> int:
        """Bytes one expert's weights and scales occupy (what a batch-1 call reads per expert)."""
        total = 0
        for t in (self.w13, self.w2, self.s13, self.s2):
            if t is not None:
                total += t[0].numel() * t.element_size()
        return total

    def expert_ranges(self, row: int) -> list[tuple[int, int]]:
        """(address, bytes) of every contiguous piece of expert `row` (for the plain-read bound)."""
        out = []
        for t in (self.w13, self.w2, self.s13, self.s2):
            if t is None:
                continue
            e = t[row]
            if e.is_contiguous():
                out.append((e.data_ptr(), e.numel() * e.element_size()))
            else:
                out.extend((e[j].data_ptr(), e.shape[1] * e.element_size()) for j in range(e.shape[0]))
        return out


# -------------------------------------------------------------------- dequantize (reference)
def _dequant_fp8(q: torch.Tensor, s: torch.Tensor, rows: int, cols: int, bn: int, bk: int) -> torch.Tensor:
    vals = q.view(torch.float8_e4m3fn).to(torch.float64)
    scale = s.to(torch.float64).repeat_interleave(bn, dim=-2)[..., :rows, :].repeat_interleave(bk, dim=-1)
    return vals * scale[..., :cols]


def _dequant_mx(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([q & 15, q >> 4], dim=-1).flatten(-2).long()
    vals = FP4_VALUES[codes]
    scale = torch.exp2(s.to(torch.float64) - 127).repeat_interleave(32, dim=-1)
    return vals * scale


def dequantize(ew: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (w13 [R, 2I, H], w2 [R, H, I]) exactly as the format defines them."""
    if ew.fmt in ("bf16", "f32"):
        return ew.w13.to(torch.float64), ew.w2.to(torch.float64)
    h, i = ew.hidden, ew.inter
    if ew.fmt == "fp8":
        bn, bk = ew.block
        nbi = _cdiv(i, bn)
        assert ew.s13 is not None and ew.s2 is not None
        gate = _dequant_fp8(ew.w13[:, :i], ew.s13[:, :nbi], i, h, bn, bk)
        up = _dequant_fp8(ew.w13[:, i:], ew.s13[:, nbi:], i, h, bn, bk)
        return torch.cat([gate, up], dim=1), _dequant_fp8(ew.w2, ew.s2, h, i, bn, bk)
    assert ew.s13 is not None and ew.s2 is not None
    return _dequant_mx(ew.w13, ew.s13), _dequant_mx(ew.w2, ew.s2)


# -------------------------------------------------------------------- quantize
def _quant_fp8(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    r, rows, cols = w.shape
    pr, pc = _cdiv(rows, bn) * bn, _cdiv(cols, bk) * bk
    padded = torch.zeros(r, pr, pc, dtype=torch.float32)
    padded[:, :rows, :cols] = w.float()
    blocks = padded.view(r, pr // bn, bn, pc // bk, bk)
    amax = blocks.abs().amax(dim=(2, 4)).clamp_min(1e-12)
    scale = amax / FP8_MAX
    q = (blocks / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(r, pr, pc)[:, :rows, :cols].contiguous().view(torch.uint8), scale.contiguous()


def _quant_mx(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r, rows, cols = w.shape
    blocks = w.double().reshape(r, rows, cols // 32, 32)
    amax = blocks.abs().amax(dim=-1).clamp_min(2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = blocks / torch.exp2(exp)[..., None]
    codes = (scaled[..., None] - FP4_VALUES).abs().argmin(dim=-1).to(torch.uint8).reshape(r, rows, cols)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def quantize(w13: torch.Tensor, w2: torch.Tensor, fmt: str, block: tuple[int, int] = (128, 128)) -> ExpertWeights:
    """Dense [R, 2I, H] / [R, H, I] weights in `fmt` (nearest rounding; fp8 scales = block amax / 448)."""
    if fmt == "bf16":
        return ExpertWeights("bf16", w13.to(torch.bfloat16).contiguous(), w2.to(torch.bfloat16).contiguous())
    if fmt == "f32":
        return ExpertWeights("f32", w13.float().contiguous(), w2.float().contiguous())
    if fmt == "fp8":
        bn, bk = block
        i = w13.shape[1] // 2
        qg, sg = _quant_fp8(w13[:, :i], bn, bk)
        qu, su = _quant_fp8(w13[:, i:], bn, bk)
        q2, s2 = _quant_fp8(w2, bn, bk)
        return ExpertWeights("fp8", torch.cat([qg, qu], 1), q2, torch.cat([sg, su], 1), s2, block)
    if fmt == "mxfp4":
        q13, s13 = _quant_mx(w13)
        q2, s2 = _quant_mx(w2)
        return ExpertWeights("mxfp4", q13, q2, s13, s2)
    raise ValueError(f"unknown weight format {fmt!r} (known: {', '.join(FORMATS)})")


def random_experts(fmt: str, rows: int, hidden: int, inter: int, seed: int = 0,
                   block: tuple[int, int] = (128, 128)) -> ExpertWeights:
    """A bank of `rows` experts with random valid codes (fast enough for multi-GB benchmark banks)."""
    g = torch.Generator().manual_seed(seed)
    std = 1.0 / math.sqrt(hidden)

    def dense(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        for j in range(shape[0]):  # per expert: bounded temporary memory
            out[j] = torch.randn(shape[1:], generator=g) * std
        return out

    def codes(shape: tuple[int, ...]) -> torch.Tensor:
        t = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        if fmt == "fp8":
            t[(t & 0x7F) == 0x7F] = 0x7E  # e4m3 NaN codes
        return t

    if fmt in ("bf16", "f32"):
        dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
        return ExpertWeights(fmt, dense((rows, 2 * inter, hidden), dtype), dense((rows, hidden, inter), dtype))
    if fmt == "fp8":
        bn, bk = block
        s13 = torch.rand(rows, 2 * _cdiv(inter, bn), _cdiv(hidden, bk), generator=g) * std / 64
        s2 = torch.rand(rows, _cdiv(hidden, bn), _cdiv(inter, bk), generator=g) * std / 64
        return ExpertWeights("fp8", codes((rows, 2 * inter, hidden)), codes((rows, hidden, inter)), s13, s2, block)
    if fmt == "mxfp4":
        s13 = torch.randint(118, 124, (rows, 2 * inter, hidden // 32), dtype=torch.uint8, generator=g)
        s2 = torch.randint(118, 124, (rows, hidden, inter // 32), dtype=torch.uint8, generator=g)
        return ExpertWeights("mxfp4", codes((rows, 2 * inter, hidden // 2)), codes((rows, hidden, inter // 2)),
                             s13, s2)
    raise ValueError(f"unknown weight format {fmt!r} (known: {', '.join(FORMATS)})")
