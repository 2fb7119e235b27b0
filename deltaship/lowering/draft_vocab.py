"""A reduced-vocabulary draft head (export option --mtp-draft-vocab N): the MTP head's logits over N token ids.

The draft call of speculative decoding streams the LM head again (at 0.8B: 1024 x 248,320, a quarter of the int4
weights) to pick one token that the verify call then checks with the full head. FR-Spec (Zhao et al. 2025,
"Frequency-Ranked Speculative Sampling") drafts over the most frequent tokens only: the draft's LM head is the rows
of those ids, so its cost falls with N, and the output stays lossless (the verify call keeps the full head; a
token outside the subset is simply never drafted; for sampling the draft distribution is zero outside it).

The subset: token ids ranked by their count on a calibration text tokenized with the checkpoint's tokenizer (the
tiny preset's held-out text past what the profile's prompts and eval read, or a file of the user's), ties and
unseen ids by ascending id (BPE ids follow merge order, roughly frequency); the special ids (eos, bos, pad, chat
markers) are always kept. Without a tokenizer (random-weight presets) it is the lowest ids: good for measuring
costs only, and the manifest says so. The ids are stored ascending in the bundle (DRAFT_VOCAB_FILE).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from deltaship.errors import DeltashipError
from deltaship.models.trained import HELDOUT

DRAFT_VOCAB_FILE = "mtp_draft_vocab.json"
# heldout.txt characters skipped: profile --speculative's prompts read its first 3,564 bytes (8 windows of 64
# bytes, 500 apart), eval and the KV-cache calibration its first ~2,600 characters
RANKING_OFFSET = 4096


def parse_draft_vocab(value: Any) -> int | None:
    """--mtp-draft-vocab: `full` (or None) -> None; N (an int or its digits) -> N, at least 2."""
    if value is None or value == "full":
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = None
    if n is None or isinstance(value, bool) or (isinstance(value, float) and value != n):
        raise DeltashipError(
            f"--mtp-draft-vocab must be a number of token ids or 'full', got {value!r}",
            "pass e.g. --mtp-draft-vocab 32768, or --mtp-draft-vocab full (the default: the whole vocabulary)",
        )
    if n < 2:
        raise DeltashipError(
            f"--mtp-draft-vocab {n}: the draft head needs at least 2 token ids",
            "pass a larger N (e.g. 32768 for a 248K vocabulary), or full",
        )
    return n


def check_draft_vocab(options: Any) -> None:
    """The option combinations of a target's typed options (mtp, mtp_draft_vocab, mtp_draft_vocab_text), checked
    with the other export options (the vocabulary size is checked once the checkpoint is loaded, in rank)."""
    n = parse_draft_vocab(getattr(options, "mtp_draft_vocab", None))
    text = getattr(options, "mtp_draft_vocab_text", None)
    if (n is not None or text is not None) and not getattr(options, "mtp", False):
        given = "--mtp-draft-vocab" if n is not None else "--mtp-draft-vocab-text"
        raise DeltashipError(
            f"{given} shapes the multi-token-prediction draft head, which is exported only with --mtp",
            f"add --mtp, or drop {given}",
        )
    if text is not None and n is None:
        raise DeltashipError(
            "--mtp-draft-vocab-text ranks the ids of a reduced draft vocabulary; without --mtp-draft-vocab N the "
            "draft head keeps the full vocabulary",
            "add --mtp-draft-vocab N, or drop --mtp-draft-vocab-text",
        )
    if text is not None and not Path(text).is_file():
        raise DeltashipError(
            f"--mtp-draft-vocab-text {text}: no such file", "pass a UTF-8 text file to rank the draft vocabulary on"
        )


def special_ids(tokens: dict[str, Any], vocab: int) -> list[int]:
    """Every special id of the manifest's `tokens` (eos, bos, pad, chat markers) inside the vocabulary."""
    out = set()
    for value in tokens.values():
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and 0 <= i < vocab:
                out.add(i)
    return sorted(out)


def ranking_text(text_file: str | Path | None) -> tuple[str, str]:
    """The calibration text and how to describe it."""
    if text_file is not None:
        return Path(text_file).read_text(encoding="utf-8", errors="replace"), f"{Path(text_file).name} (user file)"

    text = HELDOUT.read_text(encoding="utf-8", errors="replace")[RANKING_OFFSET:]
    return text, f"the tiny preset's heldout.txt from character {RANKING_OFFSET}"


def rank(
    vocab: int, n: int, specials: list[int], tokenizer_file: Path | None, text_file: str | Path | None = None
) -> tuple[np.ndarray, dict[str, Any]]:
    """The N draft ids (int32, ascending) and the manifest's record of how they were chosen."""
    if n > vocab:
        raise DeltashipError(
            f"--mtp-draft-vocab {n} is larger than the checkpoint's vocabulary ({vocab} ids)",
            f"pass at most {vocab}, or full",
        )
    if n <= len(specials):
        raise DeltashipError(
            f"--mtp-draft-vocab {n}: the draft vocabulary always keeps the {len(specials)} special ids {specials}, "
            "so it needs more than that",
            f"pass at least {len(specials) + 1}",
        )
    counts = np.zeros(vocab, np.int64)
    record: dict[str, Any] = {"file": DRAFT_VOCAB_FILE, "size": n, "vocab_size": vocab, "special_ids": specials}
    if tokenizer_file is not None:
        from tokenizers import Tokenizer  # lazy: tokenizers, only where text is encoded

        text, where = ranking_text(text_file)
        ids = np.asarray(Tokenizer.from_file(str(tokenizer_file)).encode(text).ids, np.int64)
        ids = ids[(ids >= 0) & (ids < vocab)]
        counts += np.bincount(ids, minlength=vocab)
        record["ranking"] = (
            f"token frequency on {where} ({ids.size} tokens, the checkpoint's tokenizer); ties and unseen ids by "
            "ascending id; special ids always kept"
        )
        record["calibration_tokens"] = int(ids.size)
    else:
        record["ranking"] = (
            "ascending ids (the checkpoint has no tokenizer to rank on): for measuring costs only, not a draft "
            "vocabulary to deploy"
        )
    order = np.lexsort((np.arange(vocab), -counts))  # by count, most frequent first; then by id
    rest = order[~np.isin(order, specials)][: n - len(specials)]
    out = np.sort(np.concatenate([np.asarray(specials, np.int64), rest])).astype(np.int32)
    total = int(counts.sum())
    record["coverage"] = round(float(counts[out].sum()) / total, 6) if total else None
    return out, record


def write(directory: Path, ids: np.ndarray) -> None:
    (directory / DRAFT_VOCAB_FILE).write_text(json.dumps({"dtype": "int32", "ids": [int(i) for i in ids]}))


def smallest_covering(counts: np.ndarray, coverage: float) -> int:
    """The fewest most-frequent ids whose counts cover `coverage` of the total (for choosing N)."""
    c = np.sort(np.asarray(counts))[::-1]
    return int(np.searchsorted(np.cumsum(c), coverage * c.sum()) + 1)
