"""The vision tower's shapes and prompt markers, read from config.json's vision_config."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from deltaship.errors import DeltashipError


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
