"""`export()`: checkpoint or preset -> verified artifact bundle. The CLI's `export` is this function."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from deltaship.errors import DeltashipEnvironmentError, DeltashipError
from deltaship.models.vision import check_vision
from deltaship.options import threads as check_threads
from deltaship.progress import Progress
from deltaship.targets import PRECISIONS, Target, TargetOptions, all_targets, flag, get_target

if TYPE_CHECKING:
    from deltaship.models.spec import ModelSpec

EVAL_TOKENS = 256  # held-out tokens evaluated at export (deltaship eval defaults to 512)


def check_options(
    target: str,
    precision: str,
    max_context: int | None,
    block_size: int,
    deltanet_int8: bool,
    prefill_chunk: int | None,
    target_options: dict[str, Any] | None = None,
    kv_cache: str | None = None,
) -> TargetOptions:
    """Every option combination is checked once, here, before any work starts; returns the target's typed
    options. (The target's own combinations, which need the context and chunk, are checked by export().)"""
    tgt = get_target(target)
    owners: dict[str, list[str]] = {}  # option -> the targets that take it (e.g. --mtp: onnx, executorch, coreml)
    for t in all_targets():
        for f in t.Options.fields():
            owners.setdefault(f.name, []).append(t.name)
    for key in target_options or {}:
        if key not in owners:
            raise DeltashipError(
                f"unknown export option {key!r}; options: {', '.join(owners)}", "check the option's spelling"
            )
        if target not in owners[key]:
            raise DeltashipError(
                f"{flag(key)} applies to --target {' or '.join(owners[key])}, not {target}", f"drop {flag(key)}"
            )
    options = tgt.parse_options(target_options or {})
    from deltaship.lowering.draft_vocab import check_draft_vocab

    check_draft_vocab(options.as_dict())  # --mtp-draft-vocab N: needs --mtp, N >= 2 (N <= vocab: once loaded)
    if precision not in PRECISIONS:
        raise DeltashipError(
            f"unknown --precision {precision!r}; precisions: {', '.join(PRECISIONS)}", "pick one of the precisions"
        )
    if max_context is not None and max_context < 1:
        raise DeltashipError(f"--max-context must be at least 1, got {max_context}", "pass a positive context length")
    if block_size < 16 or block_size & (block_size - 1):
        raise DeltashipError(f"--block-size must be a power of two >= 16, got {block_size}", "use 32, 64 or 128")
    if deltanet_int8 and precision != "int4":
        raise DeltashipError(
            "--deltanet-int8 keeps DeltaNet projections at int8 when the rest is int4; it needs "
            f"--precision int4 (got {precision})",
            "drop --deltanet-int8 or use --precision int4",
        )
    if prefill_chunk is not None and prefill_chunk < 1:
        raise DeltashipError(f"--prefill-chunk must be at least 1, got {prefill_chunk}", "pass a positive chunk size")
    if kv_cache is not None:
        _check_kv_cache(tgt, precision, kv_cache, options)
    return options


def _check_kv_cache(tgt: Target, precision: str, kv_cache: str, options: TargetOptions) -> None:
    from deltaship.models.spec import KV_DTYPES

    if kv_cache not in KV_DTYPES:
        raise DeltashipError(
            f"unknown --kv-cache {kv_cache!r}; KV dtypes: {', '.join(KV_DTYPES)}", "pick one of the KV dtypes"
        )
    can = tgt.kv_cache_dtypes(precision, options.as_dict())
    if kv_cache not in can:
        raise DeltashipError(
            f"--kv-cache {kv_cache} is not available for --target {tgt.name} at --precision {precision}: its KV "
            f"cache is stored as {' or '.join(can)}; {tgt.kv_cache_note}",
            f"drop --kv-cache, or pass --kv-cache {can[0]}; `deltaship plan --context N` shows what a narrower "
            "KV cache would buy",
        )


def pass_options(
    target: Target,
    options: TargetOptions,
    *,
    prefill_chunk: int,
    block_size: int = 32,
    deltanet_int8: bool = False,
    verify: bool = True,
) -> dict[str, Any]:
    """What the passes and the lowering read as ctx.options: the target's fixed pass parameters, the common
    options and every target option (defaults filled in)."""
    return {
        **target.pass_options,
        "verify": verify,
        "block_size": block_size,
        "deltanet_int8": deltanet_int8,
        "prefill_chunk": prefill_chunk,
        **options.as_dict(),
    }


def special_tokens(source, tokenizer_dir_files: list[Path]) -> dict[str, Any]:
    """eos/bos/pad from the config and generation_config; chat markers from the tokenizer."""
    spec = source.spec
    eos = list(spec.eos_token_id)
    out: dict[str, Any] = {"bos": spec.bos_token_id, "pad": spec.pad_token_id}
    for f in tokenizer_dir_files:
        if f.name == "generation_config.json":
            g = json.loads(f.read_text())
            e = g.get("eos_token_id")
            eos += e if isinstance(e, list) else ([e] if isinstance(e, int) else [])
        if f.name == "tokenizer.json":
            added = {t["content"]: t["id"] for t in json.loads(f.read_text()).get("added_tokens", [])}
            for key, content in (
                ("im_start", "<|im_start|>"),
                ("im_end", "<|im_end|>"),
                ("endoftext", "<|endoftext|>"),
            ):
                if content in added:
                    out[key] = added[content]
    out["eos"] = sorted(set(eos))
    return out


def device_options(
    spec: ModelSpec,
    device: str,
    tiers_file: str | None,
    target: str | None,
    precision: str | None,
    max_context: int | str | None,
    kv_cache: str | None,
    prefill_chunk: int | None,
) -> dict[str, Any]:
    """The export options `deltaship plan` picks for tier `device` (what the user fixed is kept): target,
    precision, max_context, kv_cache (None: the target's own) and prefill_chunk (None: the target's default; a
    smaller one when only that fits), plus `say`, the line that tells the user."""
    from deltaship.devices.plan import choose_for_tier, default_kv_dtype

    pick = choose_for_tier(spec, device, tiers_file, target, precision, max_context, kv_cache, prefill_chunk)
    own_chunk = min(get_target(pick.target).default_prefill_chunk, pick.context)
    chunk = prefill_chunk if prefill_chunk is not None or pick.prefill_chunk == own_chunk else pick.prefill_chunk
    return {
        "target": pick.target,
        "precision": pick.precision,
        "max_context": pick.context,
        # only a quantized cache made it fit
        "kv_cache": pick.kv_dtype if pick.kv_dtype != default_kv_dtype(pick.target, pick.precision) else kv_cache,
        "prefill_chunk": chunk,
        "say": f"device {device}: {pick.target} {pick.precision} with an {pick.kv_dtype} KV cache at context "
        f"{pick.context}"
        + (f", prefill chunk {chunk}" if chunk is not None else "")
        + f" ({pick.total_bytes / 2**30:.2f} of {pick.budget_bytes / 2**30:.2f} GiB, deltaship plan)",
    }


def export(
    model: str,
    out: str | Path,
    target: str | None = None,
    precision: str | None = None,
    max_context: int | str | None = None,
    force: bool = False,
    verify: bool = True,
    prefill_chunk: int | None = None,
    block_size: int = 32,
    deltanet_int8: bool = False,
    threads: int | None = None,
    progress: bool | Callable = True,
    allow_download: bool = False,
    kv_cache: str | None = None,
    device: str | None = None,
    tiers_file: str | None = None,
    vision: bool = False,
    prompt_cache: str | Path | None = None,
    **target_options: Any,
) -> dict[str, Any]:
    """Compile `model` (a checkpoint directory, a preset, or a Hub id `org/name[@revision]` from the local Hugging
    Face cache, downloaded only with allow_download=True) for `target` at `precision` into bundle `out`.

    `target_options` are the target's own options (deltaship/targets/<target>.py, e.g. onnx_deltanet_ops).
    `vision` also exports the checkpoint's vision tower (the target's `vision_module`: ONNX vision.onnx,
    embedding.onnx, decoder_mm.onnx; ExecuTorch vision.pte, decoder_mm.pte; Core ML multimodal.mlpackage); off by
    default, so text-only bundles and their export time stay as they were.
    `kv_cache` asks for a KV-cache dtype (default: the target's own at `precision`); one it cannot store is refused.
    `device` names a tier (deltaship/devices/tiers.toml, or `tiers_file`): target, precision and context not given
    are what `deltaship plan` recommends for it (a quantized KV cache when only that fits; max_context "max": the
    longest context that fits the tier); nothing fitting is refused with the plan's numbers. Without a
    device, target and precision default to onnx and fp32.
    `prompt_cache` (a text file: the system message; or JSON {"system", "template_kwargs"}) ships the state after
    that system message in the bundle (prompt_cache.safetensors, the manifest's `chat` block; docs/chat.md), so a
    chat with it starts without feeding it.
    Returns the manifest. Nothing is left at `out` unless the export (and, for fp32, its
    verification) succeeded; an existing `out` is replaced only with force=True, and only when deltaship wrote
    it (deltaship/bundle/destination.py). An export whose planned peak memory does not fit this process's
    limits (cgroup, RLIMIT_AS, MemAvailable) is refused before the work; DELTASHIP_IGNORE_MEMORY_CHECK=1 skips that.
    """
    from deltaship.bundle.destination import Destination
    from deltaship.bundle.writer import new_manifest, tool_versions, write_bundle, write_manifest
    from deltaship.logs import quiet_third_party
    from deltaship.lowering.passes import ExportContext, run_pipeline
    from deltaship.models.presets import PRESETS
    from deltaship.models.source import load_source

    check_threads(threads)  # used at verification, minutes in: refused before any work, as the CLI's --threads
    quiet_third_party()
    dest = None  # the claimed --out: checked, locked and recovered before the first load
    try:
        say = progress if callable(progress) else Progress(bool(progress))
        source = None
        if device is not None:  # the plan for the tier picks what the user did not fix
            dest = Destination(Path(out), force, inputs=(model,))
            say(f"loading {model}")
            source = load_source(model, allow_download=allow_download)
            picked = device_options(
                source.spec, device, tiers_file, target, precision, max_context, kv_cache, prefill_chunk
            )
            target, precision, max_context, kv_cache, prefill_chunk = (
                picked[k] for k in ("target", "precision", "max_context", "kv_cache", "prefill_chunk")
            )
            say(picked["say"])
        elif max_context == "max":
            raise DeltashipError(
                "--max-context max needs --device: the longest context that fits is the tier's",
                "add --device TIER, or pass a number of tokens (the model's max_position_embeddings at most)",
            )
        target, precision = target or "onnx", precision or "fp32"
        cache = None
        if prompt_cache is not None:
            from deltaship.chat.store import prompt_cache_settings

            cache = prompt_cache_settings(Path(prompt_cache))
        options = check_options(
            target, precision, max_context, block_size, deltanet_int8, prefill_chunk, target_options, kv_cache
        )
        tgt = get_target(target)
        tgt.require_tools()
        out = Path(out)
        dest = dest or Destination(out, force, inputs=(model,))  # before any loading
        if source is None:
            say(f"loading {model}")
            source = load_source(model, allow_download=allow_download)
        spec = source.spec
        if vision and get_target(target).vision_module is None:
            raise DeltashipError(
                f"--vision: --target {target} has no vision lowering",
                "use --target " + " or ".join(t.name for t in all_targets() if t.vision_module) + ", or drop --vision",
            )
        if cache is not None and not any(f.name == "tokenizer.json" for f in source.tokenizer_files):
            raise DeltashipError(
                f"--prompt-cache: {model} has no tokenizer, so no chat template to render the system message with",
                "export a checkpoint directory that has tokenizer.json and a chat template, or drop --prompt-cache",
            )
        for note in source.notes():
            say(note)
        if spec.is_multimodal and not vision:
            say("the checkpoint has a vision tower: exporting the text decoder only (add --vision for image input)")
        if max_context is None:
            max_context = (
                PRESETS[model].default_max_context if model in PRESETS else min(4096, spec.max_position_embeddings)
            )
        spec.check_context(max_context)  # names max_position_embeddings and, without scaling, YaRN
        if target_options.get("mtp") and not getattr(source.weights, "has_mtp", False):
            raise DeltashipError(
                f"--mtp: {model} has no multi-token-prediction head (config.json mtp_num_hidden_layers is "
                f"{spec.mtp_num_hidden_layers}"
                + (", and the weights hold no mtp.* tensors)" if spec.mtp_num_hidden_layers else ")"),
                "drop --mtp, or export a checkpoint that ships its MTP head (Qwen3.5 checkpoints do; qwen3.5-tiny and "
                "the published-shape presets carry one)",
            )
        tokens = special_tokens(source, source.tokenizer_files)
        draft_ids, draft_record = _draft_vocab(source, options, tokens, say)
        chunk = min(prefill_chunk or tgt.default_prefill_chunk, max_context)
        tgt.check(precision, max_context, chunk, options)
        _check_memory(spec, model, target, precision, verify)
        ctx = ExportContext(
            spec=spec,
            precision=precision,
            max_context=max_context,
            target=target,
            options=pass_options(
                tgt, options, prefill_chunk=chunk, block_size=block_size, deltanet_int8=deltanet_int8, verify=verify
            ),
        )
        if vision:  # the checkpoint's vision side is checked before any work
            check_vision(source, spec, target=target, precision=precision, vision_precisions=tgt.vision_precisions)
        ctx.kv_cache = kv_cache
        ctx.draft_ids = draft_ids
        run_pipeline(ctx, tgt.pipeline(), progress=say)
        kv_record = None
        if kv_cache in ("int8", "int4"):  # _check_kv_cache let only a target that stores them through
            from deltaship.lowering.kv_quant import prepare

            kv_record = prepare(ctx, source, kv_cache, progress=say)

        def build(tmp: Path) -> dict[str, Any]:
            say(f"lowering to {target}")
            detail = lambda m: say(f"lowering to {target}: {m}", inline=True)  # noqa: E731
            lowered = tgt.lower(ctx, source.weights, tmp, progress=detail, tokens=tokens)
            if kv_record is not None:
                lowered.details["kv_quantization"] = kv_record
            say.done() if isinstance(say, Progress) else None
            vision_block = None
            if vision:
                import importlib

                say("lowering the vision tower")
                vision_block = importlib.import_module(tgt.vision_module).lower_vision(tmp, source, ctx)
            tok_files = []
            for f in source.tokenizer_files:
                shutil.copy(f, tmp / f.name)
                tok_files.append(f.name)
            tgt.finish_bundle(tmp)  # after the copy: the target may adjust the copied files
            manifest = new_manifest(
                source={
                    "model": source.name,
                    "kind": source.kind,
                    "architecture": spec.architecture,
                    "sha256": source.fingerprint(),
                    "notes": source.notes(),
                },
                model_card=source.model_card(),
                model=spec.to_dict() | {"num_layers": spec.num_layers, "parameters": spec.parameter_count()},
                target=target,
                precision=precision,
                quantization=lowered.quantization or _quant_summary(ctx),
                max_context=max_context,
                prefill_chunk=chunk,
                entry=lowered.entry,
                inputs=tgt.io_inputs(ctx),
                outputs=tgt.io_outputs(ctx),
                states=[
                    dict(
                        s,
                        init="zeros",
                        reset="zeros",
                        **(
                            {"in_place": lowered.state_in_place[s["name"]]}
                            if s["name"] in lowered.state_in_place
                            else {}
                        ),
                    )
                    for s in ctx.states
                ],
                usage=list(tgt.usage),
                tokens=tokens,
                tokenizer={"files": tok_files},
                passes=ctx.report,
                lowering=lowered.details,
                tools=tool_versions("torch", "transformers", *tgt.tool_packages),
            )
            if "speculative" in lowered.details:  # --mtp: the draft head and the verify contract
                manifest["speculative"] = lowered.details.pop("speculative")
                manifest["lowering"] = lowered.details
                if draft_record is not None:  # --mtp-draft-vocab N: the ids the draft's logits cover, in the bundle
                    from deltaship.lowering import draft_vocab

                    draft_vocab.write(tmp, draft_ids)
                    manifest["speculative"]["draft"]["vocab"] = draft_record
                    manifest["speculative"]["files"].append(draft_record["file"])
            if vision_block is not None:
                manifest["vision"] = vision_block
                manifest["usage"] += [
                    "Images (the `vision` block, docs/bundle-format.md 'Images'): encode each image with "
                    f"{vision_block['graphs']['vision']}, splice its features into the token embeddings with "
                    f"{vision_block['graphs']['embedding']}, and run {vision_block['graphs']['decoder']} on them with "
                    "3-row M-RoPE positions; prompts without images keep using the entry graph.",
                ]
            if source.sample_prompt() is not None:  # an app's default prompt (the web kit's page)
                manifest["sample_prompt"] = source.sample_prompt()
            manifest["memory"] = _memory(spec, ctx.states, tgt)
            manifest["app_runtimes"] = {**tgt.app_runtimes, **(lowered.app_runtimes or {})}
            if verify:
                from deltaship.check.verify import verify_bundle

                # The runtime reads the manifest: write a provisional one in the staging directory.
                provisional = write_manifest(tmp, dict(manifest))
                rec = verify_bundle(tmp, provisional, source, ctx, threads=threads, progress=say)
                manifest["verification"] = rec
                _report_verification(say, rec)
                if rec["status"] == "failed" and rec["tolerance"]["fails_export"]:
                    from deltaship.check.verify import verification_error

                    raise verification_error(rec, target, precision)
                if vision_block is not None and rec["status"] != "skipped":
                    from deltaship.check.vision import verify_vision

                    say("verifying image + text prompts against transformers")
                    vrec = verify_vision(tmp, provisional, source, ctx=ctx)
                    manifest["vision"]["verification"] = vrec
                    say(
                        f"vision verification {vrec['status']}: max |logit diff| "
                        f"{vrec['max_rel_logit_diff']:.3g} of the logit std, greedy agreement "
                        f"{vrec['greedy_agreement']:.3f} over {len(vrec['images'])} images"
                    )
                if rec["status"] != "skipped":
                    from deltaship.check.evaluate import evaluate

                    manifest["fidelity"] = evaluate(
                        tmp, tokens=min(EVAL_TOKENS, max_context), threads=threads, progress=say, source=source
                    )
                    f = manifest["fidelity"]
                    say(
                        f"fidelity on {f['tokens']} tokens: perplexity {f['perplexity']:.3f} (reference "
                        f"{f['reference_perplexity']:.3f}), KL {f['kl_divergence']:.3g}, "
                        f"top-1 {f['top1_agreement']:.3f}"
                    )
            else:
                manifest["verification"] = {"status": "skipped", "reason": "--no-verify"}
            if cache is not None:  # after verification: the bundle is what it will be, but for the cache
                from deltaship.chat.conversation import write_prompt_cache

                say("feeding the system message for the prompt cache")
                provisional = write_manifest(tmp, dict(manifest))
                manifest["chat"] = {"prompt_cache": write_prompt_cache(tmp, provisional, *cache, threads=threads)}
            return manifest

        manifest = write_bundle(dest, force, build)
        say(f"wrote {out} ({manifest['bundle_bytes'] / 2**20:.1f} MiB)")
        return manifest
    except MemoryError as e:  # a MemoryError inside write_bundle has been turned into this already
        raise DeltashipEnvironmentError(
            f"out of memory while exporting {model}; nothing was written",
            "pass --no-verify or a smaller --prefill-chunk, close other programs, or use a machine with more memory",
        ) from e
    finally:
        if dest is not None:
            dest.release()


def _check_memory(spec, model: str, target: str, precision: str, verify: bool) -> None:
    """Refuse, before the work, an export whose planned peak does not fit what this process may use (a cgroup's
    limit is an OOM kill without a message, RLIMIT_AS a crash in native code)."""
    from deltaship.devices.limits import check_memory, mem_available
    from deltaship.devices.plan import EXPORT_BASE_BYTES, export_peak_bytes

    peak = export_peak_bytes(spec, target, precision, verify, budget=mem_available())
    check_memory(
        peak,
        f"exporting {model} to {target} {precision}" + (" with verification" if verify else ""),
        "pass --no-verify (the fp32 reference and the bundle's session are the largest part)"
        if verify
        else "export a smaller model or precision",
        base=EXPORT_BASE_BYTES,
    )


def _draft_vocab(source, options: TargetOptions, tokens: dict[str, Any], say) -> tuple[Any, dict[str, Any] | None]:
    """--mtp-draft-vocab N: the N draft token ids and the manifest's record of them (None, None: full)."""
    from deltaship.lowering import draft_vocab

    opts = options.as_dict()
    n = draft_vocab.parse_draft_vocab(opts.get("mtp_draft_vocab"))
    if n is None:
        return None, None
    vocab = source.spec.vocab_size
    tok = next((f for f in source.tokenizer_files if f.name == "tokenizer.json"), None)
    ids, record = draft_vocab.rank(
        vocab, n, draft_vocab.special_ids(tokens, vocab), tok, opts.get("mtp_draft_vocab_text")
    )
    cover = f", covering {record['coverage']:.1%} of the ranking text's tokens" if record["coverage"] else ""
    say(f"draft vocabulary: {n} of {vocab} token ids{cover}" + ("" if tok else " (ascending ids: no tokenizer)"))
    return ids, record


def _memory(spec, states: list[dict], tgt) -> dict[str, Any]:
    """The manifest's memory arithmetic: state bytes = deltanet_state_bytes + context x kv_bytes_per_token[kv_dtype],
    and, where the target's attention kernel keeps scratch that grows with the context, context x intra-op threads
    x kv_scratch_bytes_per_token_per_thread[kv_dtype] more at run time."""
    short = {"float32": ("fp32", 4), "float16": ("fp16", 2)}
    dtypes = {s["kind"]: s["dtype"] for s in states}
    quant = next((s["quantization"] for s in states if "quantization" in s), None)
    kv = quant["kv_dtype"] if quant else short[dtypes.get("kv_cache_key", dtypes.get("deltanet_conv", "float32"))][0]
    out = spec.memory_arithmetic(kv, short[dtypes.get("deltanet_conv", "float32")][1])
    if quant and "static" in quant["scheme"]:  # the scales live in the graph: no bytes per token
        out["kv_bytes_per_token"][kv] = spec.kv_bytes_per_token(kv, static_scales=True)
        out["kv_scale_bytes_per_token_head"][kv] = 0
    scratch = {k: tgt.kv_scratch_bytes_per_token(spec, k) for k in out["kv_bytes_per_token"]}
    if any(scratch.values()):
        out["kv_scratch_bytes_per_token_per_thread"] = {k: v for k, v in scratch.items() if v}
    return out


def _report_verification(say, rec: dict) -> None:
    if rec["status"] == "skipped":
        say(f"verification skipped: {rec['reason']}")
    else:
        say(
            f"verification {rec['status']}: max |logit diff| {rec['max_abs_logit_diff']:.3g} "
            f"({rec['max_rel_logit_diff']:.3g} of the logit std), greedy agreement {rec['greedy_agreement']:.3f} "
            f"(tie-aware {rec['tie_aware_agreement']:.3f}); vs unrounded fp32: KL {rec['kl_divergence']:.3g}, "
            f"top-1 {rec['top1_agreement']:.3f}"
        )


def _quant_summary(ctx) -> dict[str, Any]:
    if not ctx.quant["linear"]:
        return {"scheme": "none", "weights": ctx.precision}
    bits: dict[str, int] = {}
    for q in ctx.quant["linear"].values():
        bits[f"int{q['bits']}"] = bits.get(f"int{q['bits']}", 0) + 1
    return {
        "scheme": "blockwise symmetric",
        "block_size": ctx.options["block_size"],
        "tensors": bits,
        "deltanet_int8": bool(ctx.options.get("deltanet_int8")),
        "embedding": ctx.quant["embedding"].get("model.embed_tokens.weight", "not quantized"),
        "activations": str(ctx.dtype).removeprefix("torch."),
    }
