"""Where a verify call of T tokens spends its time against one plain decode step, per op type (ONNX Runtime's
profiler), on an ONNX bundle exported with --mtp.

    python bench/speculative/mtp_verify_ops.py BUNDLE [--context 128] [--steps 8] [--threads 2] [--tokens 1,2,3]

Per op type (and the LM head's MatMulNBits apart, by node name): the median kernel ms per call of a decode step and
of verify calls of each T with every row's logits, plus `verify last row`: the verify call of the largest T asking
only its last row's logits (what the rows cost). The profiler adds microseconds to every node: read the differences
between calls, not the totals.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

import numpy as np


def by_op(
    bundle: Path, context: int, steps: int, threads: int, calls: dict, in_place: bool = False
) -> dict[str, dict[str, float]]:
    import onnx

    from deltaship.bundle.reader import read_manifest
    from deltaship.runtimes.onnx import OnnxSession

    graph = onnx.load(str(bundle / "model.onnx"), load_external_data=False).graph
    lm_head = {n.name for n in graph.node if n.op_type == "MatMulNBits" and "lm_head" in n.input[1]}
    s = OnnxSession(bundle, read_manifest(bundle), threads=threads, profiling=True)
    if in_place:  # verify updates the recurrent states in place, as plain calls do (no spare: no rollback)
        s._spare = {}
    order = []
    for _ in range(steps + 1):
        for name, fn in calls.items():
            s.reset()
            s.seek(context)
            fn(s)
            order.append(name)
    trace_file = Path(s.sess.end_profiling())
    trace = json.loads(trace_file.read_text())
    shutil.rmtree(trace_file.parent, ignore_errors=True)
    runs = [e for e in trace if e.get("name") == "model_run"]
    assert len(runs) == len(order), (len(runs), len(order))
    nodes = [e for e in trace if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
    per: dict[str, dict[str, list[float]]] = {n: {} for n in calls}
    for i, (run, name) in enumerate(zip(runs, order)):
        if i < len(calls):  # the first round warms up
            continue
        lo, hi = run["ts"], run["ts"] + run["dur"]
        acc: dict[str, float] = {"(model_run)": run["dur"] / 1e3}
        for e in nodes:
            if lo <= e["ts"] <= hi:
                op = e.get("args", {}).get("op_name", "?")
                if e["name"].removesuffix("_kernel_time") in lm_head:
                    op = "MatMulNBits (lm_head)"
                acc[op] = acc.get(op, 0.0) + e["dur"] / 1e3
        for op, ms in acc.items():
            per[name].setdefault(op, []).append(ms)
    return {n: {op: statistics.median(v) for op, v in d.items()} for n, d in per.items()}


def interleaved(calls: dict[str, tuple], context: int, rounds: int) -> dict[str, list[float]]:
    """Wall ms of each call {name: (session, fn(session))}, every call at `context` (reset, then seek), the calls
    interleaved round by round so that load drifts hit them alike; round 0 warms up and is not kept."""
    import time

    out: dict[str, list[float]] = {n: [] for n in calls}
    for r in range(rounds + 1):
        for name, (s, fn) in calls.items():
            s.reset()
            s.seek(context)
            t0 = time.perf_counter()
            fn(s)
            if r:
                out[name].append(1e3 * (time.perf_counter() - t0))
    return out


def wall(bundle: Path, context: int, rounds: int, threads: int, calls: dict, in_place: bool) -> dict[str, float]:
    """Median wall ms per call without the profiler, the calls interleaved round by round (load drifts cancel)."""
    from deltaship.bundle.reader import read_manifest
    from deltaship.runtimes.onnx import OnnxSession

    s = OnnxSession(bundle, read_manifest(bundle), threads=threads)
    if in_place:
        s._spare = {}
    out = interleaved({n: (s, fn) for n, fn in calls.items()}, context, rounds)
    return {n: statistics.median(v) for n, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", default="1,2,3")
    ap.add_argument("--rounds", type=int, default=20, help="rounds of the wall-clock comparison")
    ap.add_argument(
        "--in-place",
        action="store_true",
        help="verify updates the DeltaNet recurrent states in place (as before the out-of-place rollback)",
    )
    a = ap.parse_args()
    ts = [int(t) for t in a.tokens.split(",")]
    calls = {"decode": lambda s: s.decode(7)}
    for t in ts:
        calls[f"verify {t}"] = lambda s, t=t: s.verify(np.full(t, 7, np.int64), np.arange(t, dtype=np.int64))
    calls["verify last row"] = lambda s: s.verify(np.full(ts[-1], 7, np.int64), np.array([ts[-1] - 1], np.int64))
    res = by_op(a.bundle, a.context, a.steps, a.threads, calls, a.in_place)
    ops = sorted({op for d in res.values() for op in d}, key=lambda op: -res["decode"].get(op, 0.0))
    print(f"{'op (ms per call, median)':<28}" + "".join(f"{n:>16}" for n in res))
    for op in ops:
        print(f"{op:<28}" + "".join(f"{res[n].get(op, 0.0):>16.2f}" for n in res))
    w = wall(a.bundle, a.context, a.rounds, a.threads, calls, a.in_place)
    print(f"{'wall ms per call, median':<28}" + "".join(f"{w[n]:>16.2f}" for n in res))
    print(f"{'x decode':<28}" + "".join(f"{w[n] / w['decode']:>16.3f}" for n in res))
    print(json.dumps({"by_op": res, "wall_ms": w}))


if __name__ == "__main__":
    main()
