"""The TCP sockets of the Ray processes a test started (its descendants), from /proc: tests/test_fleet.py checks
that every one is on loopback. Imports nothing heavy, so a test's child process can use it too."""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _address(text: str, family: int) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(text.split(":")[0])
    if family == 4:
        return ipaddress.IPv4Address(raw[::-1])
    return ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))


def ray_sockets() -> list[tuple[int, str, object, object]]:
    """(pid, tcp state, local address, remote address) of every TCP socket of this process's descendants (the Ray
    processes it started) other than this process itself."""
    mine = {}
    for pid in _descendants(os.getpid())[1:]:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(f"/proc/{pid}/fd/{fd}"))
                if m:
                    mine[m.group(1)] = pid
        except OSError:
            continue
    out = []
    for name, family in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 6)):
        for line in Path(name).read_text().splitlines()[1:]:
            f = line.split()
            if f[9] in mine:
                out.append((mine[f[9]], f[3], _address(f[1], family), _address(f[2], family)))
    return out


def _loopback(a) -> bool:
    return a.is_loopback or (getattr(a, "ipv4_mapped", None) is not None and a.ipv4_mapped.is_loopback)


def assert_loopback(sockets) -> None:
    listening = [s for s in sockets if s[1] == "0A"]
    assert listening, "no Ray process was seen listening: the check looked at nothing"
    for pid, state, local, remote in sockets:
        assert _loopback(local), f"pid {pid} has a socket on {local} (state {state}), not loopback"
        if state != "0A":
            assert _loopback(remote), f"pid {pid} is connected to {remote}, not loopback"
