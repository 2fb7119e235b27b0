"""Decode latency and resident memory at long context, per KV dtype, at a published shape (random weights).

    python bench/longctx/longctx.py [--preset qwen3.5-0.8b] [--contexts 4096,32768,131072,262143] [--kv fp16,int8,int4]
                            [--executorch fp16,int8,int4] [--max-context 262144] [--work DIR] [--reuse]
                            [--json bench/results/longctx.json]
    python bench/longctx/longctx.py --table bench/results/longctx.json     # the markdown table of docs/results/longctx.md
    python bench/longctx/longctx.py --annotate FILE.json   # add the kernel-scratch arithmetic to a run measured before it

For each target and KV dtype, in one invocation: an ONNX bundle (int4 weights; fp16 KV needs --onnx-activations
fp16, the others fp32 activations; the KV cache is the app's input: the export allocates none of it) and an
ExecuTorch bundle (int4 weights, fp32 activations, `--kv-cache fp16|int8|int4`; the KV buffers are the program's,
held by the exporting process: 3 GiB at 262K for fp16), exported at --max-context (262144),
then one profiling worker process (deltaship/profiling/worker.py, as `deltaship profile` runs it) that sweeps the
depths in increasing order with the synthetic fill of deltaship/profiling/longctx.py: a real 256-token prefix,
then KV rows bootstrapped from it, then single decode steps timed at the depth and the process's RSS read.
Memory is compared with the manifest's arithmetic: the RSS above the level after the real prefix against
(depth + 1 - prefix) x kv_bytes_per_token[kv_dtype]. The depths are 262,143 rather than 262,144 at the top:
the decode step at depth c writes row c, and the cache holds 262,144 rows.

--executorch KV,...: the ExecuTorch KV dtypes (fp32 too, but a 0.8B export at 262K then holds a 6 GiB cache);
"" for none. --max-context N with --contexts below it: a shorter run of the same path (each ExecuTorch export at
262K took 30+ minutes on a loaded 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MAX_CONTEXT = 262144


def export(preset: str, target: str, kv: str, out: Path, reuse: bool, max_context: int = MAX_CONTEXT) -> dict:
    if reuse and (out / "manifest.json").is_file():
        return {"bundle": str(out), "export_s": None, "reused": True}
    args = ["--model", preset, "--target", target, "--precision", "int4", "--max-context", str(max_context)]
    args += ["--no-verify", "--out", str(out), "--force", "--quiet"]
    if target == "onnx" and kv == "fp16":
        args += ["--onnx-activations", "fp16"]  # ONNX Runtime's GroupQueryAttention keeps its cache in its dtype
    elif kv != "fp32" or target == "executorch":
        args += ["--kv-cache", kv]
    t = time.time()
    r = subprocess.run([sys.executable, "-m", "deltaship.cli", "export", *args], capture_output=True, text=True)
    if r.returncode:
        return {"bundle": str(out), "error": (r.stdout + r.stderr)[-2000:], "export_s": time.time() - t}
    import resource  # the largest RSS of any export so far in this invocation (Linux: KiB)

    return {
        "bundle": str(out),
        "export_s": round(time.time() - t, 1),
        "exports_max_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
        "command": "deltaship export " + " ".join(args),
    }


def scratch_per_token(manifest: dict) -> int:
    """The manifest's kv_scratch_bytes_per_token_per_thread at its KV dtype; for bundles exported before the
    manifest recorded it, the target's formula (Target.kv_scratch_bytes_per_token) on the manifest's model."""
    mem = manifest["memory"]
    if "kv_scratch_bytes_per_token_per_thread" in mem:
        return mem["kv_scratch_bytes_per_token_per_thread"].get(mem["kv_dtype"], 0)
    from types import SimpleNamespace

    from deltaship.targets import get_target

    return get_target(manifest["target"]).kv_scratch_bytes_per_token(
        SimpleNamespace(**manifest["model"]), mem["kv_dtype"]
    )


def add_scratch(run: dict, manifest: dict, threads: int) -> None:
    """The arithmetic with the attention kernel's scratch (threads x per token x depth past the prefix), per row."""
    per = scratch_per_token(manifest)
    run["kv_scratch_bytes_per_token_per_thread"], run["threads"] = per, threads
    for r in run.get("rows", []):
        arith = r["manifest_kv_bytes_past_prefix"]
        r["manifest_kv_scratch_bytes_past_prefix"] = s = arith // run["kv_bytes_per_token"] * per * threads
        r["growth_over_arithmetic_with_scratch"] = round(r["rss_growth_bytes"] / (arith + s), 4) if arith else None


def measure(bundle: Path, contexts: list[int], threads: int | None, reps: int) -> dict:
    from deltaship.profiling.launch import run_worker

    cfg = dict(bundle=str(bundle), threads=threads, prompt_lengths=[], gen=0, contexts=contexts, reps=reps)
    cfg.update(warmups=1, min_seconds=0.0, breakdown=False)
    out, died = run_worker(cfg, None, timeout=3600)
    if died:
        return {"died": died}
    manifest = json.loads((bundle / "manifest.json").read_text())
    mem = manifest["memory"]
    per_token = mem["kv_bytes_per_token"][mem["kv_dtype"]]
    rows = []
    lat = {r["context"]: r for r in out["results"] if r["metric"] == "decode_latency_s" and r.get("samples")}
    rss = {r["context"]: r for r in out["results"] if r["metric"] == "rss_bytes"}
    for c in sorted(rss):
        m, d = rss[c], lat[c]
        arith = m["manifest_kv_bytes_past_prefix"]
        grew = m["median"] - m["rss_after_prefix_bytes"]
        rows.append(
            {
                "context": c,
                "decode_ms_median": round(d["median"] * 1e3, 2),
                "decode_ms_samples": [round(x * 1e3, 2) for x in d["samples"]],
                "decode_cv": round(d["cv"], 3),
                "rss_bytes": int(m["median"]),
                "rss_after_prefix_bytes": int(m["rss_after_prefix_bytes"]),
                "rss_growth_bytes": int(grew),
                "manifest_kv_bytes_past_prefix": arith,
                "growth_over_arithmetic": round(grew / arith, 4) if arith else None,
                "manifest_state_bytes": m["manifest_state_bytes"],
                "fill_s": round(d["fill_s"], 2),
                "position_seen": d["position_seen"],
            }
        )
    peak = next(r["median"] for r in out["results"] if r["metric"] == "peak_rss_bytes")
    run = {
        "runtime": out["runtime"],
        "kv_dtype": mem["kv_dtype"],
        "kv_bytes_per_token": per_token,
        "deltanet_state_bytes": mem["deltanet_state_bytes"],
        "bundle_bytes": manifest.get("bundle_bytes"),
        "fill": lat[min(lat)]["note"] if lat else None,
        "fill_prefix_tokens": next(iter(lat.values()))["fill_prefix_tokens"] if lat else None,
        "peak_rss_bytes": int(peak),
        "rows": rows,
    }
    add_scratch(run, manifest, threads or os.cpu_count() or 1)
    return run


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def table(doc: dict) -> str:
    """The results as a markdown table (docs/results/longctx.md)."""
    lines = [
        "| target | KV | context | decode ms (median) | CV | RSS MiB | RSS growth past the prefix MiB | "
        "manifest KV past the prefix MiB | growth / arithmetic | growth / (KV + kernel scratch) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in doc["runs"]:
        if "rows" not in run:
            why = run.get("error") or run.get("died", {}).get("reason")
            lines.append(f"| {run['target']} | {run['kv']} | - | failed: {str(why)[-120:]} | | | | | | |")
            continue
        for r in run["rows"]:
            lines.append(
                f"| {run['target']} | {run['kv']} | {r['context']:,} | {r['decode_ms_median']:,.1f} | "
                f"{r['decode_cv']:.2f} | {r['rss_bytes'] / 2**20:,.0f} | {r['rss_growth_bytes'] / 2**20:,.0f} | "
                f"{r['manifest_kv_bytes_past_prefix'] / 2**20:,.0f} | {r['growth_over_arithmetic']:.3f} | "
                + (
                    f"{r['growth_over_arithmetic_with_scratch']:.3f} |"
                    if "growth_over_arithmetic_with_scratch" in r
                    else "- |"
                )
            )
    return "\n".join(lines)


def main() -> int:
    if sys.argv[1:2] == ["--annotate"]:  # a JSON measured before add_scratch existed: add it from the bundles
        path = Path(sys.argv[2])
        doc = json.loads(path.read_text())
        threads = int(doc["command"].split("--threads ")[1].split()[0]) if "--threads " in doc["command"] else None
        for run in doc["runs"]:
            if "rows" in run and "threads" not in run:
                add_scratch(
                    run, json.loads((Path(run["bundle"]) / "manifest.json").read_text()), threads or os.cpu_count()
                )
        path.write_text(json.dumps(doc, indent=1) + "\n")
        return 0
    if sys.argv[1:2] == ["--table"]:
        print(table(json.loads(Path(sys.argv[2]).read_text())))
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3.5-0.8b")
    ap.add_argument("--contexts", default="4096,32768,131072,262143")
    ap.add_argument("--kv", default="fp16,int8,int4", help="ONNX KV dtypes (fp32 too)")
    ap.add_argument("--executorch", default="fp16,int8,int4", help="ExecuTorch KV dtypes (fp32 too); '' for none")
    ap.add_argument("--max-context", type=int, default=MAX_CONTEXT, help="the bundles' max context")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "deltaship-bench" / "longctx")
    ap.add_argument("--reuse", action="store_true", help="reuse bundles already exported in --work")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=ROOT / "bench/results/longctx.json")
    ap.add_argument("--append", action="store_true", help="add these runs to the runs already in --json")
    a = ap.parse_args()
    contexts = [int(x) for x in a.contexts.split(",")]
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    doc = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python bench/longctx/longctx.py " + " ".join(sys.argv[1:]),
        "commit": commit.stdout.strip(),
        "machine": f"{platform.system()} {platform.machine()}, {_cpu()}",
        "cpus": __import__("os").cpu_count(),
        "preset": a.preset,
        "weights": "int4 (random weights, the published shape)",
        "max_context": a.max_context,
        "contexts": contexts,
        "runs": [],
    }
    if a.append and a.json.is_file():
        before = json.loads(a.json.read_text())
        doc["runs"] = before["runs"]
        doc["earlier"] = [{k: before[k] for k in ("created", "command", "commit")}] + before.get("earlier", [])
    jobs = [("onnx", kv) for kv in a.kv.split(",") if kv] + [("executorch", kv) for kv in a.executorch.split(",") if kv]
    for target, kv in jobs:
        out = a.work / f"{target}-{kv}"
        print(f"[{time.strftime('%H:%M:%S')}] {target} kv {kv}: export", file=sys.stderr, flush=True)
        run = {"target": target, "kv": kv, **export(a.preset, target, kv, out, a.reuse, a.max_context)}
        if "error" not in run:
            print(f"[{time.strftime('%H:%M:%S')}] {target} kv {kv}: measure", file=sys.stderr, flush=True)
            run.update(measure(out, contexts, a.threads, a.reps))
        doc["runs"].append(run)
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(doc, indent=1) + "\n")  # after each run: a cut-short bench keeps what it has
    print(json.dumps([{k: r.get(k) for k in ("target", "kv", "peak_rss_bytes")} for r in doc["runs"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
