"""The bundle's manifest, assembled from the settings and the products of an export (before verification)."""

from __future__ import annotations

from typing import Any

from deltaship.bundle.writer import new_manifest, tool_versions
from deltaship.compile.settings import ExportSettings
from deltaship.lowering.lowered import Lowered
from deltaship.lowering.settings import LoweringSettings
from deltaship.models.source import ModelSource
from deltaship.targets import Target


def assemble(
    settings: ExportSettings,
    lowering: LoweringSettings,
    source: ModelSource,
    ctx,
    lowered: Lowered,
    tokens: dict[str, Any],
    tokenizer_files: list[str],
    draft_record: dict[str, Any] | None,
    kv_record: dict[str, Any] | None,
    vision_block: dict[str, Any] | None,
) -> dict[str, Any]:
    """Every manifest field but `verification`, `fidelity`, `chat`, `files` and `bundle_bytes`. ctx: the passes'
    products (deltaship.lowering.passes.ExportContext); lowered: the lowering's (its states as stored, its files)."""
    spec, tgt = lowering.spec, settings.tgt
    details = dict(lowered.details, **({"kv_quantization": kv_record} if kv_record is not None else {}))
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
        target=settings.target,
        precision=settings.precision,
        quantization=lowered.quantization or quant_summary(lowering, ctx.quant),
        max_context=lowering.max_context,
        prefill_chunk=lowering.prefill_chunk,
        entry=lowered.entry,
        inputs=tgt.io_inputs(ctx),
        outputs=tgt.io_outputs(ctx),
        states=[
            dict(
                s,
                init="zeros",
                reset="zeros",
                **({"in_place": lowered.state_in_place[s["name"]]} if s["name"] in lowered.state_in_place else {}),
            )
            for s in lowered.states
        ],
        usage=list(tgt.usage),
        tokens=tokens,
        tokenizer={"files": tokenizer_files},
        passes=ctx.report,
        lowering=details,
        tools=tool_versions("torch", "transformers", *tgt.tool_packages),
    )
    if lowered.speculative is not None:  # --mtp: the draft head and the verify contract
        manifest["speculative"] = lowered.speculative
        if draft_record is not None:  # --mtp-draft-vocab N: the ids the draft's logits cover, in the bundle
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
    manifest["memory"] = memory(lowering, lowered.states, tgt)
    manifest["app_runtimes"] = {**tgt.app_runtimes, **(lowered.app_runtimes or {})}
    return manifest


def memory(lowering: LoweringSettings, states: list[dict], tgt: Target) -> dict[str, Any]:
    """The manifest's memory arithmetic: state bytes = deltanet_state_bytes + context x kv_bytes_per_token[kv_dtype],
    and, where the target's attention kernel keeps scratch that grows with the context, context x intra-op threads
    x kv_scratch_bytes_per_token_per_thread[kv_dtype] more at run time. A quantized KV cache's dtype is the settings'
    plan; a float cache's and the DeltaNet state's width are what the lowering stored."""
    spec, kv = lowering.spec, lowering.kv
    short = {"float32": ("fp32", 4), "float16": ("fp16", 2)}
    dtypes = {s["kind"]: s["dtype"] for s in states}
    conv = short[dtypes.get("deltanet_conv", "float32")]
    # a quantized cache is the plan's; a float cache is what the lowering stored (ExecuTorch at fp16 keeps fp32 KV
    # states, which its manifest's states say); a model without attention layers has no KV cache: the DeltaNet
    # states' width names the dtype
    if kv.quantized:
        kv_dtype = kv.dtype
    else:
        kv_dtype = short[dtypes["kv_cache_key"]][0] if "kv_cache_key" in dtypes else conv[0]
    out = spec.memory_arithmetic(kv_dtype, conv[1])
    if kv.quantized and kv_dtype == kv.dtype:  # static scales: they live in the graph, no bytes per token
        out["kv_bytes_per_token"][kv_dtype] = spec.kv_bytes_per_token(kv_dtype, static_scales=True)
        out["kv_scale_bytes_per_token_head"][kv_dtype] = 0
    scratch = {k: tgt.kv_scratch_bytes_per_token(spec, k) for k in out["kv_bytes_per_token"]}
    if any(scratch.values()):
        out["kv_scratch_bytes_per_token_per_thread"] = {k: v for k, v in scratch.items() if v}
    return out


def quant_summary(lowering: LoweringSettings, quant: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The manifest's `quantization` where the passes chose it (the toolchain did not)."""
    if not quant["linear"]:
        return {"scheme": "none", "weights": lowering.precision}
    bits: dict[str, int] = {}
    for q in quant["linear"].values():
        bits[f"int{q['bits']}"] = bits.get(f"int{q['bits']}", 0) + 1
    return {
        "scheme": "blockwise symmetric",
        "block_size": lowering.block_size,
        "tensors": bits,
        "deltanet_int8": lowering.deltanet_int8,
        "embedding": quant["embedding"].get("model.embed_tokens.weight", "not quantized"),
        "activations": lowering.activation_dtype,
    }
