"""A checkpoint's vision side as export needs it: the vision spec of a checkpoint or preset, its preprocessor
configs (read, or Qwen3.5's published ones), their copy into a bundle, and the checks of `export --vision`
that depend on the checkpoint alone (the target's precisions are the caller's to check)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from deltaship.errors import DeltashipError
from deltaship.files import read_json_object
from deltaship.models.presets import get_preset
from deltaship.models.spec import ModelSpec, read_config
from deltaship.models.vision.preprocess import DEFAULT_PREPROCESSOR, PREPROCESSOR_CONFIG, Preprocessor
from deltaship.models.vision.rope import interleave_mask
from deltaship.models.vision.spec import VisionSpec
from deltaship.models.vision.video import DEFAULT_VIDEO_PREPROCESSOR, VIDEO_PREPROCESSOR_CONFIG, VideoPreprocessor


def preprocessor_config(source, name: str = PREPROCESSOR_CONFIG) -> dict[str, Any]:
    """The checkpoint's preprocessor_config.json (or video_preprocessor_config.json), or Qwen3.5's published
    one when it has none."""
    path = source.path / name if source.path is not None else None
    if path is not None and path.is_file():
        return read_json_object(path, "image preprocessor config", "restore it from the original checkpoint")
    return dict(DEFAULT_PREPROCESSOR if name == PREPROCESSOR_CONFIG else DEFAULT_VIDEO_PREPROCESSOR)


def write_preprocessor(bundle: Path, source, cfg: dict[str, Any]) -> None:
    """Copy the checkpoint's preprocessor_config.json and video_preprocessor_config.json into the bundle (or
    write the default ones)."""
    for name, default in ((PREPROCESSOR_CONFIG, cfg), (VIDEO_PREPROCESSOR_CONFIG, None)):
        if source.path is not None and (source.path / name).is_file():
            shutil.copy(source.path / name, bundle / name)
        else:
            (bundle / name).write_text(json.dumps(default or preprocessor_config(source, name), indent=2))


def vision_spec_of(source) -> VisionSpec | None:
    """The source's vision tower: a checkpoint's config.json vision_config, or a published-shape preset's
    (random weights); None for a text-only model."""
    if source.path is None:
        mm = get_preset(source.name).multimodal_config()
        return VisionSpec.from_config(mm, where=f"preset {source.name}") if mm is not None else None
    return VisionSpec.from_config(read_config(source.path / "config.json"), str(source.path / "config.json"))


def check_vision(
    source,
    spec: ModelSpec,
    *,
    target: str | None = None,
    precision: str = "",
    vision_precisions: tuple[str, ...] = (),
) -> tuple[VisionSpec, Preprocessor, dict[str, Any], tuple[int, ...]]:
    """What `export --vision` needs from the checkpoint, each problem named: the vision spec, the
    preprocessor (and its config) and the M-RoPE sections. Given a `target`, also that it exports a vision
    tower at `precision` (one of its `vision_precisions`): the orchestrator asks that before any work; the
    lowerings, which run after it, call this for the values only."""
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
    if vspec.out_hidden_size != spec.hidden_size:
        raise DeltashipError(
            f"vision_config.out_hidden_size {vspec.out_hidden_size} != text hidden_size {spec.hidden_size}",
            "fix config.json",
        )
    can = vision_precisions
    if target is not None and precision not in can:
        raise DeltashipError(
            f"--vision on {target} is exported at {' or '.join(can)} only so far (asked: --precision "
            f"{precision}; other vision bundles are not verified against a reference with the same rounding yet)",
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
