"""The oracle: transformers' own Qwen3.5 implementation, loaded with the same weights.

Two references:
- `reference_model(source)`: the checkpoint's weights in fp32. Fidelity is measured against it.
- `matched_reference_model(source, ctx)`: the weights exactly as the bundle stores them
  (fp16-rounded, or quantized then dequantized), still run in fp32. A bundle that differs from
  it by more than its runtime arithmetic explains has a lowering bug, whatever the precision.
"""

from __future__ import annotations

import numpy as np
import torch

from deltaship.logs import quiet_third_party
from deltaship.models.families import family_of_architecture
from deltaship.models.source import ModelSource
from deltaship.quant import dequantize, pack, quantize_blocks


def reference_model(source: ModelSource, dtype: torch.dtype = torch.float32):
    """transformers' Qwen3_5ForCausalLM with the source's weights (text decoder only)."""
    quiet_third_party()
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # lazy: transformers

    cfg = Qwen3_5TextConfig(**family_of_architecture(source.spec.architecture).hf_config(source.spec))
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(cfg)
    model.to_empty(device="cpu")
    state = {
        name: torch.from_numpy(np.array(source.weights.read(name))).to(dtype)
        for name in source.weights.names()
        if not name.startswith("mtp.")  # the MTP head: reference_mtp()
    }
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and source.spec.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"reference model weights do not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if source.spec.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    recompute_rotary(model, cfg)
    return model.to(dtype).eval()


class ReferenceMTP(torch.nn.Module):
    """The Qwen3.5 multi-token-prediction head built from transformers' own classes (Qwen3_5RMSNorm,
    Qwen3_5DecoderLayer as a full-attention layer) on top of a transformers trunk, whose embedding and LM head it
    shares. transformers itself ships no MTP module (it ignores `mtp.*` on load); the layout follows the published
    checkpoints (as vLLM's Qwen3.5 MTP loads them): fc over concat(norm(embed(next token)), norm(trunk hidden))."""

    def __init__(self, trunk, spec):
        super().__init__()
        from transformers import Qwen3_5TextConfig  # lazy: transformers
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        cfg = Qwen3_5TextConfig(
            **dict(
                family_of_architecture(spec.architecture).hf_config(spec),
                num_hidden_layers=spec.mtp_num_hidden_layers,
                layer_types=["full_attention"] * spec.mtp_num_hidden_layers,
            )
        )
        cfg._attn_implementation = "sdpa"  # causal without a mask
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=eps)
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.layers = torch.nn.ModuleList([Qwen3_5DecoderLayer(cfg, i) for i in range(spec.mtp_num_hidden_layers)])
        self.norm = Qwen3_5RMSNorm(h, eps=eps)
        self._trunk = [trunk]  # not a submodule: its weights stay the trunk's

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, start: int = 0):
        """hidden [1, N, H]: the trunk's final-normed hidden states at positions start .. start+N-1; next_ids
        [1, N]: the tokens one position later. Returns (logits [1, N, V] for the tokens two positions later, the
        head's final-normed hidden states), every position attending causally to the ones before it."""
        trunk = self._trunk[0]
        emb = self.pre_fc_norm_embedding(trunk.model.embed_tokens(next_ids))
        x = self.fc(torch.cat([emb, self.pre_fc_norm_hidden(hidden)], dim=-1))
        pos = torch.arange(start, start + x.shape[1])[None]
        pe = trunk.model.rotary_emb(x, pos)
        for layer in self.layers:
            x = layer(x, position_embeddings=pe, position_ids=pos)
        out = self.norm(x)
        return trunk.lm_head(out).float(), out

    def load_from(self, source) -> "ReferenceMTP":
        state = {
            name[len("mtp.") :]: torch.from_numpy(np.array(source.weights.read(name))).float()
            for name in source.weights.names()
            if name.startswith("mtp.")
        }
        missing, unexpected = self.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise RuntimeError(
                f"MTP reference weights do not match: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        return self


def reference_mtp(source: ModelSource, trunk=None) -> tuple[object, ReferenceMTP]:
    """(transformers trunk, its MTP head) with the source's weights, fp32, eval."""
    trunk = trunk if trunk is not None else reference_model(source)
    return trunk, ReferenceMTP(trunk, source.spec).load_from(source).eval()


def recompute_rotary(model, cfg, device: str = "cpu") -> None:
    """Rotary inverse frequencies are buffers, not checkpoint tensors: recompute them (float32) on `device`,
    with the config's rope type (YaRN's comes with the cos/sin attention factor)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # lazy: transformers

    rot = model.model.rotary_emb
    init = rot.compute_default_rope_parameters if rot.rope_type == "default" else ROPE_INIT_FUNCTIONS[rot.rope_type]
    inv, rot.attention_scaling = init(cfg)
    rot.inv_freq = inv.to(device, torch.float32)
    rot.original_inv_freq = inv.clone().to(device)


def _roundtrip(w: torch.Tensor, q: dict) -> torch.Tensor:
    arr = w.detach().float().numpy()
    codes, scales = quantize_blocks(arr, q["bits"], q["block_size"])
    if q.get("scale_dtype") == "float16":
        scales = scales.astype(np.float16).astype(np.float32)
    return torch.from_numpy(dequantize(pack(codes, q["bits"]), scales, q["bits"], arr.shape[1]))


def _set_from_rounded(model, source: ModelSource, plan, rounded: dict) -> None:
    """Load toolchain-rounded canonical tensors into the HF model (fused tensors split by rows)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if source.spec.tie_word_embeddings:  # the two uses may round differently: untie
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        params["lm_head.weight"] = model.lm_head.weight
    for name, arr in rounded.items():
        if name.startswith("mtp."):  # the MTP head (and its draft head's rows): not in this model (reference_mtp)
            continue
        recipe = None if name == "lm_head.weight" else plan.recipes[name]
        if recipe is not None and recipe.rows is not None:  # a row selection of one source: scatter it back
            (src,) = recipe.sources
            params[src].data[torch.from_numpy(recipe.rows)] = torch.from_numpy(np.ascontiguousarray(arr)).float()
            continue
        sources = ("lm_head.weight",) if recipe is None else recipe.sources
        row = 0
        for s in sources:
            n = source.weights.shape(s)[0] if s in source.weights.names() else arr.shape[0]
            params[s].data = torch.from_numpy(np.ascontiguousarray(arr[row : row + n])).float()
            row += n


@torch.no_grad()
def matched_reference_model(source: ModelSource, plan, quant: dict, precision: str, rounded: dict | None = None):
    """The fp32 reference with every weight rounded exactly as the bundle stores it.

    `rounded` (canonical name -> array) gives the values directly when a toolchain did the
    rounding (torchao for ExecuTorch); otherwise they are recomputed from `quant`.
    """
    model = reference_model(source)
    if precision == "fp32":
        return model
    if rounded is not None:
        _set_from_rounded(model, source, plan, rounded)
        return model.eval()
    # Checkpoint tensor -> rounding, through the weight plan (fused tensors round row by row,
    # so rounding each source tensor alone gives the same values).
    linear_q = {s: q for n, q in quant["linear"].items() for s in plan.recipes[n].sources}
    embed_q = {s: q for n, q in quant["embedding"].items() for s in plan.recipes[n].sources}
    half = {s for r in plan.recipes.values() if r.dtype == "model" for s in r.sources}
    embed_name = "model.embed_tokens.weight"
    tied = source.spec.tie_word_embeddings
    original_embed = model.model.embed_tokens.weight.detach().clone()
    for name, p in model.named_parameters(remove_duplicate=False):
        src = embed_name if (tied and name == "lm_head.weight") else name
        if precision == "fp16" and src in half:
            p.data = p.data.half().float()
    if precision in ("int8", "int4"):
        for mname, m in model.named_modules():
            if isinstance(m, torch.nn.Linear):
                src = embed_name if (tied and mname == "lm_head") else f"{mname}.weight"
                if src in linear_q:
                    m.weight = torch.nn.Parameter(
                        _roundtrip(original_embed if src == embed_name else m.weight, linear_q[src])
                    )
        emb = model.model.embed_tokens
        if embed_name in embed_q:
            emb.weight = torch.nn.Parameter(_roundtrip(original_embed, embed_q[embed_name]))
        elif tied:
            emb.weight = torch.nn.Parameter(original_embed)
    return model.eval()


@torch.no_grad()
def reference_logits(model, ids: list[int]) -> np.ndarray:
    """Logits for every position of one sequence, float32 [T, vocab]."""
    out = model(torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0].float().numpy()
