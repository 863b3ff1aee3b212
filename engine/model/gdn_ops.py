"""Gated delta rule and causal conv1d, in plain torch (CPU and any device).

Contract: for one sequence, heads already expanded to the value-head count,
- `causal_conv1d(x, state, weight)` -> (silu(conv(x)), new_state): depthwise causal conv with a
  carried window of the last K-1 inputs;
- `gated_delta_rule(q, k, v, g, beta, state)` -> (out, new_state): the recurrence
      S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - k_t^T exp(g_t) S_{t-1}))^T,   o_t = q_t^T S_t
  with q and k l2-normalised and q scaled by dk^-0.5 inside. Long inputs go through an exact
  chunked (WY) form, one token through the plain recurrence. All math in float32;
- `conv_step` and `recurrent_step`: one token of each for a batch of sequences at once (leading
  batch dim), the decode form (engine/model/linear_attention.py's `gated_deltanet_decode`).
Shapes: q, k [T, H, dk]; v [T, H, dv]; g, beta [T, H]; state [H, dk, dv] (float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C], state [C, K-1], weight [C, K] -> (out [T, C], new_state [C, K-1])."""
    seq = x.shape[0]
    window = torch.cat([state.to(x.dtype), x.t()], dim=-1)  # [C, K-1+T]
    out = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])[0]  # [C, T]
    new_state = window[:, -state.shape[-1]:].to(state.dtype) if state.shape[-1] else state
    return F.silu(out[:, -seq:]).t(), new_state


def conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One new input per sequence: x [N, C], state [N, C, K-1], weight [C, K] -> (silu(conv) [N, C]
    in x's dtype, the new windows [N, C, K-1] in state's dtype). The dot over K is float32."""
    window = torch.cat([state.to(x.dtype), x[:, :, None]], dim=-1)  # [N, C, K]
    out = (window.float() * weight.float()).sum(-1).to(x.dtype)
    return F.silu(out), window[:, :, 1:].to(state.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prep(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k l2-normalised in float32, q scaled by dk^-0.5."""
    q = l2norm(q.float())
    k = l2norm(k.float())
    return q * (q.shape[-1] ** -0.5), k


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if q.shape[0] == 1:
        return _recurrent(q, k, v, g, beta, state)
    return _chunked(q, k, v, g, beta, state)


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence for any leading batch dims: q, k [..., H, dk] (prepared: l2-
    normalised, q scaled), v [..., H, dv], g, beta [..., H], s [..., H, dk, dv], all float32."""
    s = s * g.exp()[..., None, None]
    kv_mem = torch.einsum("...hk,...hkv->...hv", k, s)
    delta = (v - kv_mem) * beta[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return torch.einsum("...hk,...hkv->...hv", q, s), s


def _recurrent(q, k, v, g, beta, state):  # type: ignore[no-untyped-def]
    q, k = prep(q, k)
    v, g, beta = v.float(), g.float(), beta.float()
    s = state.float()
    outs = []
    for t in range(q.shape[0]):
        o, s = recurrent_step(q[t], k[t], v[t], g[t], beta[t], s)
        outs.append(o)
    return torch.stack(outs), s


def _chunked(q, k, v, g, beta, state):  # type: ignore[no-untyped-def]
    q, k = prep(q, k)
    v, g, beta = v.float(), g.float(), beta.float()
    seq, heads = q.shape[:2]
    s = state.float()
    out = torch.empty(seq, heads, v.shape[-1], dtype=torch.float32, device=q.device)
    for c0 in range(0, seq, CHUNK):
        c1 = min(seq, c0 + CHUNK)
        # Per head, positions of this chunk: [H, C, ...]
        qc, kc, vc = (t[c0:c1].transpose(0, 1) for t in (q, k, v))
        gc, bc = g[c0:c1].t(), beta[c0:c1].t()
        gamma = gc.cumsum(-1)  # [H, C]: log decay from chunk start through position i
        n = c1 - c0
        diff = gamma[:, :, None] - gamma[:, None, :]  # gamma_i - gamma_j
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(lower, diff, torch.full_like(diff, float("-inf"))).exp()  # j <= i
        kk = kc @ kc.transpose(-1, -2)
        # (I + A) U = beta V - beta exp(gamma) K S0, A strictly lower: beta_i e^{g_i-g_j} k_i.k_j
        a = (bc[:, :, None] * decay * kk).tril(-1)
        eye = torch.eye(n, dtype=torch.float32, device=q.device)
        rhs_v = bc[:, :, None] * vc
        rhs_k = (bc * gamma.exp())[:, :, None] * kc
        sol = torch.linalg.solve_triangular(eye + a, torch.cat([rhs_v, rhs_k], -1), upper=False, unitriangular=True)
        u = sol[..., : vc.shape[-1]] - sol[..., vc.shape[-1]:] @ s  # [H, C, dv]
        attn = (qc @ kc.transpose(-1, -2)) * decay  # j <= i
        o = (gamma.exp()[:, :, None] * qc) @ s + attn @ u
        out[c0:c1] = o.transpose(0, 1)
        tail = (gamma[:, -1:] - gamma).exp()  # [H, C]
        s = gamma[:, -1].exp()[:, None, None] * s + (kc * tail[:, :, None]).transpose(-1, -2) @ u
    return out, s
