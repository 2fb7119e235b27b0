"""The ranges of the options the CLI and the Python API share, checked in one place.

Each check takes a value already of its type and returns it, or raises DeltashipError naming the flag, the value
and the fix. The CLI wraps them as argparse `type=` functions (deltaship/cli.py: a bad value is an argparse error,
exit 2, before any work); the API functions (generate, export, profile, evaluate, open_bundle) call them on their
keyword arguments, so `deltaship generate --threads 0` and `generate(..., threads=0)` are refused alike.
"""

from __future__ import annotations

import math
import numbers
from pathlib import Path

from deltaship.errors import DeltashipError

SAMPLING_FIX = "add --temperature T to sample (greedy ignores them)"


def at_least(flag: str, value: int, low: int, fix: str | None = None) -> int:
    """An integer option >= low (bool is not an integer here)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise DeltashipError(f"{flag} must be an integer, got {value!r}", fix or f"pass e.g. {flag} {max(low, 1)}")
    if value < low:
        raise DeltashipError(f"{flag} must be >= {low}, got {value}", fix or f"pass e.g. {flag} {max(low, 1)}")
    return int(value)


def threads(value: int | None, flag: str = "--threads") -> int | None:
    """None: the runtime's default; else at least 1 thread."""
    return None if value is None else at_least(flag, value, 1, f"pass {flag} 1 or more, or leave it out")


def block_size(value: int) -> int:
    """The int8/int4 quantization block: a power of two of at least 16 (export --block-size, plan --block-size)."""
    at_least("--block-size", value, 16, "use 32, 64 or 128")
    if value & (value - 1):
        raise DeltashipError(f"--block-size must be a power of two >= 16, got {value}", "use 32, 64 or 128")
    return int(value)


def seed(value: int | None) -> int | None:
    return None if value is None else at_least("--seed", value, 0, "pass a seed of 0 or more, e.g. --seed 0")


def top_k(value: int | None) -> int | None:
    """None: no top-k cut; else keep the k most likely tokens (k >= 1)."""
    return None if value is None else at_least("--top-k", value, 1, "pass --top-k 1 or more, or leave it out")


def max_new_tokens(value: int) -> int:
    return at_least("--max-new-tokens", value, 1, "pass --max-new-tokens 1 or more")


def number(flag: str, value: float, low: float, *, above: bool = False, high: float | None = None) -> float:
    """A finite number >= low (> low with above=True), and <= high when given."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if above else value >= low) and (high is None or value <= high)
    if not ok:
        bound = f"{'>' if above else '>='} {low}" + (f" and <= {high}" if high is not None else "")
        raise DeltashipError(f"{flag} must be a finite number {bound}, got {value!r}", f"pass e.g. {flag} {high or 2}")
    return float(value)


def temperature(value: float) -> float:
    """0 is greedy; a finite positive value samples."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise DeltashipError(f"--temperature must be a number, got {value!r}", "use 0 for greedy, e.g. 0.7 to sample")
    if not (math.isfinite(value) and value >= 0):  # NaN fails both
        raise DeltashipError(
            f"--temperature must be a finite number >= 0, got {value}", "use 0 for greedy, e.g. 0.7 to sample"
        )
    return float(value)


def top_p(value: float | None) -> float | None:
    """None: no nucleus cut; else keep the smallest set of tokens whose probability reaches p, p in (0, 1]."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:  # NaN fails too
        raise DeltashipError(f"--top-p must be in (0, 1], got {value!r}", "use e.g. --top-p 0.9, or leave it out")
    return float(value)


def sampling(temp: float, k: int | None, p: float | None, s: int | None) -> None:
    """--top-k, --top-p and --seed mean something only when sampling: with greedy decoding (temperature 0) they
    would be ignored, so they are refused (transformers' do_sample=False warns about the same thing)."""
    temperature(temp)
    top_k(k)
    top_p(p)
    seed(s)
    given = [flag for flag, v in (("--top-k", k), ("--top-p", p), ("--seed", s)) if v is not None]
    if temp == 0 and given:
        raise DeltashipError(f"{', '.join(given)} without --temperature: greedy decoding ignores them", SAMPLING_FIX)


def int_list(text: str, flag: str, low: int = 0, example: str = "1,2,3") -> list[int]:
    """Comma-separated integers >= low ("1,2,3"; spaces allowed around the commas), naming the bad item."""
    parts = text.split(",")
    ids = []
    for n, part in enumerate(parts, 1):
        part = part.strip()
        if not part.isascii() or not part.isdigit() or int(part) < low:  # "", "-1", "1.5", "x", "٣"
            what = "is empty" if part == "" else f"is {part!r}, not an integer >= {low}"
            raise DeltashipError(
                f"{flag} {text!r}: item {n} of {len(parts)} {what}",
                f"pass comma-separated integers, e.g. {flag} {example}",
            )
        ids.append(int(part))
    return ids


def token_ids(text: str, flag: str = "--input-ids") -> list[int]:
    """Comma-separated non-negative token ids."""
    return int_list(text, flag, 0)


def text(value: str, flag: str = "--prompt") -> str:
    """Text that can be encoded as UTF-8: invalid UTF-8 bytes in argv arrive as lone surrogates (Python's
    surrogateescape) and would fail deep inside the tokenizer."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        try:
            bad = "bytes " + value[e.start : e.end].encode("utf-8", "surrogateescape").hex(" ")
        except UnicodeEncodeError:  # a lone surrogate that is no escaped byte (from the Python API)
            bad = ascii(value[e.start : e.end])
        raise DeltashipError(
            f"{flag} is not valid UTF-8 text ({bad} at character {e.start})",
            "pass UTF-8 text (check the terminal's or the script's encoding)",
        ) from None
    return value


def new_file(value: str | Path, flag: str) -> Path:
    """A file to be written: its directory must exist (checked before any work) and the file must not."""
    path = Path(value)
    parent = path.parent
    try:
        path.lstat()
        exists = True
    except FileNotFoundError:
        exists = False
    except OSError as e:  # a name too long, a file where a directory should be, no permission to look
        raise DeltashipError(f"{flag} {value}: {e.strerror}", "pass a shorter path in a directory you can write")
    if not parent.is_dir():
        raise DeltashipError(
            f"{flag} {value}: the directory {parent} does not exist", f"create it first (mkdir -p {parent})"
        )
    if exists:
        raise DeltashipError(
            f"{flag} {value} already exists; nothing was overwritten", "choose another file name or remove the old one"
        )
    return path
