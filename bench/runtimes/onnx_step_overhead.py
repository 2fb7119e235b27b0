"""Python overhead of one decode step of deltaship's ONNX driver (everything in OnnxSession._forward but the run).

    python bench/runtimes/onnx_step_overhead.py BUNDLE [--steps 2000]

Times `_forward` of a one-token call twice on one session: as is, and with the session's run_with_iobinding
replaced by a no-op, so the second is the driver's own per-step cost (bindings, position, state bookkeeping,
logits copy). Medians in microseconds. No GPU, no assertions: a number to compare before and after a driver change.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from statistics import median

import numpy as np

from deltaship.bundle.reader import read_manifest
from deltaship.runtimes.onnx import OnnxSession


def per_step_us(session: OnnxSession, steps: int) -> float:
    ids = np.array([5], dtype=np.int64)
    times = []
    for _ in range(steps):
        if session.position >= session.max_context - 1:
            session.reset()
        t0 = time.perf_counter()
        session._forward(ids)
        times.append(time.perf_counter() - t0)
        session.position += 1
    return median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    s = OnnxSession(a.bundle, read_manifest(a.bundle), threads=a.threads)
    s.prefill([1, 2, 3])
    full = per_step_us(s, a.steps)
    s.sess.run_with_iobinding = lambda *args, **kw: None  # the driver without ONNX Runtime's run
    overhead = per_step_us(s, a.steps)
    print(json.dumps({"step_us": round(full, 1), "python_overhead_us": round(overhead, 1), "states": len(s.states)}))


if __name__ == "__main__":
    main()
