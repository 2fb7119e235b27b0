"""Still images on the host (PIL / NumPy, as transformers' Qwen2VLImageProcessorPil): the checkpoint's
preprocessor_config.json, the smart resize and the patch rows in merge-block order."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from deltaship.errors import DeltashipError
from deltaship.models.vision.spec import VisionSpec

PREPROCESSOR_CONFIG = "preprocessor_config.json"
# Qwen3.5's published preprocessor_config.json (Qwen2VLImageProcessor): what a checkpoint without one gets
DEFAULT_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}


@dataclass(frozen=True)
class Preprocessor:
    """The checkpoint's preprocessor_config.json, as far as images and video frames need it."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float
    min_pixels: int
    max_pixels: int

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_config(cls, cfg: dict[str, Any], where: str = PREPROCESSOR_CONFIG) -> "Preprocessor":
        size = cfg.get("size") or {}
        min_px = cfg.get("min_pixels", size.get("shortest_edge"))
        max_px = cfg.get("max_pixels", size.get("longest_edge"))
        for key, val in (("min_pixels (size.shortest_edge)", min_px), ("max_pixels (size.longest_edge)", max_px)):
            if not isinstance(val, int) or val <= 0:
                raise DeltashipError(f"{where}: {key} must be a positive integer, got {val!r}", f"fix {where}")
        if not cfg.get("do_normalize", True) or not cfg.get("do_rescale", True):
            raise DeltashipError(
                f"{where}: do_rescale and do_normalize must be true (Qwen3.5 normalizes every image)", f"fix {where}"
            )
        return cls(
            patch_size=int(cfg.get("patch_size", 16)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
            merge_size=int(cfg.get("merge_size", 2)),
            image_mean=tuple(float(x) for x in cfg.get("image_mean", (0.5, 0.5, 0.5))),
            image_std=tuple(float(x) for x in cfg.get("image_std", (0.5, 0.5, 0.5))),
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
            min_pixels=min_px,
            max_pixels=max_px,
        )

    def check(self, spec: VisionSpec, where: str) -> None:
        mine = (self.patch_size, self.temporal_patch_size, self.merge_size)
        theirs = (spec.patch_size, spec.temporal_patch_size, spec.spatial_merge_size)
        if mine != theirs:
            raise DeltashipError(
                f"{where}: patch/temporal/merge sizes {mine} disagree with config.json's vision_config {theirs}",
                "use the preprocessor_config.json that came with the checkpoint",
            )

    def max_image_tokens(self) -> int:
        return self.max_pixels // self.factor**2

    def min_image_tokens(self) -> int:
        return max(1, math.ceil(self.min_pixels / self.factor**2))


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' qwen2_vl smart_resize: multiples of `factor`, pixels within [min, max], aspect kept."""
    if max(height, width) / min(height, width) > 200:
        raise DeltashipError(
            f"image of {width}x{height} pixels: aspect ratio {max(height, width) / min(height, width):.0f} is over 200",
            "crop the image to a less extreme aspect ratio",
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def load_image(path: str | Path):
    """An RGB PIL image, or a clear error for a missing, unreadable or empty file."""
    from PIL import Image, UnidentifiedImageError  # lazy: PIL

    p = Path(path)
    if not p.is_file():
        raise DeltashipError(f"--image {path}: no such file", "pass the path of a PNG, JPEG or other image file")
    try:
        with Image.open(p) as im:
            im.load()
            img = im.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DeltashipError(f"--image {path}: not a readable image ({e})", "pass a PNG, JPEG or WebP file") from None
    if img.width == 0 or img.height == 0:
        raise DeltashipError(f"--image {path}: the image has no pixels", "pass a non-empty image")
    return img


@dataclass
class ImageInput:
    """One preprocessed image: patch rows in merge-block order and its patch grid (t, h, w)."""

    patches: np.ndarray  # float32 [t*h*w, C*T*P*P]
    grid: tuple[int, int, int]
    resized: tuple[int, int]  # (height, width) in pixels
    original: tuple[int, int]
    video: bool = False  # frames of a video: its span is video tokens
    timestamps: list[float] | None = None  # a video's seconds per temporal patch (one span each in the prompt)

    def tokens(self, merge: int) -> int:
        t, h, w = self.grid
        return t * h * w // merge**2

    def groups(self) -> list["ImageInput"]:
        """One input per temporal patch group (the tower attends within each: transformers' cu_seqlens)."""
        t, h, w = self.grid
        n = h * w
        return [
            ImageInput(
                self.patches[g * n : (g + 1) * n],
                (1, h, w),
                self.resized,
                self.original,
                self.video,
                self.timestamps[g : g + 1] if self.timestamps else None,
            )
            for g in range(t)
        ]


def preprocess_image(image, pre: Preprocessor) -> ImageInput:
    """Resize (bicubic, PIL) to multiples of patch*merge within the pixel limits, rescale, normalize and
    patchify into 2x2 merge-block order; a still image is repeated over the temporal patch (grid t = 1)."""
    from PIL import Image  # lazy: PIL

    if not isinstance(image, Image.Image):
        image = Image.fromarray(np.asarray(image, dtype=np.uint8))
    image = image.convert("RGB")
    w0, h0 = image.size
    h, w = smart_resize(h0, w0, pre.factor, pre.min_pixels, pre.max_pixels)
    if (h, w) != (h0, w0):
        image = image.resize((w, h), resample=Image.Resampling.BICUBIC)
    arr = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) * np.float32(pre.rescale_factor)  # [C, H, W]
    mean = np.asarray(pre.image_mean, np.float32)[:, None, None]
    std = np.asarray(pre.image_std, np.float32)[:, None, None]
    arr = (arr - mean) / std
    patches, gh, gw = patchify(arr[None], pre)
    return ImageInput(patches, (1, gh, gw), (h, w), (h0, w0))


def patchify(frames: np.ndarray, pre: Preprocessor) -> tuple[np.ndarray, int, int]:
    """frames [F, C, H, W] (F = 1: a still image, repeated over the temporal patch) -> rows [t*h*w, C*T*P*P]."""
    p, m, tp = pre.patch_size, pre.merge_size, pre.temporal_patch_size
    if frames.shape[0] == 1:
        frames = np.repeat(frames, tp, axis=0)
    f, c, height, width = frames.shape
    gt, gh, gw = f // tp, height // p, width // p
    x = frames.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
    # (t, bh, bw, mh, mw, C, tp, ph, pw): merge blocks in raster order, 2x2 patches inside each block
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(gt * gh * gw, c * tp * p * p), dtype=np.float32), gh, gw
