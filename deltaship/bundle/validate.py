"""Check a manifest against the bundle's JSON Schema (schema.json), with the `jsonschema` library."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from deltaship.bundle.format import SCHEMA_FILE


@lru_cache(maxsize=1)
def schema() -> dict[str, Any]:
    return json.loads(SCHEMA_FILE.read_text())


def schema_problems(manifest: dict[str, Any]) -> list[str]:
    """Where `manifest` breaks the bundle schema (empty when it conforms, or when `jsonschema` is not
    installed: the schema is a check for the maker, a reader needs only the fields it uses)."""
    try:
        import jsonschema
    except ImportError:
        return []
    validator = jsonschema.Draft202012Validator(schema())
    return [
        f"manifest{''.join(f'[{p!r}]' for p in e.absolute_path)}: {e.message}"
        for e in sorted(validator.iter_errors(manifest), key=lambda e: list(map(str, e.absolute_path)))
    ]
