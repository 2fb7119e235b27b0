"""ExecuTorch export time, the same exports from two checkouts side by side (before and after a change).

    git worktree add --detach /tmp/before <commit>^
    python bench/export/export_time.py --tree before=/tmp/before --tree after=. \\
        --preset qwen3.5-tiny --precisions fp32 fp16 int8 int4 --json bench/results/export-time.json

Each export is its own process, `flock /tmp/heavy.lock nice -n 5 /usr/bin/time -v python -m deltaship.cli export
... --no-verify --quiet`, run with PYTHONPATH set to its checkout: the lock keeps it from sharing the machine with
another heavy job (time -v starts after the lock is taken, so waiting is not counted). The trees alternate per
precision so that both see the same load. CPU seconds (user + sys) are the comparable figure on a shared machine;
wall time counts whatever else ran. Each row is appended to --json as soon as it is measured (a long sweep that is
stopped keeps what it measured); model.pte's sha256 says whether the change altered the program. `started_utc` is
when the row was queued for the lock.

    python bench/export/export_time.py --table --json bench/results/export-time.json   # the results page's table
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TIME_FIELDS = {
    "user_s": r"User time \(seconds\): ([\d.]+)",
    "sys_s": r"System time \(seconds\): ([\d.]+)",
    "peak_rss_kib": r"Maximum resident set size \(kbytes\): (\d+)",
}


def elapsed_seconds(text: str) -> float | None:
    """`Elapsed (wall clock) time (h:mm:ss or m:ss): 1:02.35` as seconds."""
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text)
    if not m:
        return None
    seconds = 0.0
    for part in m.group(1).split(":"):
        seconds = seconds * 60 + float(part)
    return seconds


def parse_time_v(text: str) -> dict:
    """The figures of GNU time's -v report that a row keeps."""
    row: dict = {"wall_s": elapsed_seconds(text)}
    for key, pattern in TIME_FIELDS.items():
        m = re.search(pattern, text)
        row[key] = float(m.group(1)) if m else None
    if row["user_s"] is not None and row["sys_s"] is not None:
        row["cpu_s"] = round(row["user_s"] + row["sys_s"], 2)
    return row


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def commit_of(tree: Path) -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def export_once(label: str, tree: Path, preset: str, precision: str, work: Path, lock: str) -> dict:
    out = work / f"{label}-{preset}-{precision}"
    export = [sys.executable, "-m", "deltaship.cli", "export", "--model", preset, "--target", "executorch"]
    export += ["--precision", precision, "--out", str(out), "--force", "--quiet", "--no-verify"]
    cmd = ["flock", lock, "nice", "-n", "5", "/usr/bin/time", "-v", *export]
    print(f"[{label}] $ {' '.join(cmd)}", flush=True)
    env = dict(os.environ, PYTHONPATH=str(tree))
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    row = {
        "label": label,
        "commit": commit_of(tree),
        "preset": preset,
        "target": "executorch",
        "precision": precision,
        "started_utc": started,
        "ok": r.returncode == 0,
        "command": " ".join(["PYTHONPATH=" + str(tree), *cmd]),
        **parse_time_v(r.stderr),
        "loadavg_after": os.getloadavg()[0],
    }
    # what the export itself wrote on stderr (--quiet: no progress), before time -v's report
    row["stderr_lines"] = r.stderr.split("\tCommand being timed:")[0].splitlines()[-20:]
    pte = out / "model.pte"
    if row["ok"] and pte.is_file():
        row["pte_sha256"] = sha256(pte)
        row["pte_bytes"] = pte.stat().st_size
    else:
        row["error"] = r.stderr.strip().splitlines()[-15:]
    shutil.rmtree(out, ignore_errors=True)
    return row


def table(rows: list[dict]) -> str:
    """The markdown table of the results page: per preset and precision, each tree's CPU seconds (the median of its
    runs when there are several), wall, peak RSS, and whether the trees wrote the same model.pte."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    keys = list(dict.fromkeys((r["preset"], r["precision"]) for r in rows if r["ok"]))
    head = ["preset", "precision"]
    head += [f"{lb} {what}" for what in ("CPU s", "wall s", "peak RSS GiB") for lb in labels]
    head += [f"CPU {labels[-1]}/{labels[0]}", "same .pte"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for preset, precision in keys:
        got = {lb: [r for r in rows if r["ok"] and (r["preset"], r["precision"], r["label"]) == (preset, precision, lb)]
               for lb in labels}  # fmt: skip
        if not all(got.values()):
            continue

        def med(lb: str, key: str) -> float | None:
            values = [r[key] for r in got[lb] if r.get(key) is not None]  # a row may lack one (its wall time)
            return statistics.median(values) if values else None

        def cell(value: float | None, digits: int, scale: float = 1.0) -> str:
            return "-" if value is None else f"{value / scale:.{digits}f}"

        cells = [preset, precision]
        cells += [cell(med(lb, "cpu_s"), 1) for lb in labels]
        cells += [cell(med(lb, "wall_s"), 0) for lb in labels]
        cells += [cell(med(lb, "peak_rss_kib"), 2, 2**20) for lb in labels]
        cells.append(f"{med(labels[-1], 'cpu_s') / med(labels[0], 'cpu_s'):.2f}")
        digests = {r["pte_sha256"] for lb in labels for r in got[lb]}
        cells.append("yes" if len(digests) == 1 else "no")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH", help="a checkout to export from")
    ap.add_argument("--preset", action="append", default=[], help="model preset (repeatable)")
    ap.add_argument("--precisions", nargs="+", default=["fp32", "fp16", "int8", "int4"], help="weight precisions")
    ap.add_argument("--json", type=Path, required=True, help="the rows are appended to this JSON list")
    ap.add_argument("--lock", default="/tmp/heavy.lock", help="the shared lock file of heavy jobs")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "deltaship-bench" / "export-time")
    ap.add_argument("--table", action="store_true", help="print the markdown table of --json's rows and exit")
    a = ap.parse_args()
    if a.table:
        print(table(json.loads(a.json.read_text())))
        return 0
    if not a.tree or not a.preset:
        ap.error("--tree and --preset are required to measure (or --table to print the table)")
    trees = []
    for spec in a.tree:
        label, _, path = spec.partition("=")
        if not path or not Path(path, "deltaship").is_dir():
            ap.error(f"--tree {spec!r}: expected LABEL=PATH of a deltaship checkout")
        trees.append((label, Path(path).resolve()))
    a.work.mkdir(parents=True, exist_ok=True)
    rows = json.loads(a.json.read_text()) if a.json.is_file() else []
    machine = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()}
    for preset in a.preset:
        for precision in a.precisions:
            for label, tree in trees:
                row = dict(export_once(label, tree, preset, precision, a.work, a.lock), **machine)
                print(json.dumps({k: v for k, v in row.items() if k != "error"}), flush=True)
                rows.append(row)
                a.json.parent.mkdir(parents=True, exist_ok=True)
                a.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
