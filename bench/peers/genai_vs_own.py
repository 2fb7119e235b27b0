"""onnxruntime-genai (the runtime apps embed) against deltaship's own ONNX driver, on one bundle.

    python bench/peers/genai_vs_own.py [--model qwen3.5-0.8b] [--precision int4] [--threads 2] \
        --out docs/results/genai.md --json OUT.json

Exports the model once (ONNX, random weights at the published shapes for the built-in presets), then
runs `deltaship profile BUNDLE --runtime R` for R = onnxruntime (deltaship's driver) and genai in
interleaved rounds (--rounds, default 3): each round runs both, the first in the order A B, the next B A, and
so on, so that load on the machine during the run (it is recorded: the load average before and after each
profile) weighs on both alike. Each metric's samples from all rounds of a runtime are pooled; the table gives
the medians and genai / own.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from statistics import median

RUNTIMES = ("onnxruntime", "genai")
METRICS = ("prefill_tok_s", "decode_tok_s", "tpot_s", "ttft_s", "peak_rss_bytes")


def run_profile(bundle: Path, runtime: str, threads: int, out: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "deltaship",
        "profile",
        str(bundle),
        "--runtime",
        runtime,
        "--threads",
        str(threads),
        "--contexts",
        "128",
        "--no-breakdown",
        "--quiet",
        "--json",
        str(out),
    ]
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines() if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    return f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"


def pooled(records: list[dict]) -> dict[tuple[str, int | None], list[float]]:
    samples: dict[tuple[str, int | None], list[float]] = {}
    for rec in records:
        for r in rec["results"]:
            if r["metric"] in METRICS:
                samples.setdefault((r["metric"], r.get("prompt_length")), []).extend(r["samples"])
    return samples


def per_round(records: dict[str, list[dict]]) -> list[dict]:
    """Each metric's genai / own ratio within each round (the two runtimes' adjacent runs), and how far one
    runtime's own runs differ from each other (max / min of its per-run medians): when that run-to-run spread is
    as large as the gap between the runtimes, a pooled ratio off by a few percent says nothing."""

    def medians(rec: dict) -> dict:
        return {
            (r["metric"], r.get("prompt_length")): median(r["samples"])
            for r in rec["results"]
            if r["metric"] in METRICS and r["samples"]
        }

    own = [medians(r) for r in records["onnxruntime"]]
    genai = [medians(r) for r in records["genai"]]
    out = []
    for key in own[0] if own else []:
        ratios = [g[key] / o[key] for o, g in zip(own, genai) if key in o and key in g and o[key]]
        runs = {rt: [m[key] for m in ms if key in m] for rt, ms in (("own", own), ("genai", genai))}
        if not ratios:
            continue
        out.append(
            {
                "metric": key[0],
                "prompt_length": key[1],
                "round_ratios": [round(x, 4) for x in ratios],
                "median_round_ratio": median(ratios),
                "own_run_spread": max(runs["own"]) / min(runs["own"]),
                "genai_run_spread": max(runs["genai"]) / min(runs["genai"]),
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3.5-0.8b")
    ap.add_argument("--precision", default="int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of both runtimes, alternating which goes first")
    ap.add_argument("--out", type=Path, help="write the markdown table here")
    ap.add_argument("--json", type=Path, help="write the raw records here")
    a = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="deltaship-genai-bench-") as tmp:
        work = Path(tmp)
        bundle = work / "bundle"
        subprocess.run(
            [sys.executable, "-m", "deltaship", "export", "--model", a.model, "--target", "onnx"]
            # --no-verify: this measures speed; parity is the export tests' job (and the 0.8B check against
            # transformers takes over half an hour on a loaded 2-core machine)
            + ["--precision", a.precision, "--out", str(bundle), "--quiet", "--no-verify"],
            check=True,
        )
        records = {rt: [] for rt in RUNTIMES}
        order = [rt for r in range(a.rounds) for rt in (RUNTIMES if r % 2 == 0 else RUNTIMES[::-1])]
        loads = []
        for i, rt in enumerate(order):
            before = os.getloadavg()
            rec = run_profile(bundle, rt, a.threads, work / f"{i}-{rt}.json")
            rec.pop("rss_trace", None)  # the memory trace is long and not compared here (peak_rss_bytes is)
            records[rt].append(rec)
            loads.append({"runtime": rt, "loadavg_before": before, "loadavg_after": os.getloadavg()})

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    own, genai = pooled(records["onnxruntime"]), pooled(records["genai"])
    rows = []
    for key in own:
        if key in genai:
            a_med, b_med = median(own[key]), median(genai[key])
            rows.append(
                {"metric": key[0], "prompt_length": key[1], "own": a_med, "genai": b_med, "ratio": b_med / a_med}
            )
    rounds = per_round(records)
    command = " ".join(["python", "bench/peers/genai_vs_own.py", *sys.argv[1:]])
    result = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "commit": commit,
        "machine": machine(),
        "command": command,
        "model": a.model,
        "precision": a.precision,
        "threads": a.threads,
        "order": order,
        "loadavg": loads,
        "rows": rows,
        "per_round": rounds,
        "records": records,
    }
    lines = [
        "| metric | prompt | deltaship (onnxruntime) | onnxruntime-genai | genai / own |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['metric']} | {r['prompt_length'] or ''} | {r['own']:.4g} | {r['genai']:.4g} | {r['ratio']:.3f} |"
        )
    lines += [
        "",
        "| metric | prompt | genai / own per round | median of rounds | own: max / min run | genai: max / min run |",
        "|---|---|---|---|---|---|",
    ]
    for r in rounds:
        lines.append(
            f"| {r['metric']} | {r['prompt_length'] or ''} | {', '.join(f'{x:.3f}' for x in r['round_ratios'])} "
            f"| {r['median_round_ratio']:.3f} | {r['own_run_spread']:.3f} | {r['genai_run_spread']:.3f} |"
        )
    table = "\n".join(lines)
    print(table)
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    if a.out:
        a.out.write_text(
            f"# onnxruntime-genai against deltaship's own ONNX driver\n\n"
            f"- **Measured:** {result['date']}, commit `{commit}`\n"
            f"- **Machine:** {result['machine']}, {a.threads} threads\n"
            f"- **Regenerate:** `{command}`\n\n"
            f"{a.model} at {a.precision}, random weights at the published shapes, one bundle; profile order "
            f"{' '.join(order)}, samples of all runs of a runtime pooled, medians.\n\n{table}\n"
        )


if __name__ == "__main__":
    main()
