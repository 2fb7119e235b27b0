"""What the passes and a lowering read, frozen: `LoweringSettings` and its `KvCachePlan`.

The export's settings (deltaship.compile.settings.ExportSettings) are built once from the CLI or the Python
API; the orchestrator hands the lowering the part it reads, with the inputs computed before the passes (the
draft vocabulary's ids, the KV cache's calibrated scales). Nothing here is set after it is built, and nothing
here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from deltaship.models.spec import ModelSpec

QUANTIZED_KV = ("int8", "int4")  # KV dtypes stored with static per-channel scales (deltaship/lowering/kv_quant.py)
# how an int8/int4 cache's codes relate to the values (the manifest's states[].quantization.scheme)
STATIC_SCALES = "symmetric, static per-channel scales (per KV head and head_dim channel)"
ACTIVATION_KV = {"float32": "fp32", "float16": "fp16"}  # an activation dtype -> the KV dtype of the same width


@dataclass(frozen=True)
class KvCachePlan:
    """How the KV cache is stored. dtype: a deltaship.models.spec.KV_DTYPES name; narrower: narrower than the
    activations (the reference rounds keys and values as the cache stores them); scheme: an int8/int4 cache's
    scales, calibrated at export on the fp32 reference (deltaship/lowering/kv_quant.py; None: no scales)."""

    dtype: str
    narrower: bool
    scheme: str | None = None

    @classmethod
    def plan(cls, dtype: str, activation_dtype: str) -> KvCachePlan:
        """The plan for a cache of `dtype` under activations of `activation_dtype` ("float32" or "float16")."""
        own = ACTIVATION_KV[activation_dtype]
        narrower = dtype != own and (dtype in QUANTIZED_KV or own == "fp32")
        return cls(dtype, narrower, STATIC_SCALES if dtype in QUANTIZED_KV else None)

    @property
    def quantized(self) -> bool:
        """int8/int4: stored as integer codes with static scales."""
        return self.dtype in QUANTIZED_KV

    @property
    def bits(self) -> int:
        return {"fp32": 32, "fp16": 16, "int8": 8, "int4": 4}[self.dtype]


@dataclass(frozen=True)
class PassParams:
    """A target's fixed parameters of the passes (Target.pass_params): int8_block "channel" quantizes int8
    weights per output channel; scale_dtype the block scales' dtype (None: the activations'); block_must_divide
    shrinks a block until it divides the row."""

    int8_block: str | None = None
    scale_dtype: str | None = None
    block_must_divide: bool = False


@dataclass(frozen=True)
class LoweringSettings:
    """Everything the passes and the lowering read besides the weights. options: the target's typed options
    (a deltaship.targets TargetOptions); draft_ids: --mtp-draft-vocab N's token ids, ascending (None: the whole
    vocabulary); kv_scales: an int8/int4 cache's static scales, {attention layer: {"bits", "key", "value"}}."""

    spec: ModelSpec
    target: str
    precision: str
    max_context: int
    activation_dtype: str  # "float32" or "float16", as the target computes at this precision
    prefill_chunk: int
    kv: KvCachePlan
    options: Any
    params: PassParams = PassParams()
    block_size: int = 32
    deltanet_int8: bool = False
    verify: bool = True
    draft_ids: np.ndarray | None = field(default=None, compare=False)
    kv_scales: Mapping[int, Mapping[str, Any]] = field(default_factory=dict, compare=False)
