"""`deltaship plan`: will a model fit a tier, and at which (target, precision, KV dtype, context)?

Memory = weights (as each target stores them) + state at the context (context x KV-cache bytes per
token at the KV dtype + the fixed DeltaNet states) + runtime overhead (the runtime itself and the
activations of one prefill chunk). Computed from the ModelSpec alone, so it works for models too big
for this machine. `context="max"` searches, per row, the longest context that fits.
"""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

from deltaship.devices.catalog import GIB, Tier, load_catalog
from deltaship.errors import DeltashipError
from deltaship.models.spec import KV_DTYPES, ModelSpec
from deltaship.targets import PRECISIONS, get_target

KV_ORDER = tuple(KV_DTYPES)  # widest first: fp32, fp16, int8, int4


@dataclass
class PlanRow:
    tier: str
    target: str
    precision: str
    context: int
    weights_bytes: int
    state_bytes: int  # kv_bytes + deltanet_bytes
    overhead_bytes: int  # activation_bytes + runtime_bytes
    total_bytes: int
    budget_bytes: int
    fits: bool
    recommended: bool = False
    kv_dtype: str = ""
    kv_exportable: bool = True  # the target exports this KV dtype (Target.kv_cache_dtypes); else planned
    kv_bytes: int = 0
    deltanet_bytes: int = 0
    activation_bytes: int = 0
    runtime_bytes: int = 0
    capped: bool = False  # the context stopped at the model's max_position_embeddings, not at the budget
    attention_scores_bytes: int = 0  # part of activation_bytes: heads x prefill chunk x context
    kv_scratch_bytes: int = 0  # part of activation_bytes: the attention kernel's scratch (fp16 KV on ORT)
    longest: bool = False  # context is the longest that fits (plan(context="max"))
    fits_at_chunk: int = 0  # when it does not fit: the largest prefill chunk (power of two) at which it would
    prefill_chunk: int = 0  # tokens per prefill call the row was planned at (the target's default unless chosen)
    weights_loaded_bytes: int = 0  # weights as resident once the runtime has loaded them (measured factor)
    terms: str = ""  # where the runtime and activation terms come from (memory_terms.toml, or an estimate)


MEMORY_TERMS = Path(__file__).with_name("memory_terms.toml")


@dataclass(frozen=True)
class MemoryTerms:
    """A (target, precision)'s measured memory terms: the process before any weight (the interpreter, the runtime's
    library, the session), resident bytes per stored weight byte once loaded (prepacked copies, originals kept), the
    peak while loading per stored byte (originals and packed copies at once), and the measured growth of one prefill
    chunk relative to activation_bytes()."""

    runtime_bytes: int
    weights_factor: float
    activation_factor: float
    source: str
    load_factor: float = 1.0
    measured: bool = False


@cache
def _terms_table() -> dict:
    try:
        with open(MEMORY_TERMS, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:  # a source tree before the first measurement: every term an estimate
        return {}


def memory_terms(target: str, precision: str) -> MemoryTerms:
    """Measured terms for (target, precision) from memory_terms.toml; the target's estimate where none was measured."""
    table = _terms_table()
    row = table.get(target, {}).get(precision)
    if row is None:
        return MemoryTerms(get_target(target).runtime_base_bytes, 1.0, 1.0, "estimate (not measured)")
    machine = table.get("machine", {})
    return MemoryTerms(
        int(row["runtime_bytes"]),
        float(row["weights_factor"]),
        float(row["activation_factor"]),
        f"measured {machine.get('date', '?')} on {machine.get('name', '?')} ({row.get('from', '')})",
        float(row.get("load_factor", row["weights_factor"])),
        True,
    )


def weight_bytes(spec: ModelSpec, target: str, precision: str) -> int:
    f = get_target(target).storage_format(precision)
    p = spec.parameter_count()
    per = f.bits / 8 + (f.scale / f.block if f.block > 1 else 0)
    matrices = p["embedding"] + p["lm_head"] + p["body"]
    if spec.tie_word_embeddings and f.head_copy:
        matrices += p["embedding"]
    return int(matrices * per)


def default_kv_dtype(target: str, precision: str) -> str:
    """The KV dtype the target's bundles use today: its activation dtype at that precision."""
    act = get_target(target).storage_format(precision).act
    by_bytes = {f.bits // 8: name for name, f in KV_DTYPES.items() if f.bits >= 8 and not f.token_head_bytes}
    by_bytes.setdefault(1, "int8")
    if act not in by_bytes:
        raise DeltashipError(
            f"target {target} stores {act}-byte activations at {precision}; the planner knows KV "
            f"caches of {sorted(by_bytes)} bytes an element",
            "fix the target's storage format",
        )
    return by_bytes[act]


def kv_dtypes_for(target: str, precision: str) -> tuple[str, ...]:
    """The target's own KV dtype, then the narrower ones a quantized cache could use."""
    return KV_ORDER[KV_ORDER.index(default_kv_dtype(target, precision)) :]


def exportable_kv_dtypes(target: str, precision: str) -> tuple[str, ...]:
    """The KV dtypes the target's bundles store at `precision` (its own first), as `export --kv-cache` takes them."""
    return get_target(target).kv_cache_dtypes(precision, {})


def kv_bytes_per_token(spec: ModelSpec, target: str, precision: str, kv_dtype: str) -> int:
    """A context token's KV bytes as the target stores it: the exported int8/int4 caches keep static scales in
    the graph (no bytes per token); a planned one is counted with a per-token-per-head scale."""
    return spec.kv_bytes_per_token(kv_dtype, static_scales=kv_dtype in exportable_kv_dtypes(target, precision))


def state_bytes(spec: ModelSpec, target: str, precision: str, context: int, kv_dtype: str | None = None) -> int:
    """Per-sequence state: the fixed DeltaNet states plus context x the KV cache's bytes per token."""
    act = get_target(target).storage_format(precision).act
    return spec.deltanet_state_bytes(act) + context * kv_bytes_per_token(
        spec, target, precision, kv_dtype or default_kv_dtype(target, precision)
    )


def attention_scores_bytes(
    spec: ModelSpec, target: str, precision: str, context: int, prefill_chunk: int | None = None
) -> int:
    """The attention scores of one prefill chunk over the whole static cache (heads x chunk x context), as a
    kernel that materialises them (ORT's CPU GroupQueryAttention does; tiled flash kernels would not)."""
    tgt = get_target(target)
    t = min(prefill_chunk or tgt.default_prefill_chunk, context)
    return tgt.storage_format(precision).act * spec.num_attention_heads * t * context


def activation_bytes(
    spec: ModelSpec,
    target: str,
    precision: str,
    context: int,
    prefill_chunk: int | None = None,
    all_layers: bool = False,
) -> int:
    """One prefill chunk's activations: MLP, projections, the attention scores and one row of logits. all_layers:
    the MLP and projections of every layer, the shape a measured prefill's growth follows across model sizes
    (docs/results/memory.md), which a measured activation_factor (memory_terms) scales to what the runtime holds."""
    tgt = get_target(target)
    act = tgt.storage_format(precision).act
    t = min(prefill_chunk or tgt.default_prefill_chunk, context)
    per_token = (spec.num_layers if all_layers else 1) * (
        2 * spec.intermediate_size + 2 * spec.conv_dim + 6 * spec.hidden_size
    )
    return (
        act * t * per_token
        + attention_scores_bytes(spec, target, precision, context, prefill_chunk)
        + 4 * spec.vocab_size
    )


def overhead_bytes(spec: ModelSpec, target: str, precision: str, context: int, prefill_chunk: int | None = None) -> int:
    """The runtime, plus one prefill chunk's activations (MLP, projections, attention scores, logits), as measured."""
    terms = memory_terms(target, precision)
    act = activation_bytes(spec, target, precision, context, prefill_chunk, all_layers=terms.measured)
    return terms.runtime_bytes + int(act * terms.activation_factor)


def estimate(
    spec: ModelSpec,
    tier: Tier,
    target: str,
    precision: str,
    context: int,
    kv_dtype: str | None = None,
    prefill_chunk: int | None = None,
) -> PlanRow:
    """Memory of (target, precision, KV dtype) at `context` tokens on `tier`, by part."""
    kv = kv_dtype or default_kv_dtype(target, precision)
    terms = memory_terms(target, precision)
    w = weight_bytes(spec, target, precision)
    loaded = int(w * terms.weights_factor)
    dn = spec.deltanet_state_bytes(get_target(target).storage_format(precision).act)
    kvb = context * kv_bytes_per_token(spec, target, precision, kv)
    scratch = context * tier.threads * get_target(target).kv_scratch_bytes_per_token(spec, kv)
    act = activation_bytes(spec, target, precision, context, prefill_chunk, all_layers=terms.measured)
    a = int(act * terms.activation_factor) + scratch
    rt = terms.runtime_bytes
    # the peak is the larger of loading (originals and prepacked copies at once) and running a prefill chunk
    total = rt + max(loaded + dn + kvb + a, int(w * terms.load_factor))
    return PlanRow(
        tier.name,
        target,
        precision,
        context,
        w,
        dn + kvb,
        total - w - dn - kvb,  # the runtime, the activations and what loading adds to the stored weights
        total,
        tier.budget_bytes,
        total <= tier.budget_bytes,
        kv_dtype=kv,
        kv_exportable=kv in exportable_kv_dtypes(target, precision),
        kv_bytes=kvb,
        deltanet_bytes=dn,
        activation_bytes=a,
        runtime_bytes=rt,
        attention_scores_bytes=attention_scores_bytes(spec, target, precision, context, prefill_chunk),
        kv_scratch_bytes=scratch,
        weights_loaded_bytes=loaded,
        terms=terms.source,
    )


def longest_context(
    spec: ModelSpec,
    tier: Tier,
    target: str,
    precision: str,
    kv_dtype: str | None = None,
    prefill_chunk: int | None = None,
) -> PlanRow:
    """The longest context (at most max_position_embeddings) whose memory fits the tier, with its breakdown.

    Memory grows with the context (KV cache, attention scores), so a binary search finds it. When not even one
    token fits, the row is the one-token estimate with fits False.
    """

    def at(n: int) -> PlanRow:
        return _at(spec, tier, target, precision, n, kv_dtype, prefill_chunk)

    lo, hi = 1, spec.max_position_embeddings
    if at(hi).fits:
        lo = hi
    elif at(lo).fits:
        while hi - lo > 1:  # at(lo) fits, at(hi) does not
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if at(mid).fits else (lo, mid)
    row = at(lo)
    row.longest, row.capped = True, lo == spec.max_position_embeddings
    return row


# A smaller prefill chunk changes no output (chunked prefill == one-shot), only prefill speed: ExecuTorch 0.8B
# prefill at chunk 128 is 2-5% slower than at 512 (docs/results/executorch.md); below 128 nothing is measured.
FREE_CHUNK = 128


def chunks(target: str, context: int, fixed: int | None = None) -> list[int]:
    """The prefill chunks to plan at, largest first: `fixed` (the user's), else the target's default and each
    power-of-two half of it down to 1 (all valid Core ML chunks too)."""
    first = min(fixed or get_target(target).default_prefill_chunk, context)
    if fixed:
        return [first]
    out = [first]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def slow_chunk(row: PlanRow) -> bool:
    """The row's chunk is below both FREE_CHUNK and the target's default: an unmeasured prefill-speed cost."""
    return row.prefill_chunk < min(FREE_CHUNK, get_target(row.target).default_prefill_chunk, row.context)


def _at(
    spec: ModelSpec, tier: Tier, target: str, precision: str, context: int, kv: str | None, chunk: int | None
) -> PlanRow:
    """estimate() with the chunk it was planned at recorded on the row."""
    row = estimate(spec, tier, target, precision, context, kv, chunk)
    row.prefill_chunk = min(chunk or get_target(target).default_prefill_chunk, context)
    return row


def _largest_chunk_fit(
    spec: ModelSpec, tier: Tier, target: str, precision: str, context: int, kv: str, fixed: int | None
) -> PlanRow | None:
    """The row at the largest prefill chunk (see chunks) at which (target, precision, kv) fits `context`."""
    for chunk in chunks(target, context, fixed):
        row = _at(spec, tier, target, precision, context, kv, chunk)
        if row.fits:
            return row
    return None


def fits_at_chunk(spec: ModelSpec, row: PlanRow, tier: Tier) -> int:
    """The largest prefill chunk (a power of two below the row's) at which the row would fit; 0 if none."""
    chunk = min(get_target(row.target).default_prefill_chunk, row.context) // 2
    while chunk >= 1:
        if estimate(spec, tier, row.target, row.precision, row.context, row.kv_dtype, chunk).fits:
            return chunk
        chunk //= 2
    return 0


def parse_context(context: int | str | None) -> int | str | None:
    """--context: a number of tokens, or "max" (the longest that fits each tier); None: each tier's typical."""
    if context is None or context == "max":
        return context
    if isinstance(context, str):
        if not context.strip().isdigit():
            raise DeltashipError(
                f"--context must be a number of tokens or max, got {context!r}",
                "pass e.g. --context 262144, or --context max for the longest that fits",
            )
        context = int(context)
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise DeltashipError(f"--context must be positive, got {context}", "pass a context length in tokens")
    return context


def plan(
    model: str,
    tier: str | None = None,
    tiers_file: str | None = None,
    context: int | str | None = None,
    targets: list[str] | None = None,
    kv_dtypes: list[str] | None = None,
    prefill_chunk: int | None = None,
) -> list[dict]:
    """One row per (tier, target, precision, KV dtype): memory parts, total, budget, fits; the pick per tier
    is marked.

    context: tokens, "max" (per row, the longest context that fits, capped at max_position_embeddings) or None
    (each tier's typical context). kv_dtypes: the KV-cache dtypes to plan; by default the target's own when
    no context is asked for (the table as before), and with a context its own then every narrower one
    (a KV dtype the target does not export yet, e.g. Core ML's int8, is planned: kv_exportable False, never the
    pick). prefill_chunk: tokens per prefill call (default: the target's), which sizes the attention scores.
    """
    from deltaship.models.source import load_source

    context = parse_context(context)
    for kv in kv_dtypes or ():
        if kv not in KV_DTYPES:
            raise DeltashipError(
                f"unknown KV dtype {kv!r}; KV dtypes: {', '.join(KV_DTYPES)}", "pick KV dtypes among those"
            )
    if prefill_chunk is not None and prefill_chunk < 1:
        raise DeltashipError(f"--prefill-chunk must be at least 1, got {prefill_chunk}", "pass a positive chunk size")
    spec = load_source(model).spec
    catalog, _ = load_catalog(tiers_file)
    if tier is not None and tier not in catalog:
        raise DeltashipError(
            f"unknown tier {tier!r}; tiers: {', '.join(catalog)}",
            "pick a tier from the catalog or add your own with --tiers FILE",
        )

    def kvs(tg: str, pr: str) -> tuple[str, ...]:
        if kv_dtypes:
            return tuple(kv_dtypes)
        return kv_dtypes_for(tg, pr) if context is not None else (default_kv_dtype(tg, pr),)

    rows: list[PlanRow] = []
    for t in [catalog[tier]] if tier else catalog.values():
        combos = [(tg, pr, kv) for tg in (targets or t.targets) for pr in PRECISIONS for kv in kvs(tg, pr)]
        if context == "max":
            tier_rows = [longest_context(spec, t, tg, pr, kv, prefill_chunk) for tg, pr, kv in combos]
            pick = _longest(t, tier_rows, targets)
        else:
            ctx = min(context or t.context, spec.max_position_embeddings)
            tier_rows = [_at(spec, t, tg, pr, ctx, kv, prefill_chunk) for tg, pr, kv in combos]
            for r in tier_rows:
                r.capped = context is not None and context > ctx
                if not r.fits:
                    r.fits_at_chunk = fits_at_chunk(spec, r, t) if prefill_chunk is None else 0
            pick = recommend(spec, t, ctx, targets, prefill_chunk)
        key = lambda r: (r.target, r.precision, r.context, r.kv_dtype, r.prefill_chunk)  # noqa: E731
        for r in tier_rows:
            r.recommended = pick is not None and key(r) == key(pick)
        if pick is not None and not any(r.recommended for r in tier_rows):
            pick.recommended = True
            if context not in (None, "max"):
                pick.capped = context > spec.max_position_embeddings and pick.context == spec.max_position_embeddings
            tier_rows.append(pick)  # the pick needed a shorter context or a smaller prefill chunk
        rows += tier_rows
    return [asdict(r) for r in rows]


def recommend(
    spec: ModelSpec, tier: Tier, context: int, targets: list[str] | None = None, prefill_chunk: int | None = None
) -> PlanRow | None:
    """The tier's pick at `context` (a smaller prefill chunk first, then halved down to 512): see _first_fit."""
    return _first_fit(spec, tier, list(targets or tier.targets), list(tier.precisions), context, True, prefill_chunk)


def _first_fit(
    spec: ModelSpec,
    tier: Tier,
    targets: list[str],
    precisions: list[str],
    context: int,
    halve: bool,
    prefill_chunk: int | None = None,
    kv_dtype: str | None = None,
) -> PlanRow | None:
    """The first row that fits, in the tier's order of targets then precisions (most accurate first), with the
    target's own KV dtype; only when none fits at that context, the same again with each quantized KV cache the
    target exports (int8, then int4: a narrower cache costs accuracy, so it is the price of the context, not a
    default). Each at the largest prefill chunk that fits (see chunks; `prefill_chunk` fixes it): a smaller chunk
    changes no output, only the prefill speed, so it comes before a shorter context; a chunk under FREE_CHUNK (an
    unmeasured slowdown) only when no row fits at a measured-cheap one, own or quantized KV cache. With halve,
    when nothing fits at any chunk, the context is halved down to 512 (or `context` when shorter)."""
    ctx = context
    while True:
        found = []
        for quantized in (False, True):
            for tg in targets:
                for pr in precisions:
                    own = default_kv_dtype(tg, pr)
                    if kv_dtype is not None:
                        kvs = [kv_dtype] if (kv_dtype == own) != quantized else []
                    else:
                        kvs = [k for k in exportable_kv_dtypes(tg, pr) if k != own] if quantized else [own]
                    for kv in kvs:
                        row = _largest_chunk_fit(spec, tier, tg, pr, ctx, kv, prefill_chunk)
                        if row is not None and row.kv_exportable:
                            found.append((slow_chunk(row), quantized, len(found), row))
        if found:
            return min(found, key=lambda f: f[:3])[3]
        if not halve or ctx // 2 < min(512, context):
            return None
        ctx //= 2


def choose_for_tier(
    spec: ModelSpec,
    tier: str,
    tiers_file: str | None = None,
    target: str | None = None,
    precision: str | None = None,
    context: int | str | None = None,
    kv_dtype: str | None = None,
    prefill_chunk: int | None = None,
) -> PlanRow:
    """What `export --device TIER` builds: the tier's preferred target and most accurate precision that fit
    (within the target, precision, context, KV dtype and prefill chunk the user fixed), with the target's own KV
    cache or, when only a quantized one fits, that, at the largest prefill chunk that fits (row.prefill_chunk); at
    the tier's typical context, halved down to 512 when nothing fits there at any chunk and the user fixed none
    (see _first_fit). context "max": the longest context any exportable combination reaches at the target's
    chunk (see _longest). Refused, with the plan's numbers, when nothing fits."""
    from deltaship.devices.catalog import get_tier

    t = get_tier(tier, tiers_file)
    context = parse_context(context)
    targets, precisions = [target] if target else list(t.targets), [precision] if precision else list(t.precisions)
    if kv_dtype is not None:
        can = [(tg, pr) for tg in targets for pr in precisions if kv_dtype in exportable_kv_dtypes(tg, pr)]
        if not can:
            raise DeltashipError(
                f"--kv-cache {kv_dtype}: none of {', '.join(targets)} at {', '.join(precisions)} (tier {t.name}'s "
                "choice, or yours) stores that KV dtype",
                "drop --kv-cache to let the plan pick, or fix a --target/--precision that stores it "
                "(ONNX: int8/int4 at fp32 activations; ExecuTorch: int8)",
            )
        targets = list(dict.fromkeys(tg for tg, _ in can))
        precisions = list(dict.fromkeys(pr for _, pr in can))
    if context == "max":
        rows = [
            longest_context(spec, t, tg, pr, kv, prefill_chunk)
            for tg in targets
            for pr in precisions
            for kv in ([kv_dtype] if kv_dtype else exportable_kv_dtypes(tg, pr))
        ]
        pick = _longest(t, rows, targets)
        tried = rows
    else:
        start = context or min(t.context, spec.max_position_embeddings)
        pick = _first_fit(spec, t, targets, precisions, start, context is None, prefill_chunk, kv_dtype)
        tried = [
            estimate(spec, t, tg, pr, start, kv)
            for tg in targets
            for pr in precisions
            for kv in ([kv_dtype] if kv_dtype else exportable_kv_dtypes(tg, pr))
        ]
    if pick is not None:
        return pick
    best = min(tried, key=lambda r: r.total_bytes)
    raise DeltashipError(
        f"nothing fits tier {t.name} ({t.budget_bytes / GIB:.2f} GiB for the app): the smallest, {best.target} "
        f"{best.precision} with an {best.kv_dtype} KV cache at context {best.context}, needs "
        f"{best.total_bytes / GIB:.2f} GiB ({_parts(asdict(best))})",
        f"pick a tier with a larger budget, a shorter --max-context or a smaller model; `deltaship plan --model "
        f"MODEL --tier {t.name}` shows every option",
    )


def _longest(tier: Tier, rows: list[PlanRow], targets: list[str] | None) -> PlanRow | None:
    """The exportable row reaching the longest context; among equals, the tier's preferred target, then the
    widest KV cache, then the most accurate precision."""
    order = {tg: i for i, tg in enumerate(targets or tier.targets)}
    prec = {p: i for i, p in enumerate(tier.precisions)}
    ok = [r for r in rows if r.fits and r.kv_exportable and r.precision in prec]
    return min(
        ok,
        key=lambda r: (-r.context, order.get(r.target, len(order)), KV_ORDER.index(r.kv_dtype), prec[r.precision]),
        default=None,
    )


def verdicts(rows: list[dict], tiers_file: str | None = None) -> list[str]:
    """One line per tier: what is recommended and why the tier's other precisions were passed over, or that
    nothing fits (at the context asked for), by how much and by what part, and what would (a smaller prefill
    chunk, a narrower KV cache, a shorter context, a tier with a larger budget)."""
    catalog, _ = load_catalog(tiers_file)
    lines = []
    for name in dict.fromkeys(r["tier"] for r in rows):
        tier_rows = [r for r in rows if r["tier"] == name]
        today = [r for r in tier_rows if r.get("kv_exportable", True)] or tier_rows
        pick = next((r for r in tier_rows if r["recommended"]), None)
        tier = catalog[name]
        asked = max(r["context"] for r in tier_rows)
        if pick is not None and (pick["context"] == asked or pick.get("longest")):
            line = (
                f"{name}: {pick['target']} {pick['precision']}{_kv_note(pick, tier_rows)} at context {pick['context']} "
                f"{_chunk_note(pick)}({pick['total_bytes'] / GIB:.2f} of {pick['budget_bytes'] / GIB:.2f} GiB): "
                "the tier prefers "
                f"{' > '.join(tier.targets)} and {' > '.join(tier.precisions)} (most accurate first)"
            )
            smaller = [
                r
                for r in today
                if r["target"] == pick["target"]
                and r["fits"]
                and r["total_bytes"] < pick["total_bytes"]
                and r["precision"] != pick["precision"]
                and r["context"] == pick["context"]
            ]
            if smaller:
                s = min(smaller, key=lambda r: r["total_bytes"])
                line += f"; {s['precision']} also fits, in {s['total_bytes'] / GIB:.2f} GiB"
            if pick.get("capped"):
                line += "; the context stops at the model's max_position_embeddings (longer needs YaRN rope scaling)"
            lines.append(line + _chunk_cost(pick, tier_rows) + _planned_kv(tier_rows, pick))
            continue
        at_asked = [r for r in tier_rows if r["context"] == asked]
        best = min([r for r in at_asked if r.get("kv_exportable", True)] or at_asked, key=lambda r: r["total_bytes"])
        line = (
            f"{name}: nothing fits{f' at context {asked}' if pick else ''}. The smallest, {best['target']} "
            f"{best['precision']}{_kv_note(best, at_asked)} at context {best['context']}, needs "
            f"{best['total_bytes'] / GIB:.2f} GiB of a {best['budget_bytes'] / GIB:.2f} GiB budget "
            f"({_parts(best)})"
        )
        rescued = [r for r in at_asked if r.get("fits_at_chunk")]
        if rescued:
            # today's KV dtype first, then the widest planned one, then the largest chunk
            r = max(
                rescued,
                key=lambda r: (r.get("kv_exportable", True), -KV_ORDER.index(r["kv_dtype"]), r["fits_at_chunk"]),
            )
            line += (
                f"; {r['target']} {r['precision']}{_kv_note(r, at_asked)} would fit with --prefill-chunk "
                f"{r['fits_at_chunk']} (fewer attention scores per chunk)"
            )
        line += _planned_kv(at_asked, None)
        if pick is not None:
            line += (
                f". Recommended instead: {pick['target']} {pick['precision']}{_kv_note(pick, tier_rows)} at context "
                f"{pick['context']} {_chunk_note(pick)}"
                f"({pick['total_bytes'] / GIB:.2f} of {pick['budget_bytes'] / GIB:.2f} GiB)"
            ) + _chunk_cost(pick, tier_rows)
        else:
            line += (
                f"; it would fit a tier with {best['total_bytes'] / GIB:.2f} GiB or more to spend (--tiers FILE), "
                "or a smaller model"
            )
        lines.append(line)
    return lines


def _smaller_chunk(r: dict) -> bool:
    """The row was planned at a prefill chunk below its target's default (a chunk the planner chose)."""
    return 0 < r.get("prefill_chunk", 0) < min(get_target(r["target"]).default_prefill_chunk, r["context"])


def _chunk_note(r: dict) -> str:
    """'with --prefill-chunk 128 ' when the row needs a chunk below its target's default; nothing otherwise."""
    return f"with --prefill-chunk {r['prefill_chunk']} " if _smaller_chunk(r) else ""


def _chunk_cost(pick: dict, rows: list[dict]) -> str:
    """Why the pick's chunk is smaller than its target's default, and what that costs in prefill speed."""
    if not _smaller_chunk(pick):
        return ""
    default = min(get_target(pick["target"]).default_prefill_chunk, pick["context"])
    same = (pick["target"], pick["precision"], pick["kv_dtype"], pick["context"], default)
    at_default = next(
        (r for r in rows if (r["target"], r["precision"], r["kv_dtype"], r["context"], r.get("prefill_chunk")) == same),
        None,
    )
    why = f" (needs {at_default['total_bytes'] / GIB:.2f} GiB)" if at_default else ""
    cost = (
        "measured: ExecuTorch 0.8B prefill at chunk 128 is 2-5% slower than at 512, docs/results/executorch.md"
        if pick["prefill_chunk"] >= FREE_CHUNK
        else f"not measured below {FREE_CHUNK}, an estimate: slower still, towards one-token calls, which prefill "
        "4-13x slower than 512-token ones, ExecuTorch 0.8B int4 and fp32, docs/results/executorch.md"
    )
    return (
        f"; prefill chunk {pick['prefill_chunk']}, not the target's {default}{why}: fewer attention scores per chunk, "
        f"the same outputs, a slower prefill ({cost})"
    )


def _kv_note(r: dict, rows: list[dict]) -> str:
    """' with an int8 KV cache (planned)' when the rows compare KV dtypes; nothing otherwise."""
    if len({x.get("kv_dtype") for x in rows}) <= 1:
        return ""
    return f" with an {r['kv_dtype']} KV cache" + ("" if r.get("kv_exportable", True) else " (planned)")


def _parts(r: dict) -> str:
    """The memory breakdown of a row, in GiB."""
    if not r.get("kv_dtype"):
        return f"weights {r['weights_bytes'] / GIB:.2f} GiB alone"
    return (
        f"weights {r['weights_bytes'] / GIB:.2f} + {r['kv_dtype']} KV cache {r['kv_bytes'] / GIB:.2f} + DeltaNet "
        f"states {r['deltanet_bytes'] / GIB:.2f} + activations {r['activation_bytes'] / GIB:.2f} (attention "
        f"scores {r['attention_scores_bytes'] / GIB:.2f}"
        + (f", KV scratch {r['kv_scratch_bytes'] / GIB:.2f}" if r.get("kv_scratch_bytes") else "")
        + f") + runtime {r['runtime_bytes'] / GIB:.2f} GiB"
    )


def _planned_kv(tier_rows: list[dict], pick: dict | None) -> str:
    """What a KV dtype the target does not export yet (planned) would add: a longer context that fits."""
    reach = pick["context"] if pick else 0
    better = [r for r in tier_rows if not r.get("kv_exportable", True) and r["fits"] and r["context"] > reach]
    if not better:
        return ""
    b = max(better, key=lambda r: (r["context"], -r["total_bytes"]))
    return (
        f". With an {b['kv_dtype']} KV cache (planned, not exportable yet) {b['target']} {b['precision']} "
        f"fits at context {b['context']} in {b['total_bytes'] / GIB:.2f} GiB ({_parts(b)})"
    )


def format_table(rows: list[dict]) -> str:
    """The rows as a table: memory by part (KV cache, DeltaNet states, activations, runtime) in GiB."""
    head = (
        "memory in GiB\n"
        f"{'tier':<12} {'target':<11} {'prec':<5} {'kv':<5} {'context':>7} {'chunk':>5} {'weights':>8} {'loaded':>8} "
        f"{'kv':>8} "
        f"{'deltanet':>8} {'activ.':>8} {'runtime':>8} {'total':>8} {'budget':>8}  fit"
    )
    lines = [head, "-" * len(head.splitlines()[-1])]
    g = lambda b: f"{b / GIB:8.2f}"  # noqa: E731
    for r in rows:
        mark = ("yes" if r["fits"] else "no") + ("  <- recommended" if r["recommended"] else "")
        kv = r.get("kv_dtype", "") + ("" if r.get("kv_exportable", True) else "*")
        lines.append(
            f"{r['tier']:<12} {r['target']:<11} {r['precision']:<5} {kv:<5} {r['context']:>7} "
            f"{r.get('prefill_chunk') or '':>5} "
            f"{g(r['weights_bytes'])} {g(r.get('weights_loaded_bytes') or r['weights_bytes'])} "
            f"{g(r['kv_bytes'])} {g(r['deltanet_bytes'])} "
            f"{g(r['activation_bytes'])} {g(r['runtime_bytes'])} {g(r['total_bytes'])} "
            f"{g(r['budget_bytes'])}  {mark}"
        )
    if any(not r.get("kv_exportable", True) for r in rows):
        lines.append("* a KV-cache dtype the target cannot export yet (planned)")
    lines.append(
        "loaded: the weights as resident once the runtime has loaded them (prepacked copies); total: the runtime plus "
        "the larger of loading and a prefill chunk"
    )
    for terms in sorted({(r["target"], r["precision"], r.get("terms", "")) for r in rows}):
        lines.append(f"  {terms[0]} {terms[1]}: {terms[2]}")
    return "\n".join(lines)


__all__ = [
    "plan",
    "format_table",
    "verdicts",
    "weight_bytes",
    "state_bytes",
    "estimate",
    "longest_context",
    "kv_dtypes_for",
    "exportable_kv_dtypes",
    "default_kv_dtype",
    "parse_context",
    "fits_at_chunk",
    "chunks",
    "export_peak_bytes",
]


# ---- an export's own memory (deltaship export, before it starts) -------------------------------------------
EXPORT_BASE_BYTES = 400 << 20  # the interpreter with torch, transformers and a toolchain imported
VERIFY_RUNTIME_BYTES = 200 << 20  # the runtime's own libraries and buffers in the verification session


def export_peak_bytes(spec: ModelSpec, target: str, precision: str, verify: bool, budget: int | None = None) -> int:
    """The resident peak of `deltaship export` (an estimate fitted to docs/results/export-memory.md). With
    verification add the bundle's session and the fp32 transformers reference, which export skips (and so does
    this estimate) when it needs more than 0.6 of `budget`, as deltaship.check.verify.reference_fits does."""
    fp16 = 2 * spec.parameter_count()["total"]
    peak = EXPORT_BASE_BYTES + int(get_target(target).export_weight_factor * fp16)
    if verify:
        reference = int(spec.parameter_count()["total"] * 4 * 1.3)
        if budget is None or reference <= 0.6 * budget:
            peak += reference
        peak += weight_bytes(spec, target, precision) + VERIFY_RUNTIME_BYTES
    return peak


# ---- the vision tower (a model with one: `export --vision`) --------------------------------------------
VISION_SIDES = (224, 448, 896)  # square test images, in pixels; plus the preprocessor's largest image


def vision_plan(model: str) -> dict | None:
    """The vision tower's weights and its activation peak per image size, or None for a text-only model.

    Counted at fp32 (an fp16 bundle halves it), for one image per call, with full bidirectional attention over the
    image's N patches: the peak is one block's attention scores and their softmax (2 x heads x N x N) plus
    the patch-wide tensors of that block (input rows, QKV, MLP, residual), all fp32. Each image becomes N / 4
    tokens of the text decoder's context (its KV cost is the text plan's). "max" is the largest image the
    preprocessor produces (max_pixels, as a square)."""
    import math

    from deltaship.models.source import load_source
    from deltaship.models.vision import Preprocessor, preprocessor_config, smart_resize, vision_spec_of, vision_tensors

    source = load_source(model)
    vs = vision_spec_of(source)
    if vs is None:
        return None
    pre = Preprocessor.from_config(preprocessor_config(source))
    params = sum(math.prod(s) for s in vision_tensors(vs).values())
    sides = [(str(s), s) for s in VISION_SIDES] + [("max", math.isqrt(pre.max_pixels))]
    images = []
    for label, side in sides:
        h, w = smart_resize(side, side, pre.factor, pre.min_pixels, pre.max_pixels)
        n = (h // vs.patch_size) * (w // vs.patch_size)
        scores = 2 * vs.num_heads * n * n * 4
        rows = n * (vs.patch_dim + 3 * vs.hidden_size + vs.intermediate_size + 2 * vs.hidden_size) * 4
        images.append(
            {
                "image": label,
                "resized": [h, w],
                "patches": n,
                "tokens": n // vs.merge_unit,
                "attention_scores_bytes": scores,
                "activation_peak_bytes": scores + rows,
            }
        )
    return {
        "depth": vs.depth,
        "hidden_size": vs.hidden_size,
        "parameters": params,
        "weights_bytes": params * 4,
        "dtype": "float32",
        "images": images,
    }


def format_vision(vp: dict) -> str:
    lines = [
        f"vision tower: {vp['depth']} blocks x {vp['hidden_size']}, {vp['parameters'] / 1e6:.1f}M parameters, "
        f"{vp['weights_bytes'] / GIB:.2f} GiB of {vp['dtype']} weights; activation peak per image (one call):",
        f"{'image':<8} {'resized':>11} {'patches':>8} {'tokens':>7} {'attention':>11} {'peak':>11}",
    ]
    for r in vp["images"]:
        h, w = r["resized"]
        lines.append(
            f"{r['image']:<8} {f'{w}x{h}':>11} {r['patches']:>8} {r['tokens']:>7} "
            f"{_gib(r['attention_scores_bytes']):>11} {_gib(r['activation_peak_bytes']):>11}"
        )
    return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def planned_peak(manifest: dict, prompt_length: int, threads: int | None = None) -> dict | None:
    """The plan's memory for a bundle as `profile` runs it (its context, a prefill of `prompt_length` tokens in the
    bundle's chunks), by part; None when the bundle's model cannot be loaded here (a checkpoint not on this
    machine). `profile` prints it beside the measured peak RSS."""
    from deltaship.devices.catalog import Tier
    from deltaship.models.source import load_source

    try:
        spec = load_source(manifest["source"]["model"]).spec
    except (DeltashipError, KeyError, OSError):
        return None
    chunk = min(prompt_length, manifest.get("prefill_chunk") or prompt_length)
    ctx = manifest["max_context"]
    tier = Tier("host", "host", 1 << 62, 1 << 62, (manifest["target"],), (manifest["precision"],), ctx, threads or 1)
    row = estimate(spec, tier, manifest["target"], manifest["precision"], manifest["max_context"], None, chunk)
    return {
        "total_bytes": row.total_bytes,
        "weights_loaded_bytes": row.weights_loaded_bytes,
        "state_bytes": row.state_bytes,
        "activation_bytes": row.activation_bytes,
        "runtime_bytes": row.runtime_bytes,
        "context": row.context,
        "prefill_chunk": chunk,
        "terms": row.terms,
    }
