"""Writing a bundle: everything goes to a staging directory, renamed into place only when complete
(deltaship/bundle/destination.py: which --out may be written, the lock, crash recovery)."""

from __future__ import annotations

import json
import platform
import shutil
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

from deltaship.bundle.destination import (
    DEFAULT_REPLACES,  # noqa: F401 (check_destination: the writers' public check)
    Destination,
    environment_errors,
    new_staging,
    publish,
    tree_bytes,
)
from deltaship.bundle.format import MANIFEST, SCHEMA, SCHEMA_VERSION
from deltaship.errors import DeltashipEnvironmentError
from deltaship.files import sha256_file

T = TypeVar("T")


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


def write_dir(
    out: Path | Destination,
    force: bool,
    build: Callable[[Path], T],
    inputs: Iterable[str | Path] = (),
    option: str = "--out",
    replaces: tuple[str, ...] = DEFAULT_REPLACES,
) -> T:
    """Run `build(tmp_dir)` in a staging directory beside `out` and publish it at `out` only when it returned;
    on any failure (an exception, Ctrl-C, SIGTERM through the CLI) the staging directory is removed and an old
    `out` is left as it was. Bundles, app kits, profile plots.

    `out` is a path (claimed here: checked against `force`, `inputs` and `replaces`, locked, recovered) or a
    Destination the caller claimed before its work started. An OSError of the machine (disk full, a name too
    long, permissions) and a MemoryError become one DeltashipEnvironmentError (exit 3)."""
    dest = out if isinstance(out, Destination) else Destination(Path(out), force, inputs, option, replaces)
    try:
        with environment_errors(dest.out, dest.option):
            tmp = new_staging(dest.out)
        try:
            with environment_errors(dest.out, dest.option, written=lambda: tree_bytes(tmp)):
                result = build(tmp)
                publish(tmp, dest.out)
            return result
        except MemoryError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise DeltashipEnvironmentError(
                f"out of memory while writing {dest.option} {dest.out}; nothing was written",
                "close other programs or use a machine with more memory (for an export: --no-verify or a smaller "
                "--prefill-chunk need less)",
            ) from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        if dest is not out:
            dest.release()


def write_bundle(
    out: Path | Destination, force: bool, build: Callable[[Path], dict[str, Any]], inputs: Iterable[str | Path] = ()
) -> dict[str, Any]:
    """Run `build(tmp_dir) -> manifest`, hash the files into it and publish the bundle at `out`."""
    return write_dir(out, force, lambda tmp: write_manifest(tmp, build(tmp)), inputs)


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
