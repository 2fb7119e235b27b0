"""Check a manifest against the bundle's JSON Schema (schema.json), with the `jsonschema` library."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from deltaship.bundle.format import SCHEMA_FILE


@lru_cache(maxsize=1)
def schema() -> dict[str, Any]:
    return json.loads(SCHEMA_FILE.read_text())


if TYPE_CHECKING:
    import jsonschema


@lru_cache(maxsize=1)
def _validator() -> "jsonschema.Draft202012Validator":
    # imported when a manifest is first checked: the ONNX Runtime worker (runtimes/ort_worker.py) imports this
    # package in a Python that has only onnxruntime and numpy, and checks no manifest there
    import jsonschema  # lazy: jsonschema

    # JSON Schema's "integer" takes 3.0 (a number with a zero fraction); a shape, a size or a token id read as
    # 3.0 would reach range() and the runtimes as a float, so here an integer is a JSON integer (and not a bool)
    types = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _, x: isinstance(x, int) and not isinstance(x, bool)
    )
    strict = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=types)
    return strict(schema())


def schema_problems(manifest: dict[str, Any]) -> list[str]:
    """Where `manifest` breaks the bundle schema (empty when it conforms). Every reader refuses a manifest
    with problems (reader.read_manifest); `inspect` lists them."""
    validator = _validator()
    return [
        f"manifest{''.join(f'[{p!r}]' for p in e.absolute_path)}: {_short(e.message)}"
        for e in sorted(validator.iter_errors(manifest), key=lambda e: list(map(str, e.absolute_path)))
    ]


def _short(message: str, limit: int = 200) -> str:
    """jsonschema quotes the offending value whole; a line of a report needs its start."""
    return message if len(message) <= limit else message[:limit] + "..."
