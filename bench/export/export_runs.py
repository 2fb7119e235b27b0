"""Export the published-shape presets and record what each export costs: peak RSS, wall time, bundle size.

    python bench/export/export_runs.py memory --out docs/results/export-memory.md --json bench/results/export-memory.json
        # 9B int4/fp16 ONNX, 4B int4 for every target
    python bench/export/export_runs.py coreml --out docs/results/export-coreml.md --json bench/results/export-coreml.json
        # every preset to Core ML, sizes per precision
    python bench/export/export_runs.py q08 --verify --out Q08.md   # the 0.8B as a user exports it (verification included)

Each export runs as its own process under `/usr/bin/time -v` (peak RSS of the export process is
getrusage's maxrss), random weights at the published shapes (speed and memory do not depend on the
values). The table goes to the markdown page --out (hand-written sections below the table, "## ...", are
kept), the rows to --json (default: --out with .json); --only keeps the other rows from that JSON, and an
export already measured with the same committed code is taken from the other sets' export-<set>.json
beside it. Bundles are written under --work (default: deltaship-bench/exports in the system temp dir)
and deleted after measuring unless --keep.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
SETS = {
    "memory": [
        ("qwen3.5-9b", "onnx", "int4", []),
        ("qwen3.5-9b", "onnx", "fp16", []),
        ("qwen3.5-4b", "onnx", "int4", []),
        ("qwen3.5-4b", "coreml", "int4", []),
        ("qwen3.5-4b", "executorch", "int4", []),
    ],
    "q08": [
        ("qwen3.5-0.8b", "onnx", "fp32", []),
        ("qwen3.5-0.8b", "onnx", "int4", []),
        ("qwen3.5-0.8b", "executorch", "fp32", []),
        ("qwen3.5-0.8b", "executorch", "int4", []),
    ],
    "coreml": [
        ("qwen3.5-0.8b", "coreml", "fp16", []),
        ("qwen3.5-0.8b", "coreml", "int8", []),
        ("qwen3.5-0.8b", "coreml", "int4", []),
        ("qwen3.5-2b", "coreml", "int4", []),
        ("qwen3.5-4b", "coreml", "int4", []),
        ("qwen3.5-9b", "coreml", "int4", []),
    ],
}
GIB = 1 << 30


def run_one(preset: str, target: str, precision: str, extra: list[str], work: Path, verify: bool) -> dict:
    out = work / f"{preset}-{target}-{precision}"
    cmd = [
        "/usr/bin/time",
        "-v",
        sys.executable,
        "-m",
        "deltaship.cli",
        "export",
        "--model",
        preset,
        "--target",
        target,
        "--precision",
        precision,
        "--out",
        str(out),
        "--force",
        "--quiet",
    ] + extra
    if not verify:
        cmd.append("--no-verify")
    print("$", " ".join(cmd[2:]), flush=True)
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - t0
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr)
    row = {
        "preset": preset,
        "target": target,
        "precision": precision,
        "args": " ".join(extra),
        "ok": r.returncode == 0,
        "wall_s": round(wall, 1),
        "peak_rss_bytes": int(rss.group(1)) * 1024 if rss else None,
    }
    if r.returncode == 0:
        m = json.loads((out / "manifest.json").read_text())
        row.update(
            bundle_bytes=m["bundle_bytes"],
            verification=m["verification"]["status"],
            parts=len(m["lowering"].get("parts", [])) or 1,
            weights_fp16_bytes=m["model"]["parameters"]["total"] * 2,
            rel=m["verification"].get("max_rel_logit_diff"),
            kl=m["verification"].get("kl_divergence"),
        )
    else:
        row["error"] = r.stderr.strip().splitlines()[-25:]
    print(json.dumps({k: v for k, v in row.items() if k != "error"}), flush=True)
    return row


def package_tree() -> str | None:
    """The git tree of the committed deltaship/ package, or None when it has uncommitted changes."""
    root = HERE.parents[1]  # the repository root
    dirty = subprocess.run(["git", "status", "--porcelain", "deltaship"], cwd=root, capture_output=True, text=True)
    if dirty.returncode or dirty.stdout.strip():
        return None
    tree = subprocess.run(["git", "rev-parse", "HEAD:deltaship"], cwd=root, capture_output=True, text=True)
    return tree.stdout.strip() or None


def reusable(
    preset: str, target: str, precision: str, extra: list[str], verify: bool, code: str | None, results: Path
) -> dict | None:
    """The same export already measured by another set with the same committed package code (the 4B Core ML
    int4 export is in both `memory` and `coreml`); exports take minutes, so it is not run twice."""
    if code is None:
        return None
    for other in SETS:
        f = results / f"export-{other}.json"
        if not f.is_file():
            continue
        for r in json.loads(f.read_text()):
            if (
                r.get("code") == code
                and r.get("ok")
                and r.get("verify") == verify
                and (r["preset"], r["target"], r["precision"], r["args"])
                == (preset, target, precision, " ".join(extra))
            ):
                return r
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("set", choices=sorted(SETS))
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "deltaship-bench" / "exports")
    ap.add_argument("--out", type=Path, required=True, help="the markdown results page to write")
    ap.add_argument("--json", type=Path, default=None, help="the rows as JSON (default: --out with .json)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--verify", action="store_true", help="verify too (where the fp32 reference fits)")
    ap.add_argument("--note", default="", help="how the run was made, when not on an idle machine (goes in the header)")
    ap.add_argument(
        "--only",
        action="append",
        default=None,
        metavar="PRESET:TARGET:PRECISION",
        help="re-run only these rows; the others are kept from the set's last run, marked as such",
    )
    a = ap.parse_args()
    a.json = a.json or a.out.with_suffix(".json")
    known = {f"{p}:{t}:{q}" for p, t, q, _ in SETS[a.set]}
    if a.only and not set(a.only) <= known:
        ap.error(f"--only {sorted(set(a.only) - known)} not in set {a.set}: {sorted(known)}")
    a.work.mkdir(parents=True, exist_ok=True)
    rows = []
    code = package_tree()
    last_file = a.json
    last = {
        (r["preset"], r["target"], r["precision"], r["args"]): r
        for r in (json.loads(last_file.read_text()) if last_file.is_file() else [])
    }
    for preset, target, precision, extra in SETS[a.set]:
        if a.only and f"{preset}:{target}:{precision}" not in a.only:
            kept = last.get((preset, target, precision, " ".join(extra)))
            if kept:
                rows.append(dict(kept, earlier=kept.get("earlier") or kept.get("code") or "unknown"))
            else:
                print(f"warning: no earlier row for {preset} {target} {precision}: left out of the table", flush=True)
            continue
        again = reusable(preset, target, precision, extra, a.verify, code, a.json.parent)
        if again:
            print(f"reusing {preset} {target} {precision} from {again['set']} (same package code)", flush=True)
            rows.append(again)
            continue
        rows.append(
            dict(run_one(preset, target, precision, extra, a.work, a.verify), set=a.set, code=code, verify=a.verify)
        )
        if not a.keep:
            shutil.rmtree(a.work / f"{preset}-{target}-{precision}", ignore_errors=True)
    lines = [
        f"# Export runs: {a.set}",
        "",
        f"`python bench/export/export_runs.py {a.set}{' --verify' if a.verify else ''}`: each export its own process "
        "under /usr/bin/time -v, on this machine (2 cores, 24 GiB); random weights at the published shapes.",
        "",
        *([f"Run conditions: {a.note}", ""] if a.note else []),
        "| preset | target | precision | peak RSS GiB | wall s | bundle GiB | packages | fp16 weights GiB | verification |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["ok"]:
            lines.append(
                f"| {r['preset']} | {r['target']} | {r['precision']} | "
                f"{(r['peak_rss_bytes'] or 0) / GIB:.2f} | {r['wall_s']} | FAILED | | | |"
            )
            continue
        ver = r["verification"] + (
            f" (max rel logit diff {r['rel']:.2g}, KL {r['kl']:.2g})" if r.get("rel") is not None else ""
        )
        if r.get("earlier"):
            ver += f" (earlier run, package tree {str(r['earlier'])[:10]})"
        elif r["set"] != a.set:
            ver += f" (row from `export_runs.py {r['set']}`, same package code)"
        lines.append(
            f"| {r['preset']} | {r['target']} | {r['precision']} | {r['peak_rss_bytes'] / GIB:.2f} | "
            f"{r['wall_s']:.0f} | {r['bundle_bytes'] / GIB:.2f} | {r['parts']} | "
            f"{r['weights_fp16_bytes'] / GIB:.2f} | {ver} |"
        )
    text = "\n".join(lines) + "\n"
    md = a.out
    kept_md = md.read_text() if md.is_file() else ""
    if "\n## " in kept_md:  # keep the hand-written sections below the table
        text += "\n## " + kept_md.split("\n## ", 1)[1]
    md.write_text(text)
    a.json.write_text(json.dumps(rows, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
