"""Qwen3.5's vision tower: its spec, weights, the host-side image and video preprocessing and the grid tensors.

The tower (transformers' `Qwen3_5VisionModel`) turns patch rows [N, C*T*P*P] of one image into N/4 merged
features of the text hidden size. What depends on the image's patch grid is computed on the host, in NumPy,
and passed to the exported graph (rope.py). Nothing here imports torch (the runtime uses it).

    spec.py        VisionSpec from config.json's vision_config
    weights.py     the tower's tensor names and shapes, a lazy checked reader
    preprocess.py  still images: preprocessor_config.json, smart resize, patch rows
    video.py       clips: video_preprocessor_config.json, sampling, decoding, patch rows
    rope.py        position-table resampling, the tower's 2-D rotary, the decoder's M-RoPE positions
    config.py      a checkpoint's vision side for export: its spec, preprocessor configs and checks

The names below are the package's public face: `from deltaship.models.vision import X` works for each.
"""

from deltaship.models.vision.config import check_vision, preprocessor_config, vision_spec_of, write_preprocessor
from deltaship.models.vision.preprocess import (
    DEFAULT_PREPROCESSOR,
    PREPROCESSOR_CONFIG,
    ImageInput,
    Preprocessor,
    load_image,
    patchify,
    preprocess_image,
    smart_resize,
)
from deltaship.models.vision.rope import (
    encoder_inputs,
    interleave_mask,
    patch_coordinates,
    position_interpolation,
    rope_positions,
    rotary_cos_sin,
)
from deltaship.models.vision.spec import GELU_APPROXIMATION, VisionSpec
from deltaship.models.vision.video import (
    DEFAULT_VIDEO_PREPROCESSOR,
    VIDEO_PREPROCESSOR_CONFIG,
    VideoPreprocessor,
    frame_timestamps,
    load_video,
    preprocess_frames,
    sample_indices,
    video_smart_resize,
)
from deltaship.models.vision.weights import VisionWeights, vision_tensors

__all__ = [
    "DEFAULT_PREPROCESSOR",
    "DEFAULT_VIDEO_PREPROCESSOR",
    "GELU_APPROXIMATION",
    "PREPROCESSOR_CONFIG",
    "VIDEO_PREPROCESSOR_CONFIG",
    "ImageInput",
    "Preprocessor",
    "VideoPreprocessor",
    "VisionSpec",
    "VisionWeights",
    "check_vision",
    "encoder_inputs",
    "frame_timestamps",
    "interleave_mask",
    "load_image",
    "load_video",
    "patch_coordinates",
    "patchify",
    "position_interpolation",
    "preprocess_frames",
    "preprocess_image",
    "preprocessor_config",
    "rope_positions",
    "rotary_cos_sin",
    "sample_indices",
    "smart_resize",
    "video_smart_resize",
    "vision_spec_of",
    "vision_tensors",
    "write_preprocessor",
]
