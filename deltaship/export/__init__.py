"""`export()`: checkpoint or preset -> verified artifact bundle. The CLI's `export` is this function."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

from deltaship.errors import DeltashipError

TARGETS = ("onnx", "executorch", "coreml")
PRECISIONS = ("fp32", "fp16", "int8", "int4")
DEFAULT_PREFILL_CHUNK = 512
EVAL_TOKENS = 256  # held-out tokens evaluated at export (deltaship eval defaults to 512)


class Progress:
    """Step lines on stderr, with elapsed time; quiet when disabled."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.t0 = time.monotonic()
        self.tty = sys.stderr.isatty()
        self._inline = False

    def __call__(self, msg: str, inline: bool = False) -> None:
        if not self.enabled:
            return
        line = f"[{time.monotonic() - self.t0:6.1f}s] {msg}"
        if inline and self.tty:
            sys.stderr.write("\r" + line[:120].ljust(120))
            self._inline = True
        else:
            if self._inline:
                sys.stderr.write("\n")
                self._inline = False
            if not inline:
                sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self._inline and self.enabled:
            sys.stderr.write("\n")
            self._inline = False


# Target-specific options (keyword arguments of export()) and the target each belongs to.
TARGET_OPTIONS = {"onnx_deltanet_ops": "onnx", "onnx_activations": "onnx", "external_data": "onnx",
                  "allow_portable_fallback": "executorch",
                  "coreml_states": "coreml", "coreml_palettize": "coreml", "coreml_part_gb": "coreml"}


def check_options(target: str, precision: str, max_context: int | None, block_size: int, deltanet_int8: bool,
                  prefill_chunk: int | None, accuracy_level: int = 4, target_options: dict | None = None) -> None:
    """Every option combination is checked once, here, before any work starts."""
    if target not in TARGETS:
        raise DeltashipError(f"unknown --target {target!r}; targets: {', '.join(TARGETS)}", "pick one of the targets")
    for key in target_options or {}:
        owner = TARGET_OPTIONS.get(key)
        flag = "--" + key.replace("_", "-")
        if owner is None:
            raise DeltashipError(f"unknown export option {key!r}; options: {', '.join(TARGET_OPTIONS)}",
                                 "check the option's spelling")
        if owner != target:
            raise DeltashipError(f"{flag} applies to --target {owner}, not {target}", f"drop {flag}")
    ops = (target_options or {}).get("onnx_deltanet_ops", "standard")
    if ops not in ("standard", "contrib"):
        raise DeltashipError(f"--onnx-deltanet-ops must be standard or contrib, got {ops!r}",
                             "use standard (default) or contrib")
    acts = (target_options or {}).get("onnx_activations")
    if acts not in (None, "fp32", "fp16"):
        raise DeltashipError(f"--onnx-activations must be fp32 or fp16, got {acts!r}", "use fp32 (default) or fp16")
    if acts is not None and precision not in ("int8", "int4"):
        raise DeltashipError(f"--onnx-activations applies to int8/int4 weights (--precision {precision} already "
                             f"sets the activations)", "drop --onnx-activations, or use --precision int8 or int4")
    if precision not in PRECISIONS:
        raise DeltashipError(f"unknown --precision {precision!r}; precisions: {', '.join(PRECISIONS)}",
                             "pick one of the precisions")
    if max_context is not None and max_context < 1:
        raise DeltashipError(f"--max-context must be at least 1, got {max_context}", "pass a positive context length")
    if block_size < 16 or block_size & (block_size - 1):
        raise DeltashipError(f"--block-size must be a power of two >= 16, got {block_size}", "use 32, 64 or 128")
    if deltanet_int8 and precision != "int4":
        raise DeltashipError("--deltanet-int8 keeps DeltaNet projections at int8 when the rest is int4; it needs "
                             f"--precision int4 (got {precision})", "drop --deltanet-int8 or use --precision int4")
    if accuracy_level not in (0, 1, 2, 3, 4):
        raise DeltashipError(f"--accuracy-level must be 0..4, got {accuracy_level}", "use 4 (int8 activations) or 0 (float)")
    if accuracy_level != 4 and (target != "onnx" or precision not in ("int8", "int4")):
        raise DeltashipError("--accuracy-level applies to ONNX int8/int4 bundles (MatMulNBits) only",
                             "drop --accuracy-level")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise DeltashipError(f"--prefill-chunk must be at least 1, got {prefill_chunk}", "pass a positive chunk size")


def _target_module(target: str):
    if target == "onnx":
        from deltaship.export import onnx as mod
        return mod
    if target == "executorch":
        from deltaship.export import executorch as mod
        return mod
    from deltaship.export import coreml as mod
    return mod


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
            for key, content in (("im_start", "<|im_start|>"), ("im_end", "<|im_end|>"),
                                 ("endoftext", "<|endoftext|>")):
                if content in added:
                    out[key] = added[content]
    out["eos"] = sorted(set(eos))
    return out


def export(model: str, out: str | Path, target: str = "onnx", precision: str = "fp32",
           max_context: int | None = None, force: bool = False, verify: bool = True,
           prefill_chunk: int | None = None, block_size: int = 32, deltanet_int8: bool = False,
           accuracy_level: int = 4, threads: int | None = None, progress: bool | Callable = True,
           **target_options: Any) -> dict[str, Any]:
    """Compile `model` (a checkpoint directory or a preset) for `target` at `precision` into bundle `out`.

    Returns the manifest. Nothing is left at `out` unless the export (and, for fp32, its
    verification) succeeded; an existing `out` is replaced only with force=True.
    """
    from deltaship.export.bundle import base_manifest, check_destination, tool_versions, write_bundle
    from deltaship.export.passes import PIPELINE, ExportContext, run_pipeline
    from deltaship.models.presets import PRESETS
    from deltaship.models.source import load_source

    from deltaship.logs import quiet_third_party
    quiet_third_party()
    check_options(target, precision, max_context, block_size, deltanet_int8, prefill_chunk, accuracy_level,
                  target_options)
    out = Path(out)
    check_destination(out, force)
    say = progress if callable(progress) else Progress(bool(progress))
    say(f"loading {model}")
    source = load_source(model)
    spec = source.spec
    for note in source.notes():
        say(note)
    if max_context is None:
        max_context = PRESETS[model].default_max_context if model in PRESETS else min(4096, spec.max_position_embeddings)
    if max_context > spec.max_position_embeddings:
        raise DeltashipError(f"--max-context {max_context} exceeds the model's max_position_embeddings "
                             f"({spec.max_position_embeddings})", f"pass --max-context {spec.max_position_embeddings} or less")
    tmod = _target_module(target)
    chunk = min(prefill_chunk or getattr(tmod, "DEFAULT_CHUNK", DEFAULT_PREFILL_CHUNK), max_context)
    options = {**getattr(tmod, "OPTIONS", {}), "verify": verify, "block_size": block_size, "deltanet_int8": deltanet_int8, "prefill_chunk": chunk,
               "accuracy_level": accuracy_level, **target_options}
    if hasattr(tmod, "check_options"):
        tmod.check_options(precision, max_context, chunk, options)
    ctx = ExportContext(spec=spec, precision=precision, max_context=max_context, target=target, options=options)
    run_pipeline(ctx, getattr(tmod, "PIPELINE", PIPELINE), progress=say)

    tokens = special_tokens(source, source.tokenizer_files)

    def build(tmp: Path) -> dict[str, Any]:
        say(f"lowering to {target}")
        lowered = tmod.lower(ctx, source.weights, tmp, progress=lambda m: say(f"  {m}", inline=True),
                             tokens=tokens)
        say.done() if isinstance(say, Progress) else None
        tok_files = []
        for f in source.tokenizer_files:
            shutil.copy(f, tmp / f.name)
            tok_files.append(f.name)
        if hasattr(tmod, "adapt_tokenizer_config"):  # after the copy: the target adjusts the copied files
            tmod.adapt_tokenizer_config(tmp)
        in_place = lowered.get("state_in_place", {})  # states whose past and present may share a buffer
        manifest = base_manifest(
            source={"model": source.name, "kind": source.kind, "architecture": spec.architecture,
                    "sha256": source.fingerprint(), "notes": source.notes()},
            model=spec.to_dict() | {"num_layers": spec.num_layers, "parameters": spec.parameter_count()},
            target=target, precision=precision,
            quantization=lowered.get("quantization") or _quant_summary(ctx),
            max_context=max_context, prefill_chunk=chunk, entry=lowered["entry"],
            inputs=tmod.io_inputs(ctx) if hasattr(tmod, "io_inputs") else _default_inputs(),
            outputs=tmod.io_outputs(ctx) if hasattr(tmod, "io_outputs") else [
                {"name": "logits", "shape": [1, spec.vocab_size], "dtype": "float32", "kind": "logits",
                 "doc": "logits after the last token of the call"}],
            states=[dict(s, init="zeros", reset="zeros", **({"in_place": in_place[s["name"]]} if s["name"] in in_place
                                                            else {})) for s in ctx.states],
            state_bytes=sum(_nbytes(s) for s in ctx.states),
            usage=tmod.USAGE,
            tokens=tokens,
            tokenizer={"files": tok_files},
            passes=ctx.report,
            lowering={k: v for k, v in lowered.items() if k not in ("files", "entry", "quantization", "state_in_place")},
            tools=tool_versions("torch", "transformers", *tmod.TOOL_PACKAGES),
        )
        if verify:
            from deltaship.export.verify import verify_bundle
            # The runtime reads the manifest: write a provisional one in the staging directory.
            provisional = finalize_in_place(tmp, manifest)
            rec = verify_bundle(tmp, provisional, source, ctx, threads=threads, progress=say)
            manifest["verification"] = rec
            _report_verification(say, rec)
            if rec["status"] == "failed" and rec["tolerance"]["fails_export"]:
                raise DeltashipError(
                    f"verification failed: the {target} {precision} bundle disagrees with transformers "
                    f"(max relative logit difference {rec['max_rel_logit_diff']:.3g}, tie-aware greedy agreement "
                    f"{rec['tie_aware_agreement']:.3f}; tolerance {rec['tolerance']}); nothing was written",
                    "this is a deltaship bug: please report it with the model's config.json")
            if rec["status"] != "skipped":
                from deltaship.export.evaluate import evaluate
                manifest["fidelity"] = evaluate(tmp, tokens=min(EVAL_TOKENS, max_context), threads=threads,
                                                progress=say, source=source)
                f = manifest["fidelity"]
                say(f"fidelity on {f['tokens']} tokens: perplexity {f['perplexity']:.3f} (reference "
                    f"{f['reference_perplexity']:.3f}), KL {f['kl_divergence']:.3g}, top-1 {f['top1_agreement']:.3f}")
        else:
            manifest["verification"] = {"status": "skipped", "reason": "--no-verify"}
        return manifest

    manifest = write_bundle(out, force, build)
    say(f"wrote {out} ({manifest['bundle_bytes'] / 2**20:.1f} MiB)")
    return manifest


def finalize_in_place(tmp: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Write a manifest with file hashes into the staging directory (it is rewritten at the end)."""
    from deltaship.files import sha256_file
    from deltaship.runtimes.bundle import MANIFEST
    m = dict(manifest)
    m["files"] = {p.relative_to(tmp).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
                  for p in sorted(tmp.rglob("*")) if p.is_file() and p.name != MANIFEST}
    (tmp / MANIFEST).write_text(json.dumps(m, indent=2) + "\n")
    return m


def _report_verification(say, rec: dict) -> None:
    if rec["status"] == "skipped":
        say(f"verification skipped: {rec['reason']}")
    else:
        say(f"verification {rec['status']}: max |logit diff| {rec['max_abs_logit_diff']:.3g} "
            f"({rec['max_rel_logit_diff']:.3g} of the logit std), greedy agreement {rec['greedy_agreement']:.3f} "
            f"(tie-aware {rec['tie_aware_agreement']:.3f}); vs unrounded fp32: KL {rec['kl_divergence']:.3g}, "
            f"top-1 {rec['top1_agreement']:.3f}")


def _default_inputs() -> list[dict]:
    return [{"name": "input_ids", "shape": [1, "tokens"], "dtype": "int64", "kind": "tokens",
             "doc": "1 to prefill_chunk token ids"},
            {"name": "position", "shape": [1], "dtype": "int64", "kind": "position",
             "doc": "position of the first token of this call = tokens already consumed by the state"}]


def _nbytes(s: dict) -> int:
    n = 1
    for d in s["shape"]:
        n *= d
    return n * {"float32": 4, "float16": 2}[s["dtype"]]


def _quant_summary(ctx) -> dict[str, Any]:
    if not ctx.quant["linear"]:
        return {"scheme": "none", "weights": ctx.precision}
    bits: dict[str, int] = {}
    for q in ctx.quant["linear"].values():
        bits[f"int{q['bits']}"] = bits.get(f"int{q['bits']}", 0) + 1
    return {"scheme": "blockwise symmetric", "block_size": ctx.options["block_size"], "tensors": bits,
            "deltanet_int8": bool(ctx.options.get("deltanet_int8")),
            "embedding": ctx.quant["embedding"].get("model.embed_tokens.weight", "not quantized"),
            "activations": str(ctx.dtype).removeprefix("torch.")}
