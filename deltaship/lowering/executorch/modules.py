"""The canonical modules re-laid out so that XNNPACK takes each layer in one delegate call.

ExecuTorch's XNNPACK delegate rejects a slice or split of any tensor with a dynamic (prompt-length)
dimension, and every rejected node cuts the surrounding partition in two: the canonical layout (fused
projections split after the matmul, q/gate interleaved in q_proj, rotary on a slice of each head,
q/k/v split before their L2 norms) costs about ten partitions per layer. Here:

- projections stay separate linears of one input (no split); q_proj's rows are divided into a query
  and a gate projection by the weight plan;
- rotary acts on whole heads: x * cos + (x @ R) * sin with cos/sin full-width (1 and 0 past the rotary
  part) and R the constant rotate-half matrix;
- DeltaNet normalises q and k on the conv output reshaped to heads (a per-head constant picks the L2
  scale, times 1/sqrt(d_k), for q/k heads and 1 for v heads) and splits q, k, v only right before the
  gated delta rule kernel, at the partition boundary that kernel makes anyway.

What is left outside XNNPACK per layer is the stateful kernel itself (llama::gated_delta_rule, or the
KV-cache update and llama::custom_sdpa) and the data movement next to it.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaship.models import qwen3_5 as fam
from deltaship.models.spec import ModelSpec


def rotate_half_matrix(head_dim: int, rot: int) -> np.ndarray:
    """W [d, d] with F.linear(x, W) = rotate_half on the first `rot` channels ([-x2, x1]) and 0 past them."""
    w = np.zeros((head_dim, head_dim), np.float32)
    half = rot // 2
    for j in range(half):
        w[j, j + half] = -1.0
        w[j + half, j] = 1.0
    return w


def full_width_inv_freq(spec: ModelSpec) -> np.ndarray:
    """[d] angular frequencies per head channel: the rotary ones twice (half-split layout), 0 past them."""
    inv = fam.rotary_inv_freq(spec)
    out = np.zeros(spec.head_dim, np.float32)
    out[: inv.size], out[inv.size : 2 * inv.size] = inv, inv
    return out


def head_selection(spec: ModelSpec) -> np.ndarray:
    """[3 Hv, 2 Hk + Hv] 0/1: the conv output's heads -> q and k repeated per value head (head h serves value
    heads h*r .. h*r+r-1, as transformers' repeat_interleave), then v."""
    hk, hv = spec.linear_num_key_heads, spec.linear_num_value_heads
    r = hv // hk
    sel = np.zeros((3 * hv, 2 * hk + hv), np.float32)
    for i in range(hv):
        sel[i, i // r] = sel[hv + i, hk + i // r] = sel[2 * hv + i, 2 * hk + i] = 1.0
    return sel


def qkv_head_scales(spec: ModelSpec) -> tuple[np.ndarray, np.ndarray]:
    """Per conv-output head: (multiplier of the L2 scale, constant term): q heads get 1/sqrt(d_k) * l2,
    k heads l2, v heads 1 (no norm)."""
    hk, hv = spec.linear_num_key_heads, spec.linear_num_value_heads
    mult = np.array([spec.linear_key_head_dim**-0.5] * hk + [1.0] * hk + [0.0] * hv, np.float32)
    const = np.array([0.0] * (2 * hk) + [1.0] * hv, np.float32)
    return mult.reshape(-1, 1), const.reshape(-1, 1)


def full_width_cos_scale(spec: ModelSpec) -> np.ndarray:
    """[d] YaRN's cos/sin factor on the rotary channels, 1 past them (cos must stay exactly 1 there)."""
    out = np.ones(spec.head_dim, np.float32)
    out[: spec.rotary_dim] = fam.rotary_attention_factor(spec)
    return out


class XnnpackRotary(nn.Module):
    """cos/sin [1, T, 1, head_dim], full width: 1 and 0 on the channels rotary does not touch."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.register_buffer("inv_freq_full", torch.empty(spec.head_dim, device="meta"))
        self.scaled = fam.rotary_attention_factor(spec) != 1.0
        if self.scaled:  # only with rope scaling: unscaled models keep the same program
            self.register_buffer("cos_scale_full", torch.empty(spec.head_dim, device="meta"))

    def forward(self, position: Tensor, length: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        pos = (position + torch.arange(length, device=position.device)).float()
        freqs = pos.reshape(1, -1, 1, 1) * self.inv_freq_full.reshape(1, 1, 1, -1)  # reshapes XNNPACK takes
        if not self.scaled:  # the program of unscaled models, node for node
            return freqs.cos().to(dtype), freqs.sin().to(dtype)
        scale = self.cos_scale_full.reshape(1, 1, 1, -1)
        return (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)


class XnnpackAttention(nn.Module):
    """Gated attention with separate q and gate projections and rotary on whole heads."""

    state_kinds = fam.StaticCacheAttention.state_kinds

    def __init__(self, canonical: fam.StaticCacheAttention):
        super().__init__()
        s = canonical.spec
        self.spec, self.max_context, self.kernels = s, canonical.max_context, canonical.kernels
        h, d = s.num_attention_heads, s.head_dim
        q_proj = canonical.qkv.parts["q_proj"]
        make = lambda: nn.Linear(q_proj.in_features, h * d, bias=False, device="meta", dtype=q_proj.weight.dtype)  # noqa: E731
        self.qkv = fam.Projections(
            {
                "q": make(),
                "gate": make(),
                "k_proj": canonical.qkv.parts["k_proj"],
                "v_proj": canonical.qkv.parts["v_proj"],
            }
        )
        self.q_norm, self.k_norm, self.o_proj = canonical.q_norm, canonical.k_norm, canonical.o_proj
        self.register_buffer("rotate", torch.empty(d, d, device="meta"))

    @staticmethod
    def q_gate_rows(spec: ModelSpec) -> dict[str, np.ndarray]:
        """q_proj emits [q_h | gate_h] per head: the rows of each part, head by head."""
        d = spec.head_dim
        heads = np.arange(spec.num_attention_heads)[:, None] * 2 * d
        return {"q": (heads + np.arange(d)).reshape(-1), "gate": (heads + d + np.arange(d)).reshape(-1)}

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, position: Tensor, k_cache: Tensor, v_cache: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        s = self.spec
        h, hkv, d = s.num_attention_heads, s.num_key_value_heads, s.head_dim
        q, gate, k, v = self.qkv(x)
        q = self.q_norm(q.reshape(1, -1, h, d))
        k = self.k_norm(k.reshape(1, -1, hkv, d))
        q = q * cos + F.linear(q, self.rotate) * sin  # `rotate` is stored in the model dtype: a static weight
        k = k * cos + F.linear(k, self.rotate) * sin
        if k_cache.dtype != torch.float32:  # --kv-cache fp16/int8/int4 (int8/int4: static scales, set by the lowering)
            out, k_cache, v_cache = self.kernels.attention_with_stored_kv_cache(
                q,
                k,
                v.reshape(1, -1, hkv, d),
                k_cache,
                v_cache,
                position,
                getattr(self, "k_scale", None),
                getattr(self, "v_scale", None),
            )
        else:
            out, k_cache, v_cache = self.kernels.attention_with_kv_cache(
                q, k, v.reshape(1, -1, hkv, d), k_cache, v_cache, position
            )
        out = out.reshape(1, -1, h * d) * torch.sigmoid(gate)
        return self.o_proj(out), k_cache, v_cache


class XnnpackGatedDeltaNet(nn.Module):
    """Gated DeltaNet whose q/k/v leave XNNPACK only to enter the gated delta rule kernel."""

    state_kinds = fam.StatefulGatedDeltaNet.state_kinds

    def __init__(self, canonical: fam.StatefulGatedDeltaNet):
        super().__init__()
        c = canonical
        self.spec, self.kernels = c.spec, c.kernels
        self.proj, self.conv_weight, self.dt_bias, self.decay_scale = c.proj, c.conv_weight, c.dt_bias, c.decay_scale
        self.norm_weight, self.out_proj = c.norm_weight, c.out_proj
        n_heads = 2 * self.spec.linear_num_key_heads + self.spec.linear_num_value_heads
        self.register_buffer("head_mult", torch.empty(n_heads, 1, device="meta"))
        self.register_buffer("head_const", torch.empty(n_heads, 1, device="meta"))
        if self.spec.linear_num_value_heads != self.spec.linear_num_key_heads:
            self.register_buffer(
                "head_select", torch.empty(3 * self.spec.linear_num_value_heads, n_heads, device="meta")
            )

    def forward(self, x: Tensor, conv_state: Tensor, rec_state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        s = self.spec
        hk, hv, dk, dv = (
            s.linear_num_key_heads,
            s.linear_num_value_heads,
            s.linear_key_head_dim,
            s.linear_value_head_dim,
        )
        kern = self.kernels
        qkv, z, b, a = self.proj(x)
        y, conv_state = kern.causal_conv_with_state(qkv, conv_state, self.conv_weight)
        if dk == dv:
            heads = y.reshape(1, -1, 2 * hk + hv, dk).float()
            inv = torch.rsqrt(kern.mean_last(heads * heads) * dk + 1e-6)
            heads = heads * (inv * self.head_mult + self.head_const)  # [1, T, H, d]
            if hv != hk:  # repeat q/k per value head with a 0/1 matmul (exact), XNNPACK has no gather
                heads = F.linear(heads.transpose(2, 3), self.head_select).permute(0, 3, 1, 2)  # [1, 3 Hv, T, d]
                q, k, v = heads.split([hv, hv, hv], dim=1)  # outside XNNPACK, next to the kernel
            else:
                q, k, v = heads.transpose(1, 2).split([hk, hk, hv], dim=1)
        else:  # the split comes first: one more partition boundary, same numbers
            q, k, v = y.split([hk * dk, hk * dk, hv * dv], dim=-1)
            q = (kern.l2norm(q.reshape(1, -1, hk, dk)) * dk**-0.5).transpose(1, 2)
            k = kern.l2norm(k.reshape(1, -1, hk, dk)).transpose(1, 2)
            v = v.reshape(1, -1, hv, dv).float().transpose(1, 2)
        g, beta = kern.delta_gates(a, b, self.dt_bias, self.decay_scale)
        o, rec_state = kern.gated_delta_rule_heads_first(q, k, v, g, beta, rec_state)
        o = kern.gated_rms_norm(o.to(x.dtype), z.reshape(1, -1, hv, dv), self.norm_weight, s.rms_norm_eps)
        return self.out_proj(o.reshape(1, -1, hv * dv)), conv_state, rec_state


class XnnpackLayout:
    """Export pass (ExecuTorch only): the canonical modules -> the XNNPACK-friendly layout above."""

    name = "xnnpack_layout"

    def requires(self, ctx) -> None:
        if any(isinstance(m, ctx.family.SourceModule) for m in ctx.model.modules()):
            raise RuntimeError("rewrite the token mixers (DeltaNet, attention) first")
        if any(isinstance(m, ctx.family.Projections) and m.fused is not None for m in ctx.model.modules()):
            raise RuntimeError("projections are fused: XNNPACK would need a dynamic split after each (skip fusing)")

    def run(self, ctx) -> dict[str, int]:
        model, plan, spec = ctx.model, ctx.plan, ctx.spec
        counts = {"attention_q_gate_split": 0, "deltanet_heads_first": 0}
        for i, layer in enumerate(model.model.layers):
            path = f"model.layers.{i}"
            if isinstance(layer.mixer, ctx.family.StaticCacheAttention):
                layer.self_attn = XnnpackAttention(layer.self_attn)
                rows = XnnpackAttention.q_gate_rows(spec)
                plan.select_rows(
                    f"{path}.self_attn.qkv.parts.q_proj.weight",
                    {f"{path}.self_attn.qkv.parts.{k}.weight": v for k, v in rows.items()},
                )
                rot = rotate_half_matrix(spec.head_dim, spec.rotary_dim)
                plan.add_constant(f"{path}.self_attn.rotate", lambda r=rot: r, rot.shape, dtype="model")
                counts["attention_q_gate_split"] += 1
            elif isinstance(layer.mixer, ctx.family.StatefulGatedDeltaNet):
                layer.linear_attn = XnnpackGatedDeltaNet(layer.linear_attn)
                mult, const = qkv_head_scales(spec)
                plan.add_constant(f"{path}.linear_attn.head_mult", lambda m=mult: m, mult.shape)
                plan.add_constant(f"{path}.linear_attn.head_const", lambda c=const: c, const.shape)
                if spec.linear_num_value_heads != spec.linear_num_key_heads:
                    sel = head_selection(spec)
                    plan.add_constant(f"{path}.linear_attn.head_select", lambda m=sel: m, sel.shape)
                counts["deltanet_heads_first"] += int(spec.linear_key_head_dim == spec.linear_value_head_dim)
        mtp = getattr(model, "mtp", None)
        for i, layer in enumerate(mtp.layers if mtp is not None else []):
            path = f"mtp.layers.{i}"  # --mtp: the draft head's attention layer(s), laid out as the trunk's
            layer.self_attn = XnnpackAttention(layer.self_attn)
            rows = XnnpackAttention.q_gate_rows(spec)
            plan.select_rows(
                f"{path}.self_attn.qkv.parts.q_proj.weight",
                {f"{path}.self_attn.qkv.parts.{k}.weight": v for k, v in rows.items()},
            )
            rot = rotate_half_matrix(spec.head_dim, spec.rotary_dim)
            plan.add_constant(f"{path}.self_attn.rotate", lambda r=rot: r, rot.shape, dtype="model")
            counts["mtp_attention_q_gate_split"] = i + 1
        model.model.rotary = XnnpackRotary(spec)
        plan.add_constant("model.rotary.inv_freq_full", lambda: full_width_inv_freq(spec), (spec.head_dim,))
        if model.model.rotary.scaled:
            plan.add_constant("model.rotary.cos_scale_full", lambda: full_width_cos_scale(spec), (spec.head_dim,))
        del plan.recipes["model.rotary.inv_freq"]
        return counts

    def ensures(self, ctx) -> None:
        names = {n for n, _ in ctx.model.named_parameters()} | {n for n, _ in ctx.model.named_buffers()}
        missing = names - set(ctx.plan.names())
        extra = {n for n in set(ctx.plan.names()) - names if n != "lm_head.weight"}
        if missing or extra:
            raise RuntimeError(
                f"weight plan out of step with the module tree: missing {sorted(missing)[:4]}, "
                f"extra {sorted(extra)[:4]}"
            )
