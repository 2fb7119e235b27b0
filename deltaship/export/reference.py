"""The oracle: transformers' own Qwen3.5 implementation, loaded with the same weights.

Two references:
- `reference_model(source)`: the checkpoint's weights in fp32. Fidelity is measured against it.
- `matched_reference_model(source, ctx)`: the weights exactly as the bundle stores them
  (fp16-rounded, or quantized then dequantized), still run in fp32. A bundle that differs from
  it by more than its runtime arithmetic explains has a lowering bug, whatever the precision.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from deltaship.export.onnx.quant import dequantize, pack, quantize_blocks
from deltaship.models import qwen3_5 as fam
from deltaship.models.source import ModelSource


def quiet_third_party() -> None:
    """transformers pulls in torchao, whose import logs about CUDA kernels; keep the CLI readable."""
    for name in ("torchao", "torch.utils._pytree", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


def reference_model(source: ModelSource, dtype: torch.dtype = torch.float32):
    """transformers' Qwen3_5ForCausalLM with the source's weights (text decoder only)."""
    quiet_third_party()
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(**fam.hf_config(source.spec))
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(cfg)
    model.to_empty(device="cpu")
    state = {name: torch.from_numpy(np.array(source.weights.read(name))).to(dtype) for name in source.weights.names()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and source.spec.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"reference model weights do not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if source.spec.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Rotary inverse frequencies are buffers, not checkpoint tensors: recompute them on the CPU.
    rot = model.model.rotary_emb
    inv, _ = rot.compute_default_rope_parameters(cfg)
    rot.inv_freq = inv.to(torch.float32)
    rot.original_inv_freq = inv.clone()
    return model.to(dtype).eval()


def _roundtrip(w: torch.Tensor, q: dict) -> torch.Tensor:
    arr = w.detach().float().numpy()
    codes, scales = quantize_blocks(arr, q["bits"], q["block_size"])
    return torch.from_numpy(dequantize(pack(codes, q["bits"]), scales, q["bits"], arr.shape[1]))


@torch.no_grad()
def matched_reference_model(source: ModelSource, plan, quant: dict, precision: str):
    """The fp32 reference with every weight rounded exactly as the bundle stores it."""
    model = reference_model(source)
    if precision == "fp32":
        return model
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
                    m.weight = torch.nn.Parameter(_roundtrip(original_embed if src == embed_name else m.weight,
                                                             linear_q[src]))
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
