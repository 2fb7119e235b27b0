"""What a depth-1 verify call (2 tokens) costs against a decode step, taken apart, on ONNX bundles: the same
two-token call on a bundle without --mtp (the plain graph: the compute of a second token), on the --mtp bundle's
plain path (`_forward`: the graph with its rollback split, states in place), then `verify` asking for the last
row's logits only (the states written out of place, which the rollback needs) and for both rows (what the driver
asks: the LM head's second row). Optional further --mtp bundles (other `--block-size`) give the same calls.

    deltaship export --model qwen3.5-0.8b --target onnx --precision int4 --max-context 512 --no-verify --out PLAIN
    deltaship export --model qwen3.5-0.8b --target onnx --precision int4 --mtp --mtp-draft-vocab 32768 \
        --max-context 512 --no-verify [--block-size 128] --out MTP
    python bench/speculative/mtp_verify_parts.py PLAIN MTP [MTP128 ...] [--rounds 40] [--context 128] [--out bench/results/x.json]

One process, every session with 2 threads that stop spinning when a call returns (as deltaship sets for --mtp
bundles; a spinning session would slow the next session's call), every call at `--context` (seek: costs do not
depend on the states' values), the calls interleaved round by round so that load drifts hit them alike; medians and
quartiles of wall-clock ms. Ratios are to the first bundle's decode step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundles", nargs="+", type=Path, help="a bundle without --mtp, then one or more --mtp bundles")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    load = os.getloadavg()[0]

    from mtp_verify_ops import interleaved  # bench/speculative/, beside this script

    import deltaship.runtimes.onnx as onnx_runtime
    from deltaship.bundle.reader import read_manifest

    options = onnx_runtime.session_options
    # the plain bundle's session takes turns too, so that no call pays for another session's spinning threads
    onnx_runtime.session_options = lambda *args, **kw: options(*args, **{**kw, "turn_taking": True})
    two = np.array([7, 9], np.int64)
    calls: dict[str, tuple] = {}
    for b in a.bundles:
        m = read_manifest(b)
        s = onnx_runtime.OnnxSession(b, m, threads=a.threads)
        tag = f"{b.name} (block {m['quantization'].get('block_size')}{', --mtp' if 'speculative' in m else ''})"
        calls[f"{tag}: decode step"] = (s, lambda s: s._forward(two[:1]))
        calls[f"{tag}: 2 tokens, plain path"] = (s, lambda s: s._forward(two))
        if "speculative" in m:
            calls[f"{tag}: verify 2, last row"] = (s, lambda s: s.verify(two, np.array([1], np.int64)))
            calls[f"{tag}: verify 2, both rows"] = (s, lambda s: s.verify(two, np.arange(2, dtype=np.int64)))
    ms = interleaved(calls, a.context, a.rounds)
    base = statistics.median(next(iter(ms.values())))
    rows = {}
    for c, v in ms.items():
        med = statistics.median(v)
        q1, q3 = np.percentile(v, [25, 75])
        rows[c] = {"median_ms": round(med, 2), "q1_ms": round(float(q1), 2), "q3_ms": round(float(q3), 2),
                   "x_first_decode_step": round(med / base, 3)}  # fmt: skip
        print(f"{c:<64} {med:7.1f} ms  [{q1:6.1f}, {q3:6.1f}]  x{med / base:.3f}", flush=True)
    if a.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
        doc = {
            "command": "python bench/speculative/mtp_verify_parts.py " + " ".join(map(str, a.bundles)),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": commit.strip(),
            "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, threads {a.threads}",
            "load_average_at_start": round(load, 2),
            "context": a.context,
            "rounds": a.rounds,
            "calls": rows,
        }
        a.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
