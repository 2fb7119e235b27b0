"""Verification: run a bundle in its real runtime against transformers' Qwen3.5 (fp32).

For each prompt, the reference greedily continues it; the bundle prefills the prompt and is then
fed the reference's tokens one by one (teacher forcing), so every logit row is comparable. We
record the largest absolute logit difference and the greedy agreement (exact and tie-aware).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from deltaship.models.source import ModelSource
from deltaship.tolerances import tolerance

MEMORY_FRACTION = 0.6  # the fp32 reference may use at most this share of available memory


def available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_prompts(vocab: int, chunk: int, max_context: int, steps: int, seed: int = 1234) -> list[list[int]]:
    """Prompts of awkward lengths (1, 7, chunk+3), as random token ids, bounded by the context."""
    rng = np.random.default_rng(seed)
    lengths = sorted({n for n in (1, 7, chunk + 3) if n + steps <= max_context})
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def compare(bundle_rows: np.ndarray, ref_rows: np.ndarray, ref_tokens: list[int], tie_margin: float) -> dict:
    diff = float(np.abs(bundle_rows - ref_rows).max())
    picks = bundle_rows.argmax(-1)
    exact = float(np.mean(picks == np.asarray(ref_tokens)))
    margin = ref_rows[np.arange(len(ref_tokens)), ref_tokens] - ref_rows[np.arange(len(picks)), picks]
    tie_aware = float(np.mean((picks == np.asarray(ref_tokens)) | (margin <= tie_margin)))
    return {"max_abs_logit_diff": diff, "greedy_agreement": exact, "tie_aware_agreement": tie_aware}


@torch.no_grad()
def reference_continuation(model, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """The reference's greedy continuation and its logits [steps, vocab]; row i chose token i."""
    ids = list(prompt)
    for _ in range(steps):
        out = model(torch.tensor([ids]), use_cache=False, logits_to_keep=1)
        ids.append(int(out.logits[0, -1].argmax()))
    full = model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
    p = len(prompt)
    return ids[p:], full[p - 1:p - 1 + steps]


def verify_bundle(bundle: Path, manifest: dict[str, Any], source: ModelSource, steps: int = 8,
                  prompts: list[list[int]] | None = None, threads: int | None = None,
                  progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the bundle in its runtime against the transformers reference; return the manifest record."""
    from deltaship.export.reference import reference_model
    from deltaship.runtimes import open_bundle
    import transformers

    tol = tolerance(manifest["target"], manifest["precision"])
    record: dict[str, Any] = {"reference": f"transformers {transformers.__version__} Qwen3_5ForCausalLM fp32",
                              "tolerance": tol.__dict__, "steps": steps}
    need = source.spec.parameter_count()["total"] * 4 * 1.2
    if need > MEMORY_FRACTION * available_memory():
        record.update(status="skipped", reason=f"the fp32 reference needs about {need / 2**30:.1f} GiB; "
                      f"{available_memory() / 2**30:.1f} GiB are available")
        return record
    if progress:
        progress("verify: loading the transformers reference")
    ref = reference_model(source)
    session = open_bundle(bundle, threads=threads, check_hashes=False)
    record["runtime"] = session.runtime_name() if hasattr(session, "runtime_name") else manifest["target"]
    prompts = prompts or default_prompts(source.spec.vocab_size, session.prefill_chunk, session.max_context, steps)
    rows = []
    for prompt in prompts:
        if progress:
            progress(f"verify: prompt of {len(prompt)} tokens")
        ref_tokens, ref_rows = reference_continuation(ref, prompt, steps)
        session.reset()
        got = [session.prefill(prompt)]
        for tok in ref_tokens[:-1]:
            got.append(session.decode(tok))
        rows.append({"prompt_length": len(prompt), **compare(np.stack(got), ref_rows, ref_tokens, tol.tie_margin)})
    worst = max(r["max_abs_logit_diff"] for r in rows)
    agree = min(r["tie_aware_agreement"] for r in rows)
    ok = worst <= tol.max_abs_logit_diff and agree >= tol.min_greedy_agreement
    record.update(status="passed" if ok else "failed", prompts=rows, max_abs_logit_diff=worst,
                  greedy_agreement=min(r["greedy_agreement"] for r in rows), tie_aware_agreement=agree)
    del ref
    return record
