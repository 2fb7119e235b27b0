"""`Lowered`: what a target's lowering returns (deltaship/lowering/<target>'s `lower()`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Lowered:
    """What a target's lowering wrote into the staging directory.

    files: the artifact files it wrote (relative paths); entry: the file a runtime opens first; states: the
    state contract as the artifact stores it (the manifest's `states`: each target's layouts, a narrower KV cache's
    dtype); rounded: the weights as the toolchain rounded them, dequantized, for verification's matched reference
    (None: the passes' quantization choices say how); details: target-specific facts for the manifest's `lowering`
    block; quantization: the scheme as the toolchain applied it (None: the passes' own choices are reported);
    state_in_place: past-state name -> execution providers on which its past and present may share one buffer;
    app_runtimes: entries of the manifest's `app_runtimes` that differ for this artifact from the target's (e.g.
    ONNX at opset 27, or a runtime that cannot run it, "unavailable: why"); speculative: --mtp's draft head and
    verify contract (the manifest's `speculative` block)."""

    files: list[str]
    entry: str
    states: list[dict[str, Any]]
    rounded: dict[str, Any] | None = None
    details: dict[str, Any] = field(default_factory=dict)
    quantization: dict[str, Any] | None = None
    state_in_place: dict[str, list[str]] = field(default_factory=dict)
    app_runtimes: dict[str, str] | None = None  # entries replacing the target's app_runtimes
    speculative: dict[str, Any] | None = None
