"""The planner's text: one verdict line per tier, the table of rows by part, the vision tower's table."""

from __future__ import annotations

from deltaship.devices.catalog import GIB, load_catalog
from deltaship.devices.plan.memory import FREE_CHUNK, KV_ORDER
from deltaship.targets import get_target


def verdicts(rows: list[dict], tiers_file: str | None = None) -> list[str]:
    """One line per tier: what is recommended and why the tier's other precisions were passed over, or that
    nothing fits (at the context asked for), by how much and by what part, and what would (a smaller prefill
    chunk, a narrower KV cache, a shorter context, a tier with a larger budget)."""
    catalog, _ = load_catalog(tiers_file)
    defaults = {name: get_target(name).default_prefill_chunk for name in {r["target"] for r in rows}}
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
                f"{_chunk_note(pick, defaults)}"
                f"({pick['total_bytes'] / GIB:.2f} of {pick['budget_bytes'] / GIB:.2f} GiB): "
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
            lines.append(line + _chunk_cost(pick, tier_rows, defaults) + _planned_kv(tier_rows, pick))
            continue
        at_asked = [r for r in tier_rows if r["context"] == asked]
        best = min([r for r in at_asked if r.get("kv_exportable", True)] or at_asked, key=lambda r: r["total_bytes"])
        line = (
            f"{name}: nothing fits{f' at context {asked}' if pick else ''}. The smallest, {best['target']} "
            f"{best['precision']}{_kv_note(best, at_asked)} at context {best['context']}, needs "
            f"{best['total_bytes'] / GIB:.2f} GiB of a {best['budget_bytes'] / GIB:.2f} GiB budget "
            f"({parts(best)})"
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
                f"{pick['context']} {_chunk_note(pick, defaults)}"
                f"({pick['total_bytes'] / GIB:.2f} of {pick['budget_bytes'] / GIB:.2f} GiB)"
            ) + _chunk_cost(pick, tier_rows, defaults)
        elif not best.get("npu_problem") and not best.get("prompt_cache_problem"):  # no budget lifts those
            line += (
                f"; it would fit a tier with {best['total_bytes'] / GIB:.2f} GiB or more to spend (--tiers FILE), "
                "or a smaller model"
            )
        lines.append(line)
    return lines


def _smaller_chunk(r: dict, defaults: dict[str, int]) -> bool:
    """The row was planned at a prefill chunk below its target's default (a chunk the planner chose); defaults:
    each target's default prefill chunk."""
    return 0 < r.get("prefill_chunk", 0) < min(defaults[r["target"]], r["context"])


def _chunk_note(r: dict, defaults: dict[str, int]) -> str:
    """'with --prefill-chunk 128 ' when the row needs a chunk below its target's default; nothing otherwise."""
    return f"with --prefill-chunk {r['prefill_chunk']} " if _smaller_chunk(r, defaults) else ""


def _chunk_cost(pick: dict, rows: list[dict], defaults: dict[str, int]) -> str:
    """Why the pick's chunk is smaller than its target's default, and what that costs in prefill speed."""
    if not _smaller_chunk(pick, defaults):
        return ""
    default = min(defaults[pick["target"]], pick["context"])
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


def parts(r: dict) -> str:
    """The memory breakdown of a row, in GiB."""
    if not r.get("kv_dtype"):
        return f"weights {r['weights_bytes'] / GIB:.2f} GiB alone"
    return (
        f"weights {r['weights_bytes'] / GIB:.2f} + {r['kv_dtype']} KV cache {r['kv_bytes'] / GIB:.2f} + DeltaNet "
        f"states {r['deltanet_bytes'] / GIB:.2f} + activations {r['activation_bytes'] / GIB:.2f} (attention "
        f"scores {r['attention_scores_bytes'] / GIB:.2f}"
        + (f", KV scratch {r['kv_scratch_bytes'] / GIB:.2f}" if r.get("kv_scratch_bytes") else "")
        + f") + runtime {r['runtime_bytes'] / GIB:.2f}"
        + (f" + prompt cache restore {r['prompt_cache_restore_bytes'] / GIB:.2f}" if _cached(r) else "")
        + " GiB"
        + (f"; {r['npu_problem']}" if r.get("npu_problem") else "")
        + (f"; {r['prompt_cache_problem']}" if r.get("prompt_cache_problem") else "")
    )


def _cached(r: dict) -> bool:
    """The row counts a prompt cache shipped in the bundle (plan --prompt-cache)."""
    return r.get("prompt_cache_tokens") is not None


def _planned_kv(tier_rows: list[dict], pick: dict | None) -> str:
    """What a KV dtype the target does not export yet (planned) would add: a longer context that fits."""
    reach = pick["context"] if pick else 0
    better = [r for r in tier_rows if not r.get("kv_exportable", True) and r["fits"] and r["context"] > reach]
    if not better:
        return ""
    b = max(better, key=lambda r: (r["context"], -r["total_bytes"]))
    return (
        f". With an {b['kv_dtype']} KV cache (planned, not exportable yet) {b['target']} {b['precision']} "
        f"fits at context {b['context']} in {b['total_bytes'] / GIB:.2f} GiB ({parts(b)})"
    )


def format_table(rows: list[dict], provenance: bool = True) -> str:
    """The rows as a table: memory by part (KV cache, DeltaNet states, activations, runtime, and a shipped prompt
    cache's restore when one is planned) in GiB. provenance: a footnote per (target, precision) saying where its
    memory terms come from (measured when and where, or estimated); otherwise one line saying they exist."""
    cached = any(_cached(r) for r in rows)
    head = (
        "memory in GiB\n"
        f"{'tier':<12} {'target':<11} {'prec':<5} {'kv':<5} {'context':>7} {'chunk':>5} {'weights':>8} {'loaded':>8} "
        f"{'kv':>8} "
        f"{'deltanet':>8} {'activ.':>8} {'runtime':>8} " + (f"{'pcache':>8} " if cached else "") + f"{'total':>8} "
        f"{'budget':>8}  fit"
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
            f"{g(r['activation_bytes'])} {g(r['runtime_bytes'])} "
            + (f"{g(r['prompt_cache_restore_bytes'])} " if cached else "")
            + f"{g(r['total_bytes'])} "
            f"{g(r['budget_bytes'])}  {mark}"
        )
    if any(not r.get("kv_exportable", True) for r in rows):
        lines.append("* a KV-cache dtype the target cannot export yet (planned)")
    lines.append(
        "loaded: the weights as resident once the runtime has loaded them (prepacked copies); total: the runtime plus "
        "the larger of loading and a prefill chunk" + (" (with pcache)" if cached else "")
    )
    notes = sorted({(r["target"], r["precision"], r.get("terms", "")) for r in rows})
    if provenance:
        lines += [f"  {target} {precision}: {terms}" for target, precision, terms in notes]
    elif notes:
        lines.append(f"where each row's memory terms come from ({len(notes)} notes): deltaship plan --verbose")
    if cached:
        lines += prompt_cache_lines(rows)
    return "\n".join(lines)


def prompt_cache_lines(rows: list[dict]) -> list[str]:
    """What a shipped prompt cache (export --prompt-cache) costs: the pcache column, and its bytes in the bundle
    (the state at its length: DeltaNet states whole, KV caches up to it), by the (target, precision, KV dtype) that
    share a size."""
    tokens = next(r["prompt_cache_tokens"] for r in rows if _cached(r))
    sizes: dict[int, list[str]] = {}
    for r in rows:
        if _cached(r):
            name = f"{r['target']} {r['precision']} ({r['kv_dtype']} KV)"
            sizes.setdefault(r["prompt_cache_bytes"], [])
            if name not in sizes[r["prompt_cache_bytes"]]:
                sizes[r["prompt_cache_bytes"]].append(name)
    return [
        f"pcache: restoring the prompt cache of {tokens:,} tokens when a chat starts from it (its file read, checked "
        "and written into the session's states one at a time, then freed): on the peak, not held",
        f"prompt cache {tokens:,} tokens in the bundle: "
        + "; ".join(f"{_gib(size)} ({', '.join(names)})" for size, names in sorted(sizes.items(), reverse=True)),
    ]


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
