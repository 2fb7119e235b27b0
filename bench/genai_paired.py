"""onnxruntime-genai and deltaship's own ONNX driver on one bundle, in ONE process, alternating prompt by prompt.

    python bench/genai_paired.py BUNDLE [--threads 2] [--pairs 12] [--prompt 128] [--decode 16]

bench/genai_vs_own.py compares whole `deltaship profile` runs, one process per runtime; this one loads both
runtimes in one process (the same libonnxruntime build: genai dlopens the onnxruntime wheel's) and alternates them
per prompt (A B, then B A, ...), so that load on the machine, and anything particular to a process, weighs on both
alike. Each pair gives a ratio own time / genai time (> 1: genai faster); the medians of the ratios are printed as
JSON, with the median times. Both runtimes go through deltaship's Session API (runtimes/onnx.py and
runtimes/genai.py: genai's append_tokens + get_logits per call), reset before each prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from statistics import median

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def one(session, ids: list[int], steps: int) -> tuple[float, float]:
    """Prefill seconds and the median decode step seconds of one prompt."""
    session.reset()
    t = time.perf_counter()
    logits = session.prefill(ids)
    prefill = time.perf_counter() - t
    tok, steps_s = int(np.argmax(logits)), []
    for _ in range(steps):
        t = time.perf_counter()
        logits = session.decode(tok)
        steps_s.append(time.perf_counter() - t)
        tok = int(np.argmax(logits))
    return prefill, median(steps_s)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=16)
    a = ap.parse_args()
    from deltaship.runtimes import open_bundle

    own = open_bundle(a.bundle, threads=a.threads, check_hashes=False)
    genai = open_bundle(a.bundle, threads=a.threads, check_hashes=False, runtime="genai")
    ids = np.random.default_rng(0).integers(100, 5000, size=a.prompt).tolist()
    for s in (own, genai, own, genai):  # warm both (memory patterns, caches)
        one(s, ids, a.decode)
    rows = []
    for i in range(a.pairs):
        order = ("own", "genai") if i % 2 == 0 else ("genai", "own")
        rows.append({name: one(own if name == "own" else genai, ids, a.decode) for name in order})
    out = {
        "bundle": str(a.bundle),
        "threads": a.threads,
        "pairs": a.pairs,
        "loadavg": os.getloadavg(),
        "genai_speed_over_own_prefill": round(median(r["own"][0] / r["genai"][0] for r in rows), 3),
        "genai_speed_over_own_decode": round(median(r["own"][1] / r["genai"][1] for r in rows), 3),
        "own_prefill_ms": round(1e3 * median(r["own"][0] for r in rows), 1),
        "genai_prefill_ms": round(1e3 * median(r["genai"][0] for r in rows), 1),
        "own_decode_ms": round(1e3 * median(r["own"][1] for r in rows), 2),
        "genai_decode_ms": round(1e3 * median(r["genai"][1] for r in rows), 2),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
