"""The vision tower's memory (`deltaship plan --vision`): its weights and activation peak per image size."""

from __future__ import annotations

import math

from deltaship.models.source import load_source
from deltaship.models.vision import Preprocessor, preprocessor_config, smart_resize, vision_spec_of, vision_tensors

VISION_SIDES = (224, 448, 896)  # square test images, in pixels; plus the preprocessor's largest image


def vision_plan(model: str) -> dict | None:
    """The vision tower's weights and its activation peak per image size, or None for a text-only model.

    Counted at fp32 (an fp16 bundle halves it), for one image per call, with full bidirectional attention over the
    image's N patches: the peak is one block's attention scores and their softmax (2 x heads x N x N) plus
    the patch-wide tensors of that block (input rows, QKV, MLP, residual), all fp32. Each image becomes N / 4
    tokens of the text decoder's context (its KV cost is the text plan's). "max" is the largest image the
    preprocessor produces (max_pixels, as a square)."""
    source = load_source(model)
    vs = vision_spec_of(source)
    if vs is None:
        return None
    pre = Preprocessor.from_config(preprocessor_config(source))
    params = sum(math.prod(s) for s in vision_tensors(vs).values())
    sides = [(str(s), s) for s in VISION_SIDES] + [("max", math.isqrt(pre.max_pixels))]
    images = []
    for label, side in sides:
        h, w = smart_resize(side, side, pre.factor, pre.min_pixels, pre.max_pixels)
        n = (h // vs.patch_size) * (w // vs.patch_size)
        scores = 2 * vs.num_heads * n * n * 4
        rows = n * (vs.patch_dim + 3 * vs.hidden_size + vs.intermediate_size + 2 * vs.hidden_size) * 4
        images.append(
            {
                "image": label,
                "resized": [h, w],
                "patches": n,
                "tokens": n // vs.merge_unit,
                "attention_scores_bytes": scores,
                "activation_peak_bytes": scores + rows,
            }
        )
    return {
        "depth": vs.depth,
        "hidden_size": vs.hidden_size,
        "parameters": params,
        "weights_bytes": params * 4,
        "dtype": "float32",
        "images": images,
    }
