"""The fleet's bundle store: bundles by content address under `OUT/store/`, shared by every node (a shared
directory), so that bundle bytes never travel through Ray's object store.

A key is the sha256 of what decides a bundle's bytes: the checkpoint's digest, target, precision, export options,
and the deltaship and toolchain versions. `store/KEY/` is the bundle (published by export()'s own rename, so it is
whole or absent) and `store/KEY.json` its record (the bundle's tree sha256 and its files' sha256), written after
it. A reader checks the tree sha256 on arrival; one builder per key at a time (a lock beside it), and a key that is
in the store is never built again.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock

from deltaship.bundle.destination import replace_file
from deltaship.bundle.reader import read_manifest, require_intact
from deltaship.bundle.writer import tool_versions
from deltaship.errors import DeltashipEnvironmentError
from deltaship.files import read_json_object, sha256_file
from deltaship.targets import get_target

STORE_VERSION = 1
KEY = re.compile(r"[0-9a-f]{32}")


def bundle_key(digest: str, target: str, precision: str, options: dict[str, Any]) -> str:
    """The content address of a bundle: what decides its bytes, hashed (32 hex digits)."""
    what = {
        "store": STORE_VERSION,
        "checkpoint": digest,
        "target": target,
        "precision": precision,
        "options": options,
        "versions": tool_versions("torch", *get_target(target).tool_packages),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:32]


def tree_sha256(root: Path) -> str:
    """sha256 over every file of a bundle (relative path and content sha256, in path order)."""
    h = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + sha256_file(p).encode() + b"\n")
    return h.hexdigest()


class Store:
    """`OUT/store/`: bundle directories by key and their records."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path(self, key: str) -> Path:
        if not KEY.fullmatch(key):  # a key is ours: 32 hex digits, never a path
            raise ValueError(f"not a bundle key: {key!r}")
        return self.root / key

    def record(self, key: str) -> dict[str, Any] | None:
        """The record of a finished key, or None (no record, or its bundle is gone)."""
        rec = self.root / f"{self.path(key).name}.json"
        if not rec.is_file() or not (self.path(key) / "manifest.json").is_file():
            return None
        return read_json_object(rec, "a fleet store record", "delete it; the next run rebuilds the bundle")

    def build(self, key: str, make: Callable[[Path], None]) -> tuple[dict[str, Any], bool]:
        """(record, built): the key's record, building the bundle with make(out) first unless it is in the store;
        a bundle there without a record (a crash between the two) gets its record after an integrity check."""
        self.root.mkdir(parents=True, exist_ok=True)
        out = self.path(key)
        with FileLock(str(self.root / f".{key}.build.lock")):
            found = self.record(key)
            if found is not None:
                return found, False
            built = not (out / "manifest.json").is_file()
            if built:
                make(out)
            manifest = read_manifest(out)
            require_intact(out, manifest, hashes=True)
            record = {
                "key": key,
                "sha256": tree_sha256(out),
                "files": {name: f["sha256"] for name, f in sorted(manifest["files"].items())},
                "bytes": manifest.get("bundle_bytes"),
            }
            replace_file(self.root / f"{key}.json", json.dumps(record, indent=1), "the fleet store")
            return record, built

    def arrive(self, key: str, sha256: str) -> Path:
        """The bundle of `key`, after checking that its bytes are the ones recorded when it was built."""
        out = self.path(key)
        got = tree_sha256(out) if out.is_dir() else None
        if got != sha256:
            raise DeltashipEnvironmentError(
                f"the store's bundle {key} is {'missing' if got is None else 'changed'} on this node "
                f"(sha256 {got}, built as {sha256})",
                "give every node the same store directory (a shared mount), or delete the key to rebuild it",
            )
        return out
