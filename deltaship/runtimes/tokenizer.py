"""The bundle's tokenizer, through the `tokenizers` library (Rust; no torch, no transformers)."""

from __future__ import annotations

from pathlib import Path

from deltaship.bundle.paths import bundle_path
from deltaship.errors import DeltashipError
from deltaship.files import read_bounded_text

FIX = "export the bundle again (its tokenizer.json is damaged or not one the `tokenizers` library reads)"


class BundleTokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer  # lazy: tokenizers

        text = read_bounded_text(path, "tokenizer", FIX)  # bounded: a tokenizer beyond 64 MiB is refused unread
        self.json_text = text  # what a constraint's token table is built from (deltaship.constrain.token_table)
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
    return BundleTokenizer(bundle_path(bundle, manifest, "tokenizer.json", "tokenizer.files"))
