"""Constrained decoding beside the runtimes: JSON Schema / regex / grammar constraints (llguidance) as token guides
the runtimes' shared generation loop masks logits with (docs/agents.md)."""

from deltaship.constrain.constraint import (
    JSON_OPTIONS,
    LIMITS,
    MAX_FILE_BYTES,
    MAX_REGEX_CHARS,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_OBJECTS,
    Constraint,
    Guide,
    build_constraint,
)
from deltaship.constrain.tokens import token_table

__all__ = [
    "JSON_OPTIONS",
    "LIMITS",
    "MAX_FILE_BYTES",
    "MAX_REGEX_CHARS",
    "MAX_SCHEMA_DEPTH",
    "MAX_SCHEMA_OBJECTS",
    "Constraint",
    "Guide",
    "build_constraint",
    "token_table",
]
