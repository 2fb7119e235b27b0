"""A manifest's numbers against its own states and outputs, which each target's contract checks against the artifact
(onnx_contract, executorch_contract, coreml_contract): so max_context and the vocabulary are checked against the
graph's KV cache and logits, for every target, before the first run call. Without it, a max_context beyond the
cache was an onnxruntime error mid-generation (the tokens so far lost), a vocabulary beyond the logits an
out-of-range gather."""

from __future__ import annotations

from typing import Any

KV_KINDS = ("kv_cache_key", "kv_cache_value")


def number_problems(manifest: dict[str, Any]) -> list[str]:
    """Where max_context, model.vocab_size and the shapes of the KV-cache states and logits disagree (empty when
    they agree); for a manifest that passed the schema."""
    problems: list[str] = []
    context = manifest.get("max_context")
    for s in manifest.get("states", []):
        shape = [d for d in s.get("shape", [])[1:] if isinstance(d, int)]
        if s.get("kind") in KV_KINDS and context not in shape:  # the runtime's sequence axis: the one of max_context
            problems.append(
                f"max_context {context}: the KV cache state {s.get('name')!r} has shape {s.get('shape')}, "
                f"which holds no {context} positions"
            )
    vocab = (manifest.get("model") or {}).get("vocab_size")
    for out in manifest.get("outputs", []):
        width = (out.get("shape") or [None])[-1]
        if out.get("kind") == "logits" and isinstance(width, int) and width != vocab:
            problems.append(f"model.vocab_size {vocab}: the logits output {out.get('name')!r} has {width} columns")
    return problems
