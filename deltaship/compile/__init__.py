"""`export()`: checkpoint or preset -> verified artifact bundle. The CLI's `export` is this function.

It reads as its steps (deltaship/compile/steps.py); the settings are built once (deltaship/compile/settings.py)
and the manifest is assembled in deltaship/compile/manifest.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from deltaship.bundle.destination import Destination
from deltaship.bundle.writer import write_bundle
from deltaship.compile import steps
from deltaship.compile.manifest import assemble
from deltaship.compile.settings import (
    EVAL_TOKENS,
    ExportOptions,
    ExportSettings,
    UnknownExportOption,
    build_settings,
    check_options,
    export_options,
)
from deltaship.errors import DeltashipEnvironmentError
from deltaship.logs import quiet_third_party
from deltaship.models.source import ModelSource
from deltaship.options import threads as check_threads
from deltaship.progress import Progress

__all__ = [
    "export",
    "compile_bundle",
    "build_settings",
    "check_options",
    "export_options",
    "ExportOptions",
    "ExportSettings",
    "UnknownExportOption",
    "EVAL_TOKENS",
]


def export(
    model: str,
    out: str | Path,
    *,
    device: str | None = None,
    tiers_file: str | None = None,
    progress: bool | Callable = True,
    **options: Any,
) -> dict[str, Any]:
    """Compile `model` (a checkpoint directory, a preset, or a Hub id `org/name[@revision]` from the local Hugging
    Face cache, downloaded only with allow_download=True) for `target` at `precision` into bundle `out`.

    `options` are `ExportOptions`' fields (deltaship/compile/settings.py, the one list of them and their defaults:
    target, precision, max_context, force, verify, fidelity, prefill_chunk, block_size, deltanet_int8, threads,
    allow_download, kv_cache, vision, prompt_cache) and the target's own options (deltaship/targets/<target>.py, e.g.
    onnx_deltanet_ops); any other name is refused (UnknownExportOption, a TypeError too).
    `vision` also exports the checkpoint's vision tower (the target's `vision_module`: ONNX vision.onnx,
    embedding.onnx, decoder_mm.onnx; ExecuTorch vision.pte, decoder_mm.pte; Core ML multimodal.mlpackage); off by
    default, so text-only bundles and their export time stay as they were.
    `kv_cache` asks for a KV-cache dtype (default: the target's own at `precision`); one it cannot store is refused.
    `device` names a tier (deltaship/devices/tiers.toml, or `tiers_file`): target, precision and context not given
    are what `deltaship plan` recommends for it (a quantized KV cache when only that fits; max_context "max": the
    longest context that fits the tier); nothing fitting is refused with the plan's numbers. Without a
    device, target and precision default to onnx and fp32 (a target that builds no fp32, qnn: its first precision).
    `prompt_cache` (a text file: the system message; or JSON {"system", "template_kwargs"}) ships the state after
    that system message in the bundle (prompt_cache.safetensors, the manifest's `chat` block; docs/chat.md), so a
    chat with it starts without feeding it.
    `fidelity=False` leaves out the held-out fidelity eval that follows a verification (the manifest's
    `fidelity`), which a caller that does not read it need not pay for.
    Returns the manifest. Nothing is left at `out` unless the export (and, for fp32, its
    verification) succeeded; an existing `out` is replaced only with force=True, and only when deltaship wrote
    it (deltaship/bundle/destination.py). An export whose planned peak memory does not fit this process's
    limits (cgroup, RLIMIT_AS, MemAvailable) is refused before the work; DELTASHIP_IGNORE_MEMORY_CHECK=1 skips that.
    """
    say = progress if callable(progress) else Progress(bool(progress))
    asked, _ = export_options(options)  # unknown names refused, and the options read before the settings, typed
    check_threads(asked.threads)  # used at verification, minutes in: refused before any work, as the CLI's --threads
    quiet_third_party()
    dest, source = None, None  # the claimed --out: checked, locked and recovered before the first load
    try:
        if device is not None:  # the plan for the tier picks what the user did not fix
            dest = steps.claim(out, asked.force, model)
            source = steps.load(model, asked.allow_download, say)
            pick = steps.plan_device(
                source.spec,
                device,
                tiers_file,
                asked.target,
                asked.precision,
                asked.max_context,
                asked.kv_cache,
                asked.prefill_chunk,
                steps.device_prompt_cache_tokens(source, asked.prompt_cache),
                asked.block_size,
            )
            options = dict(options, target=pick.target, precision=pick.precision, max_context=pick.max_context)
            options.update(kv_cache=pick.kv_cache, prefill_chunk=pick.prefill_chunk)
            say(pick.say)
        settings = build_settings(model, out, **options)
        settings.tgt.require_tools()
        dest = dest or steps.claim(settings.out, settings.force, model)  # before any loading
        source = source or steps.load(model, settings.allow_download, say)
        manifest = compile_bundle(settings, source, dest, say)
        say(f"wrote {settings.out} ({manifest['bundle_bytes'] / 2**20:.1f} MiB)")
        return manifest
    except MemoryError as e:  # a MemoryError inside write_bundle has been turned into this already
        raise DeltashipEnvironmentError(
            f"out of memory while exporting {model}; nothing was written",
            "pass --no-verify or a smaller --prefill-chunk, close other programs, or use a machine with more memory",
        ) from e
    finally:
        if dest is not None:
            dest.release()


def compile_bundle(settings: ExportSettings, source: ModelSource, dest: Destination, say) -> dict[str, Any]:
    """The export's steps from a loaded checkpoint to the bundle published at `dest`; returns the manifest."""
    max_context, chunk = steps.check_source(settings, source, say)
    tokens = steps.special_tokens(source)
    draft_ids, draft_record = steps.draft_vocabulary(settings, source, tokens, say)
    lowering = steps.lowering_settings(settings, source.spec, max_context, chunk, draft_ids)
    steps.check_vision(settings, source, source.spec)
    kv_scales, kv_record = steps.calibrate_kv(settings.kv, source, max_context, say)
    ctx = steps.run_passes(steps.with_scales(lowering, kv_scales), settings.tgt.pipeline(), say)

    def build(tmp: Path) -> dict[str, Any]:
        lowered, vision_block = steps.lower(settings, ctx, source, tmp, tokens, say)
        tokenizer_files = steps.copy_tokenizer(settings, source, tmp)
        manifest = assemble(
            settings, ctx.settings, source, ctx, lowered, tokens, tokenizer_files, draft_record, kv_record, vision_block
        )
        steps.write_draft_vocabulary(tmp, draft_ids, manifest)
        manifest["verification"] = steps.verify(settings, tmp, manifest, source, ctx, lowered, say)
        if (f := steps.fidelity(settings, tmp, source, manifest["verification"], max_context, say)) is not None:
            manifest["fidelity"] = f
        if (chat := steps.prompt_cache(settings, tmp, manifest, say)) is not None:
            manifest["chat"] = chat
        return manifest

    return write_bundle(dest, settings.force, build)
