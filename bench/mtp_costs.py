"""What speculative decoding with the MTP head costs on an ONNX bundle exported with --mtp, per call.

    python bench/mtp_costs.py BUNDLE [--threads 2] [--runs 20] [--context 128] [--acceptance 0.75]

Times (median of --runs, after a warmup, at --context tokens of context): one plain decode step; a verify call
of T = 2, 3, 4 tokens (every row's logits); the DeltaNet snapshot and its restore; a draft call of the MTP head
over 1 and 2 positions. Then the decode speed-up that depth-1 speculation would give at an acceptance rate
`--acceptance` (a projection from the measured costs, not a measured speed: say where the rate comes from),
and, when the bundle's head is trained, the measured wall clock of plain vs speculative greedy generation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from deltaship.runtimes import open_bundle


def median_ms(fn, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def measure(bundle: Path, threads: int, runs: int, context: int, acceptance: float) -> dict:
    s = open_bundle(bundle, threads=threads)
    h = s.manifest["model"]["hidden_size"]
    rng = np.random.default_rng(0)
    s.reset()
    s.prefill(rng.integers(0, 200, context).tolist())
    snap = s.snapshot()

    def at_context(fn):
        def run():
            s.restore(snap)
            fn()

        return run

    out: dict = {"bundle": str(bundle), "threads": threads, "context": context, "runs": runs}
    out["decode_ms"] = median_ms(at_context(lambda: s.decode(7)), runs)
    for t in (2, 3, 4):
        ids = np.full(t, 7, np.int64)
        out[f"verify_{t}_ms"] = median_ms(at_context(lambda ids=ids: s.verify(ids, np.arange(ids.size))), runs)
    out["snapshot_ms"] = median_ms(s.snapshot, runs)
    out["restore_ms"] = median_ms(lambda: s.restore(snap), runs)
    s.reset_draft()
    hid = rng.standard_normal((2, h)).astype(np.float32)
    for t in (1, 2):
        out[f"draft_{t}_ms"] = median_ms(lambda t=t: s.draft(hid[:t], np.full(t, 7, np.int64), context), runs)
    # depth 1: per verify call, a draft over ~1 new position, a verify of 2 tokens (3 after a rejection re-feeds
    # the accepted token), a snapshot, and a restore when the draft is rejected; 1 + acceptance tokens come out
    a = acceptance
    step = (
        out["draft_1_ms"]
        + a * out["verify_2_ms"]
        + (1 - a) * out["verify_3_ms"]
        + out["snapshot_ms"]
        + (1 - a) * out["restore_ms"]
    )
    out["projection"] = {
        "acceptance": a,
        "ms_per_token_plain": round(out["decode_ms"], 3),
        "ms_per_token_speculative": round(step / (1 + a), 3),
        "speedup": round(out["decode_ms"] * (1 + a) / step, 3),
    }
    return out


def measured(bundle: Path, threads: int, tokens: int) -> dict:
    from deltaship.runtimes.speculative import generate_speculative

    s = open_bundle(bundle, threads=threads)
    text = (Path(__file__).parent.parent / "deltaship/models/data/qwen3.5-tiny/heldout.txt").read_bytes()
    prompts = [list(text[o : o + 64]) for o in range(0, 4000, 500)]
    plain_s = spec_s = 0.0
    acc = drafted = same = 0
    for p in prompts:
        s.reset()
        t = time.perf_counter()
        plain = s.generate(p, tokens, stop_at_eos=False).output_ids
        plain_s += time.perf_counter() - t
        t = time.perf_counter()
        g, st = generate_speculative(s, p, tokens, 1, stop_at_eos=False)
        spec_s += time.perf_counter() - t
        acc, drafted, same = acc + st.accepted, drafted + st.drafted, same + (g.output_ids == plain)
    n = len(prompts) * tokens
    return {
        "prompts": len(prompts),
        "new_tokens": tokens,
        "acceptance": round(acc / drafted, 4),
        "identical_to_plain": f"{same}/{len(prompts)}",
        "tokens_per_s_plain": round(n / plain_s, 1),
        "tokens_per_s_speculative": round(n / spec_s, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--acceptance", type=float, default=0.75)
    ap.add_argument("--generate", type=int, default=0, help="also time plain vs speculative generation (tokens)")
    a = ap.parse_args()
    res = measure(a.bundle, a.threads, a.runs, a.context, a.acceptance)
    if a.generate:
        res["generation"] = measured(a.bundle, a.threads, a.generate)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
