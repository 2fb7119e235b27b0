"""Where an ONNX bundle spends its time, per op type (ONNX Runtime's profiler), for both DeltaNet lowerings.

    python bench/runtimes/onnx_ops.py [--model qwen3.5-0.8b] [--precision int4] [--threads 2] [--runs 5] \
        --out docs/results/onnx-ops.md

Exports the model twice (--onnx-deltanet-ops standard and contrib), then for each: one decode step at
context 128 and one 512-token prefill, `--runs` times after a warmup, with ORT's profiler on; prints
milliseconds per op type (mean over the runs) and the whole run, and writes the markdown page given by --out.
Profiling adds overhead to every node; compare the two lowerings with each other, not with
un-profiled timings.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
from pathlib import Path

import numpy as np

from deltaship.bundle.reader import read_manifest
from deltaship.compile import export
from deltaship.runtimes.onnx import OnnxSession


def profile(bundle: Path, threads: int, runs: int, prompt: int) -> tuple[float, dict[str, float]]:
    s = OnnxSession(bundle, read_manifest(bundle), threads=threads, profiling=True)
    ids = np.random.default_rng(0).integers(0, 1000, prompt).tolist()
    for _ in range(runs + 1):
        s.reset()
        if prompt == 1:
            s.seek(128)
            s.decode(1)
        else:
            s.prefill(ids)
    trace = json.loads(Path(s.sess.end_profiling()).read_text())
    model_runs = [e for e in trace if e.get("name") == "model_run"][1:]
    per_op: collections.Counter = collections.Counter()
    for run in model_runs:
        lo, hi = run["ts"], run["ts"] + run["dur"]
        for e in trace:
            if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and lo <= e["ts"] <= hi:
                per_op[e["args"].get("op_name", "?")] += e["dur"] / 1e3 / len(model_runs)
    return sum(r["dur"] for r in model_runs) / 1e3 / len(model_runs), dict(per_op)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3.5-0.8b")
    ap.add_argument("--precision", default="int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "deltaship-bench" / "onnx_ops")
    ap.add_argument("--out", type=Path, required=True, help="the markdown results page to write")
    a = ap.parse_args()
    results = {}
    for mode in ("standard", "contrib"):
        out = a.work / f"{a.model}-{a.precision}-{mode}"
        if not (out / "manifest.json").is_file():
            export(
                a.model,
                out,
                target="onnx",
                precision=a.precision,
                max_context=1024,
                force=True,
                verify=False,
                progress=False,
                onnx_deltanet_ops=mode,
            )
        results[mode] = {p: profile(out, a.threads, a.runs, p) for p in (1, 512)}
    lines = [
        "# ONNX Runtime time per op type: DeltaNet in standard ops vs ORT's contrib kernels",
        "",
        f"`python bench/runtimes/onnx_ops.py --model {a.model} --precision {a.precision} --threads {a.threads} --runs "
        f"{a.runs}`: ms per call, mean of {a.runs} profiled runs (ORT {__import__('onnxruntime').__version__}, "
        "CPU execution provider).",
        "",
    ]
    for p, what in ((1, "one decode step at context 128"), (512, "a 512-token prefill")):
        ops = sorted(
            {op for mode in results for op in results[mode][p][1]},
            key=lambda op: -max(results[m][p][1].get(op, 0) for m in results),
        )
        lines += [f"## {what}", "", "| op type | standard ms | contrib ms |", "|---|---|---|"]
        lines.append(f"| **whole run** | **{results['standard'][p][0]:.2f}** | **{results['contrib'][p][0]:.2f}** |")
        for op in ops[:14]:
            lines.append(
                f"| {op} | {results['standard'][p][1].get(op, 0):.2f} | {results['contrib'][p][1].get(op, 0):.2f} |"
            )
        lines.append("")
    text = "\n".join(lines)
    a.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
