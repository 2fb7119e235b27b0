"""The parity tolerances: one table keyed by (target, precision), whose rows each target declares.

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


def table() -> dict[tuple[str, str], Tolerance]:
    """The one table, (target, precision) -> Tolerance, assembled from each target's rows
    (deltaship/targets/<target>.py `tolerances`, where the reasons for each row are written)."""
    from deltaship.targets import all_targets

    return {(t.name, precision): tol for t in all_targets() for precision, tol in t.tolerances.items()}


def tolerance(target: str, precision: str, kv_dtype: str | None = None) -> Tolerance:
    """The row for (target, precision); a bundle whose KV cache is narrower than its fp32 activations has its own
    row where the target states one, "fp32+kv-int8" (at lower precisions the weights' row, already looser,
    applies)."""
    from deltaship.targets import get_target

    rows = get_target(target).tolerances
    return rows.get(f"{precision}+kv-{kv_dtype}", rows[precision]) if kv_dtype else rows[precision]
