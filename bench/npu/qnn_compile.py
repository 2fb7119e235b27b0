"""Ahead-of-time compilation of a preset's QNN graphs into EPContext models, one per Snapdragon SoC.
Regenerates: the ahead-of-time compile table of docs/npu.md.

    flock /tmp/heavy.lock nice -n 5 python bench/npu/qnn_compile.py --model qwen3.5-0.8b \\
        [--max-context 4096] [--prefill-chunk 8 | 1] [--socs 8gen3,8elite] [--graphs prefill.onnx] \\
        [--rss-limit-gib 12] \\
        [--work DIR] [--json bench/results/qnn-compile-0.8b.json]

Each step runs in a fresh process so its peak RSS is its own (Linux's VmHWM): first `deltaship export --target qnn
--no-verify` (the decode graph and, at a --prefill-chunk over 1, the prefill graph; not compiled), then
deltaship.lowering.qnn.context.compile_context for every graph of that bundle x SoC. A step whose RSS passes
--rss-limit-gib is stopped and recorded with the peak measured so far. Prints and writes one JSON record: the
machine, commit, command, versions, and per step its wall time, peak RSS and products (graph nodes and bytes;
context model and binary bytes, sha256, QNN version). The HTP simulator is not involved in compiling; nothing here
is a phone's speed.
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
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _status_kib(pid: int, key: str) -> int:
    """VmRSS / VmHWM of a live process, in KiB (0 once it has gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _run_step(args: list[str], limit_kib: int) -> dict:
    """Run this script's `--step ...` in a child; its JSON line, wall time and peak RSS (killed past the limit)."""
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak = killed = 0
    while child.poll() is None:
        peak = max(peak, _status_kib(child.pid, "VmHWM"))
        if _status_kib(child.pid, "VmRSS") > limit_kib:
            child.kill()
            killed = 1
        time.sleep(0.2)
    out, err = child.communicate()
    wall = time.perf_counter() - start
    lines = [ln for ln in out.decode().splitlines() if ln.startswith("{")]
    record = json.loads(lines[-1]) if lines else {}
    peak = max(peak, record.pop("peak_rss_kib", 0))
    record.update({"wall_s": round(wall, 1), "peak_rss_gib": round(peak / 2**20, 2)})
    if killed:
        record["stopped"] = f"RSS passed the {limit_kib / 2**20:.0f} GiB limit"
    if child.returncode != 0 and not killed:
        record["error"] = err.decode(errors="replace").strip().splitlines()[-3:]
    return record


def _peak_kib() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def step_lower(model: str, max_context: int, chunk: int, soc_name: str, bundle: Path) -> dict:
    """`deltaship export --target qnn --no-verify` (the graphs, not compiled): the bundle's graphs and sizes."""
    from deltaship.compile import export

    start = time.perf_counter()
    manifest = export(
        model,
        bundle,
        target="qnn",
        precision="fp16",
        max_context=max_context,
        prefill_chunk=chunk,
        verify=False,
        fidelity=False,
        progress=False,
        qnn_soc=soc_name,
    )
    export_s = time.perf_counter() - start
    graphs = [
        {
            "file": g["file"],
            "tokens": g["tokens"],
            "nodes": g["nodes"],
            "graph_bytes": (bundle / g["file"]).stat().st_size,
        }
        for g in manifest["lowering"]["graphs"].values()
    ]
    return {"export_s": round(export_s, 1), "graphs": graphs, "peak_rss_kib": _peak_kib()}


def step_compile(graph: Path, soc_name: str, out: Path) -> dict:
    from deltaship.lowering.qnn.context import compile_context
    from deltaship.lowering.qnn.soc import soc

    out.mkdir(parents=True, exist_ok=True)
    made = compile_context(graph, soc(soc_name), out)
    return {**made, "peak_rss_kib": _peak_kib()}


def _commit() -> str:
    run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True)
    return run.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3.5-0.8b")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--prefill-chunk", type=int, default=8, help="1: the decode graph only")
    p.add_argument("--socs", default="8gen3,8elite")
    p.add_argument("--graphs", default="", help="compile only these graphs of the bundle (e.g. prefill.onnx)")
    p.add_argument("--rss-limit-gib", type=float, default=12.0)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "deltaship-bench" / "qnn-compile")
    p.add_argument("--json", type=Path)
    p.add_argument("--step", choices=["lower", "compile"], help=argparse.SUPPRESS)
    p.add_argument("--graph", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--soc", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.step == "lower":
        print(json.dumps(step_lower(a.model, a.max_context, a.prefill_chunk, a.socs.split(",")[-1], a.work)))
        return
    if a.step == "compile":
        print(json.dumps(step_compile(a.graph, a.soc, a.work)))
        return

    import onnxruntime
    import onnxruntime_qnn

    work = a.work / a.model
    if work.exists() and any(work.iterdir()):
        sys.exit(f"{work} is not empty: pass another --work (each run compiles into a fresh directory)")
    work.mkdir(parents=True, exist_ok=True)
    limit = int(a.rss_limit_gib * 2**20)
    record = {
        "what": "QNN EPContext compile of a preset's static decode/prefill graphs, per SoC",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM",
        "shared": "yes: other jobs ran on the same cores; wall times are not idle times",
        "commit": _commit(),
        "command": "python bench/npu/qnn_compile.py " + " ".join(sys.argv[1:]),
        "versions": {
            "onnxruntime": onnxruntime.__version__,
            "onnxruntime_qnn": onnxruntime_qnn.__version__,
            "qnn": onnxruntime_qnn.build_and_package_info.qnn_version,
        },
        "model": a.model,
        "max_context": a.max_context,
        "precision": "fp16 weights and activations (enable_htp_fp16_precision)",
        "steps": [],
    }
    pass_on = ["--model", a.model, "--max-context", str(a.max_context), "--prefill-chunk", str(a.prefill_chunk)]
    bundle = work / "bundle"
    lowered = _run_step([*pass_on, "--socs", a.socs, "--step", "lower", "--work", str(bundle)], limit)
    record["steps"].append({"step": "export --target qnn --no-verify", **lowered})
    print(json.dumps(record["steps"][-1]), flush=True)
    for graph in lowered.get("graphs", []):
        if a.graphs and graph["file"] not in a.graphs.split(","):
            continue
        for soc_name in a.socs.split(","):
            args = ["--step", "compile", "--graph", str(bundle / graph["file"]), "--soc", soc_name]
            made = _run_step([*args, "--work", str(work / soc_name)], limit)
            record["steps"].append({"step": "compile", "graph": graph["file"], "soc": soc_name, **made})
            print(json.dumps(record["steps"][-1]), flush=True)
    text = json.dumps(record, indent=1)
    if a.json:
        a.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
