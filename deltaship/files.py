"""Small file helpers shared by the model loader, the bundle reader and the profiler (no toolchains)."""

from __future__ import annotations

import hashlib
import json
import math
import re
from itertools import chain, compress
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


MAX_JSON_DEPTH = 64  # arrays and objects inside each other; deltaship's own files nest 6 deep at most
MAX_INT_DIGITS = 100  # an integer literal; Python itself refuses 4300 digits, with a ValueError of its own


class _Refused(ValueError):
    """What the JSON parser's hooks raise: the problem, for the one DeltashipError that names the file."""


def _refuse_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number (NaN and Infinity literals are refused)")


def _bounded_int(text: str) -> int:
    digits = len(text) - text.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {digits:,} digits (at most {MAX_INT_DIGITS} are read)")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses to inf
        raise _Refused(f"{text[:40]} is beyond a float's range")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _Refused(f"the key {dup[:80]!r} appears twice in one object")
    return obj


_IS_DICT, _IS_LIST = frozenset({dict}).__contains__, frozenset({list}).__contains__
_IS_CONTAINER = frozenset({dict, list}).__contains__
_NUMBER_HOOKS = re.compile(r"\d{%d}|[eE]\+?\d{3}" % (MAX_INT_DIGITS + 1))  # a long integer, or a float's overflow


def _too_deep(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` deep in `value`: one level at a time, the type tests in
    C (map/compress), so a tokenizer's 250K-entry vocabulary and merges cost ~0.1 s, not a Python loop per leaf."""
    level = [value]
    for _ in range(limit):
        dicts = compress(level, map(_IS_DICT, map(type, level)))
        lists = compress(level, map(_IS_LIST, map(type, level)))
        items = list(chain(chain.from_iterable(map(dict.values, dicts)), chain.from_iterable(lists)))
        level = list(compress(items, map(_IS_CONTAINER, map(type, items))))
        if not level:
            return False
    return True


def parse_json(text: str, where: str, what: str, fix: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Untrusted JSON text as data, bounded: at most `max_depth` nested arrays/objects, integers of at most
    MAX_INT_DIGITS digits, finite numbers only (no NaN/Infinity literals), no key twice in one object. Each
    violation, and text that is not JSON, is one DeltashipError naming `where` (a file, or the field that held the
    text) and the problem. The size is the caller's bound (read_json reads at most MAX_JSON_BYTES)."""
    # the number hooks cost a Python call per number: only text with a 101-digit run or a 3-digit exponent needs them
    numbers = {"parse_int": _bounded_int, "parse_float": _finite_float} if _NUMBER_HOOKS.search(text) else {}
    try:
        value = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_unique_keys, **numbers)
    except _Refused as e:
        raise DeltashipError(f"{where}: refused as a {what}: {e}", fix) from None
    except RecursionError:
        raise DeltashipError(f"{where}: refused as a {what}: nested deeper than {max_depth} levels", fix) from None
    except (json.JSONDecodeError, ValueError, TypeError) as e:
        raise DeltashipError(f"{where}: not valid JSON, so not a usable {what} ({e})", fix) from None
    if isinstance(value, (dict, list)) and _too_deep(value, max_depth):
        raise DeltashipError(f"{where}: refused as a {what}: nested deeper than {max_depth} levels", fix)
    return value


def read_json(path: str | Path, what: str, fix: str, limit: int = MAX_JSON_BYTES) -> Any:
    """An untrusted JSON file, bounded in size and in what parse_json bounds; errors name the file, say what it
    should be and the fix."""
    text = read_bounded_text(path, what, fix, limit)
    return parse_json(text, str(path), what, fix)


def read_json_object(path: str | Path, what: str, fix: str, limit: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """A JSON file that must hold an object; errors name the file, say what it should be and the fix."""
    data = read_json(path, what, fix, limit)
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
