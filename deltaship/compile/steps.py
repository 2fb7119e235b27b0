"""The steps of an export, in the order `deltaship.compile.export` runs them; each takes what it reads and returns
what it makes.

plan_device -> (settings) -> claim -> load -> check_source -> draft_vocabulary -> lowering_settings ->
check_vision -> calibrate_kv -> run_passes -> lower -> copy_tokenizer -> (manifest.assemble) -> verify ->
fidelity -> prompt_cache -> (write_bundle)
"""

from __future__ import annotations

import dataclasses
import importlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from deltaship.bundle.destination import Destination
from deltaship.bundle.writer import write_manifest
from deltaship.chat.conversation import prompt_cache_tokens, write_prompt_cache
from deltaship.check.evaluate import evaluate
from deltaship.check.vision import verify_vision
from deltaship.compile.settings import ExportSettings
from deltaship.devices.limits import check_memory, mem_available
from deltaship.devices.plan import EXPORT_BASE_BYTES, choose_for_tier, default_kv_dtype, export_peak_bytes
from deltaship.errors import DeltashipError
from deltaship.files import read_json_object
from deltaship.lowering import draft_vocab
from deltaship.lowering.lowered import Lowered
from deltaship.lowering.settings import KvCachePlan, LoweringSettings
from deltaship.models.presets import PRESETS
from deltaship.models.source import ModelSource, load_source
from deltaship.models.spec import ModelSpec
from deltaship.models.vision import check_vision as check_vision_side
from deltaship.progress import Progress, heartbeat
from deltaship.targets import get_target

Say = Callable[..., None]


@dataclass(frozen=True)
class DevicePick:
    """What `deltaship plan` picks for a tier (what the user fixed is kept): kv_cache None is the target's own,
    prefill_chunk None the target's default; `say` the line that tells the user."""

    target: str
    precision: str
    max_context: int
    kv_cache: str | None
    prefill_chunk: int | None
    say: str


def plan_device(
    spec: ModelSpec,
    device: str,
    tiers_file: str | None,
    target: str | None,
    precision: str | None,
    max_context: int | str | None,
    kv_cache: str | None,
    prefill_chunk: int | None,
    prompt_cache_tokens: int | None = None,
    block_size: int | None = None,
) -> DevicePick:
    """The export options `deltaship plan` picks for tier `device`: target, precision, max_context, kv_cache (a
    quantized cache only where only that fits) and prefill_chunk (a smaller one where only that fits), with the
    restore of a prompt cache of prompt_cache_tokens counted (export --prompt-cache), at the quantization block
    the export will use (export --block-size)."""
    pick = choose_for_tier(
        spec,
        device,
        tiers_file,
        target,
        precision,
        max_context,
        kv_cache,
        prefill_chunk,
        prompt_cache_tokens,
        block_size,
    )
    own_chunk = min(get_target(pick.target).default_prefill_chunk, pick.context)
    chunk = prefill_chunk if prefill_chunk is not None or pick.prefill_chunk == own_chunk else pick.prefill_chunk
    return DevicePick(
        target=pick.target,
        precision=pick.precision,
        max_context=pick.context,
        # only a quantized cache made it fit
        kv_cache=pick.kv_dtype if pick.kv_dtype != default_kv_dtype(pick.target, pick.precision) else kv_cache,
        prefill_chunk=chunk,
        say=f"device {device}: {pick.target} {pick.precision} with an {pick.kv_dtype} KV cache at context "
        f"{pick.context}"
        + (f", prefill chunk {chunk}" if chunk is not None else "")
        + f" ({pick.total_bytes / 2**30:.2f} of {pick.budget_bytes / 2**30:.2f} GiB, deltaship plan)",
    )


def device_prompt_cache_tokens(source: ModelSource, prompt_cache: str | Path | None) -> int | None:
    """The tokens `--prompt-cache FILE` will ship, for the tier's plan to count (None: no cache asked for, or a model
    without a tokenizer, which check_source refuses with the cache)."""
    if prompt_cache is None or not any(f.name == "tokenizer.json" for f in source.tokenizer_files):
        return None
    return prompt_cache_tokens(source.tokenizer_files, Path(prompt_cache))


def claim(out: str | Path, force: bool, model: str) -> Destination:
    """The bundle's destination: checked, locked and recovered before the first load."""
    return Destination(Path(out), force, inputs=(model,))


def load(model: str, allow_download: bool, say: Say) -> ModelSource:
    say(f"loading {model}")
    return load_source(model, allow_download=allow_download)


def check_source(settings: ExportSettings, source: ModelSource, say: Say) -> tuple[int, int]:
    """What the checkpoint decides, checked against the settings: (max_context, prefill_chunk), resolved (the
    preset's or the model's context; the target's chunk, at most the context)."""
    spec = source.spec
    if settings.prompt_cache is not None and not any(f.name == "tokenizer.json" for f in source.tokenizer_files):
        raise DeltashipError(
            f"--prompt-cache: {settings.model} has no tokenizer, so no chat template to render the system message with",
            "export a checkpoint directory that has tokenizer.json and a chat template, or drop --prompt-cache",
        )
    for note in source.notes():
        say(note)
    if spec.is_multimodal and not settings.vision:
        say("the checkpoint has a vision tower: exporting the text decoder only (add --vision for image input)")
    max_context = settings.max_context
    if max_context is None:
        model = settings.model
        max_context = (
            PRESETS[model].default_max_context if model in PRESETS else min(4096, spec.max_position_embeddings)
        )
    spec.check_context(max_context)  # names max_position_embeddings and, without scaling, YaRN
    if getattr(settings.options, "mtp", False) and not getattr(source.weights, "has_mtp", False):
        raise DeltashipError(
            f"--mtp: {settings.model} has no multi-token-prediction head (config.json mtp_num_hidden_layers is "
            f"{spec.mtp_num_hidden_layers}"
            + (", and the weights hold no mtp.* tensors)" if spec.mtp_num_hidden_layers else ")"),
            "drop --mtp, or export a checkpoint that ships its MTP head (Qwen3.5 checkpoints do; qwen3.5-tiny and "
            "the published-shape presets carry one)",
        )
    return max_context, min(settings.prefill_chunk or settings.tgt.default_prefill_chunk, max_context)


def special_tokens(source: ModelSource) -> dict[str, Any]:
    """eos/bos/pad from the config and generation_config; chat markers from the tokenizer."""
    spec = source.spec
    eos = list(spec.eos_token_id)
    out: dict[str, Any] = {"bos": spec.bos_token_id, "pad": spec.pad_token_id}
    for f in source.tokenizer_files:
        if f.name == "generation_config.json":
            g = read_json_object(f, "generation config", "restore it from the original checkpoint")
            e = g.get("eos_token_id")
            eos += e if isinstance(e, list) else ([e] if isinstance(e, int) else [])
        if f.name == "tokenizer.json":
            tok = read_json_object(f, "tokenizer", "restore it from the original checkpoint")
            listed = tok.get("added_tokens") if isinstance(tok.get("added_tokens"), list) else []
            added = {t.get("content"): t.get("id") for t in listed if isinstance(t, dict)}  # data: typed below
            for key, content in (
                ("im_start", "<|im_start|>"),
                ("im_end", "<|im_end|>"),
                ("endoftext", "<|endoftext|>"),
            ):
                if isinstance(added.get(content), int) and not isinstance(added[content], bool):
                    out[key] = added[content]
    out["eos"] = sorted(set(eos))
    return out


def draft_vocabulary(
    settings: ExportSettings, source: ModelSource, tokens: dict[str, Any], say: Say
) -> tuple[np.ndarray | None, dict[str, Any] | None]:
    """--mtp-draft-vocab N: the N draft token ids and the manifest's record of them (None, None: full)."""
    n = settings.draft_vocab.size
    if n is None:
        return None, None
    vocab = source.spec.vocab_size
    tok = next((f for f in source.tokenizer_files if f.name == "tokenizer.json"), None)
    ids, record = draft_vocab.rank(vocab, n, draft_vocab.special_ids(tokens, vocab), tok, settings.draft_vocab.text)
    cover = f", covering {record['coverage']:.1%} of the ranking text's tokens" if record["coverage"] else ""
    say(f"draft vocabulary: {n} of {vocab} token ids{cover}" + ("" if tok else " (ascending ids: no tokenizer)"))
    return ids, record


def lowering_settings(
    settings: ExportSettings, spec: ModelSpec, max_context: int, prefill_chunk: int, draft_ids: np.ndarray | None
) -> LoweringSettings:
    """What the passes and the lowering read, once the target's own combinations (which need the context and the
    chunk) are checked and the planned peak memory fits this process."""
    settings.tgt.check(settings.precision, max_context, prefill_chunk, settings.options)
    check_export_memory(spec, settings)
    return LoweringSettings(
        spec=spec,
        target=settings.target,
        precision=settings.precision,
        max_context=max_context,
        activation_dtype=settings.activation_dtype,
        prefill_chunk=prefill_chunk,
        kv=settings.kv,
        options=settings.options,
        params=settings.tgt.pass_params,
        block_size=settings.block_size,
        deltanet_int8=settings.deltanet_int8,
        verify=settings.checks.verify,
        draft_ids=draft_ids,
    )


def check_export_memory(spec: ModelSpec, settings: ExportSettings) -> None:
    """Refuse, before the work, an export whose planned peak does not fit what this process may use (a cgroup's
    limit is an OOM kill without a message, RLIMIT_AS a crash in native code)."""
    verify, target, precision = settings.checks.verify, settings.target, settings.precision
    peak = export_peak_bytes(spec, target, precision, verify, budget=mem_available())
    check_memory(
        peak,
        f"exporting {settings.model} to {target} {precision}" + (" with verification" if verify else ""),
        "pass --no-verify (the fp32 reference and the bundle's session are the largest part)"
        if verify
        else "export a smaller model or precision",
        base=EXPORT_BASE_BYTES,
    )


def check_vision(settings: ExportSettings, source: ModelSource, spec: ModelSpec) -> None:
    """--vision: the checkpoint's vision side, and that the target exports a vision tower at this precision,
    checked before any work."""
    if settings.vision:
        check_vision_side(
            source,
            spec,
            target=settings.target,
            precision=settings.precision,
            vision_precisions=settings.tgt.vision_precisions,
        )


def calibrate_kv(
    kv: KvCachePlan, source: ModelSource, max_context: int, say: Say
) -> tuple[dict[int, dict[str, Any]], dict[str, Any] | None]:
    """An int8/int4 KV cache's static scales, calibrated on the fp32 reference, and the manifest's record of them
    ({}, None: a cache at a float dtype)."""
    if not kv.quantized:  # check_options let only a target that stores them through
        return {}, None
    from deltaship.lowering.kv_quant import prepare  # lazy: torch

    return prepare(source, kv, max_context, progress=say)


def run_passes(lowering: LoweringSettings, pipeline: tuple, say: Say):
    """The target's passes over a fresh context: the context with their products (ExportContext)."""
    from deltaship.lowering.passes import ExportContext, run_pipeline  # lazy: torch

    return run_pipeline(ExportContext(lowering), pipeline, progress=say)


def lower(
    settings: ExportSettings, ctx, source: ModelSource, tmp: Path, tokens: dict[str, Any], say: Say
) -> tuple[Lowered, dict[str, Any] | None]:
    """The target's artifact (and, with --vision, the vision tower's) written into tmp: the `Lowered` and the
    manifest's `vision` block (None: text only)."""
    tgt = settings.tgt
    say(f"lowering to {settings.target}")
    detail = lambda m: say(f"lowering to {settings.target}: {m}", inline=True)  # noqa: E731
    lowered = tgt.lower(ctx, source.weights, tmp, progress=detail, tokens=tokens)
    say.done() if isinstance(say, Progress) else None
    vision_block = None
    if settings.vision:
        say("lowering the vision tower")
        vision = importlib.import_module(tgt.vision_module)
        # the vision lowerings report nothing themselves (ExecuTorch's XNNPACK lowering of a tower takes minutes)
        with heartbeat(lambda m: say(m, inline=True), "still lowering the vision tower"):
            vision_block = vision.lower_vision(tmp, source, ctx, tgt.pipeline())
        say.done() if isinstance(say, Progress) else None
    return lowered, vision_block


def copy_tokenizer(settings: ExportSettings, source: ModelSource, tmp: Path) -> list[str]:
    """The checkpoint's tokenizer files, copied into the bundle and adjusted by the target: their names."""
    names = []
    for f in source.tokenizer_files:
        shutil.copy(f, tmp / f.name)
        names.append(f.name)
    settings.tgt.finish_bundle(tmp)  # after the copy: the target may adjust the copied files
    return names


def write_draft_vocabulary(tmp: Path, draft_ids: np.ndarray | None, manifest: dict[str, Any]) -> None:
    """--mtp-draft-vocab N: the ids the draft's logits cover, in the bundle (where the manifest lists them)."""
    if draft_ids is not None and "speculative" in manifest:
        draft_vocab.write(tmp, draft_ids)


def verify(
    settings: ExportSettings,
    tmp: Path,
    manifest: dict[str, Any],
    source: ModelSource,
    ctx,
    lowered: Lowered,
    say: Say,
) -> dict[str, Any]:
    """The text verification record (the manifest's `verification`); a failure that fails the export raises.
    With --vision, the image + text verification record goes into manifest["vision"]["verification"]."""
    if not settings.checks.verify:
        return {"status": "skipped", "reason": "--no-verify"}
    from deltaship.check.verify import verification_error, verify_bundle  # lazy: torch

    # The runtime reads the manifest: write a provisional one in the staging directory.
    provisional = write_manifest(tmp, dict(manifest))
    rec = verify_bundle(
        tmp, provisional, source, ctx, threads=settings.checks.threads, progress=say, rounded=lowered.rounded
    )
    report_verification(say, rec)
    if rec["status"] == "failed" and rec["tolerance"]["fails_export"]:
        raise verification_error(rec, settings.target, settings.precision)
    if "vision" in manifest and rec["status"] != "skipped":
        say("verifying image + text prompts against transformers")
        vrec = verify_vision(tmp, provisional, source, ctx=ctx)
        manifest["vision"]["verification"] = vrec
        say(
            f"vision verification {vrec['status']}: max |logit diff| "
            f"{vrec['max_rel_logit_diff']:.3g} of the logit std, greedy agreement "
            f"{vrec['greedy_agreement']:.3f} over {len(vrec['images'])} images"
        )
    return rec


def fidelity(
    settings: ExportSettings, tmp: Path, source: ModelSource, verification: dict[str, Any], max_context: int, say: Say
) -> dict[str, Any] | None:
    """The held-out fidelity eval (the manifest's `fidelity`) of a verified bundle; None where verification was
    skipped or the settings leave it out."""
    if not settings.checks.fidelity or verification["status"] == "skipped":
        return None
    f = evaluate(
        tmp,
        tokens=min(settings.checks.fidelity_tokens, max_context),
        threads=settings.checks.threads,
        progress=say,
        source=source,
    )
    say(
        f"fidelity on {f['tokens']} tokens: perplexity {f['perplexity']:.3f} (reference "
        f"{f['reference_perplexity']:.3f}), KL {f['kl_divergence']:.3g}, top-1 {f['top1_agreement']:.3f}"
    )
    return f


def prompt_cache(settings: ExportSettings, tmp: Path, manifest: dict[str, Any], say: Say) -> dict[str, Any] | None:
    """--prompt-cache: the state after the system message, in the bundle (the manifest's `chat` block); after
    verification, when the bundle is what it will be but for the cache. None without --prompt-cache."""
    if settings.prompt_cache is None:
        return None
    say("feeding the system message for the prompt cache")
    provisional = write_manifest(tmp, dict(manifest))
    return {
        "prompt_cache": write_prompt_cache(tmp, provisional, *settings.prompt_cache, threads=settings.checks.threads)
    }


def report_verification(say: Say, rec: dict) -> None:
    if rec["status"] == "skipped":
        say(f"verification skipped: {rec['reason']}")
    else:
        say(
            f"verification {rec['status']}: max |logit diff| {rec['max_abs_logit_diff']:.3g} "
            f"({rec['max_rel_logit_diff']:.3g} of the logit std), greedy agreement {rec['greedy_agreement']:.3f} "
            f"(tie-aware {rec['tie_aware_agreement']:.3f}); vs unrounded fp32: KL {rec['kl_divergence']:.3g}, "
            f"top-1 {rec['top1_agreement']:.3f}"
        )


def with_scales(lowering: LoweringSettings, kv_scales: dict[int, dict[str, Any]]) -> LoweringSettings:
    """The lowering settings with the KV cache's calibrated scales (a new frozen object)."""
    return dataclasses.replace(lowering, kv_scales=kv_scales) if kv_scales else lowering
