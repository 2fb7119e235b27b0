"""The planner's search: the longest context that fits a tier, the prefill chunks to try, the tier's pick, and
`deltaship plan`'s rows and `export --device TIER`'s choice. The targets are looked up once here, by name, and passed
down to the arithmetic (plan/memory.py) as Target objects."""

from __future__ import annotations

from dataclasses import asdict

from deltaship.devices.catalog import GIB, Tier, get_tier, load_catalog
from deltaship.devices.plan.memory import (
    FREE_CHUNK,
    KV_ORDER,
    PlanRow,
    as_target,
    default_kv_dtype,
    estimate,
    exportable_kv_dtypes,
    kv_dtypes_for,
)
from deltaship.devices.plan.text import parts
from deltaship.errors import DeltashipError
from deltaship.models.source import load_source
from deltaship.models.spec import KV_DTYPES, ModelSpec
from deltaship.options import at_least
from deltaship.options import block_size as check_block_size
from deltaship.targets import Target


def longest_context(
    spec: ModelSpec,
    tier: Tier,
    target: Target | str,
    precision: str,
    kv_dtype: str | None = None,
    prefill_chunk: int | None = None,
    prompt_cache_tokens: int | None = None,
    block_size: int | None = None,
) -> PlanRow:
    """The longest context (at most max_position_embeddings) whose memory fits the tier, with its breakdown.

    Memory grows with the context (KV cache, attention scores), so a binary search finds it. When not even one
    token fits (one past a prompt cache's tokens), the row is that shortest one's estimate with fits False.
    """
    tgt = as_target(target)

    def at(n: int) -> PlanRow:
        return _at(spec, tier, tgt, precision, n, kv_dtype, prefill_chunk, prompt_cache_tokens, block_size)

    lo, hi = min(1 + (prompt_cache_tokens or 0), spec.max_position_embeddings), spec.max_position_embeddings
    if at(hi).fits:
        lo = hi
    elif at(lo).fits:
        while hi - lo > 1:  # at(lo) fits, at(hi) does not
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if at(mid).fits else (lo, mid)
    row = at(lo)
    row.longest, row.capped = True, lo == spec.max_position_embeddings
    return row


def chunks(target: Target | str, context: int, fixed: int | None = None) -> list[int]:
    """The prefill chunks to plan at, largest first: `fixed` (the user's), else the target's default and each
    power-of-two half of it down to 1 (all valid Core ML chunks too)."""
    first = min(fixed or as_target(target).default_prefill_chunk, context)
    if fixed:
        return [first]
    out = [first]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def slow_chunk(row: PlanRow, target: Target) -> bool:
    """The row's chunk is below both FREE_CHUNK and its target's default: an unmeasured prefill-speed cost."""
    return row.prefill_chunk < min(FREE_CHUNK, target.default_prefill_chunk, row.context)


def _at(
    spec: ModelSpec,
    tier: Tier,
    target: Target,
    precision: str,
    context: int,
    kv: str | None,
    chunk: int | None,
    prompt_cache_tokens: int | None = None,
    block_size: int | None = None,
) -> PlanRow:
    """estimate() with the chunk it was planned at recorded on the row."""
    row = estimate(
        spec,
        tier,
        target,
        precision,
        context,
        kv,
        chunk,
        prompt_cache_tokens=prompt_cache_tokens,
        block_size=block_size,
    )
    row.prefill_chunk = min(chunk or target.default_prefill_chunk, context)
    return row


def _largest_chunk_fit(
    spec: ModelSpec,
    tier: Tier,
    target: Target,
    precision: str,
    context: int,
    kv: str,
    fixed: int | None,
    prompt_cache_tokens: int | None = None,
    block_size: int | None = None,
) -> PlanRow | None:
    """The row at the largest prefill chunk (see chunks) at which (target, precision, kv) fits `context`."""
    for chunk in chunks(target, context, fixed):
        row = _at(spec, tier, target, precision, context, kv, chunk, prompt_cache_tokens, block_size)
        if row.fits:
            return row
    return None


def fits_at_chunk(spec: ModelSpec, row: PlanRow, tier: Tier, target: Target | None = None) -> int:
    """The largest prefill chunk (a power of two below the row's) at which the row would fit; 0 if none."""
    tgt = target or as_target(row.target)
    chunk = min(tgt.default_prefill_chunk, row.context) // 2
    cache, block = row.prompt_cache_tokens, row.block_size  # what the row was planned with, kept at every chunk
    while chunk >= 1:
        if estimate(
            spec,
            tier,
            tgt,
            row.precision,
            row.context,
            row.kv_dtype,
            chunk,
            prompt_cache_tokens=cache,
            block_size=block,
        ).fits:
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
    prompt_cache_tokens: int | None = None,
    block_size: int | None = None,
) -> list[dict]:
    """One row per (tier, target, precision, KV dtype): memory parts, total, budget, fits; the pick per tier
    is marked.

    context: tokens, "max" (per row, the longest context that fits, capped at max_position_embeddings) or None
    (each tier's typical context). kv_dtypes: the KV-cache dtypes to plan; by default the target's own when
    no context is asked for (the table as before), and with a context its own then every narrower one
    (a KV dtype the target does not export yet, e.g. Core ML's int8, is planned: kv_exportable False, never the
    pick). prefill_chunk: tokens per prefill call (default: the target's), which sizes the attention scores.
    prompt_cache_tokens: a prompt cache of that many tokens shipped in the bundle (export --prompt-cache), which a
    chat restores: its bytes in the bundle and its restore on the peak (memory.prompt_cache_restore_bytes).
    block_size: the int8/int4 quantization block (export --block-size; default: each target's own).
    """
    context = parse_context(context)
    if prompt_cache_tokens is not None:
        at_least("--prompt-cache-tokens", prompt_cache_tokens, 0)
    if block_size is not None:
        check_block_size(block_size)
    for kv in kv_dtypes or ():
        if kv not in KV_DTYPES:
            raise DeltashipError(
                f"unknown KV dtype {kv!r}; KV dtypes: {', '.join(KV_DTYPES)}", "pick KV dtypes among those"
            )
    if prefill_chunk is not None and prefill_chunk < 1:
        raise DeltashipError(f"--prefill-chunk must be at least 1, got {prefill_chunk}", "pass a positive chunk size")
    spec = load_source(model).spec
    if prompt_cache_tokens is not None and prompt_cache_tokens >= spec.max_position_embeddings:
        raise DeltashipError(
            f"a prompt cache of {prompt_cache_tokens} tokens leaves no room in {model}'s longest context "
            f"({spec.max_position_embeddings} tokens)",
            "ship a shorter system message",
        )
    catalog, _ = load_catalog(tiers_file)
    if tier is not None and tier not in catalog:
        raise DeltashipError(
            f"unknown tier {tier!r}; tiers: {', '.join(catalog)}",
            "pick a tier from the catalog or add your own with --tiers FILE",
        )

    def kvs(tg: Target, pr: str) -> tuple[str, ...]:
        if kv_dtypes:
            return tuple(kv_dtypes)
        return kv_dtypes_for(tg, pr) if context is not None else (default_kv_dtype(tg, pr),)

    rows: list[PlanRow] = []
    for t in [catalog[tier]] if tier else catalog.values():
        resolved = {name: as_target(name) for name in targets or t.targets}  # looked up once, passed down
        combos = [(tg, pr, kv) for tg in resolved.values() for pr in tg.precisions for kv in kvs(tg, pr)]
        if context == "max":
            tier_rows = [
                longest_context(spec, t, tg, pr, kv, prefill_chunk, prompt_cache_tokens, block_size)
                for tg, pr, kv in combos
            ]
            pick = _longest(t, tier_rows, targets)
        else:
            ctx = min(context or t.context, spec.max_position_embeddings)
            tier_rows = [
                _at(spec, t, tg, pr, ctx, kv, prefill_chunk, prompt_cache_tokens, block_size) for tg, pr, kv in combos
            ]
            for r in tier_rows:
                r.capped = context is not None and context > ctx
                if not r.fits:
                    r.fits_at_chunk = fits_at_chunk(spec, r, t, resolved[r.target]) if prefill_chunk is None else 0
            pick = recommend(spec, t, ctx, targets, prefill_chunk, prompt_cache_tokens, block_size)
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
    spec: ModelSpec,
    tier: Tier,
    context: int,
    targets: list[str] | None = None,
    prefill_chunk: int | None = None,
    prompt_cache_tokens: int | None = None,
    block_size: int | None = None,
) -> PlanRow | None:
    """The tier's pick at `context` (a smaller prefill chunk first, then halved down to 512): see _first_fit."""
    tgts = [as_target(name) for name in targets or tier.targets]
    return _first_fit(
        spec, tier, tgts, list(tier.precisions), context, True, prefill_chunk, None, prompt_cache_tokens, block_size
    )


def _first_fit(
    spec: ModelSpec,
    tier: Tier,
    targets: list[Target],
    precisions: list[str],
    context: int,
    halve: bool,
    prefill_chunk: int | None = None,
    kv_dtype: str | None = None,
    prompt_cache_tokens: int | None = None,
    block_size: int | None = None,
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
                for pr in (p for p in precisions if p in tg.precisions):
                    own = default_kv_dtype(tg, pr)
                    if kv_dtype is not None:
                        kvs = [kv_dtype] if (kv_dtype == own) != quantized else []
                    else:
                        kvs = [k for k in exportable_kv_dtypes(tg, pr) if k != own] if quantized else [own]
                    for kv in kvs:
                        row = _largest_chunk_fit(
                            spec, tier, tg, pr, ctx, kv, prefill_chunk, prompt_cache_tokens, block_size
                        )
                        if row is not None and row.kv_exportable:
                            found.append((slow_chunk(row, tg), quantized, len(found), row))
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
    prompt_cache_tokens: int | None = None,
    block_size: int | None = None,
) -> PlanRow:
    """What `export --device TIER` builds: the tier's preferred target and most accurate precision that fit
    (within the target, precision, context, KV dtype and prefill chunk the user fixed), with the target's own KV
    cache or, when only a quantized one fits, that, at the largest prefill chunk that fits (row.prefill_chunk); at
    the tier's typical context, halved down to 512 when nothing fits there at any chunk and the user fixed none
    (see _first_fit). context "max": the longest context any exportable combination reaches at the target's
    chunk (see _longest). prompt_cache_tokens: the bundle ships a prompt cache of that many tokens (export
    --prompt-cache), whose restore is counted. block_size: the quantization block (export --block-size). Refused,
    with the plan's numbers, when nothing fits."""
    t = get_tier(tier, tiers_file)
    context = parse_context(context)
    if block_size is not None:
        check_block_size(block_size)
    targets, precisions = [target] if target else list(t.targets), [precision] if precision else list(t.precisions)
    resolved = {name: as_target(name) for name in targets}  # looked up once, passed down
    if kv_dtype is not None:
        can = [(tg, pr) for tg in targets for pr in precisions if kv_dtype in exportable_kv_dtypes(resolved[tg], pr)]
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
            longest_context(spec, t, resolved[tg], pr, kv, prefill_chunk, prompt_cache_tokens, block_size)
            for tg in targets
            for pr in precisions
            for kv in ([kv_dtype] if kv_dtype else exportable_kv_dtypes(resolved[tg], pr))
        ]
        pick = _longest(t, rows, targets)
        tried = rows
    else:
        start = context or min(t.context, spec.max_position_embeddings)
        tgts = [resolved[tg] for tg in targets]
        pick = _first_fit(
            spec, t, tgts, precisions, start, context is None, prefill_chunk, kv_dtype, prompt_cache_tokens, block_size
        )
        tried = [
            estimate(
                spec, t, resolved[tg], pr, start, kv, prompt_cache_tokens=prompt_cache_tokens, block_size=block_size
            )
            for tg in targets
            for pr in precisions
            for kv in ([kv_dtype] if kv_dtype else exportable_kv_dtypes(resolved[tg], pr))
        ]
    if pick is not None:
        return pick
    best = min(tried, key=lambda r: r.total_bytes)
    raise DeltashipError(
        f"nothing fits tier {t.name} ({t.budget_bytes / GIB:.2f} GiB for the app): the smallest, {best.target} "
        f"{best.precision} with an {best.kv_dtype} KV cache at context {best.context}, needs "
        f"{best.total_bytes / GIB:.2f} GiB ({parts(asdict(best))})",
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
