"""Small file helpers shared by the model loader, the bundle reader and the profiler (no toolchains)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from deltaship.errors import DeltashipError


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


MAX_JSON_BYTES = 64 << 20  # a manifest, config or tokenizer beyond this is not one deltaship wrote


def read_bounded_text(path: str | Path, what: str, fix: str, limit: int = MAX_JSON_BYTES) -> str:
    """The text of an untrusted file, refused (naming its size) beyond `limit` bytes or when it is not UTF-8."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > limit:
            raise DeltashipError(
                f"{path}: {size:,} bytes, more than a {what} may hold ({limit:,} bytes); refused unread", fix
            )
        with open(path, "rb") as f:
            data = f.read(limit + 1)  # the file may have grown since stat
    except OSError as e:
        raise DeltashipError(f"{path}: cannot read the {what} ({e.strerror or e})", fix) from None
    if len(data) > limit:
        raise DeltashipError(f"{path}: more than a {what} may hold ({limit:,} bytes); refused", fix)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DeltashipError(f"{path}: not UTF-8 text, so not a usable {what} ({e})", fix) from None


def read_json(path: str | Path, what: str, fix: str, limit: int = MAX_JSON_BYTES) -> Any:
    """An untrusted JSON file, bounded in size; errors name the file, say what it should be and the fix."""
    text = read_bounded_text(path, what, fix, limit)
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError, ValueError) as e:
        raise DeltashipError(f"{path}: not valid JSON, so not a usable {what} ({e})", fix) from None


def read_json_object(path: str | Path, what: str, fix: str) -> dict[str, Any]:
    """A JSON file that must hold an object; errors name the file, say what it should be and the fix."""
    data = read_json(path, what, fix)
    if not isinstance(data, dict):
        raise DeltashipError(f"{path}: expected a JSON object at the top level of a {what}", fix)
    return data


def read_int(path: Path) -> int | None:
    """A small file holding one non-negative integer (a pid, a cgroup limit); None when unreadable or not one."""
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
