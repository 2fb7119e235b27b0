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


def read_json_object(path: Path, what: str, fix: str) -> dict[str, Any]:
    """A JSON file that must hold an object; errors name the file, say what it should be and the fix."""
    try:
        data = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DeltashipError(f"{path}: not valid JSON, so not a usable {what} ({e})", fix) from None
    if not isinstance(data, dict):
        raise DeltashipError(f"{path}: expected a JSON object at the top level of a {what}", fix)
    return data
