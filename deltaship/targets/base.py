"""The target contract: one `Target` subclass per target, registered once.

A target owns everything that differs between ONNX, ExecuTorch and Core ML: its typed options (the
CLI flags, defaults and help are generated from them), its explicit pass list, its lowering (a
typed `Lowered` result), its usage text and tool packages, the runtime sessions that open its
bundles, its parity tolerance rows, and the storage format the memory planner asks it for.

This module and each target's module import no toolchain (no torch, onnx, executorch or
coremltools): the pass list, the lowering and the sessions are imported inside the methods, so the
registry serves `deltaship plan`, `inspect` and the ONNX runtime without torch.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

from deltaship.errors import DeltashipError
from deltaship.lowering.lowered import Lowered
from deltaship.lowering.settings import PassParams
from deltaship.targets.tolerances import Tolerance

if TYPE_CHECKING:  # typing only: importing these pulls in torch
    from deltaship.lowering.passes import ExportContext
    from deltaship.runtimes.base import Session
    from deltaship.runtimes.vision import Multimodal

PRECISIONS = ("fp32", "fp16", "int8", "int4")
DEFAULT_PREFILL_CHUNK = 512  # tokens per prefill call, unless a target says otherwise


def option(help: str, *, choices: tuple | None = None, metavar: str | None = None) -> dict[str, Any]:
    """Field metadata of a target option: its help text and allowed values (for the CLI and the check)."""
    return {"help": help, "choices": choices, "metavar": metavar}


def draft_vocab_field() -> Any:
    """--mtp-draft-vocab, taken by every target that takes --mtp (checked in deltaship/lowering/draft_vocab.py)."""
    return field(
        default="full",
        metadata=option(
            "with --mtp: the draft head's logits over the N most frequent token ids only (FR-Spec: a smaller LM head "
            "to stream per draft; the verify call keeps the full vocabulary), or full",
            metavar="{N,full}",
        ),
    )


def draft_vocab_text_field() -> Any:
    """--mtp-draft-vocab-text: the text the draft vocabulary is ranked on."""
    return field(
        default=None,
        metadata=option(
            "with --mtp-draft-vocab N: rank the token ids on this UTF-8 text file (default: the tiny preset's "
            "held-out Python source)",
            metavar="PATH",
        ),
    )


@dataclass(frozen=True)
class TargetOptions:
    """Base of each target's options. Field names are `export()` keyword arguments; the CLI flag is the
    name with dashes (`onnx_deltanet_ops` -> `--onnx-deltanet-ops`). Fields carry `option(...)` metadata."""

    @classmethod
    def fields(cls) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _one_of(values: tuple) -> str:
    items = [str(v) for v in values]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


@dataclass(frozen=True)
class StorageFormat:
    """How a target stores weights at one precision (what the memory planner counts).

    bits: bits per weight; scale: bytes per block scale; block: quantization block (1 = none);
    head_copy: a tied LM head is stored a second time (quantized gather table + matmul weight);
    act: bytes per activation / state element."""

    bits: int
    scale: int
    block: int
    head_copy: bool
    act: int


@dataclass(frozen=True)
class TextRuntime:
    """A runtime that takes text, not token ids (ExecuTorch's C++ LLM runner): it serves `generate --prompt` and
    `profile`, through `module`'s functions `generate(bundle, prompt, max_new_tokens, temperature) -> dict`
    and `profile(bundle, prompt_length, gen, reps, warmups) -> {"runtime", "results"}`."""

    module: str
    generate: str
    profile: str


class Target(ABC):
    """One deployment target. Subclass, fill the class attributes, implement the methods, `@register`."""

    name: ClassVar[str]
    title: ClassVar[str | None] = None  # how messages name it ("ONNX": "an ONNX bundle"); None: its name
    description: ClassVar[str]
    lowering_module: ClassVar[str]  # the package under deltaship/lowering/ whose lower() writes the artifact
    Options: ClassVar[type[TargetOptions]] = TargetOptions
    default_prefill_chunk: ClassVar[int] = DEFAULT_PREFILL_CHUNK
    precisions: ClassVar[tuple[str, ...]] = PRECISIONS  # the precisions it builds (a subset of PRECISIONS)
    precision_note: ClassVar[str] = ""  # why the others are not built (the --precision refusal says it)
    tool_packages: ClassVar[tuple[str, ...]] = ()  # the toolchain its export needs (import names)
    extra: ClassVar[str] = ""  # the pip extra that installs them: pip install "deltaship[<extra>]"
    usage: ClassVar[tuple[str, ...]] = ()  # how an app drives the artifact (goes into the manifest)
    pass_params: ClassVar[PassParams] = PassParams()  # fixed parameters this target's passes read
    tolerances: ClassVar[Mapping[str, Tolerance]]  # precision -> parity tolerance (see deltaship.targets.tolerances)
    formats: ClassVar[Mapping[str, StorageFormat]]  # precision -> how weights are stored
    runtime_base_bytes: ClassVar[int] = 0  # the runtime's own resident memory (planner)
    # resident bytes per byte of fp16 weights at its export's peak (planner; docs/results/export-memory.md)
    export_weight_factor: ClassVar[float] = 1.2
    # An NPU target's bundles hold this many graphs compiled into context binaries the NPU maps, each with its own
    # copy of the weights (qnn: decode and prefill); `plan` counts them and checks one against a tier's NPU limits
    # (devices/catalog.py NpuLimits). 0: the target does not run on an NPU.
    npu_graphs: ClassVar[int] = 0
    # Why the KV dtypes kv_cache_dtypes() leaves out are not built (the --kv-cache refusal says it)
    kv_cache_note: ClassVar[str] = "int8/int4 KV caches are not built for this target yet"
    providers: ClassVar[tuple[str, ...]] = ("cpu",)  # execution providers its sessions run on
    prepacks: ClassVar[bool] = False  # its own session takes prepack_cache (runtimes/onnx_prepack.py)
    runtimes: ClassVar[tuple[str, ...]] = ()  # runtimes that run its bundles (`--runtime`); the first is the default
    text_runtimes: ClassVar[Mapping[str, TextRuntime]] = {}  # runtimes that take text only (generate, profile)
    # The runtimes apps embed that deltaship's test suite runs this target's bundles in, with the versions
    # checked and how (goes into the manifest as `app_runtimes`).
    app_runtimes: ClassVar[Mapping[str, str]] = {}
    # The app platforms whose kits (deltaship app --platform) run its bundles: platform -> the runtime an app there
    # embeds (an `app_runtimes` key)
    app_platforms: ClassVar[Mapping[str, str]] = {}
    host_runtime: ClassVar[str | None] = None  # the package that runs its bundles on this host (profiling)
    op_breakdown: ClassVar[bool] = False  # its session times each op kind (Session.profile_ops)
    android_runner_args: ClassVar[str | None] = None  # default argument line of its Android runner binary
    # the module whose lower_vision() adds the vision tower (export --vision; generate --image); None: text only
    vision_module: ClassVar[str | None] = None
    # "module:Class": the runtimes' driver of its --vision bundles' image side (a deltaship.runtimes.vision
    # Multimodal) beside an open session (open_multimodal); None: its bundles take no images
    multimodal_session: ClassVar[str | None] = None
    # the precisions `export --vision` builds and verifies (tower, splice and multimodal decoder at the text
    # decoder's activation dtype)
    vision_precisions: ClassVar[tuple[str, ...]] = ("fp32",)

    # ---- options -------------------------------------------------------------------------------
    def parse_options(self, given: Mapping[str, Any]) -> TargetOptions:
        """Typed options from `export()` keyword arguments, each checked against its allowed values."""
        values = {}
        for f in self.Options.fields():
            if f.name not in given:
                continue
            value = given[f.name]
            choices = f.metadata.get("choices")
            if choices is not None and value is not None and value not in choices:
                raise DeltashipError(
                    f"{flag(f.name)} must be {_one_of(choices)}, got {value!r}",
                    f"pass one of {_one_of(choices)} (default {f.default})",
                )
            values[f.name] = value
        return self.Options(**values)

    def typed_options(self, options: TargetOptions | Mapping[str, Any] | None) -> TargetOptions:
        """`options` as this target's typed options (None or a mapping of export() keyword arguments: parsed)."""
        return options if isinstance(options, TargetOptions) else self.parse_options(options or {})

    def require_tools(self, packages: tuple[str, ...] | None = None) -> None:
        """Refuse, naming the pip extra, when a package of this target's toolchain is not installed."""

        missing = [p for p in (packages or self.tool_packages) if importlib.util.find_spec(p) is None]
        if missing:
            raise DeltashipError(
                f"the {self.name} target needs {', '.join(missing)}, which is not installed",
                f'pip install "deltaship[{self.extra}]"',
            )

    def check(self, precision: str, max_context: int, prefill_chunk: int, options: TargetOptions) -> None:
        """Option combinations this target cannot build (raise DeltashipError); called before any work."""

    # ---- export --------------------------------------------------------------------------------
    def activation_dtype(self, precision: str, options: TargetOptions | None = None) -> str:
        """The dtype activations and float weights are computed in: fp16 for fp16 builds, fp32 otherwise
        (quantized builds keep fp32 activations unless the target says otherwise). options None: the defaults."""
        return "float16" if precision == "fp16" else "float32"

    def kv_cache_dtypes(self, precision: str, options: TargetOptions | None = None) -> tuple[str, ...]:
        """The KV-cache dtypes (deltaship.models.spec.KV_DTYPES names) this target exports at `precision`, its
        default first: the activation dtype, unless the target overrides this with quantized caches."""
        return ({"float32": "fp32", "float16": "fp16"}[self.activation_dtype(precision, options)],)

    @abstractmethod
    def pipeline(self) -> tuple:
        """The ordered export passes, explicitly (deltaship.lowering.passes and the target's own)."""

    def lower(
        self,
        ctx: "ExportContext",
        weights: Any,
        out_dir: Path,
        progress: Callable[[str], None] | None = None,
        tokens: dict[str, Any] | None = None,
    ) -> Lowered:
        """Write the artifact files for the passes' result into out_dir, with `lowering_module`'s `lower()`, which
        returns the `Lowered`."""
        return importlib.import_module(self.lowering_module).lower(
            ctx, weights, out_dir, progress=progress, tokens=tokens, **self.lowering_tools()
        )

    def lowering_tools(self) -> dict[str, Any]:
        """Keyword arguments for `lowering_module`'s `lower()` from the layers beside the lowering, which it does not
        import (e.g. a runtime's evaluator that reads a saved artifact back); none by default."""
        return {}

    def finish_bundle(self, bundle_dir: Path) -> None:
        """Adjust the bundle's copied files (tokenizer, configs) after the lowering; nothing by default."""

    @abstractmethod
    def io_inputs(self, ctx: "ExportContext") -> list[dict[str, Any]]:
        """The manifest's `inputs`: what an app feeds each call besides the states."""

    def io_outputs(self, ctx: "ExportContext") -> list[dict[str, Any]]:
        """The manifest's `outputs` besides the states."""
        return [
            {
                "name": "logits",
                "shape": [1, ctx.spec.vocab_size],
                "dtype": "float32",
                "kind": "logits",
                "doc": "logits after the last token of the call",
            }
        ]

    # ---- run -----------------------------------------------------------------------------------
    @abstractmethod
    def open_session(
        self,
        bundle: Path,
        manifest: dict[str, Any],
        *,
        threads: int | None = None,
        prefill_chunk: int | None = None,
        provider: str = "cpu",
        runtime: str | None = None,
        **options: Any,
    ) -> "Session":
        """A session over one of this target's bundles in `runtime` (one of `runtimes`; None: the first)."""

    def load_runtime(self) -> str | None:
        """Import the libraries deltaship's own session for this target loads before it opens any bundle, when an
        app does not load them (ExecuTorch's pybindings load torch): `profile` measures its process up to here as
        the host driver's part of the plan. Returns a path fragment naming the runtime's own shared objects (an app
        links those too); None: nothing of the host's to load."""
        return None

    def open_multimodal(self, session: "Session") -> "Multimodal":
        """Image + text generation beside `session`, an open session of one of this target's bundles (refused,
        with the fix, when the bundle has no vision tower)."""
        if self.multimodal_session is None:
            raise DeltashipError(
                f"{self.name} bundles take no images (the {self.name} target has no vision tower export)",
                "export with a target that takes --vision (deltaship export --help), or drop --image/--video",
            )
        module, _, cls = self.multimodal_session.partition(":")
        return getattr(importlib.import_module(module), cls)(session)

    def artifact_problems(self, bundle: Path, manifest: dict[str, Any]) -> list[str]:
        """Where the artifact itself (its inputs, outputs and states, the files it reads) disagrees with the
        manifest, for a bundle whose files passed the hash check; empty when they agree or when the target
        reads nothing cheaply. Raises a DeltashipError for a file it would read outside the bundle."""
        return []

    # ---- plan ----------------------------------------------------------------------------------
    def storage_format(self, precision: str) -> StorageFormat:
        return self.formats[precision]

    def kv_scratch_bytes_per_token(self, spec, kv_dtype: str) -> int:
        """Scratch the runtime's attention kernel holds per context token and per intra-op thread, beyond the
        KV cache itself, when the cache is of `kv_dtype` (memory that grows with the context, so the planner
        and the manifest's arithmetic must count it). None by default."""
        return 0
