"""The oracle: transformers' own Qwen3.5 implementation, loaded with the same weights."""

from __future__ import annotations

import numpy as np
import torch

from deltaship.models import qwen3_5 as fam
from deltaship.models.source import ModelSource


def reference_model(source: ModelSource, dtype: torch.dtype = torch.float32):
    """transformers' Qwen3_5ForCausalLM with the source's weights (text decoder only)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(**fam.hf_config(source.spec))
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(cfg)
    model.to_empty(device="cpu")
    state = {}
    for name in source.weights.names():
        state[name] = torch.from_numpy(np.ascontiguousarray(source.weights.read(name))).to(dtype)
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


@torch.no_grad()
def reference_logits(model, ids: list[int]) -> np.ndarray:
    """Logits for every position of one sequence, float32 [T, vocab]."""
    out = model(torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0].float().numpy()
