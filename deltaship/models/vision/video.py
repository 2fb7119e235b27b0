"""Video clips on the host (as transformers' Qwen3VLVideoProcessor): the checkpoint's
video_preprocessor_config.json, frame sampling and timestamps, decoding (PIL for animated images, PyAV for
other containers) and the clip's patch rows."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from deltaship.errors import DeltashipError
from deltaship.models.vision.preprocess import ImageInput, Preprocessor, patchify

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
    from PIL import Image  # lazy: PIL

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
    patches, gh, gw = patchify((np.stack(arrs) - mean) / std, pre)
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
    from PIL import Image, UnidentifiedImageError  # lazy: PIL

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
        import av  # lazy: PyAV, the optional video extra
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
