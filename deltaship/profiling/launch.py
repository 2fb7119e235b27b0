"""A profiling worker in a fresh process (its peak RSS is the bundle's alone), optionally inside a cgroup with a
memory limit; a run that dies (OOM kill, signal, timeout) comes back as a 'died' record, never as a number."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


# ---- memory caps ------------------------------------------------------------------------------
class MemoryCap:
    """A cgroup with a memory limit that the worker joins; `mechanism` says what was possible."""

    def __init__(self, limit: int):
        self.limit, self.path, self.mechanism, self.procs = limit, None, "none", None
        name = f"deltaship-{os.getpid()}-{int(time.time())}"
        candidates = []
        if Path("/sys/fs/cgroup/cgroup.controllers").exists():
            candidates.append((Path("/sys/fs/cgroup"), "memory.max", "cgroup v2 memory.max"))
        if Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists():
            candidates.append(
                (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes", "cgroup v1 memory.limit_in_bytes")
            )
        for root, limit_file, mech in candidates:
            d = root / name
            try:
                d.mkdir()
                (d / limit_file).write_text(str(limit))
                swap = d / "memory.memsw.limit_in_bytes"  # v1: count swap too, where the kernel allows
                if swap.exists():
                    try:
                        swap.write_text(str(limit))
                    except OSError:
                        pass
                self.path, self.mechanism, self.procs = d, mech, d / "cgroup.procs"
                return
            except OSError:
                try:
                    d.rmdir()
                except OSError:
                    pass

    def join(self) -> None:  # runs in the child before exec
        if self.procs is not None:
            self.procs.write_text(str(os.getpid()))

    def close(self) -> None:
        if self.path is not None:
            try:
                self.path.rmdir()
            except OSError:
                pass


def _died(rc: int, stderr: str) -> dict[str, Any]:
    if rc < 0:
        sig = signal.Signals(-rc).name
        why = "killed by the kernel (out of memory)" if sig == "SIGKILL" else f"killed by {sig}"
    elif rc == 137:
        sig, why = "SIGKILL", "killed (exit 137: out of memory)"
    else:
        sig = None
        oom = any(s in stderr for s in ("MemoryError", "bad_alloc", "Failed to allocate", "out of memory"))
        why = "out of memory" if oom else f"exited with status {rc}"
    return {
        "metric": "run",
        "status": "died",
        "reason": why,
        "signal": sig,
        "exit_status": rc,
        "stderr_tail": stderr.strip()[-2000:],
        "samples": [],
        "flags": ["died"],
    }


def run_worker(
    cfg: dict[str, Any], cap: MemoryCap | None = None, timeout: float = 3600, module: str = "deltaship.profiling.worker"
) -> tuple[dict | None, dict | None]:
    """(worker output, None) or (None, a 'died' record). module: the worker (profiling/vision.py has one too)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(cfg.get("threads") or ""), TOKENIZERS_PARALLELISM="false")
    if not cfg.get("threads"):
        env.pop("OMP_NUM_THREADS")
    try:
        r = subprocess.run(
            [sys.executable, "-m", module, json.dumps(cfg)],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            preexec_fn=cap.join if cap and cap.procs else None,
        )
    except subprocess.TimeoutExpired:
        return None, {
            "metric": "run",
            "status": "died",
            "reason": f"timed out after {timeout:.0f}s",
            "samples": [],
            "flags": ["died", "timeout"],
        }
    if r.returncode != 0:
        return None, _died(r.returncode, r.stderr)
    try:
        return json.loads(r.stdout), None
    except json.JSONDecodeError:
        return None, _died(1, "worker printed no JSON: " + r.stdout[-500:] + r.stderr[-500:])
