"""`deltaship plan`: will a model fit a tier, and at which (target, precision, context)?

Memory = weights (as each target stores them) + state at the context (KV cache + DeltaNet
states) + runtime overhead (the runtime itself and the activations of one prefill chunk).
Computed from the ModelSpec alone, so it works for models too big for this machine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from deltaship.devices.catalog import GIB, Tier, load_catalog
from deltaship.errors import DeltashipError
from deltaship.models.spec import ModelSpec
from deltaship.targets import PRECISIONS, get_target

@dataclass
class PlanRow:
    tier: str
    target: str
    precision: str
    context: int
    weights_bytes: int
    state_bytes: int
    overhead_bytes: int
    total_bytes: int
    budget_bytes: int
    fits: bool
    recommended: bool = False


def weight_bytes(spec: ModelSpec, target: str, precision: str) -> int:
    f = get_target(target).storage_format(precision)
    p = spec.parameter_count()
    per = f.bits / 8 + (f.scale / f.block if f.block > 1 else 0)
    matrices = p["embedding"] + p["lm_head"] + p["body"]
    if spec.tie_word_embeddings and f.head_copy:
        matrices += p["embedding"]
    return int(matrices * per)


def state_bytes(spec: ModelSpec, target: str, precision: str, context: int) -> int:
    act = get_target(target).storage_format(precision).act
    return spec.state_bytes(context, kv_bytes_per_elem=act, conv_bytes_per_elem=act)["total"]


def overhead_bytes(spec: ModelSpec, target: str, precision: str, context: int) -> int:
    """The runtime, plus one prefill chunk's activations (MLP, projections, attention scores, logits)."""
    tgt = get_target(target)
    act = tgt.storage_format(precision).act
    t = min(tgt.default_prefill_chunk, context)
    per_token = 2 * spec.intermediate_size + 2 * spec.conv_dim + 6 * spec.hidden_size
    scores = spec.num_attention_heads * t * context
    return tgt.runtime_base_bytes + act * (t * per_token + scores) + 4 * spec.vocab_size


def estimate(spec: ModelSpec, tier: Tier, target: str, precision: str, context: int) -> PlanRow:
    w = weight_bytes(spec, target, precision)
    s = state_bytes(spec, target, precision, context)
    o = overhead_bytes(spec, target, precision, context)
    total = w + s + o
    return PlanRow(tier.name, target, precision, context, w, s, o, total, tier.budget_bytes, total <= tier.budget_bytes)


def plan(model: str, tier: str | None = None, tiers_file: str | None = None, context: int | None = None,
         targets: list[str] | None = None) -> list[dict]:
    """One row per (tier, target, precision): memory parts, total, budget, fits; the pick per tier is marked."""
    from deltaship.models.source import load_source

    spec = load_source(model).spec
    catalog, _ = load_catalog(tiers_file)
    if tier is not None and tier not in catalog:
        raise DeltashipError(f"unknown tier {tier!r}; tiers: {', '.join(catalog)}",
                             "pick a tier from the catalog or add your own with --tiers FILE")
    if context is not None and context < 1:
        raise DeltashipError(f"--context must be positive, got {context}", "pass a context length in tokens")
    rows: list[PlanRow] = []
    for t in ([catalog[tier]] if tier else catalog.values()):
        ctx = min(context or t.context, spec.max_position_embeddings)
        tier_rows = [estimate(spec, t, tg, pr, ctx) for tg in (targets or t.targets) for pr in PRECISIONS]
        pick = recommend(spec, t, ctx, targets)
        for r in tier_rows:
            r.recommended = pick is not None and (r.target, r.precision, r.context) == (pick.target, pick.precision,
                                                                                         pick.context)
        if pick is not None and not any(r.recommended for r in tier_rows):
            pick.recommended = True
            tier_rows.append(pick)  # the pick needed a shorter context
        rows += tier_rows
    return [asdict(r) for r in rows]


def recommend(spec: ModelSpec, tier: Tier, context: int, targets: list[str] | None = None) -> PlanRow | None:
    """The tier's most preferred target at the best of its precisions that fits; the context is
    halved (down to 512) when nothing fits at the tier's typical context."""
    ctx = context
    while ctx >= min(512, context):
        for tg in targets or tier.targets:
            for pr in tier.precisions:
                row = estimate(spec, tier, tg, pr, ctx)
                if row.fits:
                    return row
        ctx //= 2
    return None


def verdicts(rows: list[dict], tiers_file: str | None = None) -> list[str]:
    """One line per tier: what is recommended and why the tier's other precisions were passed over, or that
    nothing fits, by how much, and what would (a smaller context, or a tier with a larger budget)."""
    catalog, _ = load_catalog(tiers_file)
    lines = []
    for name in dict.fromkeys(r["tier"] for r in rows):
        tier_rows = [r for r in rows if r["tier"] == name]
        pick = next((r for r in tier_rows if r["recommended"]), None)
        tier = catalog[name]
        if pick is not None:
            line = (f"{name}: {pick['target']} {pick['precision']} at context {pick['context']} "
                    f"({pick['total_bytes'] / GIB:.2f} of {pick['budget_bytes'] / GIB:.2f} GiB): the tier prefers "
                    f"{' > '.join(tier.targets)} and {' > '.join(tier.precisions)} (most accurate first)")
            smaller = [r for r in tier_rows if r["target"] == pick["target"] and r["fits"]
                       and r["total_bytes"] < pick["total_bytes"] and r["precision"] != pick["precision"]]
            if smaller:
                s = min(smaller, key=lambda r: r["total_bytes"])
                line += f"; {s['precision']} also fits, in {s['total_bytes'] / GIB:.2f} GiB"
            lines.append(line)
            continue
        best = min(tier_rows, key=lambda r: r["total_bytes"])
        lines.append(f"{name}: nothing fits. The smallest, {best['target']} {best['precision']} at context "
                     f"{best['context']}, needs {best['total_bytes'] / GIB:.2f} GiB of a {best['budget_bytes'] / GIB:.2f}"
                     f" GiB budget (weights {best['weights_bytes'] / GIB:.2f} GiB alone); it would fit a tier with "
                     f"{best['total_bytes'] / GIB:.2f} GiB or more to spend (--tiers FILE), or a smaller model")
    return lines


def format_table(rows: list[dict]) -> str:
    head = f"{'tier':<12} {'target':<11} {'prec':<5} {'context':>7} {'weights':>9} {'state':>9} {'overhead':>9} " \
           f"{'total':>9} {'budget':>9}  fit"
    lines = [head, "-" * len(head)]
    for r in rows:
        g = lambda b: f"{b / GIB:8.2f}G"  # noqa: E731
        mark = ("yes" if r["fits"] else "no") + ("  <- recommended" if r["recommended"] else "")
        lines.append(f"{r['tier']:<12} {r['target']:<11} {r['precision']:<5} {r['context']:>7} {g(r['weights_bytes'])} "
                     f"{g(r['state_bytes'])} {g(r['overhead_bytes'])} {g(r['total_bytes'])} {g(r['budget_bytes'])}  {mark}")
    return "\n".join(lines)


__all__ = ["plan", "format_table", "verdicts", "weight_bytes", "state_bytes"]
