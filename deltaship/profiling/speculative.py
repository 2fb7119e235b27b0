"""`deltaship profile BUNDLE --speculative mtp[:K]`: what speculative decoding with the bundle's MTP head costs
and gives, measured in one fresh process (deltaship/runtimes/speculative.py is the driver it measures).

Costs, at one context depth (`--contexts`' first, default 128), each timed like every profile phase (warmups, then
at least --reps samples and --min-seconds): one plain decode step; the verify call of T = 1 .. K+2 tokens (every
row's logits and hidden state: K+1 is the usual call, the pending token plus K drafts, longer ones follow a
rejection); the draft head over P = 1 .. K+1 new positions; the DeltaNet snapshot and its restore.

Generation, over a fixed prompt set (8 windows of the trained tiny preset's held-out text, through the bundle's
tokenizer, or as byte values when it has none): greedy decode tokens/s without and with speculation, one sample per
prompt each, both timed from the first new token to the last (prefill left out), in the same process; the
acceptance rate and the accepted length of the speculative runs; whether their tokens equal the plain ones.

Projection: decode tokens/s that the measured costs give at a stated acceptance rate (each draft accepted with
that probability, independently), simulating the driver's calls (snapshot every verify call, a restore and a longer
next call after a rejection). It is labelled a projection and cites where the rate comes from. On a bundle with
random weights (a published-shape preset) the measured acceptance means nothing, and the record says so.

Runtimes: deltaship's own session of the bundle (ONNX Runtime, ExecuTorch, Core ML). On Linux a Core ML bundle runs
in the MIL evaluator (the saved program op by op with numpy): the same measurements, but the record's `latencies`
says they are the evaluator's, not a device's (`device_latencies` false); tokens, acceptance and equality hold.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from deltaship.errors import DeltashipError
from deltaship.models.trained import HELDOUT

# the trained tiny head's measured depth-1 acceptance (int4 ONNX, 8 held-out prompts x 128 greedy tokens)
PROJECTION_ACCEPTANCE = 0.75
PROJECTION_SOURCE = (
    "qwen3.5-tiny's trained MTP head, measured: depth-1 acceptance 0.752 (fp32) / 0.766 (int4) over 8 held-out "
    "prompts x 128 greedy tokens (docs/results/mtp.md)"
)
PROMPTS = 8
PROMPT_BYTES = 64


def random_weights(manifest: dict[str, Any]) -> bool:
    """True for a bundle of a preset whose weights are random (its head drafts nothing worth accepting)."""
    source = manifest.get("source") or {}
    if source.get("kind") != "preset":
        return False
    from deltaship.models.presets import PRESETS

    preset = PRESETS.get(source.get("model", ""))
    return preset is not None and preset.weights.startswith("random")


def prompt_set(bundle: Path, manifest: dict[str, Any]) -> list[list[int]]:
    """The fixed prompts: PROMPTS windows of PROMPT_BYTES bytes of the tiny preset's held-out text."""
    text = HELDOUT.read_bytes()
    windows = [text[o : o + PROMPT_BYTES] for o in range(0, PROMPTS * 500, 500)]
    if "tokenizer.json" in manifest.get("tokenizer", {}).get("files", []):
        from deltaship.runtimes.tokenizer import load_tokenizer

        tok = load_tokenizer(bundle, manifest)
        return [tok.encode(w.decode("utf-8", "replace")) for w in windows]
    return [list(w) for w in windows]


def check(
    bundle: Path,
    manifest: dict[str, Any],
    cfg: dict[str, Any],
    depth: int,
    *,
    device: str = "host",
    runtime: str | None = None,
    provider: str = "cpu",
    tier: str | None = None,
    acceptance: float | None = None,
) -> None:
    """Refuse what cannot be profiled speculatively, before any work."""
    from deltaship.runtimes.speculative import require_head

    require_head(bundle, manifest)
    if acceptance is not None and not 0 < acceptance <= 1:
        raise DeltashipError(
            f"--acceptance {acceptance}: an acceptance rate is a fraction above 0, at most 1", "e.g. --acceptance 0.75"
        )
    if device != "host" or runtime is not None or provider != "cpu" or tier is not None:
        raise DeltashipError(
            "--speculative profiles on this host, in deltaship's own runtime on the CPU (no --tier yet)",
            "drop --device/--runtime/--provider/--tier, or drop --speculative",
        )
    mc, c, gen = int(manifest["max_context"]), min(cfg["contexts"] or [128]), int(cfg["gen"])
    if c + 2 * depth + 2 > mc or PROMPT_BYTES + gen > mc or gen < 2:
        raise DeltashipError(
            f"the speculative workload does not fit this bundle's max context of {mc}: calls of up to "
            f"{2 * depth + 2} tokens at context {c}, and prompts of up to {PROMPT_BYTES} tokens + --gen {gen}",
            "pass a smaller --contexts / --gen (at least 2), or export with a larger --max-context",
        )


# ---- the projection -------------------------------------------------------------------------------
def _cost(table: dict[int, float]):
    """ms of a call of n tokens/positions: the measured value, or a straight line through the two longest measured
    calls beyond them (calls grow about linearly with their length once past the bandwidth-bound few)."""
    xs = sorted(table)

    def at(n: int) -> float:
        if n in table:
            return table[n]
        a, b = xs[-2], xs[-1]
        return table[b] + (n - b) * (table[b] - table[a]) / (b - a)

    return at


def project(costs: dict[str, Any], depth: int, acceptance: float, calls: int = 20000, seed: int = 0) -> dict[str, Any]:
    """Decode speed from measured per-call costs (ms) at an acceptance rate: the driver's calls simulated with each
    draft accepted with probability `acceptance`, independently. costs: decode (one step), verify {T: ms},
    draft {P: ms}, snapshot, restore, and rollback_to_first where the session has it (a call that fed the newest
    token and its drafts keeps its first token when the first draft is rejected: no snapshot at depth 1, no
    re-fed tokens)."""
    from deltaship.runtimes.speculative import MAX_PENDING

    first = costs.get("rollback_to_first")  # None: the session rolls back by snapshot only

    verify, draft = (
        _cost({int(k): v for k, v in costs["verify"].items()}),
        _cost({int(k): v for k, v in costs["draft"].items()}),
    )
    rng = np.random.default_rng(seed)
    pending, emitted_before, total_ms, tokens = 1, 1, 0.0, 0
    for _ in range(calls):
        ms = draft(emitted_before) + (depth - 1) * draft(1) + verify(pending + depth)
        ms += 0.0 if first is not None and depth == 1 and pending == 1 else costs["snapshot"]
        ok = rng.random(depth) < acceptance
        accepted = depth if ok.all() else int(np.argmin(ok))
        tokens += accepted + 1
        if accepted == depth:
            pending = 1
        elif first is not None and accepted == 0 and pending == 1:
            ms += first
        else:  # restore; the accepted tokens and the decoder's own ride along with the next call
            ms += costs["restore"]
            pending += accepted + 1
            if pending - 1 > MAX_PENDING:
                ms += verify(pending - 1)
                pending = 1
        emitted_before = accepted + 1
        total_ms += ms
    ms_per_token = total_ms / tokens
    return {
        "acceptance": acceptance,
        "tokens_per_verify": round(tokens / calls, 4),
        "ms_per_token": round(ms_per_token, 4),
        "tokens_per_s": round(1e3 / ms_per_token, 2),
        "tokens_per_s_plain": round(1e3 / costs["decode"], 2),
        "speedup": round(costs["decode"] / ms_per_token, 4),
    }


class ImposedAcceptance:
    """A session (delegating everything) whose verify calls come back with each row's next fed token made the row's
    argmax or not by a shuffled schedule that accepts round(100 rate) of every 100 rows: greedy speculative decoding
    then accepts drafts at that rate, in random order. It times the driver's real calls (draft, verify, rollback) on a
    bundle whose own head accepts nothing (random weights); the tokens it emits mean nothing. Rows are rigged only
    in calls that ask for every row (the driver's verify calls; prefill asks for the last row only)."""

    def __init__(self, session: Any, rate: float, seed: int = 0, rollback: bool = True):
        object.__setattr__(self, "_session", session)
        object.__setattr__(self, "_rate", rate)
        object.__setattr__(self, "_rollback", rollback)  # False: undo rejections by snapshot even where it could not
        object.__setattr__(self, "_rng", np.random.default_rng(seed))
        object.__setattr__(self, "_schedule", [])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    def __setattr__(self, name: str, value: Any) -> None:  # the driver moves session.position
        setattr(self._session, name, value)

    def can_rollback_to_first(self) -> bool:
        from deltaship.runtimes.speculative import rolls_back_to_first

        return self._rollback and rolls_back_to_first(self._session)

    def verify(self, ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logits, hidden = self._session.verify(ids, rows)
        if len(rows) == ids.size:
            logits = np.array(logits)
            for j in range(ids.size - 1):
                row, tok = logits[j], int(ids[j + 1])
                if not self._schedule:
                    block = np.arange(100) < round(100 * self._rate)
                    self._schedule.extend(self._rng.permutation(block).tolist())
                row[tok] = row.max() + 1.0 if self._schedule.pop() else row.min() - 1.0
        return logits, hidden


# ---- the measuring process ------------------------------------------------------------------------
def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: open the bundle, measure the costs and the generation, return records and a summary."""
    from deltaship.bundle.reader import read_manifest
    from deltaship.profiling.worker import now, record, repeat
    from deltaship.runtimes.speculative import generate_speculative, require_speculative, rolls_back_to_first
    from deltaship.stats import ratio_ci
    from deltaship.targets import open_bundle

    bundle, threads, depth = Path(cfg["bundle"]), cfg.get("threads"), int(cfg["depth"])
    warmups, reps, min_s = cfg.get("warmups", 2), cfg.get("reps", 5), cfg.get("min_seconds", 2.0)
    manifest = read_manifest(bundle)
    session: Any = open_bundle(bundle, threads=threads, check_hashes=False)
    require_speculative(session)
    c = int(cfg["context"])
    h = manifest["model"]["hidden_size"]
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

    # generation over the fixed prompts: plain and speculative greedy decoding, alternated prompt by prompt
    gen = int(cfg["gen"])
    prompts = [p for p in prompt_set(bundle, manifest) if p]
    stamps: list[float] = []
    stamp = lambda _tok: stamps.append(now())  # noqa: E731

    def rate() -> float:
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])  # first new token to last: prefill left out

    rate_used = float(cfg.get("acceptance") or PROJECTION_ACCEPTANCE)
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
    where = dict(prompts=len(prompts), gen=gen)
    results.append(record("plain_decode_tok_s", "tok/s", plain_rates, **where, note="greedy, one sample per prompt"))
    results.append(
        record("spec_decode_tok_s", "tok/s", spec_rates, **where, note=f"greedy, mtp:{depth}, one per prompt")
    )
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
            "prompts": len(prompts),
            "new_tokens": gen,
            "drafted": drafted,
            "accepted": accepted,
            "acceptance_rate": round(measured_acceptance, 4),
            "mean_accepted_length": round(accepted / max(verify_calls, 1), 4),
            "tokens_per_verify": round(emitted / max(verify_calls, 1), 4),
            "identical_to_plain": same,
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
            "source": cfg.get("acceptance_source") or PROJECTION_SOURCE,
            "drafted": imposed_drafted,
            "accepted": imposed_accepted,
            "acceptance_rate": round(imposed_accepted / imposed_drafted, 4) if imposed_drafted else None,
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
            "source": cfg.get("acceptance_source") or PROJECTION_SOURCE,
            **project(costs, depth, rate_used),
        },
        "projection_at_measured_acceptance": project(costs, depth, measured_acceptance),
    }
    return {"results": results, "speculative": summary, "runtime": session.runtime_name(), "threads": threads}


def profile_speculative(
    path: Path, cfg: dict[str, Any], depth: int, threads: int | None, say, acceptance: float | None = None
) -> dict[str, Any]:
    """Run the measuring process; the parts of the profile document it fills: results, speculative, runtime."""
    from deltaship.devices.discovery import fingerprint
    from deltaship.profiling.profile import run_worker

    wcfg = {
        "bundle": str(path),
        "threads": threads,
        "depth": depth,
        "context": min(cfg["contexts"] or [128]),
        "gen": cfg["gen"],
        "warmups": cfg["warmups"],
        "reps": cfg["reps"],
        "min_seconds": cfg["min_seconds"],
        **({"acceptance": acceptance, "acceptance_source": "given with --acceptance"} if acceptance else {}),
    }
    say(f"profiling speculative decoding (mtp:{depth}) of {path.name} on the host ({threads or 'default'} threads)")
    out, died = run_worker(wcfg, module="deltaship.profiling.speculative")
    doc: dict[str, Any] = {"device": fingerprint("host"), "threads": threads}
    if died:
        doc["results"] = [died]
    else:
        doc.update(results=out["results"], speculative=out["speculative"], runtime=out["runtime"])
    return doc


# ---- the text report --------------------------------------------------------------------------------
def format_speculative(s: dict[str, Any]) -> str:
    """The speculative block of a profile as text: costs relative to a decode step, acceptance, speeds."""
    c, rel, a, d, pr = (
        s["costs_ms"],
        s["relative_to_decode_step"],
        s["acceptance"],
        s["decode_tok_s"],
        s["projection"],
    )
    lines = [f"speculative decoding, mtp:{s['depth']}, context {s['context']} (median ms; x one decode step)"]
    if s.get("draft_vocab", s.get("vocab_size")) != s.get("vocab_size"):
        lines.append(f"  draft head over {s['draft_vocab']} of {s['vocab_size']} token ids (--mtp-draft-vocab)")
    if not s.get("device_latencies", True):
        lines.append(f"  LATENCIES: {s['latencies']}")
    lines.append(f"  decode step          {c['decode_step']:9.3f} ms  x1.00")
    lines += [f"  verify {t:>2} tokens     {v:9.3f} ms  x{rel['verify'][t]:.2f}" for t, v in c["verify"].items()]
    lines += [f"  draft {p:>2} positions   {v:9.3f} ms  x{rel['draft'][p]:.2f}" for p, v in c["draft"].items()]
    lines += [
        f"  snapshot             {c['snapshot']:9.3f} ms  x{rel['snapshot']:.2f}",
        f"  restore              {c['restore']:9.3f} ms  x{rel['restore']:.2f}",
        *(
            [f"  rollback to first    {c['rollback_to_first']:9.3f} ms  x{rel['rollback_to_first']:.2f}"]
            if "rollback_to_first" in c
            else []
        ),
        f"acceptance over {a['prompts']} prompts x {a['new_tokens']} tokens: {a['acceptance_rate']:.3f} "
        f"({a['accepted']}/{a['drafted']}), {a['mean_accepted_length']:.3f} drafts accepted per verify call, "
        f"{a['tokens_per_verify']:.3f} tokens per verify call; output identical to plain greedy on "
        f"{a['identical_to_plain']}/{a['prompts']} prompts",
    ]
    if not a["meaningful"]:
        lines.append(f"  ({a['note']})")
    lines += [
        f"decode tok/s, measured: plain {d['plain']:.2f}, speculative {d['speculative']:.2f} "
        f"(x{d['speedup']:.3f}, 95% CI [{d['speedup_ci95'][0]:.3f}, {d['speedup_ci95'][1]:.3f}])",
        f"PROJECTION at acceptance {pr['acceptance']} ({pr['source']}): {pr['tokens_per_s']:.2f} tok/s vs "
        f"{pr['tokens_per_s_plain']:.2f} plain, x{pr['speedup']:.3f} ({pr['tokens_per_verify']:.2f} tokens per "
        "verify call); a projection from the measured costs, not a measured speed",
    ]
    imp = s.get("decode_tok_s_imposed")
    if imp:
        lines.append(
            f"decode tok/s TIMED AT AN IMPOSED ACCEPTANCE {imp['acceptance']} (drafts accepted "
            f"{imp['accepted']}/{imp['drafted']} by rigging the verify logits): plain {imp['plain']:.2f}, "
            f"speculative {imp['speculative']:.2f} (x{imp['speedup']:.3f}, 95% CI [{imp['speedup_ci95'][0]:.3f}, "
            f"{imp['speedup_ci95'][1]:.3f}])"
            + (
                f"; rolling back by snapshot instead: {imp['speculative_by_snapshot']:.2f} "
                f"(x{imp['speedup_by_snapshot']:.3f})"
                if "speculative_by_snapshot" in imp
                else ""
            )
        )
    m = s["projection_at_measured_acceptance"]
    lines.append(
        f"projection at the measured acceptance {m['acceptance']:.3f}: x{m['speedup']:.3f} (against the measured "
        f"x{d['speedup']:.3f}: how well the cost model holds)"
    )
    return "\n".join(lines)


def headline(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The report's summary lines for a speculative profile."""
    a, d, pr = s["acceptance"], s["decode_tok_s"], s["projection"]
    t = str(s["depth"] + 1)
    emulated = [] if s.get("device_latencies", True) else [("latencies", s["latencies"])]
    lines = emulated + [
        (f"verify of {t} tokens / decode step", f"x{s['relative_to_decode_step']['verify'][t]:.2f}"),
        ("draft step / decode step", f"x{s['relative_to_decode_step']['draft']['1']:.2f}"),
        (
            "acceptance (measured)" + ("" if a["meaningful"] else ", random weights: meaningless"),
            f"{a['acceptance_rate']:.3f}, {a['mean_accepted_length']:.2f} accepted per verify call",
        ),
        (
            "decode tok/s plain / speculative (measured)",
            f"{d['plain']:.2f} / {d['speculative']:.2f} (x{d['speedup']:.3f})",
        ),
        (f"PROJECTION at acceptance {pr['acceptance']}", f"{pr['tokens_per_s']:.2f} tok/s (x{pr['speedup']:.3f})"),
    ]
    imp = s.get("decode_tok_s_imposed")
    if imp:
        lines.append(
            (
                f"decode tok/s timed at an imposed acceptance {imp['acceptance']}",
                f"{imp['speculative']:.2f} (x{imp['speedup']:.3f})",
            )
        )
    return lines


def plot_speculative(s: dict[str, Any], plt):
    """Bars: each call's cost in decode steps (median)."""
    rel = s["relative_to_decode_step"]
    names = ["decode step"] + [f"verify {t}" for t in rel["verify"]] + [f"draft {p}" for p in rel["draft"]]
    names += ["snapshot", "restore"]
    values = [1.0, *rel["verify"].values(), *rel["draft"].values(), rel["snapshot"], rel["restore"]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, values)
    ax.axhline(1.0, color="grey", linestyle=":")
    ax.set_ylabel("x one decode step (median)")
    title = f"Speculative decoding (mtp:{s['depth']}): cost of each call at context {s['context']}"
    if not s.get("device_latencies", True):
        title += "\n(latencies of an emulation, not a device: see the record's 'latencies')"
    ax.set_title(title)
    ax.tick_params(axis="x", labelrotation=45)
    return fig


def main() -> int:
    sys.stdout.write(json.dumps(run(json.loads(sys.argv[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
