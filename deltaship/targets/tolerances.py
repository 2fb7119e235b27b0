"""The parity tolerances: one table keyed by (target, precision), whose rows each target declares
(`deltaship.targets.table()` / `tolerance()` assemble it from the registry).

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

The fp32 rows are a bar against a reference that itself computes in fp32, and on some checkpoints (large
activations: large-init or badly conditioned weights) fp32 rounding alone moves the reference's logits by
more than the row allows. When an fp32 check fails, verification measures what fp32 can reach there (the
same reference in float64 against float32, on the same tokens) and applies `fp32_bar`: the larger of the
row and FP32_REACH_FACTOR times that error.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    max_rel_logit_diff: float
    min_greedy_agreement: float
    tie_margin: float
    fails_export: bool


# Why 4: the bundle and the reference round independently, so two equally accurate fp32 computations can be
# twice one's own error apart; the runtime also orders its arithmetic differently (fused kernels, other
# reduction trees), another factor of up to 2. A real lowering bug (a wrong weight, a wrong op) is off by
# orders of magnitude more than fp32 rounding (tests/test_trust_weights.py keeps a perturbed bundle failing).
FP32_REACH_FACTOR = 4.0


@dataclass(frozen=True)
class Bar:
    """The max_rel_logit_diff bar a verification applied: the table's, or the one fp32 can reach on this
    checkpoint (reach: the float32 reference's relative logit error against float64, when it was measured)."""

    value: float
    table: float
    reach: float | None = None
    factor: float = FP32_REACH_FACTOR

    @property
    def which(self) -> str:
        return "fp32-reachable" if self.value > self.table else "table"

    def describe(self) -> str:
        if self.reach is None:
            return f"the table's bar {self.table:.3g}"
        return (
            f"the {self.which} bar {self.value:.3g} (table {self.table:.3g}; fp32-reachable {self.factor:g} x "
            f"{self.reach:.3g}, the float32 reference's own difference from float64)"
        )

    def as_dict(self) -> dict:
        return {
            "value": self.value,
            "which": self.which,
            "table": self.table,
            "fp32_reach": self.reach,
            "factor": self.factor,
        }


def fp32_bar(table_value: float, reach: float | None) -> Bar:
    """max(the table's bar, FP32_REACH_FACTOR x the reference's float32-vs-float64 error)."""
    if reach is None or not reach == reach:  # unmeasured, or NaN
        return Bar(table_value, table_value, None)
    return Bar(max(table_value, FP32_REACH_FACTOR * reach), table_value, reach)
