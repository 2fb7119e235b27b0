"""The one table of parity tolerances, keyed by (target, precision).

Used by export-time verification and by the parity tests. Logit differences are absolute, on
the last-position logits after prefill and after each teacher-forced decode step, against
transformers' fp32 Qwen3.5. Greedy agreement is "tie-aware": a differing argmax only counts
as a disagreement when the reference prefers its own token by more than `tie_margin`.
`fails_export`: a verification outside these bounds fails the export (fp32 only: lower
precisions are recorded and reported, never silently passed).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    max_abs_logit_diff: float
    min_greedy_agreement: float
    tie_margin: float
    fails_export: bool


TOLERANCES: dict[tuple[str, str], Tolerance] = {
    ("onnx", "fp32"): Tolerance(1e-3, 1.0, 1e-3, True),
    ("onnx", "fp16"): Tolerance(5e-2, 0.95, 5e-2, False),
    ("onnx", "int8"): Tolerance(0.25, 0.9, 0.1, False),
    ("onnx", "int4"): Tolerance(1.5, 0.6, 0.3, False),
    ("executorch", "fp32"): Tolerance(1e-3, 1.0, 1e-3, True),
    ("executorch", "fp16"): Tolerance(5e-2, 0.95, 5e-2, False),
    ("executorch", "int8"): Tolerance(0.25, 0.9, 0.1, False),
    ("executorch", "int4"): Tolerance(1.5, 0.6, 0.3, False),
    ("coreml", "fp32"): Tolerance(1e-3, 1.0, 1e-3, True),
    ("coreml", "fp16"): Tolerance(0.1, 0.9, 0.1, False),
    ("coreml", "int8"): Tolerance(0.25, 0.9, 0.1, False),
    ("coreml", "int4"): Tolerance(1.5, 0.6, 0.3, False),
}


def tolerance(target: str, precision: str) -> Tolerance:
    return TOLERANCES[(target, precision)]
