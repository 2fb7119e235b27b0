"""A fleet's results directory: `results.jsonl` (one row per cell and stage, appended as each finishes, fsynced, so a
crash loses at most the row being written), `results.md` (one table per metric, cells by device) and the store.

The directory is the fleet's own: a new one is created with a marker, an existing one is used only when it has the
marker, and one run at a time holds its lock."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from filelock import FileLock, Timeout

from deltaship.bundle.destination import replace_file
from deltaship.errors import DeltashipEnvironmentError, DeltashipError

MARKER = ".deltaship-fleet"
ROW_VERSION = 1


class ResultsDir:
    """OUT: its rows, its store, its lock (held from open() to close())."""

    def __init__(self, out: str | Path):
        self.root = Path(out)
        self.rows_path = self.root / "results.jsonl"
        self.store = self.root / "store"
        self._lock: FileLock | None = None

    def open(self) -> ResultsDir:
        if self.root.exists() and not (self.root / MARKER).is_file():
            if not self.root.is_dir() or any(self.root.iterdir()):
                raise DeltashipError(
                    f"--out {self.root}: exists and is not a fleet's results directory (no {MARKER})",
                    "pass a new or empty directory, or the --out of an earlier fleet run to resume it",
                )
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / MARKER).write_text("deltaship fleet results\n")
        self._lock = FileLock(str(self.root / ".lock"))
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            raise DeltashipEnvironmentError(
                f"--out {self.root}: another fleet run is writing it", "wait for it to finish, or pick another --out"
            ) from None
        return self

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()

    def rows(self) -> list[dict[str, Any]]:
        """The rows written so far; a torn last line (a crash mid-write) is skipped."""
        if not self.rows_path.is_file():
            return []
        out = []
        for line in self.rows_path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and row.get("row_version") == ROW_VERSION:
                out.append(row)
        return out

    def append(self, row: dict[str, Any]) -> dict[str, Any]:
        row = {"row_version": ROW_VERSION, **row}
        text = json.dumps(row, sort_keys=True, default=str)
        with open(self.rows_path, "a") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        return row

    def write_markdown(self) -> None:
        replace_file(self.root / "results.md", markdown(self.rows()), "results.md")


def latest(rows: list[dict[str, Any]], stage: str) -> dict[str, dict[str, Any]]:
    """The last row of each cell of a stage."""
    return {r["cell"]: r for r in rows if r.get("stage") == stage}


def _label(r: dict[str, Any]) -> str:
    where = [f"{k} {r[k]}" for k in ("prompt_length", "context", "from_context") if r.get(k) is not None]
    return r["metric"] + (f" ({', '.join(where)})" if where else "")


def _cells(rows: dict[str, dict[str, Any]]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for row in rows.values():
        for r in (row.get("profile") or {}).get("results", []):
            if r.get("median") is not None:
                yield row["bundle_cell"], row["device"], r


def markdown(rows: list[dict[str, Any]]) -> str:
    """One table per metric (cells by device), then the cells that failed."""
    profiles = latest(rows, "profile")
    tables: dict[str, dict[tuple[str, str], dict[str, Any]]] = {}
    for cell, device, r in _cells(profiles):
        tables.setdefault(_label(r), {})[(cell, device)] = r
    devices = sorted({r["device"] for r in profiles.values()})
    lines = [
        "# Fleet results",
        "",
        f"{len(profiles)} profile cells; medians (`results.jsonl` has every statistic).",
        "",
    ]
    for label, values in tables.items():
        unit = next(iter(values.values())).get("unit", "")
        lines += [
            f"## {label} [{unit}]",
            "",
            "| cell | " + " | ".join(devices) + " |",
            "|---" * (len(devices) + 1) + "|",
        ]
        for cell in sorted({c for c, _ in values}):
            got = [values.get((cell, d)) for d in devices]
            lines.append(f"| {cell} | " + " | ".join("" if g is None else f"{g['median']:.4g}" for g in got) + " |")
        lines.append("")
    failed = [r for stage in ("export", "profile") for r in latest(rows, stage).values() if r["status"] == "failed"]
    if failed:
        lines += ["## Failed", "", "| stage | cell | error |", "|---|---|---|"]
        lines += [f"| {r['stage']} | {r['cell']} | {str(r.get('error', '')).splitlines()[0][:200]} |" for r in failed]
        lines.append("")
    return "\n".join(lines)
