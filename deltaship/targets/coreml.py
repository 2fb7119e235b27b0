"""The Core ML target: one stateful multifunction .mlpackage (iOS 18 / macOS 15).

Lowering: deltaship/lowering/coreml; sessions: deltaship/runtimes/coreml.py (Core ML on macOS, the MIL
evaluator of deltaship/runtimes/mil_eval.py elsewhere)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltaship.lowering.settings import PassParams
from deltaship.runtimes.coreml import open_coreml_session
from deltaship.runtimes.coreml_contract import package_problems
from deltaship.runtimes.mil_eval import package_constants
from deltaship.targets.base import (
    StorageFormat,
    Target,
    TargetOptions,
    draft_vocab_field,
    draft_vocab_text_field,
    option,
)
from deltaship.targets.registry import register
from deltaship.targets.tolerances import Tolerance


@dataclass(frozen=True)
class CoreMLOptions(TargetOptions):
    coreml_states: str = field(
        default="io",
        metadata=option(
            "DeltaNet states as fp32 inputs/outputs (io) or fp16 Core ML states (state)", choices=("io", "state")
        ),
    )
    coreml_palettize: int | None = field(
        default=None,
        metadata=option(
            "with --precision fp16: palettize weights to BITS-bit look-up tables",
            choices=(2, 3, 4, 6, 8),
            metavar="BITS",
        ),
    )
    mtp: bool = field(
        default=False,
        metadata=option(
            "export the checkpoint's multi-token-prediction head as the function 'mtp_draft', and functions "
            "'verify_T' (every row's logits and hidden states), for `generate --speculative mtp`",
        ),
    )
    mtp_draft_vocab: str = draft_vocab_field()
    mtp_draft_vocab_text: str | None = draft_vocab_text_field()
    coreml_part_gb: float = field(
        default=1.4,
        metadata=option("weights per .mlpackage in GB: larger models are split into consecutive layer ranges"),
    )


@register
class CoreMLTarget(Target):
    name = "coreml"
    title = "Core ML"
    description = "model.mlpackage for Core ML (iOS 18 / macOS 15): prefill and decode functions, MLState"
    lowering_module = "deltaship.lowering.coreml.package"
    Options = CoreMLOptions
    default_prefill_chunk = 64  # a fixed-shape prefill function; its recurrence is unrolled in chunks of 64
    tool_packages = ("coremltools",)
    extra = "coreml"
    # int8 per output channel, fp16 scales, blocks that divide each row (what Core ML's int4/int8 take)
    pass_params = PassParams(int8_block="channel", scale_dtype="float16", block_must_divide=True)
    usage = (
        "Load model.mlpackage with Core ML (iOS 18 / macOS 15): MLModel(configuration:) with functionName "
        "'prefill' or 'decode'; both share the weights and the states.",
        "prefill takes exactly prefill_chunk tokens, decode exactly one: feed full chunks to prefill and the rest "
        "of a prompt token by token to decode.",
        "Inputs: input_ids int32 [1, T], position int32 [1] = tokens already consumed.",
        "KV cache: Core ML states (make the state once with model.makeState() and pass it to every prediction of "
        "both functions); reset = a new state.",
        "DeltaNet states listed as kind 'deltanet_*' with mode 'io' are fp32 inputs 'past_L_kind' whose values come "
        "from the previous call's outputs 'present_L_kind' (zeros at the start and on reset).",
        "logits float32 [1, vocab] for the last token of the call.",
    )
    # Evaluated on Linux by interpreting the saved ML program: fp32 builds keep every state as fp32
    # inputs/outputs and must be exact; fp16 compute covers the rest.
    tolerances = {
        "fp32": Tolerance(1e-3, 1.0, 1e-3, True),
        "fp16": Tolerance(0.3, 0.9, 0.1, False),
        "int8": Tolerance(0.3, 0.9, 0.1, False),
        "int4": Tolerance(0.3, 0.9, 0.1, False),
    }
    formats = {  # Core ML computes in fp16 below fp32; quantized tied heads are stored twice
        "fp32": StorageFormat(bits=32, scale=0, block=1, head_copy=False, act=2),
        "fp16": StorageFormat(bits=16, scale=0, block=1, head_copy=False, act=2),
        "int8": StorageFormat(bits=8, scale=2, block=4096, head_copy=True, act=2),
        "int4": StorageFormat(bits=4, scale=2, block=32, head_copy=True, act=2),
    }
    vision_module = "deltaship.lowering.coreml.vision"  # multimodal.mlpackage (export --vision)
    multimodal_session = "deltaship.runtimes.vision:CoreMLMultimodal"  # generate --image beside its session
    runtimes = ("coreml",)
    app_runtimes = {
        "coreml": "not run (no Mac): the saved ML program is evaluated op by op on Linux against transformers; "
        "the Swift kit's names are checked against the package's spec",
    }
    app_platforms = {"ios": "coreml"}  # the kits that run its bundles (deltaship app)
    runtime_base_bytes = 128 << 20
    export_weight_factor = 0.7  # export peak per fp16 weight byte: the weights stream tensor by tensor
    kv_cache_note = (
        "Core ML states (ct.StateType) hold fp16 or fp32 tensors only, so an int8/int4 KV cache would need a "
        "quantize/dequantize of the whole cache around each call's state read and write, which is not built"
    )

    def check(self, precision: str, max_context: int, prefill_chunk: int, options: CoreMLOptions) -> None:
        from deltaship.lowering.coreml.package import check_options  # lazy: torch

        check_options(precision, max_context, prefill_chunk, options)

    def activation_dtype(self, precision: str, options: CoreMLOptions | None = None) -> str:
        return "float32" if precision == "fp32" else "float16"  # Core ML computes in fp16 below fp32

    def lowering_tools(self) -> dict[str, Any]:
        # the palettized build's matched reference reads the weights back from the saved package, with the runtimes'
        # evaluator (the lowering does not import the runtimes)
        return {"package_constants": package_constants}

    def pipeline(self) -> tuple:
        from deltaship.lowering import passes as p  # lazy: torch
        from deltaship.lowering.coreml.package import StaticCapture

        # Captured with static shapes, one program per package part and function.
        return p.graph_passes(StaticCapture())

    def io_inputs(self, ctx) -> list[dict[str, Any]]:
        return [
            {
                "name": "input_ids",
                "shape": [1, "T"],
                "dtype": "int32",
                "kind": "tokens",
                "doc": "prefill: exactly prefill_chunk tokens; decode: exactly 1",
            },
            {
                "name": "position",
                "shape": [1],
                "dtype": "int32",
                "kind": "position",
                "doc": "tokens already consumed by the state",
            },
        ]

    def artifact_problems(self, bundle: Path, manifest: dict[str, Any]) -> list[str]:
        return package_problems(bundle, manifest)

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
    ):
        self.require_tools(("coremltools",))  # its runtime, with the pip extra named when missing

        return open_coreml_session(Path(bundle), manifest, threads=threads, prefill_chunk=prefill_chunk, **options)
