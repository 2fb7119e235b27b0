"""The model-family registry: a checkpoint's `model_type` (or architecture) -> the module that knows it.

A family module (one file per Hugging Face `model_type`, like deltaship/models/qwen3_5.py) builds the
checkpoint's module tree on the meta device and provides the canonical stateful modules the export
passes swap in. Passes ask `ctx.family` for these names (INTERFACE); they never import a family. The
modules import torch, so they are imported only when asked for. Adding a family: docs/architecture.md.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from deltaship.errors import DeltashipError

# model_type -> family module
FAMILIES: dict[str, str] = {
    "qwen3_5": "deltaship.models.qwen3_5",  # Qwen3_5ForConditionalGeneration (decoder under text_config)
    "qwen3_5_text": "deltaship.models.qwen3_5",  # Qwen3_5ForCausalLM
}
# architecture -> model_type (a spec keeps the architecture)
ARCHITECTURES: dict[str, str] = {
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
}
# What the export passes and the reference ask a family module for.
INTERFACE = (
    "build_source_model",
    "checkpoint_name",
    "rotary_inv_freq",
    "rotary_attention_factor",
    "hf_config",
    "fold_zero_centred_norm",
    "decay_scale_from_a_log",
    "squeeze_conv_weight",
    "SourceModule",
    "ZeroCentredRMSNorm",
    "RMSNorm",
    "Projections",
    "SourceGatedDeltaNet",
    "StatefulGatedDeltaNet",
    "SourceAttention",
    "StaticCacheAttention",
)


def model_types() -> tuple[str, ...]:
    return tuple(FAMILIES)


def family(model_type: str) -> ModuleType:
    """The family module of a checkpoint's model_type."""
    if model_type not in FAMILIES:
        raise DeltashipError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}",
            "point --model at a Qwen3.5 checkpoint directory or use a preset such as qwen3.5-tiny",
        )
    return importlib.import_module(FAMILIES[model_type])


def family_of_architecture(architecture: str) -> ModuleType:
    """The family module of a spec's architecture (`ModelSpec.architecture`)."""
    if architecture not in ARCHITECTURES:
        raise DeltashipError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(ARCHITECTURES)}",
            "export a Qwen3.5 checkpoint or a preset",
        )
    return family(ARCHITECTURES[architecture])
