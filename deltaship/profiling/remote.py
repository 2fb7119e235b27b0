"""Profiling on an ssh host: stream the bundle there, run its deltaship, pull the JSON back."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Any, Callable

from deltaship.devices.discovery import parse_ssh, ssh_base, ssh_fingerprint, ssh_run
from deltaship.errors import DeltashipError
from deltaship.files import parse_json


def copy_bundle(path: Path, target: dict, remote_dir: str, options: list[str] | None) -> None:
    """tar over the ssh connection (no scp/rsync flags to reconcile, one round trip)."""
    pack = subprocess.Popen(["tar", "-C", str(path.parent), "-cf", "-", path.name], stdout=subprocess.PIPE)
    cmd = ssh_base(target, options) + [f"mkdir -p {shlex.quote(remote_dir)} && tar -C {shlex.quote(remote_dir)} -xf -"]
    r = subprocess.run(cmd, stdin=pack.stdout, capture_output=True, text=True, timeout=3600)
    pack.wait()
    if r.returncode != 0 or pack.returncode != 0:
        raise DeltashipError(
            f"copying {path.name} to {target['host']} failed: {r.stderr.strip()[-300:]}",
            "check free disk space and write access to the remote temp directory",
        )


def profile_command(
    remote_deltaship: str, bundle: str, cfg: dict[str, Any], threads: int | None, tier: str | None
) -> str:
    """The remote shell line of `deltaship profile BUNDLE ...`: ssh hands it to a shell, so every word is quoted."""
    args = [
        remote_deltaship,
        "profile",
        bundle,
        "--device",
        "host",
        "--json",
        "-",
        "--quiet",
        "--prompt-lengths",
        ",".join(map(str, cfg["prompt_lengths"])),
        "--gen",
        str(cfg["gen"]),
        "--contexts",
        ",".join(map(str, cfg["contexts"])),
        "--warmups",
        str(cfg["warmups"]),
        "--reps",
        str(cfg["reps"]),
        "--min-seconds",
        str(cfg["min_seconds"]),
    ]
    if threads:
        args += ["--threads", str(threads)]
    if tier:
        args += ["--tier", tier]
    return " ".join(shlex.quote(a) for a in args)


def profile_ssh(
    path: Path,
    device: str,
    cfg: dict[str, Any],
    threads: int | None,
    tier: str | None,
    options: list[str] | None,
    remote_deltaship: str,
    say: Callable[[str], None],
) -> dict[str, Any]:
    target = parse_ssh(device)
    say(f"{device}: fingerprint")
    ssh_fingerprint(device, options, remote_deltaship)  # fails early and clearly when unreachable
    remote_dir = ssh_run(target, "mktemp -d -t deltaship-XXXXXX", options, timeout=60, what="mktemp").strip()
    try:
        say(f"{device}: copying {path.name} to {remote_dir}")
        copy_bundle(path, target, remote_dir, options)
        cmd = profile_command(remote_deltaship, f"{remote_dir}/{path.name}", cfg, threads, tier)
        say(f"{device}: profiling")
        out = ssh_run(target, cmd, options, timeout=7200, what="profile")
    finally:
        try:
            ssh_run(target, f"rm -rf {shlex.quote(remote_dir)}", options, timeout=60, what="cleanup")
        except DeltashipError:
            pass
    try:
        doc = parse_json(out, device, "remote profile", "run the same deltaship version on both machines")
        if (
            not isinstance(doc, dict)
            or not isinstance(doc.get("device"), dict)
            or not isinstance(doc.get("bundle"), dict)
        ):
            raise DeltashipError("not a profile", None)
    except DeltashipError:
        raise DeltashipError(
            f"{device}: the remote profile printed no JSON: {out[-300:]!r}",
            "run the same deltaship version on both machines",
        ) from None
    doc["device"].update(device=device, kind="ssh")
    doc["bundle"]["name"] = path.name
    return doc
