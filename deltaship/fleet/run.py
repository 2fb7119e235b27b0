"""`deltaship fleet run MATRIX --out DIR`: a matrix's exports as Ray tasks and its profiles on Ray actors that own
the devices, with the rows gathered as cells finish. Ray places, retries and restarts; this module only names the
steps: read the matrix, plan the cells (keys, memory), join the cluster, check that it can place every cell, run.
"""

from __future__ import annotations

import hashlib
import json as jsonlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from deltaship.devices.catalog import load_catalog
from deltaship.devices.plan import export_peak_bytes
from deltaship.errors import DeltashipError
from deltaship.fleet import cluster, tasks
from deltaship.fleet.matrix import Matrix, load_matrix
from deltaship.fleet.results import ResultsDir
from deltaship.fleet.store import Store, bundle_key
from deltaship.models.source import load_source

RETRIES = 2  # an export task on a lost node, a device actor that died: bounded, then the cell is a failed row


@dataclass(frozen=True)
class BundleCell:
    """One export cell: what to build, its content address and its planned peak memory."""

    name: str
    model: str
    target: str
    precision: str
    key: str
    memory: int


def plan_cells(m: Matrix) -> list[BundleCell]:
    """Every export cell with its key (from the checkpoint's digest) and the planner's memory estimate."""
    cells = []
    for model in m.models:
        source = load_source(model, allow_download=bool(m.export.get("allow_download")))
        digest = source.fingerprint()
        for target in m.targets:
            for precision in m.precisions:
                peak = export_peak_bytes(source.spec, target, precision, bool(m.export.get("verify", True)))
                key = bundle_key(digest, target, precision, m.export)
                cells.append(BundleCell(f"{source.name}/{target}/{precision}", model, target, precision, key, peak))
    return cells


def check_placement(m: Matrix, cells: list[BundleCell]) -> None:
    """Refuse, before any work, a device or toolchain no node has, and an export no node has the memory for (Ray
    would wait for them forever)."""
    devices = cluster.offered("device:")
    have = ", ".join(sorted(devices)) or "none"
    for d in m.devices:
        if d not in devices:
            raise DeltashipError(
                f"device {d!r}: no node of the cluster has it; the cluster's devices: {have}",
                f"attach it to a node that advertises the resource device:{d} (docs/fleet.md), or drop it from devices",
            )
    tools = cluster.offered("toolchain:")
    toolchains = ", ".join(sorted(tools)) or "none"
    memory = {n["id"]: n["resources"].get("memory", 0) for n in cluster.nodes()}
    for c in cells:
        if c.target not in tools:
            raise DeltashipError(
                f"target {c.target!r}: no node of the cluster has its toolchain; toolchains: {toolchains}",
                f"install deltaship[{c.target}] on a node, or drop {c.target} from `targets`",
            )
        if max(memory.get(n, 0) for n in tools[c.target]) < c.memory:
            raise DeltashipError(
                f"{c.name}: its export needs about {c.memory / 2**30:.1f} GiB and no node with {c.target}'s toolchain "
                "has that much memory",
                "add a node with more memory, or set [export] verify = false",
            )


def profile_key(bundle: str, device: str, workload: dict[str, Any]) -> str:
    what = {"bundle": bundle, "device": device, "workload": workload}
    return hashlib.sha256(jsonlib.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


def _error(e: BaseException) -> str:
    """One line of what went wrong in a task or actor (the cause a task raised, not Ray's traceback)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


class Runner:
    """One run's state: the rows written, the work in flight (Ray object refs and what each one is)."""

    def __init__(self, m: Matrix, out: ResultsDir, say: Callable[[str], None], emit: Callable[[dict], None]):
        ray = cluster.import_ray()
        self.ray, self.m, self.out, self.say, self.emit = ray, m, out, say, emit
        self.store = Store(out.store)
        prior = out.rows()
        self.done = {r["profile_key"]: r for r in prior if r["stage"] == "profile" and r["status"] in ("ok", "cached")}
        self.pending: dict[Any, tuple] = {}
        self.rows: list[dict[str, Any]] = []
        self.total = 0
        tiers = tuple(d for d in m.devices if d in load_catalog()[0])
        actor = ray.remote(tasks.Device)
        self.devices = {
            d: actor.options(resources={f"device:{d}": 1}, max_restarts=RETRIES, max_task_retries=RETRIES).remote(
                d, tiers
            )
            for d in m.devices
        }

    def row(self, row: dict[str, Any]) -> None:
        row = self.out.append(row)
        self.rows.append(row)
        tail = f": {row['error']}" if row.get("error") else ""
        self.say(f"[{len(self.rows)}/{self.total}] {row['stage']} {row['cell']}: {row['status']}{tail}")
        self.emit(row)

    def export_row(self, c: BundleCell, status: str, record: dict | None, error: str | None = None) -> None:
        record = record or {}
        self.row(
            {
                "stage": "export",
                "cell": c.name,
                "model": c.model,
                "target": c.target,
                "precision": c.precision,
                "status": status,
                "bundle_key": c.key,
                "bundle_sha256": record.get("sha256"),
                "files": record.get("files"),
                "node": record.get("node"),
                "host": record.get("host"),
                "seconds": record.get("seconds"),
                "error": error,
            }
        )

    def profile_row(self, c: BundleCell, device: str, status: str, **fields: Any) -> None:
        self.row(
            {
                "stage": "profile",
                "cell": f"{c.name}@{device}",
                "bundle_cell": c.name,
                "device": device,
                "status": status,
                "bundle_key": c.key,
                "profile_key": profile_key(c.key, device, self.m.profile),
                **{k: None for k in ("bundle_sha256", "profile", "fingerprint", "node", "host", "error")},
                **fields,
            }
        )

    def exports(self, cells: list[BundleCell]) -> None:
        build = self.ray.remote(tasks.build)
        self.total = len(cells) * (1 + len(self.m.devices))
        for c in cells:
            record = self.store.record(c.key)
            if record is not None:  # a finished key is never built again
                self.export_row(c, "cached", record)
                self.profiles(c, record)
                continue
            ref = build.options(
                num_cpus=1,
                memory=c.memory,
                resources={f"toolchain:{c.target}": 0.01},
                max_retries=RETRIES,
                retry_exceptions=False,  # a bad export fails the same way again; a lost node is retried
            ).remote(str(self.store.root), c.key, c.model, c.target, c.precision, self.m.export)
            self.pending[ref] = ("export", c)

    def profiles(self, c: BundleCell, record: dict[str, Any]) -> None:
        for d, actor in self.devices.items():
            done = self.done.get(profile_key(c.key, d, self.m.profile))
            if done is not None and done.get("bundle_sha256") == record["sha256"]:
                keep = {k: done.get(k) for k in ("bundle_sha256", "profile", "fingerprint", "node", "host")}
                self.profile_row(c, d, "cached", **keep)
                continue
            ref = actor.profile.remote(str(self.store.root), c.key, record["sha256"], self.m.profile)
            self.pending[ref] = ("profile", c, d, record)

    def finish(self, ref: Any) -> None:
        what = self.pending.pop(ref)
        try:
            value, error = self.ray.get(ref), None
        except Exception as e:  # noqa: BLE001  (a failed cell is a row, never the end of the run)
            value, error = None, _error(e)
        if what[0] == "export":
            c = what[1]
            if error is not None:
                self.export_row(c, "failed", None, error)
                for d in self.devices:
                    self.profile_row(c, d, "failed", error=f"its export failed: {error}")
                return
            self.export_row(c, "ok" if value["built"] else "cached", value)
            self.profiles(c, value)
            return
        _, c, d, record = what
        if error is not None:
            self.profile_row(c, d, "failed", bundle_sha256=record["sha256"], error=error)
            return
        where = value.pop("where")
        died = [r for r in value["results"] if r.get("status") == "died"]
        self.profile_row(
            c,
            d,
            "failed" if died else "ok",
            bundle_sha256=record["sha256"],
            profile={k: v for k, v in value.items() if k != "device"},
            fingerprint=value.get("device"),
            node=where["node"],
            host=where["host"],
            error=died[0].get("reason") if died else None,
        )

    def wait(self) -> None:
        while self.pending:
            ready, _ = self.ray.wait(list(self.pending), num_returns=1)
            self.finish(ready[0])


def fleet_run(
    matrix: str | Path | Matrix,
    *,
    out: str | Path,
    address: str | None = None,
    json: bool = False,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Export and profile every cell of `matrix` (a TOML file, fleet/matrix.py) on a Ray cluster: an embedded local
    one on loopback without `address`, else the cluster at HOST:PORT. Rows go to OUT/results.jsonl as cells finish
    (OUT/results.md at the end); a cell finished by an earlier run on the same OUT is `cached`. json=True: each row
    on stdout as one JSON line (else a progress line per cell on stderr). Returns this run's rows."""
    m = matrix if isinstance(matrix, Matrix) else load_matrix(matrix)
    if address is not None:
        cluster.split_address(address)
    say = progress or ((lambda s: None) if json else (lambda s: print(s, file=sys.stderr, flush=True)))
    emit = (lambda r: print(jsonlib.dumps(r, sort_keys=True, default=str), flush=True)) if json else (lambda r: None)
    results = ResultsDir(out).open()
    try:
        cells = plan_cells(m)
        tiers = tuple(d for d in m.devices if d in load_catalog()[0])
        with cluster.connect(address, cluster.advertised(tiers)):
            check_placement(m, cells)
            runner = Runner(m, results, say, emit)
            runner.exports(cells)
            runner.wait()
        results.write_markdown()
        return runner.rows
    finally:
        results.close()
