"""Reading a bundle: manifest.json and the integrity check of its files. No toolchain imports here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from deltaship.bundle.format import MANIFEST, SCHEMA, SCHEMA_VERSION
from deltaship.bundle.paths import FIX, check_paths, name_problem, named_paths
from deltaship.bundle.validate import schema_problems
from deltaship.errors import DeltashipError
from deltaship.files import read_json_object, sha256_file


def read_manifest(bundle: str | Path, validate: bool = True) -> dict[str, Any]:
    """The bundle's manifest, refused (one DeltashipError) unless it is this schema version, follows
    schema.json (`validate=False`: `inspect`, which reports the problems instead) and names only files
    inside the bundle that `files` lists. Opens no file but manifest.json."""
    d = Path(bundle)
    if not d.is_dir():
        raise DeltashipError(
            f"{d}: not a bundle directory (it does not exist or is a file)",
            "pass the directory written by `deltaship export --out DIR`",
        )
    path = d / MANIFEST
    if not path.is_file():
        raise DeltashipError(
            f"{d}: no {MANIFEST}; this is not a deltaship bundle (or an export did not finish)",
            "export again with `deltaship export ... --out DIR`",
        )
    if path.resolve().parent != d.resolve():
        raise DeltashipError(f"{path}: a symlink out of the bundle ({path.resolve()}); refused", FIX)
    m = read_json_object(path, "bundle manifest", "export the bundle again")
    if m.get("schema") != SCHEMA:
        raise DeltashipError(
            f"{path}: not a deltaship manifest (schema {m.get('schema')!r})", "export the bundle again"
        )
    version = m.get("schema_version")
    if version != SCHEMA_VERSION:
        age = "an older" if isinstance(version, int) and version < SCHEMA_VERSION else "a newer"
        source = m["source"].get("model", "MODEL") if isinstance(m.get("source"), dict) else "MODEL"
        raise DeltashipError(
            f"{path}: this bundle was written by {age} deltaship (manifest schema version {version}); "
            f"this deltaship reads version {SCHEMA_VERSION}",
            f"export it again with this version: deltaship export --model {source} "
            f"--target {m.get('target', 'TARGET')} --precision {m.get('precision', 'PRECISION')} "
            "--out NEW_DIR"
            if age == "an older"
            else "upgrade deltaship (pip install -U deltaship)",
        )
    check_paths(d, m)  # first: its refusal names the field and the path, plainer than the schema's pattern
    if validate:
        require_schema(d, m)
    return m


def require_schema(bundle: str | Path, manifest: dict[str, Any]) -> None:
    """Refuse a manifest that breaks schema.json, naming the fields (at most five)."""
    problems = schema_problems(manifest)
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise DeltashipError(
            f"{bundle}: the manifest does not follow the bundle schema: " + "; ".join(problems[:5]) + more,
            "export the bundle again with this version of deltaship (`deltaship inspect DIR` lists every problem)",
        )


def check_files(bundle: str | Path, manifest: dict[str, Any], hashes: bool = True) -> list[str]:
    """Problems with the bundle's files (missing, wrong size, wrong sha256); empty when intact."""
    d = Path(bundle)
    problems = []
    files = manifest.get("files")
    for name, info in (files if isinstance(files, dict) else {}).items():
        if (
            name_problem(name)
            or not isinstance(info, dict)
            or not isinstance(info.get("bytes"), int)
            or not isinstance(info.get("sha256"), str)
        ):
            problems.append(f"{name!r}: not a plain file name with its size and sha256")
            continue
        p = d / name
        if p.resolve() != d.resolve() and d.resolve() not in p.resolve().parents:
            problems.append(f"{name}: resolves outside the bundle (a symlink?); not opened")
        elif not p.is_file():
            problems.append(f"{name}: missing")
        elif p.stat().st_size != info["bytes"]:
            problems.append(f"{name}: {p.stat().st_size} bytes, manifest says {info['bytes']}")
        elif hashes and sha256_file(p) != info["sha256"]:
            problems.append(f"{name}: sha256 mismatch (the file was modified after export)")
    return problems + _unlisted_in_packages(d, manifest)


def _unlisted_in_packages(bundle: Path, manifest: dict[str, Any]) -> list[str]:
    """A directory the manifest names (a Core ML .mlpackage) is opened whole by its runtime: every file under it
    must be listed (and so hashed), and nothing under it may be a symlink."""
    files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    problems = []
    for field, name in named_paths(manifest):
        if name_problem(name) or not (bundle / name).is_dir() or (bundle / name).is_symlink():
            continue
        for top, dirs, names in os.walk(bundle / name):  # followlinks=False: a symlinked directory is reported
            for n in sorted(dirs + names):
                p = Path(top) / n
                rel = p.relative_to(bundle).as_posix()
                if p.is_symlink():
                    problems.append(f"{rel}: a symlink inside {name} ({field}); not opened")
                elif p.is_file() and rel not in files:
                    problems.append(f"{rel}: inside {name} ({field}) but not listed in `files`, so not hashed")
    return list(dict.fromkeys(problems))


def require_intact(bundle: str | Path, manifest: dict[str, Any], hashes: bool = True) -> None:
    problems = check_files(bundle, manifest, hashes)
    if problems:
        raise DeltashipError(
            f"{bundle}: the bundle has been tampered with or damaged: " + "; ".join(problems),
            "export the bundle again (or restore it from where it was shipped)",
        )
