"""The I/O contract of a --vision bundle's image encoder: what the lowering writes and the runtime feeds.

Both sides import it from here (the lowering and the runtimes stand side by side and never import each
other). The inputs are models/vision/rope.py `encoder_inputs` for one image; a program method takes them in
ENCODER_INPUTS order (ExecuTorch's vision_encoder); a package with enumerated patch counts (Core ML's
vision_N functions) takes them padded to N patches, with MASKED_ENCODER_INPUTS' `key_bias` masking the padding.
No toolchain: numpy only.
"""

from __future__ import annotations

import numpy as np

from deltaship.errors import DeltashipError

ENCODER_INPUTS = ("pixel_values", "pos_indices", "pos_weights", "rope_cos", "rope_sin")
MASKED_ENCODER_INPUTS = (*ENCODER_INPUTS, "key_bias")  # + an additive bias [N] on every attention score row
PAD_BIAS = -30000.0  # key_bias of a padding patch: a fp16-safe "minus infinity" (lowering.NEG)


def vision_function(patches: int) -> str:
    """The name of the function that encodes an image of up to `patches` patches."""
    return f"vision_{patches}"


def check_patch_counts(counts: tuple[int, ...]) -> tuple[int, ...]:
    """The enumerated patch counts, sorted and unique; each a positive multiple of 4 (whole 2x2 merge groups)."""
    bad = [n for n in counts if n < 4 or n % 4]
    if bad or not counts:
        raise DeltashipError(
            f"Core ML vision patch counts {list(counts)}: each must be a positive multiple of 4 (whole 2x2 merge "
            "groups)",
            "e.g. 256, 1024, 4096",
        )
    return tuple(sorted(set(counts)))


def padded_inputs(inputs: dict[str, np.ndarray], patch_counts: tuple[int, ...]) -> tuple[str, dict[str, np.ndarray]]:
    """One image's encoder inputs (models/vision/rope.py encoder_inputs) padded to the smallest enumerated count that
    holds it: (function name, feeds)."""
    n = int(inputs["pixel_values"].shape[0])
    fits = [c for c in check_patch_counts(patch_counts) if c >= n]
    if not fits:
        raise DeltashipError(
            f"an image of {n} patches is over the largest Core ML vision function ({max(patch_counts)} patches)",
            "resize the image smaller (max_pixels), or export with a larger patch count",
        )
    big = fits[0]
    pad = big - n

    def grow(a: np.ndarray, fill: float) -> np.ndarray:
        return np.concatenate([a, np.full((pad,) + a.shape[1:], fill, a.dtype)]) if pad else a

    feeds = {
        "pixel_values": grow(np.asarray(inputs["pixel_values"], np.float32), 0.0),
        "pos_indices": grow(np.asarray(inputs["pos_indices"], np.int32), 0),
        "pos_weights": grow(np.asarray(inputs["pos_weights"], np.float32), 0.0),
        "rope_cos": grow(np.asarray(inputs["rope_cos"], np.float32), 1.0),
        "rope_sin": grow(np.asarray(inputs["rope_sin"], np.float32), 0.0),
        "key_bias": np.where(np.arange(big) < n, 0.0, PAD_BIAS).astype(np.float32),
    }
    return vision_function(big), feeds
