"""Qwen3.5 (`qwen3_5`, `qwen3_5_text`): the checkpoint's structure and its canonical stateful form.

`build_source_model(spec)` returns the model as the checkpoint lays it out (parameter names are
the Hugging Face names), on the meta device. Its token mixers cannot run: the export passes
(export/passes.py) rewrite them into the canonical stateful modules below, which call the
canonical ops in models/ops.py. The weight fix-ups the rewrites need are the pure functions at
the top of this file.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaship.models.ops import CANONICAL
from deltaship.models.spec import ModelSpec


# ---- weight fix-ups: pure functions on numpy arrays ------------------------------------------
def fold_zero_centred_norm(w: np.ndarray) -> np.ndarray:
    """Qwen3.5 RMSNorm scales by (1 + w); the canonical rms_norm scales by its weight."""
    return w + 1.0


def decay_scale_from_a_log(a_log: np.ndarray) -> np.ndarray:
    """g = -exp(A_log) * softplus(a + dt_bias): precompute the -exp(A_log) factor."""
    return -np.exp(a_log.astype(np.float64)).astype(np.float32)


def squeeze_conv_weight(w: np.ndarray) -> np.ndarray:
    """Depthwise conv1d weight [C, 1, K] -> [C, K]."""
    return w.reshape(w.shape[0], w.shape[-1])


FIXUPS = {
    "fold_zero_centred_norm": fold_zero_centred_norm,
    "decay_scale_from_a_log": decay_scale_from_a_log,
    "squeeze_conv_weight": squeeze_conv_weight,
}


def rotary_inv_freq(spec: ModelSpec) -> np.ndarray:
    """[rotary_dim / 2] float32 inverse frequencies of the attention layers' partial rotary.

    With YaRN (spec.rope_type "yarn") each frequency is blended between interpolation (divided by the
    factor) and extrapolation (kept) by a ramp over the rotary dims, as transformers'
    `_compute_yarn_parameters`; the cos/sin scale that goes with it is `rotary_attention_factor(spec)`.
    """
    rot = spec.rotary_dim
    if spec.rope_type == "default":
        return (1.0 / (spec.rope_theta ** (np.arange(0, rot, 2, dtype=np.float64) / rot))).astype(np.float32)
    if spec.rope_type != "yarn":
        raise ValueError(f"qwen3_5: rope_type {spec.rope_type!r} has no inverse frequencies here")

    def correction_dim(rotations: float) -> float:  # the rotary dim that turns `rotations` times over the context
        return (
            rot
            * math.log(spec.rope_original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(spec.rope_theta))
        )

    low, high = correction_dim(spec.rope_beta_fast), correction_dim(spec.rope_beta_slow)
    if spec.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    # float32 torch arithmetic in transformers' order: the same bits as the oracle (float64 would differ
    # by an ulp, which is 0.1 rad of phase at a million positions)
    pos_freqs = spec.rope_theta ** (torch.arange(0, rot, 2, device="cpu").float() / rot)
    ramp = torch.clamp((torch.arange(rot // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the pretrained frequency (high frequencies), 0: interpolate
    inv = (1.0 / (spec.rope_factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv.numpy().astype(np.float32)


def rotary_attention_factor(spec: ModelSpec) -> float:
    """The factor transformers multiplies cos and sin by (YaRN's attention temperature; 1 without scaling)."""
    return spec.rope_attention_factor if spec.rope_type != "default" else 1.0


# ---- the checkpoint's structure (cannot run) -------------------------------------------------
class SourceModule(nn.Module):
    """A module as the checkpoint stores it; the export passes replace it before capture."""

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            f"{type(self).__name__} is the checkpoint's layout and cannot run; "
            "run the export passes (deltaship.lowering.passes) first"
        )


class ZeroCentredRMSNorm(SourceModule):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps


class _Holder(nn.Module):
    """Holds a bare weight under the checkpoint's name (conv1d.weight, norm.weight)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


class SourceGatedDeltaNet(SourceModule):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, hv = spec.hidden_size, spec.linear_num_value_heads
        self.in_proj_qkv = nn.Linear(h, spec.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, spec.linear_value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, hv, bias=False)
        self.in_proj_a = nn.Linear(h, hv, bias=False)
        self.conv1d = _Holder(spec.conv_dim, 1, spec.linear_conv_kernel_dim)
        self.dt_bias = nn.Parameter(torch.empty(hv))
        self.A_log = nn.Parameter(torch.empty(hv))
        self.norm = _Holder(spec.linear_value_head_dim)
        self.out_proj = nn.Linear(spec.linear_value_dim, h, bias=False)


class SourceAttention(SourceModule):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.q_proj = nn.Linear(h, 2 * spec.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, spec.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, spec.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(spec.num_attention_heads * d, h, bias=False)
        self.q_norm = ZeroCentredRMSNorm(d, spec.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(d, spec.rms_norm_eps)


# ---- canonical modules -------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.kernels = CANONICAL

    def forward(self, x: Tensor) -> Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


class Projections(nn.Module):
    """Several linear maps of one input; `fuse()` turns them into one matmul and a split."""

    def __init__(self, linears: dict[str, nn.Linear]):
        super().__init__()
        self.parts = nn.ModuleDict(linears)
        self.sizes = [lin.out_features for lin in linears.values()]
        self.fused: nn.Linear | None = None

    def fuse(self) -> nn.Linear:
        first = next(iter(self.parts.values()))
        self.fused = nn.Linear(
            first.in_features, sum(self.sizes), bias=False, device=first.weight.device, dtype=first.weight.dtype
        )
        self.parts = nn.ModuleDict()
        return self.fused

    def forward(self, x: Tensor) -> list[Tensor]:
        if self.fused is not None:
            return list(self.fused(x).split(self.sizes, dim=-1))
        return [lin(x) for lin in self.parts.values()]


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, m = spec.hidden_size, spec.intermediate_size
        self.gate_up = Projections({"gate_proj": nn.Linear(h, m, bias=False), "up_proj": nn.Linear(h, m, bias=False)})
        self.down_proj = nn.Linear(m, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(F.silu(gate) * up)


class StatefulGatedDeltaNet(nn.Module):
    """Gated DeltaNet with explicit state: (x, conv_state, recurrent_state) -> (y, states')."""

    state_kinds = ("conv", "recurrent")

    def __init__(self, spec: ModelSpec, src: SourceGatedDeltaNet):
        super().__init__()
        self.spec = spec
        self.proj = Projections(
            {
                "in_proj_qkv": src.in_proj_qkv,
                "in_proj_z": src.in_proj_z,
                "in_proj_b": src.in_proj_b,
                "in_proj_a": src.in_proj_a,
            }
        )
        self.conv_weight = nn.Parameter(torch.empty(spec.conv_dim, spec.linear_conv_kernel_dim, device="meta"))
        self.dt_bias = src.dt_bias
        self.decay_scale = nn.Parameter(torch.empty(spec.linear_num_value_heads, device="meta"))
        self.norm_weight = src.norm.weight
        self.out_proj = src.out_proj
        self.kernels = CANONICAL

    # source name -> canonical name, for the weight plan
    renames = {
        "in_proj_qkv.weight": "proj.parts.in_proj_qkv.weight",
        "in_proj_z.weight": "proj.parts.in_proj_z.weight",
        "in_proj_b.weight": "proj.parts.in_proj_b.weight",
        "in_proj_a.weight": "proj.parts.in_proj_a.weight",
        "conv1d.weight": "conv_weight",
        "A_log": "decay_scale",
        "norm.weight": "norm_weight",
    }

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
        qkv, conv_state = kern.causal_conv_with_state(qkv, conv_state, self.conv_weight)
        q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q = kern.l2norm(q.reshape(1, -1, hk, dk))
        k = kern.l2norm(k.reshape(1, -1, hk, dk))
        v = v.reshape(1, -1, hv, dv).float()
        g, beta = kern.delta_gates(a, b, self.dt_bias, self.decay_scale)
        o, rec_state = kern.gated_delta_rule(q, k, v, g, beta, rec_state)
        o = kern.gated_rms_norm(o.to(x.dtype), z.reshape(1, -1, hv, dv), self.norm_weight, s.rms_norm_eps)
        return self.out_proj(o.reshape(1, -1, hv * dv)), conv_state, rec_state


def rotate(x: Tensor, cos: Tensor, sin: Tensor, rot: int) -> Tensor:
    """Rotary embedding on the first `rot` channels of each head (half-split convention)."""
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


class StaticCacheAttention(nn.Module):
    """Gated softmax attention over a static KV cache of `max_context` positions."""

    state_kinds = ("key", "value")

    def __init__(self, spec: ModelSpec, src: SourceAttention, max_context: int):
        super().__init__()
        self.spec, self.max_context = spec, max_context
        self.qkv = Projections({"q_proj": src.q_proj, "k_proj": src.k_proj, "v_proj": src.v_proj})
        if not isinstance(src.q_norm, RMSNorm):
            raise RuntimeError("the q/k norms are still zero-centred; fold them (FoldZeroCentredNorms) first")
        self.q_norm, self.k_norm = src.q_norm, src.k_norm
        self.o_proj = src.o_proj
        self.kernels = CANONICAL

    renames = {
        "q_proj.weight": "qkv.parts.q_proj.weight",
        "k_proj.weight": "qkv.parts.k_proj.weight",
        "v_proj.weight": "qkv.parts.v_proj.weight",
    }

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, position: Tensor, k_cache: Tensor, v_cache: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        s = self.spec
        h, hkv, d = s.num_attention_heads, s.num_key_value_heads, s.head_dim
        qg, k, v = self.qkv(x)
        qg = qg.reshape(1, -1, h, 2 * d)
        q, gate = qg[..., :d], qg[..., d:]
        q = rotate(self.q_norm(q), cos, sin, s.rotary_dim)
        k = rotate(self.k_norm(k.reshape(1, -1, hkv, d)), cos, sin, s.rotary_dim)
        out, k_cache, v_cache = self.kernels.attention_with_kv_cache(
            q, k, v.reshape(1, -1, hkv, d), k_cache, v_cache, position
        )
        out = out.reshape(1, -1, h * d) * torch.sigmoid(gate.reshape(1, -1, h * d))
        return self.o_proj(out), k_cache, v_cache


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, kind: str):
        super().__init__()
        self.kind = kind
        self.input_layernorm: nn.Module = ZeroCentredRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm: nn.Module = ZeroCentredRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if kind == "linear_attention":
            self.linear_attn: nn.Module = SourceGatedDeltaNet(spec)
        else:
            self.self_attn: nn.Module = SourceAttention(spec)
        self.mlp = MLP(spec)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.kind == "linear_attention" else self.self_attn

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, position: Tensor, states: list[Tensor]):
        h = self.input_layernorm(x)
        if self.kind == "linear_attention":
            h, *new = self.linear_attn(h, *states)
        else:
            h, *new = self.self_attn(h, cos, sin, position, *states)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, new


class Rotary(nn.Module):
    """cos/sin [1, T, 1, rotary_dim] for positions position .. position+T-1 (times the YaRN attention factor)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.register_buffer("inv_freq", torch.empty(spec.rotary_dim // 2))
        self.attention_factor = rotary_attention_factor(spec)

    def forward(self, position: Tensor, length: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        pos = (position + torch.arange(length, device=position.device)).float()
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)[None, :, None, :]  # [1, T, 1, rot]
        if self.attention_factor == 1.0:  # the graph of unscaled models, node for node
            return emb.cos().to(dtype), emb.sin().to(dtype)
        # scaled in fp32 before the cast, as transformers does
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)


class MTPHead(nn.Module):
    """The multi-token-prediction head (`mtp.*`): from the trunk's final-normed hidden state at position t and the
    embedding of token t+1, the hidden state whose LM-head logits predict token t+2.

    x = fc(concat(pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(hidden))); full-attention decoder
    layer(s) over their own KV cache (positions t, as the trunk's); norm. The embedding and LM head are the
    trunk's (Qwen35Model.mtp_forward)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h = spec.hidden_size
        self.pre_fc_norm_embedding: nn.Module = ZeroCentredRMSNorm(h, spec.rms_norm_eps)
        self.pre_fc_norm_hidden: nn.Module = ZeroCentredRMSNorm(h, spec.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(spec, "full_attention") for _ in range(spec.mtp_num_hidden_layers)])
        self.norm: nn.Module = ZeroCentredRMSNorm(h, spec.rms_norm_eps)
        # --mtp-draft-vocab N: logits over N token ids (rows of the LM head) instead of the trunk's LM head
        self.draft_head: nn.Linear | None = None


class Qwen35Model(nn.Module):
    """The whole decoder. forward(input_ids [1, T], position [1], states) -> (logits, states').

    `states` is the flat list described by `state_specs()`; logits are float32 [1, vocab] for
    the last position once the LastTokenLogits pass ran ([1, T, vocab] before).
    """

    def __init__(self, spec: ModelSpec, mtp: bool = False):
        super().__init__()
        self.spec = spec
        if mtp and not spec.mtp_num_hidden_layers:
            raise ValueError("qwen3_5: the spec declares no MTP layers (mtp_num_hidden_layers is 0)")
        self.mtp = MTPHead(spec) if mtp else None
        # speculative=True (the SpeculativeOutputs pass): forward takes `logit_rows` and also returns the
        # logits of those rows and the final-normed hidden states of every position (what a verify call needs)
        self.speculative = False
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.model.layers = nn.ModuleList([DecoderLayer(spec, k) for k in spec.layer_types])
        self.model.norm = ZeroCentredRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.model.rotary = Rotary(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.last_token_only = False

    def state_specs(self, dtype: torch.dtype) -> list[dict]:
        """The state contract: one entry per state tensor, in forward-argument order."""
        out = []
        shapes = self.spec.deltanet_state_shapes()
        for i, layer in enumerate(self.model.layers):
            mixer = layer.mixer
            if not hasattr(mixer, "state_kinds"):
                raise RuntimeError(f"layer {i} ({layer.kind}) has no state contract yet; run the rewrite passes")
            for kind in mixer.state_kinds:
                if kind in shapes:
                    shape, dt = shapes[kind], (torch.float32 if kind == "recurrent" else dtype)
                else:
                    shape, dt = self.spec.kv_cache_shape(mixer.max_context), dtype
                out.append(
                    {
                        "name": f"past.{i}.{kind}",
                        "output": f"present.{i}.{kind}",
                        "layer": i,
                        "kind": {
                            "conv": "deltanet_conv",
                            "recurrent": "deltanet_recurrent",
                            "key": "kv_cache_key",
                            "value": "kv_cache_value",
                        }[kind],
                        "shape": list(shape),
                        "dtype": str(dt).replace("torch.", ""),
                    }
                )
        return out

    def layer_state_counts(self) -> list[int]:
        return [len(layer.mixer.state_kinds) for layer in self.model.layers]

    def run_layers(
        self, x: Tensor, position: Tensor, states: list[Tensor], start: int = 0, stop: int | None = None
    ) -> tuple[Tensor, list[Tensor]]:
        """Layers start .. stop-1 on hidden states x; `states` are those layers' states, in order."""
        cos, sin = self.model.rotary(position, x.shape[1], x.dtype)
        new_states: list[Tensor] = []
        i = 0
        for layer in self.model.layers[start:stop]:
            n = len(layer.mixer.state_kinds)
            x, new = layer(x, cos, sin, position, states[i : i + n])
            new_states += new
            i += n
        return x, new_states

    def head(self, x: Tensor) -> Tensor:
        x = self.model.norm(x)
        if self.last_token_only:
            x = x[:, -1, :]
        return self.lm_head(x).float()

    def forward(self, input_ids: Tensor, position: Tensor, states: list[Tensor], logit_rows: Tensor | None = None):
        x, new_states = self.run_layers(self.model.embed_tokens(input_ids), position, states)
        if not self.speculative:
            return self.head(x), new_states
        # one LM-head matmul over the rows asked for (the last only in plain decoding, every row to verify drafts)
        hidden = self.model.norm(x)
        rows = self.lm_head(hidden.index_select(1, logit_rows)).float()
        return rows[:, -1, :], new_states, rows, hidden

    def mtp_state_specs(self, dtype: torch.dtype) -> list[dict]:
        """The MTP head's states: the KV cache of each of its attention layers."""
        out = []
        for i, layer in enumerate(self.mtp.layers):
            for kind in layer.self_attn.state_kinds:
                out.append(
                    {
                        "name": f"mtp.past.{i}.{kind}",
                        "output": f"mtp.present.{i}.{kind}",
                        "layer": i,
                        "kind": f"kv_cache_{kind}",
                        "shape": list(self.spec.kv_cache_shape(layer.self_attn.max_context)),
                        "dtype": str(dtype).replace("torch.", ""),
                    }
                )
        return out

    def add_draft_head(self, size: int) -> None:
        """Draft over `size` token ids: mtp_forward's logits become [1, size], from `mtp.draft_head` (the LM head's
        rows for those ids, which the weight plan selects) instead of the trunk's LM head."""
        w = self.lm_head.weight
        self.mtp.draft_head = nn.Linear(self.spec.hidden_size, size, bias=False, device=w.device, dtype=w.dtype)

    def mtp_program(self) -> nn.Module:
        return MTPProgram(self)

    def mtp_forward(self, hidden: Tensor, input_ids: Tensor, position: Tensor, states: list[Tensor]):
        """hidden [1, T, H] (the trunk's final-normed hidden states at positions p .. p+T-1), input_ids [1, T] (the
        tokens at p+1 .. p+T) -> (logits [1, V] of the last row: the draft for the token at p+T+1, the head's
        final-normed hidden states [1, T, H] (fed back for a deeper draft), the head's states'). With a draft head
        (add_draft_head) the logits are [1, N], over its token ids."""
        m = self.mtp
        emb = m.pre_fc_norm_embedding(self.model.embed_tokens(input_ids))
        x = m.fc(torch.cat([emb, m.pre_fc_norm_hidden(hidden)], dim=-1))
        cos, sin = self.model.rotary(position, x.shape[1], x.dtype)
        new_states: list[Tensor] = []
        for i, layer in enumerate(m.layers):
            x, new = layer(x, cos, sin, position, states[2 * i : 2 * i + 2])
            new_states += new
        out = m.norm(x)
        head = self.lm_head if m.draft_head is None else m.draft_head
        return head(out[:, -1, :]).float(), out, new_states


class MTPProgram(nn.Module):
    """Qwen35Model.mtp_forward as a module to capture, holding the model's own submodules under their own names
    (model.*, mtp.*, lm_head), so the captured program's parameters are the weight plan's names."""

    def __init__(self, full: Qwen35Model):
        super().__init__()
        self.model, self.mtp, self.lm_head = full.model, full.mtp, full.lm_head
        self._full = [full]  # not a submodule: its parameters are the ones above

    def forward(self, hidden: Tensor, input_ids: Tensor, position: Tensor, states: list[Tensor]):
        return self._full[0].mtp_forward(hidden, input_ids, position, states)


def checkpoint_name(param: str) -> str:
    """The checkpoint tensor behind a parameter of the freshly built model (the MLP groups its inputs)."""
    return param.replace(".mlp.gate_up.parts.", ".mlp.")


def build_source_model(spec: ModelSpec, mtp: bool = False) -> Qwen35Model:
    """The checkpoint's structure on the meta device: parameter names are the HF names (with mtp=True, the
    multi-token-prediction head's `mtp.*` too)."""
    with torch.device("meta"):
        return Qwen35Model(spec, mtp=mtp)


def hf_config(spec: ModelSpec) -> dict:
    """A Qwen3_5TextConfig dict for this spec (to build the transformers reference)."""
    rope = {"rope_type": "default", "rope_theta": spec.rope_theta, "partial_rotary_factor": spec.partial_rotary_factor}
    if spec.mrope_section:
        rope["mrope_section"] = list(spec.mrope_section)
    if spec.rope_type == "yarn":
        rope.update(
            rope_type="yarn",
            factor=spec.rope_factor,
            original_max_position_embeddings=spec.rope_original_max_position_embeddings,
            beta_fast=spec.rope_beta_fast,
            beta_slow=spec.rope_beta_slow,
            attention_factor=spec.rope_attention_factor,
            truncate=spec.rope_truncate,
        )
    return {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "layer_types": list(spec.layer_types),
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "linear_num_key_heads": spec.linear_num_key_heads,
        "linear_num_value_heads": spec.linear_num_value_heads,
        "linear_key_head_dim": spec.linear_key_head_dim,
        "linear_value_head_dim": spec.linear_value_head_dim,
        "linear_conv_kernel_dim": spec.linear_conv_kernel_dim,
        "rms_norm_eps": spec.rms_norm_eps,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_parameters": rope,
    }
