"""Routed experts from packed (quantized) banks: `PackedExpertExecutor`.

Contract: the `ExpertExecutor` of engine/moe/base.py over `PackedExpertBanks`: for each MoE layer,
out[t] = sum_j weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, j], with activations
and accumulation in float32 and the intermediate kept in float32 (never quantized), returned in x's
dtype and device. Banks with biases (`b13` [L*E, 2I], `b2` [L*E, H], float32) and another
activation (gpt-oss: `swiglu_clamped`, `alpha`, `limit`) run the epilogue
h = act(gate_e x + b_gate, up_e x + b_up), y = down_e h + b_down (engine/moe/executor.py `gated`).
The work goes through one kernel call per layer with the signature of QUANT_LAYOUT.md's
`moe_packed` (x, ids, weights, gate_up, fmt_gu, down, fmt_d, gscale, out, and keyword-only
bias_gu, bias_d, activation, alpha, limit): `native.packed.moe_packed` when the native extension
provides it, else `torch_moe_packed` below, which dequantizes each routed expert's rows with
engine/quant/formats.py and multiplies in float32 (it is also the tests' reference).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.moe.base import ExpertExecutor
from engine.quant.formats import FORMATS
from engine.weights.layout import PackedExpertBanks

MoePacked = Callable[..., None]


def activate(gate: torch.Tensor, up: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """h from the gate and up projections (biases added): silu(g) * u, or gpt-oss's clamped SwiGLU."""
    if activation == "silu":
        return F.silu(gate) * up
    if activation != "swiglu_clamped":
        raise ValueError(f"activation must be silu or swiglu_clamped, got {activation!r}")
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def torch_moe_packed(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, fmt_gu: str,
                     down: torch.Tensor, fmt_d: str, gscale: torch.Tensor | None, out: torch.Tensor, *,
                     bias_gu: torch.Tensor | None = None, bias_d: torch.Tensor | None = None, activation: str = "silu",
                     alpha: float = 1.702, limit: float = 7.0) -> None:
    """out[T, H] f32 += the layer's routed experts (ids -1: skipped), dequantizing per expert."""
    h, inter = down.shape[1], gate_up.shape[1] // 2
    fgu, fd = FORMATS[fmt_gu], FORMATS[fmt_d]
    xf = x.float()
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    token_of = order // ids.shape[1]
    flat_w = weights.reshape(-1).float()[order]
    start = 0
    for expert, count in zip(experts.tolist(), counts.tolist(), strict=True):
        rows, w = token_of[start:start + count], flat_w[start:start + count, None]
        start += count
        if expert < 0:
            continue
        s = gscale[expert] if gscale is not None else None
        gate = fgu.dequantize(gate_up[expert, :inter], h, None if s is None else s[0])
        up = fgu.dequantize(gate_up[expert, inter:], h, None if s is None else s[1])
        dn = fd.dequantize(down[expert], inter, None if s is None else s[2])
        xe = xf[rows]
        bg = bu = bd = None
        if bias_gu is not None:
            bg, bu = bias_gu[expert, :inter].float(), bias_gu[expert, inter:].float()
        if bias_d is not None:
            bd = bias_d[expert].float()
        h_ = activate(F.linear(xe, gate, bg), F.linear(xe, up, bu), activation, alpha, limit)
        y = F.linear(h_, dn, bd) * w
        out.index_add_(0, rows, y)


def native_moe_packed() -> MoePacked | None:
    """The native kernel (native/packed.py's `moe_packed`) when it is built and importable, else None."""
    try:
        from native.packed import moe_packed
    except (ImportError, AttributeError):  # not built, or built before the packed kernels existed
        return None
    kernel: MoePacked = moe_packed
    return kernel


class PackedExpertExecutor(ExpertExecutor):
    def __init__(self, banks: PackedExpertBanks, kernel: MoePacked | None = None, name: str = "torch") -> None:
        self.banks = banks
        self.kernel: MoePacked = kernel or torch_moe_packed
        self.name = name

    def describe(self) -> str:
        fmts = sorted({*self.banks.fmt_gu, *self.banks.fmt_d})
        return (f"packed {self.name} ({'/'.join(fmts)}, {self.banks.total_bytes / 2**30:.2f} GiB of experts, "
                f"{torch.get_num_threads()} threads)")

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, moe_index: int) -> torch.Tensor:
        b = self.banks
        xc = x.to("cpu") if x.device.type != "cpu" else x
        out = torch.zeros(xc.shape[0], b.hidden, dtype=torch.float32)
        rows = slice(moe_index * b.num_experts, (moe_index + 1) * b.num_experts)
        self.kernel(xc.contiguous(), ids.to("cpu", torch.int32).contiguous(), weights.to("cpu", torch.float32).contiguous(),
                    b.gate_up[moe_index], b.fmt_gu[moe_index], b.down[moe_index], b.fmt_d[moe_index],
                    b.gscale[moe_index], out, bias_gu=None if b.b13 is None else b.b13[rows],
                    bias_d=None if b.b2 is None else b.b2[rows], activation=b.activation, alpha=b.alpha,
                    limit=b.limit)
        return out.to(device=x.device, dtype=x.dtype)
