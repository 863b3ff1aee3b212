"""The packed expert formats: name -> block size, block bytes and a float32 reference dequantiser.

Contract: `FORMATS[name]` is a frozen `QuantFormat` for every format of the shared packed layout
(QUANT_LAYOUT.md at the worktrees' root): ggml's q8_0, q4_0, q4_1, q5_0, q5_1, q2_k..q6_k,
iq4_nl, iq4_xs, mxfp4; fp8 (a float32 scale per 128 e4m3 values); nvfp4 (an e4m3 scale per 16
e2m1 values, times a per-matrix global scale); bf16 (plain). `fmt.dequantize(rows, k, gscale)`
turns uint8 rows [..., row_bytes(k)] into float32 [..., k]; `format_of(name)` raises `ConfigError`
for an unknown name; `GGML_FORMATS` maps a GGUF tensor type name (`Q4_K`) to its format.
The dequantisers are the references the CPU, native and GPU paths are tested against; they are
bit-identical to gguf.quants (ggml types), transformers (fp8) and the float64 definition (nvfp4).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.errors import ConfigError
from engine.quant import ggml

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _dq_fp8(b: torch.Tensor) -> torch.Tensor:
    scale = b[:, :4].contiguous().view(torch.float32)
    return b[:, 4:].contiguous().view(torch.float8_e4m3fn).float() * scale


def _dq_nvfp4(b: torch.Tensor) -> torch.Tensor:
    scale = b[:, :1].contiguous().view(torch.float8_e4m3fn).float()
    q = b[:, 1:]
    idx = torch.stack([q & 0x0F, q >> 4], dim=-1).reshape(b.shape[0], 16)
    return torch.tensor(E2M1, dtype=torch.float32)[idx.long()] * scale


def _dq_bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).float()


@dataclass(frozen=True)
class QuantFormat:
    name: str
    block: int  # values per block
    block_bytes: int
    decode: Callable[[torch.Tensor], torch.Tensor]  # uint8 [n, block_bytes] -> float32 [n, block]
    has_gscale: bool = False  # a per-matrix global scale multiplies every value (nvfp4)
    halves: tuple[int, ...] = ()  # byte offsets of the block's half-precision scale fields

    def random_rows(self, shape: tuple[int, ...], k: int, gen: torch.Generator, scale: float = 1e-3) -> torch.Tensor:
        """uint8 [*shape, row_bytes(k)] of random valid blocks (finite scales of about `scale`), e.g. for benchmarks."""
        nb = self.row_bytes(k) // self.block_bytes
        raw = torch.randint(0, 256, (*shape, nb, self.block_bytes), dtype=torch.uint8, generator=gen)
        scales = (torch.rand((*shape, nb, 1), generator=gen) * scale + scale / 4)
        for off in self.halves:
            raw[..., off:off + 2] = scales.half().view(torch.uint8)
        if self.name == "fp8":
            raw[..., :4] = scales.view(torch.uint8)
        if self.name in ("fp8", "nvfp4"):  # no NaN codes among the e4m3 bytes
            first = 4 if self.name == "fp8" else 0
            end = None if self.name == "fp8" else 1
            part = raw[..., first:end]
            part[(part & 0x7F) == 0x7F] = 0x38
        if self.name == "mxfp4":
            raw[..., 0] = 118 + raw[..., 0] % 8  # exponents near 2^-10
        if self.name == "bf16":
            raw = (torch.randn((*shape, nb), generator=gen) * scale).to(torch.bfloat16).view(torch.uint8)
        return raw.reshape(*shape, -1)

    def row_bytes(self, k: int, what: str = "tensor") -> int:
        if k % self.block:
            raise ConfigError(f"{what}: {k} columns are not a multiple of {self.name}'s block of {self.block}")
        return k // self.block * self.block_bytes

    def dequantize(self, rows: torch.Tensor, k: int, gscale: float | torch.Tensor | None = None) -> torch.Tensor:
        """uint8 [..., row_bytes(k)] -> float32 [..., k] (times `gscale` when given)."""
        lead = rows.shape[:-1]
        if rows.dtype != torch.uint8 or rows.shape[-1] != self.row_bytes(k):
            raise ConfigError(f"{self.name}: rows of {rows.shape[-1]} bytes ({rows.dtype}) for {k} values, "
                              f"expected {self.row_bytes(k)} uint8")
        out = self.decode(rows.reshape(-1, self.block_bytes)).reshape(*lead, k)
        if gscale is not None:  # a bank holds 1.0 for formats without a global scale
            out = out * (gscale if isinstance(gscale, torch.Tensor) else torch.tensor(gscale, dtype=torch.float32))
        return out


_ALL = [
    QuantFormat("q8_0", 32, 34, ggml.dq_q8_0, halves=(0,)), QuantFormat("q4_0", 32, 18, ggml.dq_q4_0, halves=(0,)),
    QuantFormat("q4_1", 32, 20, ggml.dq_q4_1, halves=(0, 2)), QuantFormat("q5_0", 32, 22, ggml.dq_q5_0, halves=(0,)),
    QuantFormat("q5_1", 32, 24, ggml.dq_q5_1, halves=(0, 2)),
    QuantFormat("q2_k", 256, 84, ggml.dq_q2_k, halves=(80, 82)),
    QuantFormat("q3_k", 256, 110, ggml.dq_q3_k, halves=(108,)),
    QuantFormat("q4_k", 256, 144, ggml.dq_q4_k, halves=(0, 2)),
    QuantFormat("q5_k", 256, 176, ggml.dq_q5_k, halves=(0, 2)),
    QuantFormat("q6_k", 256, 210, ggml.dq_q6_k, halves=(208,)),
    QuantFormat("iq4_nl", 32, 18, ggml.dq_iq4_nl, halves=(0,)),
    QuantFormat("iq4_xs", 256, 136, ggml.dq_iq4_xs, halves=(0,)),
    QuantFormat("mxfp4", 32, 17, ggml.dq_mxfp4), QuantFormat("fp8", 128, 132, _dq_fp8),
    QuantFormat("nvfp4", 16, 9, _dq_nvfp4, has_gscale=True), QuantFormat("bf16", 1, 2, _dq_bf16),
]
FORMATS: dict[str, QuantFormat] = {f.name: f for f in _ALL}
GGML_FORMATS: dict[str, str] = {n.upper(): n for n in FORMATS if n not in ("fp8", "nvfp4", "bf16")}
PACKED = tuple(n for n in FORMATS if n != "bf16")


def format_of(name: str) -> QuantFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ConfigError(f"unknown expert format {name!r} (known: {', '.join(FORMATS)})") from None
