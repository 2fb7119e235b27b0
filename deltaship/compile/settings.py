"""`ExportSettings`: every export option, typed and checked once, before any work.

`ExportOptions` is the one list of `deltaship.export()`'s options and their defaults (the CLI's `export` passes
its flags as those keyword arguments, and a target's own options beside them). `build_settings` builds the settings
from them; frozen from then on. What the checkpoint decides (the default context, the prefill chunk it
bounds) is resolved later, into the lowering's own frozen `LoweringSettings` (steps.lowering_settings).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from deltaship.chat.store import prompt_cache_settings
from deltaship.errors import DeltashipError
from deltaship.lowering.draft_vocab import check_draft_vocab, parse_draft_vocab
from deltaship.lowering.settings import KvCachePlan
from deltaship.models.spec import KV_DTYPES
from deltaship.options import block_size as check_block_size
from deltaship.options import threads as check_threads
from deltaship.targets import PRECISIONS, Target, TargetOptions, all_targets, flag, get_target

EVAL_TOKENS = 256  # held-out tokens evaluated at export (deltaship eval defaults to 512)


@dataclass(frozen=True)
class DraftVocabPlan:
    """--mtp-draft-vocab N [--mtp-draft-vocab-text FILE]: the draft head's logits over the N most frequent ids,
    ranked on `text` (None: the tiny preset's held-out text). size None: the whole vocabulary."""

    size: int | None = None
    text: str | None = None


@dataclass(frozen=True)
class CheckSettings:
    """verify: run the bundle against transformers (parity); fidelity: then the held-out fidelity eval of
    `fidelity_tokens` tokens (at most the context); threads: the sessions' intra-op threads."""

    verify: bool = True
    fidelity: bool = True
    threads: int | None = None
    fidelity_tokens: int = EVAL_TOKENS


@dataclass(frozen=True)
class ExportOptions:
    """`deltaship.export()`'s options (beyond model, out and the export-only device, tiers_file and progress), with
    their defaults: the one source of its keyword arguments, `build_settings`'s and the CLI's `export` flags. A
    target's own options (its `Options` dataclass: onnx_opset, mtp, ...) are passed beside them.

    target/precision None: onnx/fp32, or what a --device plan picks; max_context None: the checkpoint's default
    ("max": the longest a --device tier fits); verify: parity against transformers; fidelity: the held-out eval after
    it; prefill_chunk None: the target's default; block_size: int8/int4 quantization block; deltanet_int8: int4 with
    DeltaNet projections at int8; threads: verification's; kv_cache None: the target's own KV dtype at the
    precision; vision: the vision tower too; prompt_cache: a system message's state shipped in the bundle."""

    target: str | None = None
    precision: str | None = None
    max_context: int | str | None = None
    force: bool = False
    verify: bool = True
    fidelity: bool = True
    prefill_chunk: int | None = None
    block_size: int = 32
    deltanet_int8: bool = False
    threads: int | None = None
    allow_download: bool = False
    kv_cache: str | None = None
    vision: bool = False
    prompt_cache: str | Path | None = None


EXPORT_OPTIONS = tuple(f.name for f in fields(ExportOptions))


class UnknownExportOption(DeltashipError, TypeError):
    """An export option no one takes: bad input (exit 2), and the TypeError a Python caller expects of an unknown
    keyword argument."""


def export_options(options: Mapping[str, Any]) -> tuple[ExportOptions, dict[str, Any]]:
    """Split `deltaship.export()`'s keyword options into `ExportOptions` and the target options (checked against the
    target by check_options); an option neither names is refused with both lists."""
    taken = {f.name for t in all_targets() for f in t.Options.fields()}
    unknown = [k for k in options if k not in EXPORT_OPTIONS and k not in taken]
    if unknown:
        raise UnknownExportOption(
            f"unknown export option {unknown[0]!r}; options: {', '.join(EXPORT_OPTIONS)}; the targets' options: "
            f"{', '.join(sorted(taken))}",
            "check the option's spelling (`deltaship export --help` lists them as flags)",
        )
    mine = ExportOptions(**{k: v for k, v in options.items() if k in EXPORT_OPTIONS})
    return mine, {k: v for k, v in options.items() if k not in EXPORT_OPTIONS}


@dataclass(frozen=True)
class ExportSettings:
    """One export, as asked. options: the target's typed options (its `Options` dataclass, defaults filled in);
    activation_dtype: what the target computes in at this precision; kv: how the KV cache is stored; max_context
    and prefill_chunk None: the checkpoint's and the target's defaults; prompt_cache: the system message and the
    chat template's keyword arguments (export --prompt-cache)."""

    model: str
    out: Path
    target: str
    precision: str
    options: TargetOptions
    activation_dtype: str
    kv: KvCachePlan
    draft_vocab: DraftVocabPlan = DraftVocabPlan()
    checks: CheckSettings = CheckSettings()
    max_context: int | None = None
    prefill_chunk: int | None = None
    block_size: int = 32
    deltanet_int8: bool = False
    vision: bool = False
    prompt_cache: tuple[str, dict[str, Any]] | None = None
    force: bool = False
    allow_download: bool = False

    @property
    def tgt(self) -> Target:
        return get_target(self.target)


def build_settings(model: str, out: str | Path, **options: Any) -> ExportSettings:
    """The settings of `deltaship.export()`'s keyword options (`ExportOptions` and a target's own; device and
    tiers_file already applied), every option and combination checked; target and precision default to onnx and
    fp32."""
    o, asked = export_options(options)
    check_threads(o.threads)  # used at verification, minutes in: refused before any work, as the CLI's --threads
    if o.max_context == "max":
        raise DeltashipError(
            "--max-context max needs --device: the longest context that fits is the tier's",
            "add --device TIER, or pass a number of tokens (the model's max_position_embeddings at most)",
        )
    target = o.target or "onnx"
    precision = o.precision or get_target(target).precisions[0]  # fp32, or the first the target builds (qnn: fp16)
    cache = prompt_cache_settings(Path(o.prompt_cache)) if o.prompt_cache is not None else None
    typed = check_options(
        target, precision, o.max_context, o.block_size, o.deltanet_int8, o.prefill_chunk, asked, o.kv_cache
    )
    tgt = get_target(target)
    if o.vision and tgt.vision_module is None:
        raise DeltashipError(
            f"--vision: --target {target} has no vision lowering",
            "use --target " + " or ".join(t.name for t in all_targets() if t.vision_module) + ", or drop --vision",
        )
    activations = tgt.activation_dtype(precision, typed)
    return ExportSettings(
        model=model,
        out=Path(out),
        target=target,
        precision=precision,
        options=typed,
        activation_dtype=activations,
        kv=KvCachePlan.plan(o.kv_cache or tgt.kv_cache_dtypes(precision, typed)[0], activations),
        draft_vocab=DraftVocabPlan(
            parse_draft_vocab(getattr(typed, "mtp_draft_vocab", None)), getattr(typed, "mtp_draft_vocab_text", None)
        ),
        checks=CheckSettings(verify=o.verify, fidelity=o.fidelity, threads=o.threads),
        max_context=o.max_context,
        prefill_chunk=o.prefill_chunk,
        block_size=o.block_size,
        deltanet_int8=o.deltanet_int8,
        vision=o.vision,
        prompt_cache=cache,
        force=o.force,
        allow_download=o.allow_download,
    )


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
    options. (The target's own combinations, which need the context and chunk, are checked once the checkpoint
    is loaded: steps.lowering_settings.)"""
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
    check_draft_vocab(options)  # --mtp-draft-vocab N: needs --mtp, N >= 2 (N <= vocab: once loaded)
    if precision not in PRECISIONS:
        raise DeltashipError(
            f"unknown --precision {precision!r}; precisions: {', '.join(PRECISIONS)}", "pick one of the precisions"
        )
    if precision not in tgt.precisions:
        raise DeltashipError(
            f"--target {target} builds --precision {' or '.join(tgt.precisions)} only, not {precision}"
            + (f": {tgt.precision_note}" if tgt.precision_note else ""),
            f"pass --precision {tgt.precisions[0]}, or export with another --target",
        )
    if max_context is not None and max_context < 1:
        raise DeltashipError(f"--max-context must be at least 1, got {max_context}", "pass a positive context length")
    check_block_size(block_size)
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
    if kv_cache not in KV_DTYPES:
        raise DeltashipError(
            f"unknown --kv-cache {kv_cache!r}; KV dtypes: {', '.join(KV_DTYPES)}", "pick one of the KV dtypes"
        )
    can = tgt.kv_cache_dtypes(precision, options)
    if kv_cache not in can:
        raise DeltashipError(
            f"--kv-cache {kv_cache} is not available for --target {tgt.name} at --precision {precision}: its KV "
            f"cache is stored as {' or '.join(can)}; {tgt.kv_cache_note}",
            f"drop --kv-cache, or pass --kv-cache {can[0]}; `deltaship plan --context N` shows what a narrower "
            "KV cache would buy",
        )
