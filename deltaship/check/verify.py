"""Verification: run a bundle in its real runtime against transformers' Qwen3.5.

Parity (pass/fail): against the *matched* reference, transformers in fp32 with the weights rounded
exactly as the bundle stores them, so what is left is the runtime's arithmetic and any lowering
bug. Fidelity (recorded): against the unrounded fp32 reference, KL divergence and top-1 agreement,
i.e. what the precision costs.

For each prompt the reference greedily continues it; the bundle prefills the prompt and is then
fed the reference's tokens one by one (teacher forcing), so every logit row is comparable.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from deltaship.errors import DeltashipError, DeltashipUnavailable
from deltaship.lowering.kv_quant import rounded_cache_attention
from deltaship.models.source import ModelSource
from deltaship.oracle.budget import available_memory, reference_fits, reference_need
from deltaship.oracle.reference import matched_reference_model, quiet_third_party, reference_model
from deltaship.progress import Progress, heartbeat
from deltaship.targets import open_bundle, tolerance
from deltaship.targets.tolerances import Bar, fp32_bar


def default_prompts(vocab: int, chunk: int, max_context: int, steps: int, seed: int = 1234) -> list[list[int]]:
    """Prompts of awkward lengths (1, 7, chunk+3), as random token ids, bounded by the context."""
    rng = np.random.default_rng(seed)
    lengths = sorted({n for n in (1, 7, chunk + 3) if n + steps <= max_context})
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def compare(got: np.ndarray, ref: np.ndarray, ref_tokens: list[int], tie_margin: float) -> dict[str, float]:
    """Parity metrics of bundle logits `got` against reference rows `ref` [steps, vocab].

    rel: |difference| / standard deviation of the reference row. Tie-aware agreement forgives a
    different argmax when the reference prefers its own token by at most tie_margin (relative).
    """
    toks = np.asarray(ref_tokens)
    idx = np.arange(len(toks))
    std = ref.std(-1, keepdims=True)
    picks = got.argmax(-1)
    margin = (ref[idx, toks] - ref[idx, picks]) / std[:, 0]
    return {
        "max_abs_logit_diff": float(np.abs(got - ref).max()),
        "max_rel_logit_diff": float((np.abs(got - ref) / std).max()),
        "greedy_agreement": float(np.mean(picks == toks)),
        "tie_aware_agreement": float(np.mean((picks == toks) | (margin <= tie_margin))),
    }


def fidelity(got: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """What the precision costs: KL(reference || bundle) per token and top-1 agreement."""
    lp, lq = log_softmax(ref), log_softmax(got)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    return {"kl_divergence": float(kl.mean()), "top1_agreement": float(np.mean(ref.argmax(-1) == got.argmax(-1)))}


@torch.no_grad()
def reference_continuation(model, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """The reference's greedy continuation and its logits [steps, vocab]; row i chose token i.

    The rows come from one full pass over prompt + continuation. The tokens come from cached decoding (a prefill,
    then a token at a time: two passes over the prompt rather than steps + 1); when the full pass would choose
    otherwise somewhere (a near-tie that the two orders of summation break differently), the continuation is
    redone a token at a time without the cache, so the rows always chose the tokens."""
    # lazy: transformers
    from deltaship.oracle.compat import CACHE_NAME, output_cache  # transformers, imported on use like the reference

    p = len(prompt)
    ids = list(prompt)
    try:
        out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        while True:
            ids.append(int(out.logits[0, -1].argmax()))
            if len(ids) - p == steps:
                break
            out = model(torch.tensor([ids[-1:]]), use_cache=True, **{CACHE_NAME: output_cache(out)})
    except ValueError:  # transformers' cache of a model without attention layers (DeltaNet only) cannot decode
        ids = None
    if ids is not None:
        rows = model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()[p - 1 : p - 1 + steps]
        if rows.argmax(-1).tolist() == ids[p:]:
            return ids[p:], rows
    ids = list(prompt)
    for _ in range(steps):
        out = model(torch.tensor([ids]), use_cache=False, logits_to_keep=1)
        ids.append(int(out.logits[0, -1].argmax()))
    full = model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
    return ids[p:], full[p - 1 : p - 1 + steps]


def reference_not_finite(logits: np.ndarray, where: str) -> DeltashipError | None:
    """The error for a reference (transformers) whose logits hold NaN or inf, else None: the checkpoint's fault,
    never deltaship's."""
    if np.isfinite(logits).all():
        return None
    nan, inf = int(np.isnan(logits).sum()), int(np.isinf(logits).sum())
    return DeltashipError(
        f"the reference model (transformers) gives non-finite logits on this checkpoint: the weights overflow or "
        f"are corrupt ({nan} NaN and {inf} inf of {logits.size} logits, {where}); nothing was written",
        "this checkpoint's weights are corrupt or diverged in training: re-save it from a good copy (check it with "
        "transformers: its logits should be finite)",
    )


def bundle_not_finite(got: np.ndarray, where: str, step_names: list[str], precision: str) -> DeltashipError | None:
    """The error for bundle logits rows [steps, vocab] holding NaN or inf while the reference's are finite, naming
    the first such row (prefill or decode step) and the counts; else None."""
    if np.isfinite(got).all():
        return None
    bad = ~np.isfinite(got)
    first = int(np.argmax(bad.reshape(len(got), -1).any(-1)))
    nan, inf = int(np.isnan(got).sum()), int(np.isinf(got).sum())
    fix = "this is a deltaship bug: please report it with the model's config.json"
    if precision == "fp16":
        fix = "fp16 activations can overflow on this checkpoint: export at --precision fp32; if that fails too, " + fix
    return DeltashipError(
        f"the bundle's output 'logits' is non-finite where transformers' is finite: {nan} NaN and {inf} inf of "
        f"{got.size} values, first at {step_names[first]} ({where}); nothing was written",
        fix,
    )


def fp32_reach(source: ModelSource, cases: list[tuple[list[int], list[int], np.ndarray]]) -> float:
    """What fp32 itself can reach on this checkpoint: the float32 reference's logit rows (cases: prompt, its
    greedy tokens, the rows) against transformers in float64 on the same tokens, as compare()'s relative error."""

    hi = reference_model(source, dtype=torch.float64)
    worst = 0.0
    with torch.no_grad():
        for prompt, toks, rows in cases:
            ids = list(prompt) + list(toks[:-1])
            full = hi(torch.tensor([ids]), use_cache=False).logits[0].numpy()
            p = len(prompt)
            exact = full[p - 1 : p - 1 + len(toks)]
            worst = max(worst, compare(rows.astype(np.float64), exact, toks, 0.0)["max_rel_logit_diff"])
    del hi
    return worst


def verification_error(rec: dict[str, Any], target: str, precision: str) -> DeltashipError:
    """The export's error for a failed text verification, naming the bar it missed."""
    bar = rec.get("bar") or {}
    which = (
        Bar(bar["value"], bar["table"], bar.get("fp32_reach"), bar.get("factor", 0.0)).describe()
        if bar
        else f"tolerance {rec['tolerance']}"
    )
    return DeltashipError(
        f"verification failed: the {target} {precision} bundle disagrees with transformers "
        f"(max relative logit difference {rec['max_rel_logit_diff']:.3g} against {which}; tie-aware greedy agreement "
        f"{rec['tie_aware_agreement']:.3f}, at least {rec['tolerance']['min_greedy_agreement']} needed); "
        "nothing was written",
        "this is a deltaship bug: please report it with the model's config.json",
    )


def teacher_forced(session, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """Bundle logits after the prompt and after each of tokens[:-1]: [len(tokens), vocab]."""
    session.reset()
    rows = [session.prefill(prompt)]
    for tok in tokens[:-1]:
        rows.append(session.decode(tok))
    return np.stack(rows)


def _tokens(prompt: list[int]) -> str:
    return f"{len(prompt)} token" + ("s" if len(prompt) != 1 else "")


def verify_bundle(
    bundle: Path,
    manifest: dict[str, Any],
    source: ModelSource,
    ctx,
    steps: int = 8,
    prompts: list[list[int]] | None = None,
    threads: int | None = None,
    progress: Callable[[str], None] | None = None,
    rounded: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the bundle in its runtime against the transformers references; return the manifest record. ctx: the
    passes' products (the weight plan, the quantization choices); rounded: the weights as the toolchain rounded
    them (the lowering's `Lowered.rounded`), which the matched reference then holds."""

    quiet_third_party()
    import transformers  # lazy: transformers

    tol = tolerance(manifest["target"], manifest["precision"], manifest.get("memory", {}).get("kv_dtype"))
    record: dict[str, Any] = {
        "reference": f"transformers {transformers.__version__} Qwen3_5ForCausalLM, fp32 "
        f"compute, weights as stored in the bundle",
        "tolerance": tol.__dict__,
        "steps": steps,
    }
    need = reference_need(source.spec)
    if not reference_fits(source.spec):
        record.update(
            status="skipped",
            reason=f"the fp32 reference needs about {need / 2**30:.1f} GiB; "
            f"{available_memory() / 2**30:.1f} GiB are available",
        )
        return record
    try:
        session = open_bundle(bundle, threads=threads, check_hashes=False)
    except DeltashipUnavailable as e:  # e.g. an opset-27 bundle and onnxruntime < 1.32: nothing ran
        record.update(status="skipped", reason=str(e))
        return record
    record["runtime"] = session.runtime_name()
    prompts = prompts or default_prompts(source.spec.vocab_size, session.prefill_chunk, session.max_context, steps)
    if progress:
        progress("verify: parity against the matched transformers reference")
    ref = matched_reference_model(source, ctx.plan, ctx.quant, ctx.precision, rounded=rounded)
    kv_rounded = contextlib.nullcontext(ref)
    # a KV cache narrower than the activations (int8/int4 with scales, or fp16): the reference rounds it too
    if ctx.kv_scales:  # an int8/int4 KV cache: the reference's attention sees keys and values rounded the same way
        bits = next(iter(ctx.kv_scales.values()))["bits"]
        scales = {layer: (q["key"], q["value"]) for layer, q in ctx.kv_scales.items()}
        kv_rounded = rounded_cache_attention(ref, scales, bits)
        record["reference"] += f", keys and values rounded as the int{bits} KV cache stores them"
    elif (
        ctx.kv.narrower and not ctx.kv.quantized
    ):  # an fp16 cache under fp32 activations: keys and values rounded to fp16
        kv_rounded = rounded_cache_attention(ref, None, 16)
        record["reference"] += ", keys and values rounded to fp16 as the KV cache stores them"
    detail = (lambda m: progress(m, inline=True)) if isinstance(progress, Progress) else (lambda m: None)
    rows, cases = [], []
    with kv_rounded as matched:
        for n, prompt in enumerate(prompts, 1):
            label = f"verify: parity, prompt {n}/{len(prompts)} ({_tokens(prompt)} + {steps} steps)"
            detail(label)
            with heartbeat(detail, label):
                toks, ref_rows = reference_continuation(matched, prompt, steps)
                where = f"the prompt of {len(prompt)} tokens and {len(toks)} greedy steps"
                if (err := reference_not_finite(ref_rows, where)) is not None:
                    raise err
                got = teacher_forced(session, prompt, toks)
            names = ["the prefill"] + [f"decode step {i}" for i in range(1, len(toks))]
            if (err := bundle_not_finite(got, where, names, ctx.precision)) is not None:
                raise err
            cases.append((prompt, toks, ref_rows, got))
            rows.append({"prompt_length": len(prompt), **compare(got, ref_rows, toks, tol.tie_margin)})
            if ctx.precision == "fp32" and not ctx.kv.narrower:
                rows[-1].update(fidelity(got, ref_rows))
    del ref, matched
    worst = max(r["max_rel_logit_diff"] for r in rows)
    agree = min(r["tie_aware_agreement"] for r in rows)
    bar = fp32_bar(tol.max_rel_logit_diff, None)
    fails = worst > bar.value or agree < tol.min_greedy_agreement
    if fails and ctx.precision == "fp32" and not ctx.kv.narrower:  # only then: the common path pays nothing
        if progress:
            progress("verify: measuring what fp32 reaches on this checkpoint (the reference in float64)")
        bar = fp32_bar(tol.max_rel_logit_diff, fp32_reach(source, [c[:3] for c in cases]))
        if bar.which == "fp32-reachable":
            # a logit error up to the bar on each of two tokens can swap them where the reference's margin is under
            # 2 bars
            margin = max(tol.tie_margin, 2 * bar.value)
            for row, (_, toks, ref_rows, got) in zip(rows, cases):
                row["tie_aware_agreement"] = compare(got, ref_rows, toks, margin)["tie_aware_agreement"]
            agree = min(r["tie_aware_agreement"] for r in rows)
        record["bar"] = bar.as_dict()
    if ctx.precision != "fp32" or ctx.kv.narrower:
        if progress:
            progress("verify: fidelity against the unrounded fp32 reference")
        plain = reference_model(source)
        for n, (row, prompt) in enumerate(zip(rows, prompts), 1):
            label = f"verify: fidelity, prompt {n}/{len(prompts)} ({_tokens(prompt)} + {steps} steps)"
            detail(label)
            with heartbeat(detail, label):
                toks, ref_rows = reference_continuation(plain, prompt, steps)
                row.update(fidelity(teacher_forced(session, prompt, toks), ref_rows))
        del plain
    ok = worst <= bar.value and agree >= tol.min_greedy_agreement
    record.update(
        status="passed" if ok else "failed",
        prompts=rows,
        max_rel_logit_diff=worst,
        max_abs_logit_diff=max(r["max_abs_logit_diff"] for r in rows),
        greedy_agreement=min(r["greedy_agreement"] for r in rows),
        tie_aware_agreement=agree,
        kl_divergence=float(np.mean([r["kl_divergence"] for r in rows])),
        top1_agreement=float(np.mean([r["top1_agreement"] for r in rows])),
    )
    return record
