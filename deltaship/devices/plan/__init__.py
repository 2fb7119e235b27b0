"""`deltaship plan`: will a model fit a tier, and at which (target, precision, KV dtype, context)?

Memory = weights (as each target stores them) + state at the context (context x KV-cache bytes per
token at the KV dtype + the fixed DeltaNet states) + runtime overhead (the runtime itself and the
activations of one prefill chunk). Computed from the ModelSpec alone, so it works for models too big
for this machine. `context="max"` searches, per row, the longest context that fits.

    memory.py   the arithmetic: each part's bytes, a row's estimate, an export's own peak, a bundle's plan
    search.py   the longest context, the prefill chunks, the tier's pick, plan() and choose_for_tier()
    text.py     verdict lines, the table, the vision tower's table
    vision.py   the vision tower's weights and activation peak per image size
"""

from deltaship.devices.plan.memory import (
    EXPORT_BASE_BYTES,
    FREE_CHUNK,
    KV_ORDER,
    MemoryTerms,
    PlanRow,
    activation_bytes,
    attention_scores_bytes,
    default_kv_dtype,
    estimate,
    export_peak_bytes,
    exportable_kv_dtypes,
    kv_bytes_per_token,
    kv_dtypes_for,
    memory_terms,
    overhead_bytes,
    planned_peak,
    state_bytes,
    weight_bytes,
)
from deltaship.devices.plan.search import (
    choose_for_tier,
    chunks,
    fits_at_chunk,
    longest_context,
    parse_context,
    plan,
    recommend,
)
from deltaship.devices.plan.text import format_table, format_vision, verdicts
from deltaship.devices.plan.vision import vision_plan

__all__ = [
    "EXPORT_BASE_BYTES",
    "FREE_CHUNK",
    "KV_ORDER",
    "MemoryTerms",
    "PlanRow",
    "activation_bytes",
    "attention_scores_bytes",
    "choose_for_tier",
    "chunks",
    "default_kv_dtype",
    "estimate",
    "export_peak_bytes",
    "exportable_kv_dtypes",
    "fits_at_chunk",
    "format_table",
    "format_vision",
    "kv_bytes_per_token",
    "kv_dtypes_for",
    "longest_context",
    "memory_terms",
    "overhead_bytes",
    "parse_context",
    "plan",
    "planned_peak",
    "recommend",
    "state_bytes",
    "verdicts",
    "vision_plan",
    "weight_bytes",
]
