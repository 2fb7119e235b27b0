"""What depends on an image's patch grid, computed on the host in NumPy and passed to the exported graphs: the
learned position table's bilinear resampling (indices and weights, 4 taps per patch), the tower's 2-D rotary
cos/sin, and the decoder's 3-row M-RoPE positions for a prompt with image spans."""

from __future__ import annotations

import numpy as np

from deltaship.errors import DeltashipError
from deltaship.models.vision.preprocess import ImageInput
from deltaship.models.vision.spec import VisionSpec


# ---- grid tensors of one image (the vision graph's inputs besides the patches) --------------------------
def patch_coordinates(grid: tuple[int, int, int], merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of every patch, in the merge-block order of the patch rows (repeated over t)."""
    t, h, w = grid
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    cols = cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    return np.tile(rows, t), np.tile(cols, t)


def position_interpolation(spec: VisionSpec, grid: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The learned square position table resampled (bilinear, align_corners) to the image's patch grid:
    int64 indices [N, 4] into the flattened table and float32 weights [N, 4], in patch-row order."""
    side = spec.grid_side
    t, h, w = grid
    rows, cols = patch_coordinates(grid, spec.spatial_merge_size)

    def taps(index: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
        floor = np.floor(src)
        offsets = np.arange(2)
        tap = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
        weight = np.clip(1 - np.abs(src[:, None] - floor[:, None] - offsets), 0, None)
        return tap, weight.astype(np.float32)

    ht, hw = taps(rows, h)
    wt, ww = taps(cols, w)
    indices = (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4)
    weights = (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4)
    return indices.astype(np.int64), weights.astype(np.float32)


def rotary_cos_sin(spec: VisionSpec, grid: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The 2-D axial rotary of the tower: cos, sin float32 [N, head_dim] (row frequencies, then column
    frequencies, the pair repeated for the rotate-half convention)."""
    half = spec.head_dim // 2
    inv_freq = 1.0 / (spec.rope_theta ** (np.arange(0, half, 2, dtype=np.float32) / np.float32(half)))
    rows, cols = patch_coordinates(grid, spec.spatial_merge_size)
    fh = rows[:, None].astype(np.float32) * inv_freq.astype(np.float32)
    fw = cols[:, None].astype(np.float32) * inv_freq.astype(np.float32)
    freqs = np.concatenate([fh, fw, fh, fw], axis=-1)
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


def encoder_inputs(spec: VisionSpec, image: ImageInput) -> dict[str, np.ndarray]:
    """Every input of the vision graph for one image."""
    idx, wts = position_interpolation(spec, image.grid)
    cos, sin = rotary_cos_sin(spec, image.grid)
    return {"pixel_values": image.patches, "pos_indices": idx, "pos_weights": wts, "rope_cos": cos, "rope_sin": sin}


# ---- the decoder's M-RoPE positions ------------------------------------------------------------------
def rope_positions(
    ids: list[int] | np.ndarray, grids: list[tuple[int, int, int]], spec: VisionSpec
) -> tuple[np.ndarray, int]:
    """3-row (T, H, W) positions int64 [3, len(ids)] of a prompt whose image spans are runs of the image
    token, one run per grid (in order), and the rope delta every later token adds to its cache position
    (transformers' Qwen3_5Model.get_rope_index)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    is_img = (ids == spec.image_token_id) | (ids == spec.video_token_id)
    m = spec.spatial_merge_size
    out = np.zeros((3, ids.size), dtype=np.int64)
    pos, i, g = 0, 0, 0
    while i < ids.size:
        j = i
        while j < ids.size and is_img[j] == is_img[i]:
            j += 1
        if not is_img[i]:
            out[:, i:j] = pos + np.arange(j - i)
            pos += j - i
        else:
            k = i
            while k < j:  # consecutive images without a separator: one grid after the other
                if g >= len(grids):
                    raise DeltashipError(
                        f"the prompt has more image placeholder tokens than the {len(grids)} image(s) fill",
                        "give one --image per <|image_pad|> span of the prompt",
                    )
                t, h, w = grids[g]
                n = t * h * w // m**2
                if k + n > j:
                    raise DeltashipError(
                        f"image {g + 1}'s placeholder span has {j - k} token(s), its grid needs {n}",
                        "let deltaship expand the image placeholders (one <|image_pad|> per image)",
                    )
                tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h // m), np.arange(w // m), indexing="ij")
                out[0, k : k + n] = tt.reshape(-1) + pos
                out[1, k : k + n] = hh.reshape(-1) + pos
                out[2, k : k + n] = ww.reshape(-1) + pos
                pos += max(h, w) // m
                k += n
                g += 1
        i = j
    if g != len(grids):
        raise DeltashipError(
            f"the prompt has placeholders for {g} image(s) but {len(grids)} were given",
            "give one --image per <|image_pad|> span of the prompt",
        )
    delta = int(out.max()) + 1 - ids.size if ids.size else 0
    return out, delta


def interleave_mask(mrope_section: tuple[int, ...], half: int) -> np.ndarray:
    """float32 [3, half] one-hot: which of the T/H/W position rows drives each rotary frequency
    (interleaved M-RoPE: frequency 1, 4, 7, .. from H, 2, 5, 8, .. from W, as far as each section reaches)."""
    if len(mrope_section) != 3 or sum(mrope_section) != half:
        raise DeltashipError(
            f"rope_parameters.mrope_section {list(mrope_section)} must be 3 numbers summing to {half} (rotary_dim / 2)",
            "fix mrope_section in config.json",
        )
    row = np.zeros(half, dtype=np.int64)
    for dim, offset in ((1, 1), (2, 2)):
        row[offset : mrope_section[dim] * 3 : 3] = dim
    mask = np.zeros((3, half), dtype=np.float32)
    mask[row, np.arange(half)] = 1
    return mask
