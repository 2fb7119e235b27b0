"""The token table llguidance computes masks over, built once per bundle tokenizer and cached.

llguidance reads a `tokenizers` tokenizer.json itself (byte-level BPE as Qwen3.5's, and the presets' byte-level
vocabulary of 256 bytes and special tokens); ids the tokenizer does not define (a vocabulary padded past it, as the
tiny's 259..271) are never allowed.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import llguidance

from deltaship.errors import DeltashipError

_TABLES: dict[tuple[str, int, tuple[int, ...]], llguidance.LLTokenizer] = {}


def token_table(tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for a bundle's tokenizer.json text, its vocabulary size (the logits' width) and its
    end-of-sequence ids; the same arguments give the same (cached) object."""
    key = (hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest(), int(vocab_size), tuple(sorted(eos_ids)))
    table = _TABLES.get(key)
    if table is None:
        try:
            table = llguidance.LLTokenizer(tokenizer_json, n_vocab=int(vocab_size), eos_token=list(key[2]) or None)
        except (ValueError, RuntimeError) as e:
            raise DeltashipError(
                f"the bundle's tokenizer cannot drive a constraint: {str(e).splitlines()[0] if str(e) else e}",
                "export the bundle again from a checkpoint with a `tokenizers` tokenizer.json",
            ) from None
        _TABLES[key] = table
    return table
