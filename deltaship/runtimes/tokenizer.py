"""The bundle's tokenizer, through the `tokenizers` library (Rust; no torch, no transformers)."""

from __future__ import annotations

from pathlib import Path

from deltaship.bundle.paths import bundle_path
from deltaship.errors import DeltashipError
from deltaship.files import parse_json, read_bounded_text

FIX = "export the bundle again (its tokenizer.json is damaged or not one the `tokenizers` library reads)"

# What a tokenizer may cost before `tokenizers` builds it: its memory grows with the vocabulary, the merges and the
# longest token far beyond the file's bytes (a 60 MiB file under the byte bound took 4.7 GB of RSS). Qwen3.5's has
# ~248K tokens and about as many merges, tokens of at most a few hundred characters: 4x headroom on each count.
MAX_TOKENS = 1 << 20  # vocabulary entries, and separately merges
MAX_ADDED_TOKENS = 1 << 16
MAX_TOKEN_CHARS = 4096


def check_cost(doc: object, path: Path, vocab_size: int | None = None) -> None:
    """Refuse a parsed tokenizer.json whose vocabulary, merges, added tokens or longest token is beyond the bounds
    above, naming the count and the bound, before the `tokenizers` library builds anything from it; and one with
    ids at or beyond `vocab_size` (the model's, which the logits' width is checked against)."""
    if not isinstance(doc, dict):
        raise DeltashipError(f"{path}: not a tokenizer (expected a JSON object)", FIX)
    model = doc.get("model") if isinstance(doc.get("model"), dict) else {}
    vocab, merges, added = model.get("vocab"), model.get("merges"), doc.get("added_tokens")
    counts = [("vocabulary entries", vocab, MAX_TOKENS), ("merges", merges, MAX_TOKENS)]
    counts.append(("added tokens", added, MAX_ADDED_TOKENS))
    for what, items, bound in counts:
        if isinstance(items, (dict, list)) and len(items) > bound:
            raise DeltashipError(f"{path}: {len(items):,} {what}, more than a tokenizer may have here ({bound:,})", FIX)
    tokens = list(vocab) if isinstance(vocab, dict) else [e[0] for e in vocab or () if isinstance(e, list) and e]
    tokens += [t.get("content") for t in added or () if isinstance(t, dict)]
    if vocab_size is not None:
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab or ())))
        ids += [t.get("id") for t in added or () if isinstance(t, dict)]
        top = max((i for i in ids if isinstance(i, int) and not isinstance(i, bool)), default=-1)
        if top >= vocab_size:
            raise DeltashipError(
                f"{path}: the tokenizer has token id {top:,}, beyond the model's vocabulary of {vocab_size:,}", FIX
            )
    longest = max((len(t) for t in tokens if isinstance(t, str)), default=0)
    if longest > MAX_TOKEN_CHARS:
        raise DeltashipError(
            f"{path}: a token of {longest:,} characters, longer than a tokenizer's may be here ({MAX_TOKEN_CHARS:,})",
            FIX,
        )


class BundleTokenizer:
    def __init__(self, path: Path, vocab_size: int | None = None):
        from tokenizers import Tokenizer  # lazy: tokenizers

        text = read_bounded_text(path, "tokenizer", FIX)  # bounded: a tokenizer beyond 64 MiB is refused unread
        self.json_text = text  # what a constraint's token table is built from (deltaship.constrain.token_table)
        try:
            doc = parse_json(text, str(path), "tokenizer", FIX)  # bounded: depth, numbers, keys
        except DeltashipError as e:
            why = e.message.removeprefix(f"{path}: ")
            raise DeltashipError(f"{path}: not a tokenizer deltaship reads ({why})", FIX) from None
        check_cost(doc, path, vocab_size)
        try:
            self._tok = Tokenizer.from_str(text)
        except Exception as e:  # the Rust library raises a bare Exception with serde's message
            raise DeltashipError(f"{path}: not a tokenizer the `tokenizers` library can read ({e})", FIX) from None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def load_tokenizer(bundle: Path, manifest: dict) -> BundleTokenizer:
    files = manifest.get("tokenizer", {}).get("files", [])
    if "tokenizer.json" not in files:
        source = manifest.get("source", {})
        why = (
            f"the preset {source.get('model')} has random weights and ships no tokenizer"
            if source.get("kind") == "preset"
            else "the checkpoint had no tokenizer.json"
        )
        raise DeltashipError(
            f"{bundle}: this bundle has no tokenizer ({why})",
            "pass token ids with --input-ids 1,2,3 instead of --prompt (or export a checkpoint "
            "directory that has tokenizer.json)",
        )
    vocab = (manifest.get("model") or {}).get("vocab_size")
    path = bundle_path(bundle, manifest, "tokenizer.json", "tokenizer.files")
    return BundleTokenizer(path, vocab if isinstance(vocab, int) else None)
