"""The one table of parity tolerances, keyed by (target, precision).

Used by export-time verification and by the parity tests. The reference is transformers' Qwen3.5
in fp32 with the weights exactly as the bundle stores them (fp16-rounded or quantized), so these
bounds cover the runtime's arithmetic (fp16 activations, int8 activation blocks in MatMulNBits),
not the rounding of the weights (that cost is reported as fidelity: KL and top-1 agreement).

max_rel_logit_diff: the largest |logit difference| divided by the standard deviation of that
reference logit row, over the last-position logits after prefill and each teacher-forced decode
step. Greedy agreement is tie-aware: a differing argmax only counts when the reference prefers
its own token by more than tie_margin (also in logit standard deviations).
fails_export: a verification outside these bounds fails the export (fp32); for lower precisions
the result is recorded in the manifest and reported.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    max_rel_logit_diff: float
    min_greedy_agreement: float
    tie_margin: float
    fails_export: bool


TOLERANCES: dict[tuple[str, str], Tolerance] = {
    ("onnx", "fp32"): Tolerance(1e-3, 1.0, 1e-3, True),
    ("onnx", "fp16"): Tolerance(0.15, 0.95, 0.05, False),
    # MatMulNBits at accuracy_level 4 quantizes activations to int8 blocks: that noise, not the
    # weights, is what these bounds cover (with --accuracy-level 0 the fp32 row applies).
    ("onnx", "int8"): Tolerance(2.0, 0.75, 0.1, False),
    ("onnx", "int4"): Tolerance(2.0, 0.75, 0.1, False),
    # ExecuTorch (XNNPACK): int8/int4 are torchao 8da8w / 8da4w, i.e. int8 dynamic activations.
    ("executorch", "fp32"): Tolerance(1e-3, 1.0, 1e-3, True),
    ("executorch", "fp16"): Tolerance(0.15, 0.95, 0.05, False),
    ("executorch", "int8"): Tolerance(2.0, 0.75, 0.1, False),
    ("executorch", "int4"): Tolerance(2.0, 0.75, 0.1, False),
    # Core ML (evaluated on Linux by interpreting the saved ML program): fp32 builds keep every state
    # as fp32 inputs/outputs and must be exact; fp16 compute covers the rest.
    ("coreml", "fp32"): Tolerance(1e-3, 1.0, 1e-3, True),
    ("coreml", "fp16"): Tolerance(0.3, 0.9, 0.1, False),
    ("coreml", "int8"): Tolerance(0.3, 0.9, 0.1, False),
    ("coreml", "int4"): Tolerance(0.3, 0.9, 0.1, False),
}


def tolerance(target: str, precision: str) -> Tolerance:
    return TOLERANCES[(target, precision)]
