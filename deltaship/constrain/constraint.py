"""A constraint on what a generation may say: a JSON Schema, a regex or a grammar, compiled by llguidance.

`build_constraint(json_schema=..., regex=..., grammar=...)` checks exactly one of them before any bundle is opened
(an invalid or unsupported schema, a regex that does not compile, a grammar that does not parse: DeltashipError);
`Constraint.guide(table)` starts one generation's parser over a bundle's token table (tokens.py). The guide is what
the runtimes' generation loop asks for the allowed tokens (`deltaship.runtimes.base.TokenGuide`).

Grammars are llguidance's Lark-like syntax (docs/agents.md). JSON is compact: no whitespace outside strings, `,`
and `:` as separators, so the longest output of a bounded schema is bounded and a token budget covers it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import numpy as np

from deltaship.errors import DeltashipError
from deltaship.files import read_bounded_text

# No whitespace outside strings; llguidance's own separators spelled out so the form does not drift with its defaults.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

# Bounds on hostile input (llguidance's ParserLimits; its rates: lexer ~50k fuel/ms at build and ~14k/ms per step,
# Earley items ~20k/ms, a lexer state 1-2 kB): about 20 ms to build the lexer, 15 ms per token at worst, and at most
# ~80 MB of lexer states.
LIMITS = {
    "max_items_in_row": 2_000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "max_lexer_states": 50_000,
    "max_grammar_size": 200_000,
}
MAX_FILE_BYTES = 1 << 20  # a schema or grammar file beyond 1 MiB is refused unread
MAX_SCHEMA_DEPTH = 64  # nesting of objects/arrays in a schema document
# JSON objects in a schema document (subschemas, property maps): llguidance's JSON compiler takes ~0.5 ms per
# subschema of a wide anyOf before its grammar-size limit can refuse it, so the count is bounded first
MAX_SCHEMA_OBJECTS = 2_000
MAX_REGEX_CHARS = 10_000

KINDS = ("json_schema", "regex", "grammar")
FLAGS = {"json_schema": "--json-schema", "regex": "--regex", "grammar": "--grammar"}


def limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS, verbose_errors=False)


@dataclass(frozen=True)
class Constraint:
    """One checked constraint: its kind, where it came from (for messages) and llguidance's grammar for it."""

    kind: str  # one of KINDS
    where: str  # "--json-schema FILE", "--regex PATTERN", ...
    grammar: str  # llguidance's top-level grammar (JSON text)

    def guide(self, table: llguidance.LLTokenizer) -> Guide:
        """A fresh parser for one generation over a bundle's token table (tokens.token_table)."""
        return Guide(self, table)


class Guide:
    """One generation's parser state: which tokens may come next, advanced by each emitted token."""

    def __init__(self, constraint: Constraint, table: llguidance.LLTokenizer):
        self.constraint = constraint
        self.vocab_size = int(table.vocab_size)
        self._m = llguidance.LLMatcher(table, constraint.grammar, log_level=0, limits=limits())
        self._raise_if_error("does not compile for this bundle's tokenizer")
        first = np.frombuffer(self._m.compute_bitmask(), np.uint8)
        # llguidance's "no extension" stop: no token can start it (a grammar that matches nothing)
        empty = "NoExtension" in self._m.get_error() if self._m.is_error() else not first.any()
        if empty and not self._m.is_accepting():
            raise DeltashipError(
                f"{constraint.where}: matches nothing (no token can start it, and the empty text is not in it)",
                "check the constraint: e.g. its rules intersect to nothing, or need a token the vocabulary lacks",
            )

    def _raise_if_error(self, what: str) -> None:
        if self._m.is_error():
            raise DeltashipError(
                f"{self.constraint.where}: {what}: {_first_line(self._m.get_error())}",
                "simplify the constraint (limits: docs/agents.md)",
            )

    def allowed(self) -> np.ndarray:
        """bool [vocab_size]: the tokens the constraint allows next (an end-of-sequence id only where it accepts)."""
        bits = np.frombuffer(self._m.compute_bitmask(), np.uint8)
        self._raise_if_error("hit its parser limits")
        return np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)

    def advance(self, token: int) -> None:
        """Consume an emitted token (one `allowed()` let through: anything else is a bug in the caller)."""
        if not self._m.consume_token(int(token)):
            raise RuntimeError(f"token {token} was emitted outside the constraint: {self._m.get_error()}")

    def done(self) -> bool:
        """Nothing but an end-of-sequence token can follow (or one was consumed)."""
        return self._m.is_stopped()

    def complete(self) -> bool:
        """The tokens so far form a whole match of the constraint."""
        return self._m.is_accepting()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the constraint allows in a row from here (the state does not move)."""
        return int(self._m.validate_tokens([int(t) for t in tokens]))


def _first_line(text: str) -> str:
    """A parser message in one line: its first line, and the regex engine's `error: ...` line when there is one."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    why = [ln for ln in lines[1:] if ln.startswith("error:")]
    return " ".join(lines[:1] + why[:1]) or "(no message)"


def build_constraint(
    json_schema: dict[str, Any] | bool | str | Path | None = None,
    regex: str | None = None,
    grammar: str | Path | None = None,
) -> Constraint | None:
    """At most one of: a JSON Schema (a dict, or a file path), a regex (the pattern), a grammar (a file path, in
    llguidance's Lark-like syntax). None when none is given. Every error is a DeltashipError raised here."""
    given = [k for k, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar)) if v is not None]
    if len(given) > 1:
        raise DeltashipError(
            f"{' and '.join(FLAGS[k] for k in given)} cannot be combined: a generation takes one constraint",
            "pass one of --json-schema, --regex or --grammar",
        )
    if not given:
        return None
    if json_schema is not None:
        return _json_schema(json_schema)
    if regex is not None:
        return _regex(regex)
    return _grammar(grammar)


def _json_schema(value: dict[str, Any] | bool | str | Path) -> Constraint:
    fix = "pass a JSON Schema (draft 2020-12 or earlier) file"
    if isinstance(value, (str, Path)):
        where = f"--json-schema {value}"
        text = read_bounded_text(value, "JSON Schema", fix, MAX_FILE_BYTES)
        try:
            schema = json.loads(text)
        except RecursionError:
            raise DeltashipError(f"{where}: nested deeper than {MAX_SCHEMA_DEPTH} levels", fix) from None
        except ValueError as e:
            raise DeltashipError(f"{where}: not JSON ({e})", fix) from None
    else:
        where, schema = "json_schema=", value
        _check_depth(schema, where)  # before anything recurses into it (a cycle too ends here)
        try:
            if len(json.dumps(schema)) > MAX_FILE_BYTES:
                raise DeltashipError(f"{where}: more than {MAX_FILE_BYTES:,} bytes as JSON", "pass a smaller schema")
        except (TypeError, ValueError, RecursionError) as e:
            raise DeltashipError(f"{where}: not a JSON document ({e})", "pass a dict of JSON values") from None
    if not isinstance(schema, (dict, bool)):
        raise DeltashipError(f"{where}: a JSON Schema is an object or a boolean, not {type(schema).__name__}", fix)
    _check_depth(schema, where)
    _check_schema(schema, where)
    g = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    _validate(g, where, schema)
    return Constraint("json_schema", where, g)


def _check_depth(doc: Any, where: str) -> None:
    """Iteratively: a schema nested beyond MAX_SCHEMA_DEPTH or holding more than MAX_SCHEMA_OBJECTS objects is
    refused before anything recurses into it."""
    stack, objects = [(doc, 1)], 0
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise DeltashipError(
                f"{where}: nested deeper than {MAX_SCHEMA_DEPTH} levels", "flatten the schema (or use $defs/$ref)"
            )
        objects += isinstance(node, dict)
        if objects > MAX_SCHEMA_OBJECTS:
            raise DeltashipError(
                f"{where}: more than {MAX_SCHEMA_OBJECTS:,} subschemas (JSON objects)", "split or simplify the schema"
            )
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children)


def _check_schema(schema: dict[str, Any] | bool, where: str) -> None:
    """The schema against its draft's meta-schema (jsonschema): the error names the keyword path."""
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "".join(f"/{p}" for p in e.path) or "/"
        raise DeltashipError(
            f"{where}: invalid schema at {path}: {_first_line(e.message)}", "fix that keyword of the schema"
        ) from None


def _unimplemented(message: str) -> list[str]:
    """The keywords of llguidance's "Unimplemented keys: [...]" message."""
    _, _, rest = message.partition("Unimplemented keys:")
    try:
        keys = json.loads(rest.strip())
    except ValueError:
        return []
    return [str(k) for k in keys] if isinstance(keys, list) else []


def _key_path(doc: Any, key: str, path: str = "") -> str | None:
    """Where `key` first appears as a keyword of the schema, as a JSON pointer."""
    stack = [(doc, path)]
    while stack:
        node, at = stack.pop(0)
        if isinstance(node, dict):
            if key in node:
                return f"{at}/{key}"
            stack.extend((v, f"{at}/{k}") for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, f"{at}/{i}") for i, v in enumerate(node))
    return None


def _validate(g: str, where: str, schema: Any = None) -> None:
    """llguidance's own check of a grammar (no tokenizer needed), under LIMITS."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(g, None, limits=limits())
    if not is_error and not messages:
        return
    msg = messages[0] if messages else "(no message)"
    keys = _unimplemented(msg)
    if keys:
        at = ", ".join(f"{k} (at {_key_path(schema, k) or '?'})" for k in keys)
        raise DeltashipError(
            f"{where}: unsupported keyword(s) {at}: llguidance cannot enforce them, so the output would not be "
            "guaranteed to validate",
            "drop or rewrite those keywords (supported: docs/agents.md)",
        )
    raise DeltashipError(f"{where}: {_first_line(msg)}", "fix the constraint (syntax and limits: docs/agents.md)")


def _regex(pattern: str) -> Constraint:
    where = f"--regex {pattern[:60]!r}"
    if not isinstance(pattern, str) or not pattern:
        raise DeltashipError("--regex: the pattern is empty", "pass a pattern, e.g. --regex '[0-9]{3}'")
    if len(pattern) > MAX_REGEX_CHARS:
        raise DeltashipError(
            f"--regex: {len(pattern):,} characters, more than {MAX_REGEX_CHARS:,}", "use --grammar for a large language"
        )
    g = llguidance.LLMatcher.grammar_from_regex(pattern)
    _validate(g, where)
    return Constraint("regex", where, g)


def _grammar(path: str | Path) -> Constraint:
    where = f"--grammar {path}"
    text = read_bounded_text(path, "grammar", "pass a grammar file in llguidance's Lark syntax", MAX_FILE_BYTES)
    if not text.strip():
        raise DeltashipError(f"{where}: the file is empty", "write a grammar with a `start:` rule (docs/agents.md)")
    # wrapped here: llguidance would read a text that starts with `{` as its own JSON grammar format, not as Lark
    g = json.dumps({"grammars": [{"lark_grammar": text}]})
    _validate(g, where)
    return Constraint("grammar", where, g)
