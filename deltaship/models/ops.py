"""Canonical ops: defined once here, lowered by every target (export/<target>/lowering).

Each op is a `torch.library.custom_op` in the `deltaship` namespace. Its body is the readable
reference implementation (run in eager mode by tests and by the eager canonical model); its fake
kernel lets torch.export trace on meta tensors. Stateful ops are functional: they take the state
and return the new state, never mutate their inputs; a target that keeps state in place (an
ExecuTorch mutable buffer, a Core ML state) writes the returned state back itself.

Batch size is 1 on device, but the bodies accept any B.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

# Chunk length of the reference gated delta rule for T > 1 (a power of two).
DELTA_CHUNK = 64


@torch.library.custom_op("deltaship::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last axis, computed in fp32 and cast back to x.dtype.

    x [..., D], weight [D] (plain scale: Qwen's zero-centred `1 + w` is folded in by the
    weight fix-ups). y = x * rsqrt(mean(x^2) + eps) * weight.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("deltaship::gated_rms_norm", mutates_args=())
def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """DeltaNet output norm: RMSNorm(x) * weight * silu(gate), fp32 inside.

    x, gate [..., D] (D = value head dim, one norm per head), weight [D] (not zero-centred).
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight.float() * y.to(x.dtype).float()
    return (y * F.silu(gate.float())).to(x.dtype)


@gated_rms_norm.register_fake
def _(x, gate, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("deltaship::l2norm", mutates_args=())
def l2norm(x: Tensor) -> Tensor:
    """L2-normalise the last axis in fp32, as transformers does for DeltaNet q/k.

    x [..., D] -> fp32 [..., D]; y = x * rsqrt(sum(x^2) + 1e-6).
    """
    xf = x.float()
    return xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + 1e-6)


@l2norm.register_fake
def _(x):
    return torch.empty_like(x, dtype=torch.float32)


@torch.library.custom_op("deltaship::delta_gates", mutates_args=())
def delta_gates(a: Tensor, b: Tensor, dt_bias: Tensor, decay_scale: Tensor) -> tuple[Tensor, Tensor]:
    """The DeltaNet gates, in fp32: g = decay_scale * softplus(a + dt_bias), beta = sigmoid(b).

    a, b [B, T, Hv] (projections), dt_bias [Hv], decay_scale [Hv] = -exp(A_log).
    Returns (g [B, T, Hv] log-space decay <= 0, beta [B, T, Hv]).
    """
    g = decay_scale.float() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


@delta_gates.register_fake
def _(a, b, dt_bias, decay_scale):
    return torch.empty_like(a, dtype=torch.float32), torch.empty_like(b, dtype=torch.float32)


@torch.library.custom_op("deltaship::causal_conv_with_state", mutates_args=())
def causal_conv_with_state(x: Tensor, state: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv1d + SiLU, continuing from a carried state.

    x [B, T, C] (channels last), state [B, K-1, C] = the last K-1 inputs seen (zeros at the
    start), weight [C, K]. Returns (y [B, T, C], new_state [B, K-1, C]); y_t = silu(sum_j
    weight[:, j] * u[t + j]) over u = concat(state, x) along time. State: DeltaNet conv state.
    """
    k = weight.shape[1]
    full = torch.cat([state.to(x.dtype), x], dim=1)
    y = F.conv1d(full.transpose(1, 2), weight.to(x.dtype).unsqueeze(1), groups=weight.shape[0]).transpose(1, 2)
    return F.silu(y).contiguous(), full[:, full.shape[1] - (k - 1) :].to(state.dtype).contiguous()


@causal_conv_with_state.register_fake
def _(x, state, weight):
    return torch.empty_like(x), torch.empty_like(state)


@torch.library.custom_op("deltaship::gated_delta_rule", mutates_args=())
def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """The gated delta rule over T tokens, continuing from a carried state.

    q, k [B, T, Hk, dk] (already L2-normalised), v [B, T, Hv, dv] with Hv a multiple of Hk
    (q/k head h serves value heads h*r .. h*r+r-1), g [B, T, Hv] log-space decay (<= 0),
    beta [B, T, Hv] in (0, 1), state [B, Hv, dk, dv] fp32. Per value head and token:
        S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = q^T S / sqrt(dk)
    Returns (o [B, T, Hv, dv] in v's dtype, new_state [B, Hv, dk, dv] fp32). State: DeltaNet
    recurrent state. T > 1 runs the chunked form (chunks of DELTA_CHUNK, no token loop).
    """
    out_dtype = v.dtype
    hv, hk = v.shape[2], k.shape[2]
    if hv != hk:
        q = q.repeat_interleave(hv // hk, dim=2)
        k = k.repeat_interleave(hv // hk, dim=2)
    q, k, v, g, beta = (t.transpose(1, 2).float() for t in (q, k, v, g, beta))  # [B, H, T, ...]
    q = q * (q.shape[-1] ** -0.5)
    s = state.float()
    if q.shape[2] == 1:
        s = s * g[..., 0, None, None].exp()
        kv_mem = (s * k[:, :, 0, :, None]).sum(-2)
        delta = (v[:, :, 0] - kv_mem) * beta[:, :, 0, None]
        s = s + k[:, :, 0, :, None] * delta[:, :, None, :]
        o = (s * q[:, :, 0, :, None]).sum(-2)[:, :, None]
    else:
        o, s = _chunked_delta(q, k, v, g, beta, s, DELTA_CHUNK)
    return o.transpose(1, 2).to(out_dtype).contiguous(), s.contiguous()


def _chunked_delta(q, k, v, g, beta, s, c):
    """Chunked gated delta rule: all work inside a chunk is batched matmuls.

    The WY system (I + L) with L strictly lower-triangular is inverted exactly as
    (I - L)(I + L^2)(I + L^4)... since L is nilpotent: log2(c) matmuls, no triangular solve.
    """
    b, h, t, dk = k.shape
    pad = (c - t % c) % c
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // c
    q, k, v = (x.reshape(b, h, n, c, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, c), beta.reshape(b, h, n, c)
    cum = g.cumsum(-1)
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta[..., None]
    strict = (k_beta @ k.transpose(-1, -2)) * decay * (~torch.eye(c, dtype=torch.bool, device=q.device))
    inv = _unit_lower_inverse(strict)
    u = inv @ (v * beta[..., None])
    w = inv @ (k_beta * cum.exp()[..., None])
    attn = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    last = cum[..., -1].exp()[..., None, None]
    outs = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ s
        outs.append(q_dec[:, :, i] @ s + attn[:, :, i] @ v_new)
        s = s * last[:, :, i] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).reshape(b, h, n * c, -1)[:, :, :t]
    return o, s


def _unit_lower_inverse(strict: Tensor) -> Tensor:
    """(I + L)^-1 for strictly lower-triangular L [..., c, c], c a power of two."""
    c = strict.shape[-1]
    eye = torch.eye(c, dtype=strict.dtype, device=strict.device)
    n = -strict
    inv = eye + n
    p = n
    for _ in range(int(math.log2(c)) - 1):
        p = p @ p
        inv = inv @ (eye + p)
    return inv


@gated_delta_rule.register_fake
def _(q, k, v, g, beta, state):
    return torch.empty_like(v), torch.empty_like(state)


@torch.library.custom_op("deltaship::attention_with_kv_cache", mutates_args=())
def attention_with_kv_cache(
    q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Causal grouped-query attention over a static KV cache.

    q [B, T, H, D], k and v [B, T, Hkv, D] (rotary already applied), caches [B, Hkv, S, D]
    holding positions 0 .. pos-1, pos [1] int64 = position of the first new token. Writes the
    new keys/values at pos .. pos+T-1 and attends causally over 0 .. pos+t with scale
    1/sqrt(D). Returns (out [B, T, H, D], k_cache', v_cache'). State: the KV cache.
    """
    b, t, h, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    idx = pos.reshape(1) + torch.arange(t, device=q.device)
    kc = k_cache.clone().index_copy_(2, idx, k.transpose(1, 2).to(k_cache.dtype))
    vc = v_cache.clone().index_copy_(2, idx, v.transpose(1, 2).to(v_cache.dtype))
    rep = h // hkv
    keys = kc.float().repeat_interleave(rep, dim=1)
    vals = vc.float().repeat_interleave(rep, dim=1)
    scores = (q.transpose(1, 2).float() @ keys.transpose(-1, -2)) / math.sqrt(d)  # [B, H, T, S]
    allowed = torch.arange(s, device=q.device)[None, :] <= idx[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vals
    return out.transpose(1, 2).to(q.dtype).contiguous(), kc, vc


@attention_with_kv_cache.register_fake
def _(q, k, v, k_cache, v_cache, pos):
    return torch.empty_like(q), torch.empty_like(k_cache), torch.empty_like(v_cache)


CANONICAL_OPS = {
    "rms_norm": torch.ops.deltaship.rms_norm.default,
    "l2norm": torch.ops.deltaship.l2norm.default,
    "delta_gates": torch.ops.deltaship.delta_gates.default,
    "gated_rms_norm": torch.ops.deltaship.gated_rms_norm.default,
    "causal_conv_with_state": torch.ops.deltaship.causal_conv_with_state.default,
    "gated_delta_rule": torch.ops.deltaship.gated_delta_rule.default,
    "attention_with_kv_cache": torch.ops.deltaship.attention_with_kv_cache.default,
}
STATEFUL_OPS = ("causal_conv_with_state", "gated_delta_rule", "attention_with_kv_cache")


class Kernels:
    """The implementations a canonical module calls. By default the canonical ops themselves (which
    ONNX and Core ML lower from the captured graph); a target that lowers at module level
    (ExecuTorch) substitutes its own object with the same methods."""

    name = "canonical"

    def __getattr__(self, op: str):
        return getattr(torch.ops.deltaship, op)


CANONICAL = Kernels()
