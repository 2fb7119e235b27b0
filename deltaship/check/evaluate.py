"""`deltaship eval`: what a bundle's precision costs, on held-out text.

Perplexity of the bundle (run in its own runtime, token by token) and of the unrounded fp32
transformers reference on the same tokens, plus the per-token KL divergence KL(reference ||
bundle) and top-1 agreement. The text is the held-out split of the tiny model's training corpus
(Python standard library source, shipped as heldout.txt), tokenized with the bundle's tokenizer;
a bundle without a tokenizer is evaluated on seeded random token ids (perplexity is then
meaningless and flagged as such, KL and agreement still are).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from deltaship.bundle.reader import read_manifest
from deltaship.errors import DeltashipError
from deltaship.files import read_bounded_text
from deltaship.models.source import load_source
from deltaship.models.trained import HELDOUT
from deltaship.options import threads as check_threads
from deltaship.progress import Progress, heartbeat
from deltaship.runtimes.speculative import mtp_acceptance
from deltaship.runtimes.tokenizer import load_tokenizer
from deltaship.targets import open_bundle

MAX_TEXT_BYTES = 16 << 20  # --text: far more than the longest context needs (about 4 bytes a token)


def user_tokens(bundle: Path, manifest: dict, path: str | Path, n: int) -> tuple[list[int], str]:
    """The first n tokens of the user's own text file (--text), with the bundle's tokenizer; refused when the
    file is too large, not UTF-8, or shorter than n tokens (naming how many it has and how many are needed)."""
    if "tokenizer.json" not in manifest.get("tokenizer", {}).get("files", []):
        raise DeltashipError(
            f"--text needs the bundle's tokenizer, and {bundle} has none",
            "drop --text (a bundle without a tokenizer is evaluated on seeded random token ids), or export a "
            "checkpoint that has tokenizer.json",
        )
    text = read_bounded_text(path, "--text file", "pass a UTF-8 text file under 16 MiB", MAX_TEXT_BYTES)
    ids = load_tokenizer(bundle, manifest).encode(text)
    if len(ids) < n:
        shorter = f", or --tokens {len(ids)}" if len(ids) >= 2 else ""
        raise DeltashipError(
            f"--text {path}: {len(ids)} tokens with the bundle's tokenizer; the eval needs {n} (--tokens, at most "
            "the bundle's max context)",
            f"pass a longer text{shorter}",
        )
    return ids[:n], f"{path}"


def eval_tokens(bundle: Path, manifest: dict, n: int) -> tuple[list[int], str]:
    if "tokenizer.json" in manifest.get("tokenizer", {}).get("files", []) and HELDOUT.is_file():
        ids = load_tokenizer(bundle, manifest).encode(HELDOUT.read_text(encoding="utf-8", errors="replace"))
        return ids[:n], "held-out Python standard library source (heldout.txt)"
    vocab = manifest["model"]["vocab_size"]
    return np.random.default_rng(0).integers(0, vocab, n).tolist(), "seeded random token ids (no tokenizer)"


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    from deltaship.check.verify import log_softmax  # lazy: torch

    return -log_softmax(logits)[np.arange(len(targets)), targets]


def evaluate(
    bundle: str | Path,
    model: str | None = None,
    tokens: int = 512,
    threads: int | None = None,
    progress: Callable[[str], None] | None = None,
    source=None,
    text: str | Path | None = None,
) -> dict[str, Any]:
    """Perplexity, reference perplexity, KL divergence and top-1 agreement of a bundle.

    The reference is the model named in the manifest (or `model`), checked by sha256. text: a UTF-8 text file to
    evaluate on instead of the held-out text (its first `tokens` tokens; refused when shorter). progress: a step's line
    ("eval: N tokens of ..."); a Progress also gets each long step's detail (the bundle's token-by-token run, the
    reference's forward), which a log shows once the step has been silent for a while.
    """
    import torch  # lazy: torch

    from deltaship.check.verify import log_softmax  # lazy: torch
    from deltaship.oracle.reference import reference_model  # lazy: torch

    check_threads(threads)  # before the reference is loaded, as the CLI's --threads
    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    if tokens < 2:
        raise DeltashipError(f"--tokens must be at least 2, got {tokens}", "pass --tokens 256 or more")
    if text is not None:  # before the reference and the bundle are loaded: a bad file fails at once
        own = user_tokens(bundle, manifest, text, min(tokens, int(manifest["max_context"])))
    name = model or manifest["source"]["model"]
    if source is None:
        try:
            source = load_source(name)
        except DeltashipError as e:
            raise DeltashipError(
                f"the reference model {name!r} of this bundle is not available here ({e.message})",
                "pass --model with the checkpoint directory the bundle was exported from",
            ) from None
    if source.fingerprint() != manifest["source"]["sha256"]:
        raise DeltashipError(
            f"{name} is not the model this bundle was exported from (sha256 differs)",
            "pass --model with the exact checkpoint the bundle was exported from",
        )
    session = open_bundle(bundle, threads=threads)
    ids, text = own if text is not None else eval_tokens(bundle, manifest, min(tokens, session.max_context))
    if len(ids) < 2:
        raise DeltashipError("the evaluation text gives fewer than 2 tokens", "pass --tokens 2 or more")
    if progress:
        progress(f"eval: {len(ids)} tokens of {text}")
    beat = (lambda m: progress(m, inline=True)) if isinstance(progress, Progress) else None
    rows = [session.prefill(ids[:1])]
    with heartbeat(beat and (lambda m: beat(f"{m}: {len(rows)} of {len(ids) - 1} tokens")), "eval: the bundle"):
        for tok in ids[1:-1]:
            rows.append(session.decode(tok))
    got = np.stack(rows)
    with heartbeat(beat, "eval: the transformers fp32 reference"):
        ref = reference_model(source)
        with torch.no_grad():
            want = ref(torch.tensor([ids[:-1]]), use_cache=False).logits[0].float().numpy()
    del ref
    targets = np.asarray(ids[1:])
    lp, lq = log_softmax(want), log_softmax(got)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    result = {
        "perplexity": float(np.exp(_nll(got, targets).mean())),
        "reference_perplexity": float(np.exp(_nll(want, targets).mean())),
        "top1_agreement": float(np.mean(want.argmax(-1) == got.argmax(-1))),
        "kl_divergence": float(kl.mean()),
        # how the loss grows with context (a quantized KV cache's rounding accumulates with depth): mean KL
        # over each quarter of the positions, keyed by the quarter's last position
        "kl_by_depth": {
            str(int(part[-1]) + 1): float(kl[part].mean())
            for part in np.array_split(np.arange(len(kl)), 4)
            if len(part)
        },
        "kv_dtype": manifest.get("memory", {}).get("kv_dtype"),
        "tokens": int(len(targets)),
        "text": text,
        "runtime": session.runtime_name(),
        "target": manifest["target"],
        "precision": manifest["precision"],
    }
    if manifest.get("speculative"):  # the MTP head: how often its draft is what greedy decoding accepts
        with heartbeat(beat, "eval: the MTP head's drafts"):
            result["mtp"] = mtp_acceptance(session, ids)
    if "random" in text:
        result["note"] = "random token ids: perplexity is not a quality measure here"
    return result
