"""The fused Gated DeltaNet decode step (engine/model/fused_gdn.py + the gated norm of
engine/model/fused_ops.py) against a float64 reference of the layer and the torch decode step it
replaces (engine/model/linear_attention.py `gated_deltanet_decode`), over three consecutive tokens
of sequences in scattered state slots:

- the conv windows after each step equal the torch step's bit for bit (they are shifted inputs);
- float32 models: outputs and SSM states within 1e-5 of the largest magnitude of the torch step's
  (only the float32 reductions' order differs);
- bf16 models: the output's and the SSM states' errors against float64 at most 1.5x the torch
  step's own (6x under Triton's interpreter, which truncates to bf16 where a GPU rounds to
  nearest): the kernels round where the torch ops do, so their error is the torch step's;
- conv kernels of 2, 3 and 4 taps; key heads shared by 1 and 2 value heads; head sizes that are
  not powers of two.
On CUDA directly; on a CPU through Triton's interpreter.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import run_in_interpreter

SLOTS = 6


def _config(hk: int, hv: int, dk: int, dv: int, taps: int):  # type: ignore[no-untyped-def]
    from engine.weights.dummy import dummy_config

    return dataclasses.replace(dummy_config("tiny-hybrid"), linear_num_key_heads=hk, linear_num_value_heads=hv,
                               linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=taps)


def _weights(cfg, dtype: torch.dtype, device: str, g: torch.Generator):  # type: ignore[no-untyped-def]
    from engine.weights.layout import LinearAttentionWeights

    h, c, hv = cfg.hidden_size, cfg.linear_conv_dim, cfg.linear_num_value_heads

    def rand(*shape: int, std: float = 1.0, mean: float = 0.0, dt: torch.dtype = dtype) -> torch.Tensor:
        return (mean + std * torch.randn(*shape, generator=g)).to(device, dt)

    return LinearAttentionWeights(
        in_proj_qkv=rand(c, h, std=h**-0.5), in_proj_z=rand(cfg.linear_value_dim, h, std=h**-0.5),
        in_proj_a=rand(hv, h, std=h**-0.5), in_proj_b=rand(hv, h, std=h**-0.5),
        conv=rand(c, cfg.linear_conv_kernel_dim, std=0.4), a_log=rand(hv, std=0.5, dt=torch.float32),
        dt_bias=rand(hv, std=0.3, mean=1.0, dt=torch.float32), norm=rand(cfg.linear_value_head_dim, std=0.1, mean=1.0),
        out_proj=rand(h, cfg.linear_value_dim, std=cfg.linear_value_dim**-0.5))


def _reference(x, w, cfg, slots, conv, ssm):  # type: ignore[no-untyped-def]
    """The layer in float64, written out (state tensors float64, updated in place)."""
    d = {k: v.double().cpu() for k, v in dataclasses.asdict(w).items()}
    x = x.double().cpu()
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    mixed, z = x @ d["in_proj_qkv"].T, x @ d["in_proj_z"].T
    beta = torch.sigmoid(x @ d["in_proj_b"].T)
    g = -d["a_log"].exp() * F.softplus(x @ d["in_proj_a"].T + d["dt_bias"])
    out = torch.empty(x.shape[0], hv * dv, dtype=torch.float64)
    for i, slot in enumerate(slots.tolist()):
        window = torch.cat([conv[slot], mixed[i][:, None]], dim=-1)
        conv[slot] = window[:, 1:]
        act = F.silu((window * d["conv"]).sum(-1))
        q = act[:hk * dk].view(hk, dk).repeat_interleave(hv // hk, 0)
        k = act[hk * dk:2 * hk * dk].view(hk, dk).repeat_interleave(hv // hk, 0)
        v = act[2 * hk * dk:].view(hv, dv)
        q = q / q.norm(dim=-1, keepdim=True) / math.sqrt(dk)
        k = k / k.norm(dim=-1, keepdim=True)
        s = ssm[slot] * g[i].exp()[:, None, None]
        delta = (v - torch.einsum("hk,hkv->hv", k, s)) * beta[i][:, None]
        s = s + k[:, :, None] * delta[:, None, :]
        ssm[slot] = s
        core = torch.einsum("hk,hkv->hv", q, s)
        core = core / core.pow(2).mean(-1, keepdim=True).add(cfg.rms_norm_eps).sqrt() * d["norm"]
        out[i] = (core * F.silu(z[i].view(hv, dv))).reshape(-1)
    return out @ d["out_proj"].T


def _case(cfg, dtype: torch.dtype, device: str, seed: int, interpreted: bool) -> None:  # type: ignore[no-untyped-def]
    from engine.model.linear_attention import gated_deltanet_decode, gated_deltanet_decode_fused

    g = torch.Generator().manual_seed(seed)
    w = _weights(cfg, dtype, device, g)
    c, km1 = cfg.linear_conv_dim, cfg.linear_conv_kernel_dim - 1
    conv0 = torch.randn(SLOTS, c, km1, generator=g).to(dtype)
    ssm0 = 0.3 * torch.randn(SLOTS, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                             generator=g)
    conv_t, conv_f = conv0.to(device, copy=True), conv0.to(device, copy=True)  # updated in place
    ssm_t, ssm_f = ssm0.to(device, copy=True), ssm0.to(device, copy=True)
    conv_r, ssm_r = conv0.double(), ssm0.double()
    slots = torch.tensor([4, 0, 2], device=device)
    case = (dtype, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim)
    for step in range(3):
        x = torch.randn(3, cfg.hidden_size, generator=g).to(device, dtype)
        torch_out = gated_deltanet_decode(x, w, cfg, slots, conv_t, ssm_t)  # CPU, or CUDA without the flag
        fused = gated_deltanet_decode_fused(x, w, cfg, slots, conv_f, ssm_f)
        ref = _reference(x, w, cfg, slots, conv_r, ssm_r)
        assert torch.equal(conv_f, conv_t), (case, step)
        scale = ref.abs().max()
        if dtype == torch.float32:
            assert (fused.double().cpu() - torch_out.double().cpu()).abs().max() <= 1e-5 * scale, (case, step)
            assert (ssm_f - ssm_t).abs().max() <= 1e-5 * ssm_t.abs().max(), (case, step)
        else:
            err_fused = (fused.double().cpu() - ref).abs().max()
            err_torch = (torch_out.double().cpu() - ref).abs().max()
            assert err_fused <= (6.0 if interpreted else 1.5) * err_torch + 1e-6 * scale, \
                (case, step, float(err_fused), float(err_torch))
            err_fused = (ssm_f.double().cpu() - ssm_r).abs().max()
            err_torch = (ssm_t.double().cpu() - ssm_r).abs().max()
            assert err_fused <= (6.0 if interpreted else 1.5) * err_torch + 1e-6 * ssm_r.abs().max(), \
                (case, step, float(err_fused), float(err_torch))


def check(device: str) -> None:
    from engine.model import linear_attention, ops

    interpreted = device == "cpu"
    enabled = linear_attention.fused_gdn_enabled, ops.fused_gdn_enabled
    # the torch side is the torch step, whatever FREETOKEN_FUSED_GDN says
    linear_attention.fused_gdn_enabled = ops.fused_gdn_enabled = lambda: False  # type: ignore[assignment]
    try:
        for i, (hk, hv, dk, dv, taps) in enumerate([(2, 4, 16, 16, 4), (2, 2, 32, 24, 3), (1, 2, 24, 40, 2)]):
            for dtype in (torch.float32, torch.bfloat16):
                _case(_config(hk, hv, dk, dv, taps), dtype, device, seed=i, interpreted=interpreted)
    finally:
        linear_attention.fused_gdn_enabled, ops.fused_gdn_enabled = enabled  # type: ignore[assignment]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_gdn_decode_matches_torch_and_float64_cuda() -> None:
    check("cuda")


def test_fused_gdn_decode_matches_torch_and_float64_in_triton_interpreter() -> None:
    run_in_interpreter(__file__)


if __name__ == "__main__":  # the interpreter test's child
    check("cpu")
    print("ok")
