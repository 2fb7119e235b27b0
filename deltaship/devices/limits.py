"""What memory this process may still use, and the check an export makes against its planned peak.

A process is bounded by its cgroup (v2 memory.max, v1 memory.limit_in_bytes: the kernel's OOM killer, silent),
by RLIMIT_AS (address space: an allocation fails, often as a segfault in native code) and by the machine's
MemAvailable. An export that would pass one of them is refused before it starts, with both numbers.
DELTASHIP_IGNORE_MEMORY_CHECK=1 skips the check (the estimate is an estimate).
"""

from __future__ import annotations

import os
import re
import resource
from dataclasses import dataclass
from pathlib import Path

from deltaship.errors import DeltashipEnvironmentError
from deltaship.files import read_int

IGNORE_ENV = "DELTASHIP_IGNORE_MEMORY_CHECK"
CGROUP_ROOT = Path("/sys/fs/cgroup")
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63-1


@dataclass(frozen=True)
class Limit:
    name: str  # e.g. "cgroup memory.max (/sys/fs/cgroup/x/memory.max)"
    limit: int  # bytes
    used: int  # bytes already counted against it
    virtual: bool = False  # counts address space (RLIMIT_AS), not resident memory

    @property
    def headroom(self) -> int:
        return max(0, self.limit - self.used)


def _status(key: str) -> int:
    try:
        m = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return 0
    return int(m.group(1)) * 1024 if m else 0


def _reclaimable(d: Path, keys: tuple[str, ...]) -> int:
    """The page cache counted in a cgroup's usage (the kernel drops it before it kills anything)."""
    try:
        stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines() if " " in line)
    except (OSError, ValueError):
        return 0
    return next((int(stat[k]) for k in keys if k in stat), 0)


def cgroup_limits(root: Path = CGROUP_ROOT) -> list[Limit]:
    """The memory limits of this process's cgroup and its ancestors (v2), or of its v1 memory cgroup."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":  # v2: the path and each ancestor may set memory.max
            d = root / path.lstrip("/")
            if not d.is_dir():  # a namespaced mount: the cgroup is the root
                d = root
            while True:
                limit, used = read_int(d / "memory.max"), read_int(d / "memory.current")
                if limit is not None and used is not None:
                    used -= _reclaimable(d, ("file",))
                    out.append(Limit(f"cgroup memory.max ({d / 'memory.max'})", limit, max(0, used)))
                if d == root or root not in d.parents:
                    break
                d = d.parent
        elif "memory" in controllers.split(","):
            base = root / "memory"
            d = base / path.lstrip("/")
            if not d.is_dir():
                d = base
            limit, used = read_int(d / "memory.limit_in_bytes"), read_int(d / "memory.usage_in_bytes")
            if limit is not None and used is not None and limit < _NO_LIMIT:
                used -= _reclaimable(d, ("total_cache", "cache"))
                name = f"cgroup memory.limit_in_bytes ({d / 'memory.limit_in_bytes'})"
                out.append(Limit(name, limit, max(0, used)))
    return out


def mem_available() -> int | None:
    """MemAvailable in bytes (None where /proc/meminfo is not there)."""
    try:
        m = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def memory_limits() -> list[Limit]:
    """Every bound on this process's memory that is set: cgroups, RLIMIT_AS, MemAvailable."""
    out = cgroup_limits()
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        out.append(Limit("RLIMIT_AS (ulimit -v)", soft, _status("VmSize"), virtual=True))
    available = mem_available()
    if available is not None:
        rss = _status("VmRSS")  # MemAvailable excludes what this process holds already
        out.append(Limit("MemAvailable (/proc/meminfo)", available + rss, rss))
    return out


def virtual_need(peak: int) -> int:
    """Address space an export of resident peak `peak` reserves: glibc's per-thread arenas and the thread stacks
    of torch's and the runtime's pools come on top of what is resident."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return peak + cpus * (64 << 20) + (768 << 20)  # fitted to the tiny export under prlimit --as (2 cores)


def check_memory(peak: int, what: str, fixes: str, base: int = 0) -> None:
    """Refuse (DeltashipEnvironmentError) when `peak` bytes (resident; `what` says whose) do not fit one of the
    process's limits. `base`: what the process holds before the work (the interpreter and its libraries, mostly
    shared file pages a cgroup does not charge again): the work needs peak - base more. Address space is compared
    whole (virtual_need)."""
    if os.environ.get(IGNORE_ENV, "") not in ("", "0"):
        return
    for lim in memory_limits():
        if lim.virtual:
            need = virtual_need(peak)
            more = need - _status("VmSize")
        else:
            need, more = peak, peak - base
        if more > lim.headroom:
            space = "of address space " if lim.virtual else ""
            raise DeltashipEnvironmentError(
                f"{what} needs about {gib(need)} GiB {space}at its peak, {gib(more)} GiB more than this process "
                f"holds; {lim.name} leaves it {gib(lim.headroom)} GiB ({gib(lim.limit)} GiB, {gib(lim.used)} GiB "
                "in use); nothing was written",
                f"{fixes}, or run on a machine (or in a container) with more memory; {IGNORE_ENV}=1 skips this check",
            )


def gib(n: int) -> str:
    return f"{n / 2**30:.2f}"
