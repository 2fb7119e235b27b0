"""onnxruntime-genai and deltaship's own ONNX driver on one bundle, in ONE process, alternating prompt by prompt.

    python bench/peers/genai_paired.py BUNDLE [--threads 2] [--pairs 12] [--prompt 128] [--decode 16]

bench/peers/genai_vs_own.py compares whole `deltaship profile` runs, one process per runtime; this one loads both
runtimes in one process (the same libonnxruntime build: genai dlopens the onnxruntime wheel's) and alternates them
per prompt (A B, then B A, ...), so that load on the machine, and anything particular to a process, weighs on both
alike. Each pair gives a ratio own time / genai time (> 1: genai faster); the medians of the ratios are printed as
JSON, with the median times. Both runtimes go through deltaship's Session API (runtimes/onnx.py and
runtimes/genai.py: genai's append_tokens + get_logits per call), reset before each prompt.

With --processes each runtime lives in a process of its own (as in an app, and as in the whole-profile runs of
bench/peers/genai_vs_own.py), started once and driven over a pipe: the parent still alternates them prompt by prompt,
and a worker waits blocked on its pipe while the other one runs, so the pairing still cancels the machine's drift.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from statistics import median, quantiles

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


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


def worker(conn, bundle: str, threads: int, runtime: str, reopen: int = 0) -> None:
    """--processes: one runtime's session in this process; runs `one` for each (ids, steps) it is sent. With
    `reopen`, the bundle is first opened and closed that many times, as `deltaship profile` does for its warm-load
    metric before it measures prefill and decode."""
    import gc

    from deltaship.targets import open_bundle

    kwargs = {"runtime": "genai"} if runtime == "genai" else {}
    for _ in range(reopen):
        again = open_bundle(Path(bundle), threads=threads, check_hashes=False, **kwargs)
        del again
        gc.collect()
    session = open_bundle(Path(bundle), threads=threads, check_hashes=False, **kwargs)
    conn.send("ready")
    while (job := conn.recv()) is not None:
        conn.send(one(session, *job))


class Remote:
    """A session in a worker process, called like `one(session, ids, steps)` through `run`."""

    def __init__(self, ctx, bundle: Path, threads: int, runtime: str, reopen: int = 0):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker, args=(child, str(bundle), threads, runtime, reopen), daemon=True)
        self.proc.start()
        if self.conn.recv() != "ready":
            raise RuntimeError(f"the {runtime} worker did not start")

    def run(self, ids: list[int], steps: int) -> tuple[float, float]:
        self.conn.send((ids, steps))
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--processes", action="store_true", help="each runtime in a worker process of its own")
    ap.add_argument("--reopen", type=int, default=0, help="--processes: open and close the bundle N times first")
    a = ap.parse_args()
    if a.processes:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter each: nothing loaded before the runtime
        remotes = {
            "own": Remote(ctx, a.bundle, a.threads, "onnxruntime", a.reopen),
            "genai": Remote(ctx, a.bundle, a.threads, "genai", a.reopen),
        }
        run = {name: r.run for name, r in remotes.items()}
    else:
        from deltaship.targets import open_bundle

        sessions = {
            "own": open_bundle(a.bundle, threads=a.threads, check_hashes=False),
            "genai": open_bundle(a.bundle, threads=a.threads, check_hashes=False, runtime="genai"),
        }
        run = {name: (lambda ids, steps, s=s: one(s, ids, steps)) for name, s in sessions.items()}
    ids = np.random.default_rng(0).integers(100, 5000, size=a.prompt).tolist()
    for name in ("own", "genai", "own", "genai"):  # warm both (memory patterns, caches)
        run[name](ids, a.decode)
    rows = []
    for i in range(a.pairs):
        order = ("own", "genai") if i % 2 == 0 else ("genai", "own")
        rows.append({name: run[name](ids, a.decode) for name in order})
    if a.processes:
        for r in remotes.values():
            r.close()
    ratios = {k: [r["own"][j] / r["genai"][j] for r in rows] for j, k in enumerate(("prefill", "decode"))}
    out = {
        "bundle": str(a.bundle),
        "threads": a.threads,
        "pairs": a.pairs,
        "processes": "one per runtime" if a.processes else "one for both",
        "reopen": a.reopen,
        "prompt_tokens": a.prompt,
        "decode_steps": a.decode,
        "loadavg": os.getloadavg(),
        "genai_speed_over_own_prefill": round(median(r["own"][0] / r["genai"][0] for r in rows), 3),
        "genai_speed_over_own_decode": round(median(r["own"][1] / r["genai"][1] for r in rows), 3),
        "own_prefill_ms": round(1e3 * median(r["own"][0] for r in rows), 1),
        "genai_prefill_ms": round(1e3 * median(r["genai"][0] for r in rows), 1),
        "own_decode_ms": round(1e3 * median(r["own"][1] for r in rows), 2),
        "genai_decode_ms": round(1e3 * median(r["genai"][1] for r in rows), 2),
        # the spread of the per-pair ratios: quartiles, so one disturbed pair does not move the verdict
        "ratio_quartiles_prefill": [round(x, 3) for x in quantiles(ratios["prefill"], n=4)],
        "ratio_quartiles_decode": [round(x, 3) for x in quantiles(ratios["decode"], n=4)],
        "pairs_raw": rows,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
