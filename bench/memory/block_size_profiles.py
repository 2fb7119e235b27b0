"""`deltaship profile` of bundles side by side, alternating, in rounds: peak RSS, the plan beside it, decode and
prefill speed (ratios between the bundles of one run; the machine may be shared).

    python bench/memory/block_size_profiles.py B32 B128 [--rounds 2] [--gen 32] --json OUT

Written for int4 bundles exported at two quantization blocks (`deltaship export --block-size`), the 512-token
prefill of tests/test_memory_plan.py's workload at 2 threads; the profile documents are written whole to OUT.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from deltaship.profiling.profile import profile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", nargs="+", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args()
    work = dict(prompt_lengths=[512], gen=a.gen, contexts=[], warmups=1, reps=2, min_seconds=0, breakdown=False)
    out: dict[str, list[dict]] = {}
    for r in range(a.rounds):
        for b in a.bundles:
            doc = profile(b, threads=a.threads, **work)
            res = {x["metric"]: x.get("median") for x in doc["results"] if x.get("samples")}
            m = doc["memory_plan"]
            print(
                f"round {r} {b.name}: peak {m['peak_rss_bytes'] / 2**30:.3f} GiB, plan {m['total_bytes'] / 2**30:.3f} "
                f"({m['plan_over_measured']:.3f}), decode {res['decode_tok_s']:.2f} tok/s, 512-token prefill "
                f"{res['prefill_tok_s']:.1f} tok/s",
                flush=True,
            )
            out.setdefault(str(b), []).append(doc)
    a.json.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
