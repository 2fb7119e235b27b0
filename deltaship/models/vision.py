"""Qwen3.5's vision tower: its spec, weights, the host-side image preprocessing and the grid tensors.

The tower (transformers' `Qwen3_5VisionModel`) turns patch rows [N, C*T*P*P] of one image into N/4 merged
features of the text hidden size. What depends on the image's patch grid is computed here on the host,
in NumPy, and passed to the exported graph: the learned position table's bilinear resampling (indices and
weights, 4 taps per patch), the 2-D rotary cos/sin, and the decoder's 3-row M-RoPE positions for a prompt
with image spans. Nothing here imports torch (the runtime uses it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from deltaship.errors import DeltashipError

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
VIDEO_PREPROCESSOR_CONFIG = "video_preprocessor_config.json"
# Qwen3-VL's published video_preprocessor_config.json (Qwen3VLVideoProcessor; Qwen3.5 uses the same processor):
# pixel limits over all frames of a clip (t * h * w), frames sampled at `fps`, between min_frames and max_frames
DEFAULT_VIDEO_PREPROCESSOR = {
    "video_processor_type": "Qwen3VLVideoProcessor",
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 4096, "longest_edge": 25165824},
    "fps": 2,
    "min_frames": 4,
    "max_frames": 768,
}


@dataclass(frozen=True)
class VisionSpec:
    """Shapes of one Qwen3.5 vision tower and the prompt markers that go with it (config.json)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    hidden_act: str
    rope_theta: float
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Width of one patch row: C * T * P * P (1536 for 3 channels, 2 frames, 16 x 16 pixels)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def grid_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2

    def to_dict(self) -> dict[str, Any]:
        import dataclasses

        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: dict[str, Any], where: str = "config.json") -> "VisionSpec | None":
        """The vision tower of a multimodal qwen3_5 config; None for a text-only config."""
        vc = config.get("vision_config")
        if config.get("model_type") != "qwen3_5" or not isinstance(vc, dict):
            return None

        def get(src: dict, key: str, default: Any, kind: type = int) -> Any:
            val = src.get(key, default)
            if isinstance(val, (list, tuple)) and kind is int and len(set(val)) == 1:
                val = val[0]  # patch sizes may be written [16, 16]
            ok = isinstance(val, (int, float)) and not isinstance(val, bool) and val > 0
            if kind is int:
                ok = ok and isinstance(val, int)
            if not ok:
                raise DeltashipError(
                    f"{where}: vision_config.{key} must be a positive {kind.__name__}, got {val!r}",
                    "fix the value in config.json (or re-save the checkpoint with transformers)",
                )
            return val

        rope = vc.get("rope_parameters") or {}
        spec = cls(
            depth=get(vc, "depth", 27),
            hidden_size=get(vc, "hidden_size", 1152),
            intermediate_size=get(vc, "intermediate_size", 4304),
            num_heads=get(vc, "num_heads", 16),
            out_hidden_size=get(vc, "out_hidden_size", 3584),
            num_position_embeddings=get(vc, "num_position_embeddings", 2304),
            patch_size=get(vc, "patch_size", 16),
            temporal_patch_size=get(vc, "temporal_patch_size", 2),
            spatial_merge_size=get(vc, "spatial_merge_size", 2),
            in_channels=get(vc, "in_channels", 3),
            hidden_act=str(vc.get("hidden_act", "gelu_pytorch_tanh")),
            rope_theta=float(get(rope, "rope_theta", 10000.0, float)),
            image_token_id=get(config, "image_token_id", 248056),
            video_token_id=get(config, "video_token_id", 248057),
            vision_start_token_id=get(config, "vision_start_token_id", 248053),
            vision_end_token_id=get(config, "vision_end_token_id", 248054),
        )
        if spec.hidden_act not in GELU_APPROXIMATION:
            raise DeltashipError(
                f"{where}: vision_config.hidden_act {spec.hidden_act!r} is not supported; supported: "
                + ", ".join(GELU_APPROXIMATION),
                "this checkpoint is not a Qwen3.5 vision-language model",
            )
        if spec.grid_side**2 != spec.num_position_embeddings:
            raise DeltashipError(
                f"{where}: vision_config.num_position_embeddings {spec.num_position_embeddings} is not a square",
                "the position table is a square grid (e.g. 2304 = 48 x 48); fix config.json",
            )
        if spec.hidden_size % spec.num_heads or spec.head_dim % 4:
            raise DeltashipError(
                f"{where}: vision_config.hidden_size {spec.hidden_size} / num_heads {spec.num_heads} must be a "
                "whole head size divisible by 4 (2-D rotary over halves)",
                "fix hidden_size or num_heads in config.json",
            )
        return spec


# vision_config.hidden_act -> the ONNX Gelu approximation of the blocks' MLP
GELU_APPROXIMATION = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


def vision_tensors(spec: VisionSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of the tower, under its checkpoint name (`model.visual.` prefix), with its shape."""
    d, m, o = spec.hidden_size, spec.intermediate_size, spec.out_hidden_size
    t, p, c = spec.temporal_patch_size, spec.patch_size, spec.in_channels
    wide = d * spec.merge_unit
    v = "model.visual."
    out = {
        v + "patch_embed.proj.weight": (d, c, t, p, p),
        v + "patch_embed.proj.bias": (d,),
        v + "pos_embed.weight": (spec.num_position_embeddings, d),
        v + "merger.norm.weight": (d,),
        v + "merger.norm.bias": (d,),
        v + "merger.linear_fc1.weight": (wide, wide),
        v + "merger.linear_fc1.bias": (wide,),
        v + "merger.linear_fc2.weight": (o, wide),
        v + "merger.linear_fc2.bias": (o,),
    }
    for i in range(spec.depth):
        b = f"{v}blocks.{i}."
        out |= {
            b + "norm1.weight": (d,),
            b + "norm1.bias": (d,),
            b + "norm2.weight": (d,),
            b + "norm2.bias": (d,),
            b + "attn.qkv.weight": (3 * d, d),
            b + "attn.qkv.bias": (3 * d,),
            b + "attn.proj.weight": (d, d),
            b + "attn.proj.bias": (d,),
            b + "mlp.linear_fc1.weight": (m, d),
            b + "mlp.linear_fc1.bias": (m,),
            b + "mlp.linear_fc2.weight": (d, m),
            b + "mlp.linear_fc2.bias": (d,),
        }
    return out


class VisionWeights:
    """The tower's tensors in a checkpoint's safetensors files, read lazily (one tensor at a time), checked
    against the spec's shapes."""

    def __init__(self, files: dict, spec: VisionSpec, where: str):
        self.spec = spec
        self._where = {raw: sf for sf in files.values() for raw in sf.entries if raw.startswith("model.visual.")}
        expected = vision_tensors(spec)
        missing = sorted(set(expected) - set(self._where))
        wrong = [
            f"{n}: {list(self._where[n].shape(n))} (expected {list(s)})"
            for n, s in expected.items()
            if n in self._where and tuple(self._where[n].shape(n)) != s
        ]
        extra = sorted(set(self._where) - set(expected))
        if missing or wrong or extra:
            parts = [
                f"{len(x)} {what}: {', '.join(x[:6])}"
                for what, x in (("missing", missing), ("wrong", wrong), ("unexpected", extra))
                if x
            ]
            raise DeltashipError(
                f"{where}: the vision tower's weights do not match vision_config: " + "; ".join(parts),
                "use the config.json that came with these weights",
            )

    def read(self, name: str) -> np.ndarray:
        return self._where[name].read(name)


# ---- preprocessing (PIL / NumPy, as transformers' Qwen2VLImageProcessorPil) --------------------------
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
    from PIL import Image, UnidentifiedImageError

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
    from PIL import Image

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
    patches, gh, gw = _patchify(arr[None], pre)
    return ImageInput(patches, (1, gh, gw), (h, w), (h0, w0))


@dataclass(frozen=True)
class VideoPreprocessor:
    """The checkpoint's video_preprocessor_config.json (Qwen3VLVideoProcessor): the pixel limits over a whole
    clip (frames x height x width), the sampling rate and the frame-count limits."""

    min_pixels: int
    max_pixels: int
    fps: float
    min_frames: int
    max_frames: int

    @classmethod
    def from_config(cls, cfg: dict[str, Any], where: str = VIDEO_PREPROCESSOR_CONFIG) -> "VideoPreprocessor":
        size = cfg.get("size") or {}
        vals = {
            "min_pixels (size.shortest_edge)": cfg.get("min_pixels", size.get("shortest_edge")),
            "max_pixels (size.longest_edge)": cfg.get("max_pixels", size.get("longest_edge")),
            "min_frames": cfg.get("min_frames", 4),
            "max_frames": cfg.get("max_frames", 768),
        }
        for key, val in vals.items():
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise DeltashipError(f"{where}: {key} must be a positive integer, got {val!r}", f"fix {where}")
        fps = cfg.get("fps", 2)
        if not isinstance(fps, (int, float)) or isinstance(fps, bool) or fps <= 0:
            raise DeltashipError(f"{where}: fps must be a positive number, got {fps!r}", f"fix {where}")
        mn, mx, fmin, fmax = vals.values()
        return cls(min_pixels=mn, max_pixels=mx, fps=float(fps), min_frames=fmin, max_frames=fmax)


def video_smart_resize(
    frames: int, height: int, width: int, temporal: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """transformers' qwen3_vl video smart_resize: multiples of `factor` with the clip's pixels (frames rounded
    to the temporal patch x height x width) within [min, max], aspect kept."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise DeltashipError(
            f"video of {width}x{height} pixels: aspect ratio {max(height, width) / min(height, width):.0f} is over 200",
            "crop the video to a less extreme aspect ratio",
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def sample_indices(total: int, video_fps: float, fps: float, vpre: VideoPreprocessor) -> np.ndarray:
    """Which of a video's `total` frames (decoded at `video_fps`) to keep for `fps` frames per second:
    transformers' Qwen3VLVideoProcessor.sample_frames (evenly spaced, min_frames .. max_frames, at most all)."""
    n = int(total / video_fps * fps)
    n = min(max(n, vpre.min_frames), vpre.max_frames, total)
    return np.linspace(0, total - 1, n).round().astype(int)


def frame_timestamps(indices, video_fps: float, temporal: int) -> list[float]:
    """Seconds of each temporal patch: the mean of its first and last frame's time (the last frame repeated to
    fill the patch), as transformers' Qwen3VLProcessor writes them before each frame group."""
    idx = [int(i) for i in indices]
    while len(idx) % temporal:
        idx.append(idx[-1])
    secs = [i / video_fps for i in idx]
    return [(secs[i] + secs[i + temporal - 1]) / 2 for i in range(0, len(secs), temporal)]


def preprocess_frames(
    frames,
    pre: Preprocessor,
    vpre: VideoPreprocessor | None = None,
    timestamps: list[float] | None = None,
    max_frame_pixels: int | None = None,
) -> ImageInput:
    """Video frames (PIL images or HxWx3 uint8 arrays, in time order) as one input, as transformers'
    Qwen3VLVideoProcessor: every frame resized (bicubic) to the clip's smart size (pixel limits over the whole
    clip; `max_frame_pixels` caps one frame, a bundle's image limit), frames padded to a multiple of the
    temporal patch by repeating the last; grid t = frames / 2. timestamps: seconds of each temporal patch
    (default: frames taken at the preprocessor's fps)."""
    from PIL import Image

    if not len(frames):
        raise DeltashipError("--video has no frames", "pass frame image files (comma-separated) or a video file")
    vpre = vpre or VideoPreprocessor.from_config(DEFAULT_VIDEO_PREPROCESSOR)
    frames = [f if isinstance(f, Image.Image) else Image.fromarray(np.asarray(f, dtype=np.uint8)) for f in frames]
    first = frames[0].convert("RGB")
    w0, h0 = first.size
    tp = pre.temporal_patch_size
    max_px = vpre.max_pixels
    if max_frame_pixels is not None:
        max_px = min(max_px, max_frame_pixels * max(tp, round(len(frames) / tp) * tp))
    h, w = video_smart_resize(max(len(frames), tp), h0, w0, tp, pre.factor, vpre.min_pixels, max_px)
    arrs = []
    for f in frames:
        f = f.convert("RGB")
        if f.size != (w, h):
            f = f.resize((w, h), resample=Image.Resampling.BICUBIC)
        arrs.append(np.asarray(f, dtype=np.float32).transpose(2, 0, 1) * np.float32(pre.rescale_factor))
    n = len(arrs)
    while len(arrs) % tp:
        arrs.append(arrs[-1])
    mean = np.asarray(pre.image_mean, np.float32)[None, :, None, None]
    std = np.asarray(pre.image_std, np.float32)[None, :, None, None]
    patches, gh, gw = _patchify((np.stack(arrs) - mean) / std, pre)
    gt = len(arrs) // tp
    if timestamps is None:
        timestamps = frame_timestamps(range(n), vpre.fps, tp)
    if len(timestamps) != gt:
        raise ValueError(f"{len(timestamps)} timestamps for {gt} temporal patches")
    return ImageInput(patches, (gt, gh, gw), (h, w), (h0, w0), video=True, timestamps=list(timestamps))


def load_video(path: str | Path, fps: float, vpre: VideoPreprocessor) -> tuple[list, list[float]]:
    """Frames of a video file sampled at `fps` frames per second (transformers' rule: evenly spaced over the
    whole clip, min_frames .. max_frames) and the seconds of each temporal patch. Animated GIF/WebP/PNG through
    PIL; other containers (MP4, WebM, MKV, ...) through PyAV (the `video` extra). Only the sampled frames are
    kept in memory (a first pass counts the frames when the container does not say)."""
    from PIL import Image, UnidentifiedImageError

    p = Path(path)
    if not p.is_file():
        raise DeltashipError(f"--video {path}: no such file", "pass a video file or comma-separated frame images")
    if not (isinstance(fps, (int, float)) and fps > 0):
        raise DeltashipError(f"--fps {fps!r} must be a positive number", "e.g. --fps 2")
    try:
        with Image.open(p) as im:
            total = getattr(im, "n_frames", 1)
            if total > 1:  # an animated image: frame delays in milliseconds
                durations = []
                for i in range(total):
                    im.seek(i)
                    durations.append(float(im.info.get("duration") or 100))
                video_fps = 1000.0 / (sum(durations) / total)
                idx = sample_indices(total, video_fps, fps, vpre)
                frames = []
                for i in idx:
                    im.seek(int(i))
                    frames.append(im.convert("RGB"))
                return frames, frame_timestamps(idx, video_fps, 2)
    except (UnidentifiedImageError, OSError, ValueError):
        pass
    return _decode_av(p, fps, vpre)


def _decode_av(p: Path, fps: float, vpre: VideoPreprocessor) -> tuple[list, list[float]]:
    try:
        import av
    except ImportError:
        raise DeltashipError(
            f"--video {p}: decoding video files needs PyAV, which is not installed",
            "pip install 'deltaship[video]' (or pass an animated GIF, or the frames as comma-separated image files)",
        ) from None
    try:
        with av.open(str(p)) as container:
            if not container.streams.video:
                raise DeltashipError(f"--video {p}: the file has no video stream", "pass a video file")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
            video_fps = float(rate) if rate else 24.0
            total = int(stream.frames or 0)
            if total <= 0:  # the container does not say: count them
                total = sum(1 for _ in container.decode(stream))
                container.seek(0)
            if total <= 0:
                raise DeltashipError(f"--video {p}: no frames could be decoded", "pass a non-empty video file")
            idx = sample_indices(total, video_fps, fps, vpre)
            want, frames, last = {int(i) for i in idx}, {}, None
            for i, frame in enumerate(container.decode(stream)):
                if i in want:
                    frames[i] = last = frame.to_image()
                if i >= idx[-1]:
                    break
    except av.error.FFmpegError as e:
        raise DeltashipError(f"--video {p}: not a readable video ({e})", "pass an MP4, WebM, MKV or GIF file") from None
    # a container may state more frames than it decodes: the missing tail repeats the last frame decoded
    return [frames.get(int(i), last) for i in idx], frame_timestamps(idx, video_fps, 2)


def _patchify(frames: np.ndarray, pre: Preprocessor) -> tuple[np.ndarray, int, int]:
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


# ---- export-time checks shared by the targets --------------------------------------------------------------
def preprocessor_config(source, name: str = PREPROCESSOR_CONFIG) -> dict[str, Any]:
    """The checkpoint's preprocessor_config.json (or video_preprocessor_config.json), or Qwen3.5's published
    one when it has none."""
    import json

    path = source.path / name if source.path is not None else None
    if path is not None and path.is_file():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise DeltashipError(f"{path}: not valid JSON ({e})", "restore it from the original checkpoint") from None
    return dict(DEFAULT_PREPROCESSOR if name == PREPROCESSOR_CONFIG else DEFAULT_VIDEO_PREPROCESSOR)


def write_preprocessor(bundle: Path, source, cfg: dict[str, Any]) -> None:
    """Copy the checkpoint's preprocessor_config.json and video_preprocessor_config.json into the bundle (or
    write the default ones)."""
    import json
    import shutil

    for name, default in ((PREPROCESSOR_CONFIG, cfg), (VIDEO_PREPROCESSOR_CONFIG, None)):
        if source.path is not None and (source.path / name).is_file():
            shutil.copy(source.path / name, bundle / name)
        else:
            (bundle / name).write_text(json.dumps(default or preprocessor_config(source, name), indent=2))


def vision_spec_of(source) -> VisionSpec | None:
    """The source's vision tower: a checkpoint's config.json vision_config, or a published-shape preset's
    (random weights); None for a text-only model."""
    from deltaship.models.presets import get_preset
    from deltaship.models.spec import read_config

    if source.path is None:
        mm = get_preset(source.name).multimodal_config()
        return VisionSpec.from_config(mm, where=f"preset {source.name}") if mm is not None else None
    return VisionSpec.from_config(read_config(source.path / "config.json"), str(source.path / "config.json"))


def check_vision(source, ctx) -> tuple[VisionSpec, Preprocessor, dict[str, Any], tuple[int, ...]]:
    """What `export --vision` needs from the checkpoint, each problem named: the vision spec, the
    preprocessor (and its config) and the M-RoPE sections."""
    if source.path is None and vision_spec_of(source) is None:
        raise DeltashipError(
            f"--vision: {source.name} is a preset with no vision tower",
            "export a Qwen3.5 vision-language checkpoint directory (Qwen3_5ForConditionalGeneration), or a "
            "published-shape preset (qwen3.5-0.8b, -2b, -4b, -9b), with --vision",
        )
    vspec = vision_spec_of(source)
    if vspec is None:
        raise DeltashipError(
            f"--vision: {source.path} is a text-only checkpoint (no vision_config)",
            "drop --vision, or export a Qwen3.5 vision-language checkpoint",
        )
    spec = ctx.spec
    if vspec.out_hidden_size != spec.hidden_size:
        raise DeltashipError(
            f"vision_config.out_hidden_size {vspec.out_hidden_size} != text hidden_size {spec.hidden_size}",
            "fix config.json",
        )
    from deltaship.targets import get_target

    can = get_target(ctx.target).vision_precisions
    if ctx.precision not in can:
        raise DeltashipError(
            f"--vision on {ctx.target} is exported at {' or '.join(can)} only so far (asked: --precision "
            f"{ctx.precision}; other vision bundles are not verified against a reference with the same rounding yet)",
            f"export with --precision {' or '.join(can)}, or drop --vision",
        )
    mrope = tuple(spec.mrope_section or (11, 11, 10))
    interleave_mask(mrope, spec.rotary_dim // 2)  # a section that does not fit the rotary is refused first
    cfg = preprocessor_config(source)
    pre = Preprocessor.from_config(cfg)
    pre.check(vspec, PREPROCESSOR_CONFIG)
    vcfg = preprocessor_config(source, VIDEO_PREPROCESSOR_CONFIG)
    VideoPreprocessor.from_config(vcfg)
    vsizes = tuple(vcfg.get(k, d) for k, d in (("patch_size", 16), ("temporal_patch_size", 2), ("merge_size", 2)))
    if vsizes != (pre.patch_size, pre.temporal_patch_size, pre.merge_size):
        raise DeltashipError(
            f"{VIDEO_PREPROCESSOR_CONFIG}: patch/temporal/merge sizes {vsizes} disagree with {PREPROCESSOR_CONFIG}'s",
            "use the video_preprocessor_config.json that came with the checkpoint",
        )
    return vspec, pre, cfg, mrope
