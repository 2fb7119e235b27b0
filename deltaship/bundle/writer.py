"""Writing a bundle: everything goes to a temporary directory, renamed into place only when complete."""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, TypeVar

from deltaship.bundle.format import MANIFEST, SCHEMA, SCHEMA_VERSION
from deltaship.errors import DeltashipError
from deltaship.files import sha256_file

T = TypeVar("T")


def check_destination(out: Path, force: bool) -> None:
    """Refuse to overwrite unless asked; never write through a file."""
    if out.exists() and not out.is_dir():
        raise DeltashipError(f"--out {out} exists and is a file", "choose another --out directory")
    if out.exists() and any(out.iterdir()) and not force:
        raise DeltashipError(
            f"--out {out} already exists and is not empty; nothing was written",
            "pass --force to replace it, or choose another --out directory",
        )


def staging_dir(out: Path) -> Path:
    """A private temporary directory beside `out`, named after this process (see sweep_stale_partials)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-", dir=out.parent))


def sweep_stale_partials(out: Path) -> list[Path]:
    """Remove staging directories of earlier exports to `out` whose process is gone (killed with SIGKILL,
    or a machine that went down); a staging directory of a live process is left alone."""
    removed = []
    for p in out.parent.glob(f".{out.name}.partial-*-*"):
        pid = p.name.removeprefix(f".{out.name}.partial-").split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
        except PermissionError:  # alive, someone else's
            pass
    return removed


def write_manifest(tmp: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Hash every file in `tmp` into manifest["files"] and write manifest.json there.

    Called once before verification (the runtimes read the manifest) and again when the bundle is complete."""
    files = {}
    for p in sorted(tmp.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files[p.relative_to(tmp).as_posix()] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    manifest["files"] = files
    manifest["bundle_bytes"] = sum(f["bytes"] for f in files.values())
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return manifest


def move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished staging directory to `out` (an old `out` is moved aside first, then removed)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp made it private; the result gets normal permissions
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_dir(out: Path, force: bool, build: Callable[[Path], T]) -> T:
    """Run `build(tmp_dir)` in a staging directory beside `out` and publish it at `out` only when it returned;
    on any failure (an exception, Ctrl-C, SIGTERM through the CLI) nothing is left. Bundles and app kits."""
    out = Path(out)
    check_destination(out, force)
    if out.parent.is_dir():
        sweep_stale_partials(out)
    tmp = staging_dir(out)
    try:
        result = build(tmp)
        move_into_place(tmp, out)
        return result
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_bundle(out: Path, force: bool, build: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """Run `build(tmp_dir) -> manifest`, hash the files into it and publish the bundle at `out`."""
    return write_dir(out, force, lambda tmp: write_manifest(tmp, build(tmp)))


def tool_versions(*packages: str) -> dict[str, str]:
    out = {"python": platform.python_version()}
    for p in ("deltaship",) + packages:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = "not installed"
    return out


def state_bytes(states: list[dict[str, Any]]) -> int:
    """Bytes of one sequence's state (every state tensor at its dtype)."""
    size = {"float32": 4, "float16": 2, "int8": 1, "uint8": 1}
    total = 0
    for s in states:
        n = 1
        for d in s["shape"]:
            n *= d
        total += n * size[s["dtype"]]
    return total


def new_manifest(
    *,
    source: dict[str, Any],
    model_card: dict[str, Any],
    model: dict[str, Any],
    target: str,
    precision: str,
    quantization: dict[str, Any],
    max_context: int,
    prefill_chunk: int,
    entry: str,
    inputs: list[dict[str, Any]],
    outputs: list[dict[str, Any]],
    states: list[dict[str, Any]],
    usage: list[str],
    tokens: dict[str, Any],
    tokenizer: dict[str, Any],
    passes: list[dict[str, Any]],
    lowering: dict[str, Any],
    tools: dict[str, str],
) -> dict[str, Any]:
    """A manifest with every field of schema.json but `verification`, `files` and `bundle_bytes`
    (added when verification has run and the files are final)."""
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": source,
        "model_card": model_card,
        "model": model,
        "target": target,
        "precision": precision,
        "quantization": quantization,
        "max_context": max_context,
        "prefill_chunk": prefill_chunk,
        "entry": entry,
        "inputs": inputs,
        "outputs": outputs,
        "states": states,
        "state_bytes": state_bytes(states),
        "usage": usage,
        "tokens": tokens,
        "tokenizer": tokenizer,
        "passes": passes,
        "lowering": lowering,
        "tools": tools,
    }
