"""ExecuTorch lowerings of the canonical ops, applied at module level before capture.

The stateful ops run on mutable buffers (program state): the KV cache is written in place by
`llama::update_cache` and read by `llama::custom_sdpa`; the gated delta rule is ExecuTorch's
`llama::gated_delta_rule` kernel (all T tokens in one call; the kernel itself loops over them: in a
512-token prefill of the 0.8B int4 program it takes about 17% of the time, ETDump in docs/results/executorch-ops.md,
where XNNPACK's 4-bit GEMMs take about 70%). Everything else is written in the ops XNNPACK delegates
(4-D means for the norms, a static-weight depthwise conv1d), so a layer stays in few delegate
partitions.

A new sequence is detected in the graph (position 0): the first token's decay and the conv state
are multiplied by 0, which discards the old DeltaNet state without touching the whole tensor, so
ExecuTorch's own runner, whose reset() only rewinds the position, works with these programs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from deltaship.lowering.lowerings import OpLowerings
from deltaship.models.ops import CANONICAL_OPS

KV_LAYOUT = "[1, max_context, kv_heads, head_dim]"  # llama::update_cache / custom_sdpa layout


def _mean_last(x: Tensor) -> Tensor:
    """mean(x, -1, keepdim) in the 4-D (dims 2, 3) form XNNPACK delegates."""
    d = x.shape[-1]
    y = x.reshape(1, -1, 1, d).mean(dim=(2, 3), keepdim=True)
    return y.reshape(*x.shape[:-1], 1)


class ExecuTorchKernels:
    """Same methods as the canonical ops; the state arguments are the program's mutable buffers."""

    name = "executorch"

    def __init__(self) -> None:
        # lazy: executorch
        from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401  (registers torch.ops.llama)

        self.position: Tensor | None = None  # set by the wrapper for the in-graph reset

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(_mean_last(xf * xf) + eps)
        return (y * weight.float()).to(x.dtype)

    def gated_rms_norm(self, x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
        xf = x.float()
        y = (xf * torch.rsqrt(_mean_last(xf * xf) + eps)).to(x.dtype).float()
        return (weight.float() * y * F.silu(gate.float())).to(x.dtype)

    def l2norm(self, x: Tensor) -> Tensor:
        xf = x.float()
        return xf * torch.rsqrt(_mean_last(xf * xf) * xf.shape[-1] + 1e-6)

    def delta_gates(self, a: Tensor, b: Tensor, dt_bias: Tensor, decay_scale: Tensor) -> tuple[Tensor, Tensor]:
        z = a.float() + dt_bias.float()
        softplus = torch.relu(z) + torch.log(1 + torch.exp(-torch.abs(z)))  # XNNPACK has these; not softplus
        return decay_scale.float() * softplus, torch.sigmoid(b.float())

    def _keep(self) -> Tensor:
        """1.0 inside a sequence, 0.0 on its first call (position 0)."""
        return (self.position.reshape(1) != 0).float()

    def causal_conv_with_state(self, x: Tensor, state: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        # weight is the [C, 1, K] parameter (a static weight keeps the conv delegated)
        k = weight.shape[-1]
        state = state * self._keep().to(state.dtype)
        full = torch.cat([state.to(x.dtype), x], dim=1)
        y = F.conv1d(full.transpose(1, 2), weight.to(x.dtype), groups=weight.shape[0]).transpose(1, 2)
        return F.silu(y), full[:, full.shape[1] - (k - 1) :].to(state.dtype)

    mean_last = staticmethod(_mean_last)

    def gated_delta_rule_heads_first(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The kernel on heads-first inputs: q (already scaled by 1/sqrt(d_k)), k [1, Hk, T, d_k], v [1, Hv, T, d_v],
        g, beta [1, T, Hv]. Returns (o [1, T, Hv, d_v], new state)."""
        hv, hk = v.shape[1], k.shape[1]
        if hv != hk:  # ExecuTorch's kernel groups the other way (query heads over state heads)
            q = q.repeat_interleave(hv // hk, dim=1)
            k = k.repeat_interleave(hv // hk, dim=1)
        decay = g.exp()
        first = (torch.arange(decay.shape[1], device=decay.device) == 0).float()  # 1 for the call's first token
        decay = decay * (1 - first * (1 - self._keep())).reshape(1, -1, 1)  # position 0: the old state is dropped
        o, new_state = torch.ops.llama.gated_delta_rule(
            q, k, v, decay.transpose(1, 2).contiguous(), beta.transpose(1, 2).contiguous(), state
        )
        return o.transpose(1, 2), new_state

    def gated_delta_rule(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The canonical signature (q, k [B, T, Hk, d_k], v [B, T, Hv, d_v]) over the heads-first kernel."""
        tr = lambda t: t.float().transpose(1, 2).contiguous()  # noqa: E731  [B, T, H, D] -> [B, H, T, D]
        o, new_state = self.gated_delta_rule_heads_first(
            tr(q * q.shape[-1] ** -0.5), tr(k), tr(v), g.float(), beta.float(), state
        )
        return o.to(v.dtype), new_state

    def attention_with_kv_cache(
        self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        # caches are mutable buffers in the [1, S, Hkv, D] layout; written in place
        t, s = q.shape[1], k_cache.shape[1]
        sp = pos[0].item()
        torch._check(sp >= 0)
        torch._check(sp + t <= s)
        torch.ops.llama.update_cache(k.to(k_cache.dtype), k_cache, sp)
        torch.ops.llama.update_cache(v.to(v_cache.dtype), v_cache, sp)
        out = torch.ops.llama.custom_sdpa(q.float(), k_cache.float(), v_cache.float(), sp, None, 0.0, True)
        return out.to(q.dtype), k_cache, v_cache

    def attention_with_stored_kv_cache(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        pos: Tensor,
        k_scale: Tensor | None = None,
        v_scale: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """attention_with_kv_cache over a cache narrower than the fp32 activations (--kv-cache fp16, int8, int4;
        int8/int4 with the static per-channel scales [1, 1, Hkv, D] of deltaship/lowering/kv_quant.py): the new keys
        and values are stored in the cache's dtype (store_kv), and the cache up to the current position is widened
        back to fp32 (load_kv, a transient copy, one layer at a time) for llama::custom_sdpa."""
        t, s = q.shape[1], k_cache.shape[1]
        sp = pos[0].item()
        torch._check(sp >= 0)
        torch._check(sp + t <= s)
        torch.ops.llama.update_cache(store_kv(k, k_cache.dtype, k_scale), k_cache, sp)
        torch.ops.llama.update_cache(store_kv(v, v_cache.dtype, v_scale), v_cache, sp)
        kd = load_kv(k_cache[:, : sp + t], k.shape[-1], k_scale)
        vd = load_kv(v_cache[:, : sp + t], v.shape[-1], v_scale)
        out = torch.ops.llama.custom_sdpa(q.float(), kd, vd, sp, None, 0.0, True)
        return out.to(q.dtype), k_cache, v_cache


# A stored KV cache in elementwise ops the portable kernels have: symmetric rounding with static scales,
# q = clamp(round(x / scale), -qmax, qmax). int4 keeps q + 8 (1 .. 15) in a nibble, two a byte along head_dim:
# channel 2i in the low nibble, 2i + 1 in the high one, packed and unpacked with integer bitwise ops (bitwise_or,
# shifts, bitwise_and on uint8: portable kernels XNNPACK does not claim, so the packing never splits a delegate).
INT4_OFFSET = 8


def store_kv(x: Tensor, dtype: torch.dtype, scale: Tensor | None) -> Tensor:
    """x [1, T, Hkv, D] (fp32) as the cache stores it: fp16, int8 codes, or int4 codes packed [1, T, Hkv, D/2]."""
    if dtype == torch.float16:
        return x.to(torch.float16)
    if dtype == torch.int8:
        return torch.clamp(torch.round(x.float() / scale), -127, 127).to(torch.int8)
    u = (torch.clamp(torch.round(x.float() / scale), -7, 7) + INT4_OFFSET).to(torch.uint8)
    u = u.reshape(1, -1, x.shape[2], x.shape[3] // 2, 2)
    return torch.bitwise_or(u[..., 0], torch.bitwise_left_shift(u[..., 1], 4))


def load_kv(c: Tensor, d: int, scale: Tensor | None) -> Tensor:
    """Rows of a stored cache [1, n, Hkv, D or D/2] back in fp32 [1, n, Hkv, D] (store_kv's inverse, up to its
    rounding)."""
    if c.dtype == torch.float16:
        return c.float()
    if c.dtype == torch.int8:
        return c.float() * scale
    codes = torch.stack([torch.bitwise_and(c, 15), torch.bitwise_right_shift(c, 4)], dim=-1)
    return (codes.reshape(1, -1, c.shape[2], d).float() - INT4_OFFSET) * scale


# ExecuTorch lowers the canonical ops at module level: the canonical modules call these kernel methods
# instead of the ops (export/executorch swaps them in), so each op's lowering is the method of its name.
LOWERINGS = OpLowerings("executorch")
for _name, _op in CANONICAL_OPS.items():
    if hasattr(ExecuTorchKernels, _name):
        LOWERINGS.add(_op, getattr(ExecuTorchKernels, _name))
