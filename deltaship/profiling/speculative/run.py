"""The measuring process of `deltaship profile BUNDLE --speculative mtp[:K]` (run as
`python -m deltaship.profiling.speculative.run CONFIG_JSON`): open the bundle, time each call, generate over the
prompt set with and without speculation, and print the records and the summary as JSON."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from deltaship.bundle.reader import read_manifest
from deltaship.profiling.speculative.imposed import ImposedAcceptance
from deltaship.profiling.speculative.projection import PROJECTION_ACCEPTANCE, PROJECTION_SOURCE, project
from deltaship.profiling.speculative.workload import prompt_set, random_weights
from deltaship.profiling.worker import now, record, repeat
from deltaship.runtimes.speculative import generate_speculative, require_speculative, rolls_back_to_first
from deltaship.stats import ratio_ci
from deltaship.targets import open_bundle


@dataclass(frozen=True)
class Timing:
    """How each call is timed, as every profile phase: warmups, then at least `reps` samples and `min_seconds`."""

    warmups: int
    reps: int
    min_seconds: float


@dataclass(frozen=True)
class Generation:
    """Greedy decoding over the prompt set: tokens/s per prompt (plain, speculative, at the imposed acceptance, and
    rolling back by snapshot where the session can keep the first token instead) and the driver's counts."""

    plain_rates: list[float]
    spec_rates: list[float]
    imposed_rates: list[float]
    snapshot_rates: list[float]
    same: int
    drafted: int
    accepted: int
    verify_calls: int
    emitted: int
    imposed_drafted: int
    imposed_accepted: int


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: open the bundle, measure the costs and the generation, return records and a summary."""
    bundle, threads, depth = Path(cfg["bundle"]), cfg.get("threads"), int(cfg["depth"])
    timing = Timing(cfg.get("warmups", 2), cfg.get("reps", 5), cfg.get("min_seconds", 2.0))
    manifest = read_manifest(bundle)
    session: Any = open_bundle(bundle, threads=threads, check_hashes=False)
    require_speculative(session)
    c = int(cfg["context"])
    results, costs = measure_costs(session, c, depth, manifest["model"]["hidden_size"], timing)
    gen = int(cfg["gen"])
    prompts = [p for p in prompt_set(bundle, manifest) if p]
    rate_used = float(cfg.get("acceptance") or PROJECTION_ACCEPTANCE)
    g = measure_generation(session, prompts, gen, depth, rate_used, rolls_back="rollback_to_first" in costs)
    where = dict(prompts=len(prompts), gen=gen)
    results.append(record("plain_decode_tok_s", "tok/s", g.plain_rates, **where, note="greedy, one sample per prompt"))
    results.append(
        record("spec_decode_tok_s", "tok/s", g.spec_rates, **where, note=f"greedy, mtp:{depth}, one per prompt")
    )
    source = cfg.get("acceptance_source") or PROJECTION_SOURCE
    summary = summarize(session, manifest, c, depth, costs, len(prompts), gen, g, rate_used, source)
    return {"results": results, "speculative": summary, "runtime": session.runtime_name(), "threads": threads}


def measure_costs(
    session: Any, c: int, depth: int, h: int, timing: Timing
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each call's records at context depth `c`, and their medians in ms: decode (one step), verify {T: ms},
    draft {P: ms}, snapshot, restore, and rollback_to_first where the session has it."""
    warmups, reps, min_s = timing.warmups, timing.reps, timing.min_seconds
    rng = np.random.default_rng(0)
    results: list[dict[str, Any]] = []

    def at_context(fn):
        def timed() -> float:
            session.reset()
            session.seek(c)  # a call's cost depends on the depth, not on the state's values
            t0 = now()
            fn()
            return now() - t0

        return timed

    def med(metric: str, **where: Any) -> float:
        r = next(r for r in results if r["metric"] == metric and all(r.get(k) == v for k, v in where.items()))
        return 1e3 * r["median"]

    results.append(
        record(
            "decode_latency_s",
            "s",
            repeat(at_context(lambda: session.decode(7)), warmups, reps, min_s),
            context=c,
            note="one plain decode step at this context depth (reached by seek)",
        )
    )
    for t in range(1, depth + 3):
        ids = np.full(t, 7, np.int64)
        rows = np.arange(t, dtype=np.int64)
        samples = repeat(at_context(lambda ids=ids, rows=rows: session.verify(ids, rows)), warmups, reps, min_s)
        results.append(
            record("verify_s", "s", samples, context=c, tokens=t, note="one verify call: every row's logits")
        )

    def timed(fn):
        def run_once() -> float:
            t0 = now()
            fn()
            return now() - t0

        return run_once

    # the snapshot before a verify call of K+1 tokens, and the restore that undoes it (each timed alone)
    snap_s: list[float] = []
    ids, rows = np.full(depth + 1, 7, np.int64), np.arange(depth + 1, dtype=np.int64)

    def rollback() -> float:
        session.reset()
        session.seek(c)
        t0 = now()
        snap = session.snapshot()
        snap_s.append(now() - t0)
        session.verify(ids, rows)
        t0 = now()
        session.restore(snap)
        return now() - t0

    restore_s = repeat(rollback, warmups, reps, min_s)
    rolls_back = rolls_back_to_first(session)

    def rollback_to_first() -> float:
        session.reset()
        session.seek(c)
        session.verify(ids, rows)
        t0 = now()
        session.rollback_to_first()
        return now() - t0

    if rolls_back:
        results.append(
            record(
                "rollback_to_first_s",
                "s",
                repeat(rollback_to_first, warmups, reps, min_s),
                note="keeping only the first token of a verify call (the bundle's rollback outputs become the states)",
            )
        )
    results.append(
        record(
            "snapshot_s",
            "s",
            snap_s[warmups:],
            note="what the runtime keeps before a verify call to undo it (the KV caches keep their length pointer)",
        )
    )
    results.append(record("restore_s", "s", restore_s, note="undoing the verify call after a rejection"))
    session.reset_draft()
    hid = rng.standard_normal((depth + 1, h)).astype(np.float32)
    for p in range(1, depth + 2):
        ids = np.full(p, 7, np.int64)

        draft = timed(lambda p=p, ids=ids: session.draft(hid[:p], ids, c))
        results.append(
            record("draft_s", "s", repeat(draft, warmups, reps, min_s), context=c, positions=p, note="MTP head call")
        )
    costs = {
        "decode": med("decode_latency_s"),
        "verify": {t: med("verify_s", tokens=t) for t in range(1, depth + 3)},
        "draft": {p: med("draft_s", positions=p) for p in range(1, depth + 2)},
        "snapshot": med("snapshot_s"),
        "restore": med("restore_s"),
        **({"rollback_to_first": med("rollback_to_first_s")} if rolls_back else {}),
    }
    return results, costs


def measure_generation(
    session: Any, prompts: list[list[int]], gen: int, depth: int, rate_used: float, rolls_back: bool
) -> Generation:
    """Plain and speculative greedy decoding, alternated prompt by prompt; each run timed from its first new token
    to its last."""
    stamps: list[float] = []
    stamp = lambda _tok: stamps.append(now())  # noqa: E731

    def rate() -> float:
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])  # first new token to last: prefill left out

    session.generate(prompts[0], min(gen, 8), stop_at_eos=False)  # warm both paths up
    generate_speculative(session, prompts[0], min(gen, 8), depth, stop_at_eos=False)
    plain_rates, spec_rates, imposed_rates, snapshot_rates, same = [], [], [], [], 0
    # drafts accepted at rate_used over the whole prompt set (one schedule each)
    imposed, by_snapshot = ImposedAcceptance(session, rate_used), ImposedAcceptance(session, rate_used, rollback=False)
    drafted = accepted = verify_calls = emitted = 0
    imposed_drafted = imposed_accepted = 0
    for p in prompts:
        stamps.clear()
        session.reset()
        plain = session.generate(p, gen, stop_at_eos=False, on_token=stamp).output_ids
        plain_rates.append(rate())
        stamps.clear()
        g, st = generate_speculative(session, p, gen, depth, stop_at_eos=False, on_token=stamp)
        spec_rates.append(rate())
        same += g.output_ids == plain
        drafted, accepted = drafted + st.drafted, accepted + st.accepted
        verify_calls, emitted = verify_calls + st.verify_calls, emitted + sum(st.emitted_per_verify)
        stamps.clear()
        _, st = generate_speculative(imposed, p, gen, depth, stop_at_eos=False, on_token=stamp)
        imposed_rates.append(rate())
        imposed_drafted, imposed_accepted = imposed_drafted + st.drafted, imposed_accepted + st.accepted
        if rolls_back:  # the other way back, on the same bundle: snapshot, restore and feed the token again
            stamps.clear()
            generate_speculative(by_snapshot, p, gen, depth, stop_at_eos=False, on_token=stamp)
            snapshot_rates.append(rate())
    return Generation(
        plain_rates,
        spec_rates,
        imposed_rates,
        snapshot_rates,
        same,
        drafted,
        accepted,
        verify_calls,
        emitted,
        imposed_drafted,
        imposed_accepted,
    )


def summarize(
    session: Any,
    manifest: dict[str, Any],
    c: int,
    depth: int,
    costs: dict[str, Any],
    n_prompts: int,
    gen: int,
    g: Generation,
    rate_used: float,
    source: str,
) -> dict[str, Any]:
    """The profile document's `speculative` block: costs, acceptance, measured speeds and the projections."""
    rolls_back = "rollback_to_first" in costs
    plain_rates, spec_rates, imposed_rates, snapshot_rates = (
        g.plain_rates,
        g.spec_rates,
        g.imposed_rates,
        g.snapshot_rates,
    )
    drafted, accepted, verify_calls, emitted = g.drafted, g.accepted, g.verify_calls, g.emitted
    rand = random_weights(manifest)
    measured_acceptance = accepted / drafted if drafted else 0.0
    speedup = ratio_ci(spec_rates, plain_rates)
    imposed_speedup = ratio_ci(imposed_rates, plain_rates)
    summary: dict[str, Any] = {
        "method": "mtp",
        "depth": depth,
        "context": c,
        "random_weights": rand,
        # the draft head's logits: every token id, or N of them (--mtp-draft-vocab N)
        "draft_vocab": (manifest["speculative"]["draft"].get("vocab") or {}).get("size")
        or manifest["model"]["vocab_size"],
        "vocab_size": manifest["model"]["vocab_size"],
        "latencies": session.latency_note or f"measured on this host in {session.runtime_name()}",
        "device_latencies": session.latency_note is None,
        "costs_ms": {
            "decode_step": round(costs["decode"], 4),
            "verify": {str(t): round(v, 4) for t, v in costs["verify"].items()},
            "draft": {str(p): round(v, 4) for p, v in costs["draft"].items()},
            "snapshot": round(costs["snapshot"], 4),
            "restore": round(costs["restore"], 4),
            **({"rollback_to_first": round(costs["rollback_to_first"], 4)} if rolls_back else {}),
        },
        "relative_to_decode_step": {
            "verify": {str(t): round(v / costs["decode"], 4) for t, v in costs["verify"].items()},
            "draft": {str(p): round(v / costs["decode"], 4) for p, v in costs["draft"].items()},
            "snapshot": round(costs["snapshot"] / costs["decode"], 4),
            "restore": round(costs["restore"] / costs["decode"], 4),
            **({"rollback_to_first": round(costs["rollback_to_first"] / costs["decode"], 4)} if rolls_back else {}),
        },
        "rollback": "first token kept in place (rollback outputs), else snapshot" if rolls_back else "snapshot",
        "acceptance": {
            "prompts": n_prompts,
            "new_tokens": gen,
            "drafted": drafted,
            "accepted": accepted,
            "acceptance_rate": round(measured_acceptance, 4),
            "mean_accepted_length": round(accepted / max(verify_calls, 1), 4),
            "tokens_per_verify": round(emitted / max(verify_calls, 1), 4),
            "identical_to_plain": g.same,
            "meaningful": not rand,
            **(
                {"note": "random weights: the head's drafts are noise; this says nothing of a trained head"}
                if rand
                else {}
            ),
        },
        "decode_tok_s": {
            "plain": round(float(np.median(plain_rates)), 3),
            "speculative": round(float(np.median(spec_rates)), 3),
            "speedup": round(speedup["ratio"], 4),
            "speedup_ci95": [round(x, 4) for x in speedup["ci95"]],
            "measured": "in this run, over the prompt set above",
        },
        "decode_tok_s_imposed": {
            "label": "timed at an imposed acceptance: the driver's real calls, each draft accepted with the stated "
            "probability by rigging the verify call's logits (greedy); measures speed, not the head",
            "acceptance": rate_used,
            "source": source,
            "drafted": g.imposed_drafted,
            "accepted": g.imposed_accepted,
            "acceptance_rate": round(g.imposed_accepted / g.imposed_drafted, 4) if g.imposed_drafted else None,
            "plain": round(float(np.median(plain_rates)), 3),
            "speculative": round(float(np.median(imposed_rates)), 3),
            "speedup": round(imposed_speedup["ratio"], 4),
            "speedup_ci95": [round(x, 4) for x in imposed_speedup["ci95"]],
            **(
                {
                    "speculative_by_snapshot": round(float(np.median(snapshot_rates)), 3),
                    "speedup_by_snapshot": round(ratio_ci(snapshot_rates, plain_rates)["ratio"], 4),
                    "by_snapshot": "the same loop with rollback_to_first left unused: a rejection restores the "
                    "snapshot and the next verify call feeds the kept token again (3 tokens)",
                }
                if rolls_back
                else {}
            ),
        },
        "projection": {
            "label": "projection, not a measurement: the measured per-call costs at a stated acceptance rate",
            "source": source,
            **project(costs, depth, rate_used),
        },
        "projection_at_measured_acceptance": project(costs, depth, measured_acceptance),
    }
    return summary


def main() -> int:
    sys.stdout.write(json.dumps(run(json.loads(sys.argv[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
