"""Small stateless tensor ops shared by the decoder layers.

Contract: pure functions on tensors, no parameters owned, numerics chosen to match the
`transformers` reference (norms in float32, cast back to the input dtype). On CUDA, `rms_norm`
and `Rotary.apply` run as one Triton kernel each (engine/model/fused_ops.py: the same rounding
points; the rotary bit-identical, the norm's sum of squares in another order) instead of ~7 torch
kernels: a decode step runs ~100 of them per token, at a few microseconds each. Which fused
kernels run is the engine's `opts.kernels` (engine/options.py), handed over once at engine start
(`use_kernels`); `kernels.fused_ops` off keeps the torch kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.config import RopeScaling
from engine.model.kernel_limits import FUSED_NORM_MAX_DIM
from engine.model.rope import rope_frequencies
from engine.options import KernelOptions

_kernels = KernelOptions()  # the process's kernel choices: the engine sets them at start


def use_kernels(kernels: KernelOptions) -> None:
    """The fused-kernel switches every forward pass reads from now on (the engine's
    `opts.kernels`, set when it starts; process-wide, like the kernels themselves)."""
    global _kernels
    _kernels = kernels


def kernel_options() -> KernelOptions:
    return _kernels


def fused_ops_enabled() -> bool:
    """RMSNorm and rotary as Triton kernels on CUDA (kernels.fused_ops, default on)."""
    return _kernels.fused_ops


def fused_gdn_enabled() -> bool:
    """The Gated DeltaNet decode step and its gated norm as Triton kernels on CUDA
    (engine/model/fused_gdn.py; kernels.fused_gdn, default on)."""
    return _kernels.fused_gdn


def fused_router_enabled() -> bool:
    """The router's softmax, top-k and renormalisation as one Triton kernel on CUDA
    (engine/model/fused_ops.py `route_topk`; kernels.fused_router, default on)."""
    return _kernels.fused_router


def fused_shared_enabled() -> bool:
    """A MoE block's shared-expert gate, product and sum as one Triton kernel on CUDA
    (engine/model/fused_ops.py `shared_gated_add`; kernels.fused_shared, opt-in: no gain measured)."""
    return _kernels.fused_shared


def embed_tokens(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """table[ids]. A table in page-locked host memory with ids on CUDA is read by one kernel through
    its device mapping (engine/gpu/host_rows.py `gather_rows`): a copy, bit-identical, no host sync."""
    if table.device == ids.device:
        return F.embedding(ids, table)
    from engine.gpu.host_rows import gather_rows  # triton: imported where CUDA runs

    return gather_rows(ids, table)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """RMSNorm over the last dim. `zero_centered` scales by (1 + weight), as Qwen3.5 stores it. A
    float32 weight on lower-precision x scales in float32 and rounds once (gpt-oss keeps its norms
    in float32); otherwise x is rounded to its dtype first and then scaled (Qwen)."""
    if weight.dtype != x.dtype and not zero_centered:
        xf = x.float()
        return (weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)
    if x.is_cuda and fused_ops_enabled() and x.shape[-1] <= FUSED_NORM_MAX_DIM:
        from engine.model import fused_ops  # triton: imported where CUDA runs

        return fused_ops.rms_norm(x, weight, eps, zero_centered)
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (xf * (1.0 + weight.float())).to(dtype)
    return weight * xf.to(dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x, then times silu(gate): the output norm of Gated DeltaNet."""
    if x.is_cuda and fused_gdn_enabled() and x.dim() == 2 and x.shape[-1] <= FUSED_NORM_MAX_DIM:
        from engine.model import fused_ops

        return fused_ops.gated_rms_norm(x, gate, weight, eps)
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(dtype)
    return (out * F.silu(gate.float())).to(dtype)


def swiglu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


class Rotary:
    """Rotary position embedding over the first `rotary_dim` dims of each head (partial rotary).

    Frequencies and the cos / sin scale by the rope type (engine/model/rope.py). cos/sin tables grow
    on demand and are cached per device and dtype.
    """

    def __init__(self, rotary_dim: int, theta: float, scaling: RopeScaling | None = None,
                 max_position_embeddings: int = 0) -> None:
        self.rotary_dim = rotary_dim
        self.inv_freq, self.attention_scaling = rope_frequencies(scaling or RopeScaling(), rotary_dim, theta,
                                                                 max_position_embeddings)
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None
        self._builds = 0

    def prepare(self, n: int, device: torch.device, dtype: torch.dtype) -> None:
        """Tables for positions below n (grown by doubling)."""
        self._tables(n, device, dtype)

    @property
    def size(self) -> int:
        return 0 if self._cos is None else int(self._cos.shape[0])

    @property
    def version(self) -> int:
        """Changes whenever the tables are rebuilt (a captured graph holds the old ones)."""
        return self._builds

    def _tables(self, n: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self._cos
        if cos is None or cos.shape[0] < n or cos.device != device or cos.dtype != dtype:
            size = max(n, 2 * (cos.shape[0] if cos is not None else 1024))
            pos = torch.arange(size, dtype=torch.float)
            freqs = pos[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos = (emb.cos() * self.attention_scaling).to(device=device, dtype=dtype)
            self._sin = (emb.sin() * self.attention_scaling).to(device=device, dtype=dtype)
            self._builds += 1
        assert self._cos is not None and self._sin is not None
        return self._cos, self._sin

    def apply(self, x: torch.Tensor, positions: torch.Tensor, limit: int | None = None) -> torch.Tensor:
        """x: [T, heads, head_dim]; positions: [T] -> rotated x. `limit` (> every position), when
        the caller knows it on the host, spares reading positions back (a device sync); the
        decoder passes it, so a forward pass never waits here."""
        if self.rotary_dim == 0:
            return x
        cos_t, sin_t = self._tables(limit if limit is not None else int(positions.max()) + 1, x.device, x.dtype)
        if x.is_cuda and fused_ops_enabled():
            from engine.model import fused_ops

            return fused_ops.apply_rotary(x, cos_t, sin_t, positions, self.rotary_dim)
        cos = cos_t[positions][:, None, :]
        sin = sin_t[positions][:, None, :]
        rd = self.rotary_dim
        x_rot, x_pass = x[..., :rd], x[..., rd:]
        half = rd // 2
        rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
        out = x_rot * cos + rotated * sin
        return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out
