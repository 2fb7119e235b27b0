"""The ONNX target: model.onnx for ONNX Runtime (CPU and CUDA execution providers).

Lowering: deltaship/export/onnx; session: deltaship/runtimes/onnx.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltaship.errors import DeltashipError
from deltaship.targets import register
from deltaship.targets.base import StorageFormat, Target, TargetOptions, option
from deltaship.tolerances import Tolerance


@dataclass(frozen=True)
class OnnxOptions(TargetOptions):
    onnx_deltanet_ops: str = field(
        default="standard",
        metadata=option(
            "DeltaNet conv and output norm in standard ops (faster on ONNX Runtime's CPU) or ONNX Runtime's "
            "CausalConvWithState/GatedRMSNorm contrib ops",
            choices=("standard", "contrib"),
        ),
    )
    onnx_activations: str | None = field(
        default=None,
        metadata=option(
            "int8/int4 weights: activation dtype (fp32 when not given; fp16 for ONNX Runtime's CUDA provider, whose "
            "GroupQueryAttention takes fp16 only)",
            choices=("fp32", "fp16"),
        ),
    )
    accuracy_level: int = field(
        default=4,
        metadata=option(
            "int8/int4 weights (MatMulNBits): 4 = int8 activation blocks (fast), 0 = float activations",
            choices=(0, 1, 2, 3, 4),
        ),
    )
    external_data: bool = field(
        default=False, metadata=option("write the weights to model.onnx.data even when the model is under 2 GB")
    )


@register
class OnnxTarget(Target):
    name = "onnx"
    description = "model.onnx for ONNX Runtime (CPU, CUDA)"
    lowering_module = "deltaship.export.onnx.model"
    Options = OnnxOptions
    tool_packages = ("onnx", "onnxruntime")
    extra = "onnx"
    usage = (
        "Open model.onnx with ONNX Runtime (com.microsoft contrib ops: CPU and CUDA execution providers).",
        "Each call: input_ids int64 [1, T] (T = 1 .. prefill_chunk; 1 to decode) and position_ids int64 [1, T] = "
        "p, p+1, .., p+T-1 where p is the number of tokens the state already holds; the graph reads only element 0, "
        "so [1, 1] = [[p]] is enough (and lets ONNX Runtime keep separate memory patterns for prefill and decode).",
        "Feed every state input 'past.L.kind' the output 'present.L.kind' of the previous call; start from zeros "
        "and zero them again to reset.",
        "KV-cache states hold max_context positions; GroupQueryAttention writes the new positions in place, so "
        "present.L.key/value may be bound to the same buffer as past.L.key/value (IOBinding).",
        "A state whose entry lists 'in_place' execution providers may share one buffer between past and present "
        "on them (IOBinding); elsewhere give present its own buffer and swap the two after each call.",
        "logits float32 [1, 1, vocab] are for the last token of the call.",
        "onnxruntime-genai runs the bundle as it is: og.Model(bundle_dir) reads genai_config.json.",
    )
    tolerances = {
        "fp32": Tolerance(1e-3, 1.0, 1e-3, True),
        "fp16": Tolerance(0.15, 0.95, 0.05, False),
        # MatMulNBits at accuracy_level 4 quantizes activations to int8 blocks: that noise, not the
        # weights, is what these bounds cover (with --accuracy-level 0 the fp32 row applies).
        "int8": Tolerance(2.0, 0.75, 0.1, False),
        "int4": Tolerance(2.0, 0.75, 0.1, False),
    }
    formats = {  # the int8/int4 gather and MatMulNBits share one table
        "fp32": StorageFormat(bits=32, scale=0, block=1, head_copy=False, act=4),
        "fp16": StorageFormat(bits=16, scale=0, block=1, head_copy=False, act=2),
        "int8": StorageFormat(bits=8, scale=4, block=32, head_copy=False, act=4),
        "int4": StorageFormat(bits=4, scale=4, block=32, head_copy=False, act=4),
    }
    runtime_base_bytes = 96 << 20
    providers = ("cpu", "cuda")
    runtimes = ("onnxruntime", "genai")  # deltaship's IOBinding session; onnxruntime-genai, as apps embed it
    app_runtimes = {
        "onnxruntime": "1.31 (Python, CPU): export-time verification against transformers",
        "onnxruntime-genai": "0.18.0 (Python wheel, the C++ core of its Android/iOS packages): same greedy tokens "
        "(tests/test_genai.py)",
        "onnxruntime-node": "1.30.0: same greedy tokens with deltaship-runtime (tests/test_js.py)",
        "onnxruntime-web": "1.30.0, wasm and WebGPU (SwiftShader) in headless Chromium: same greedy tokens "
        "(tests/test_js.py)",
        "onnxruntime-android": "not run (no Android device): the Kotlin kit's names are checked against the graph",
    }
    host_runtime = "onnxruntime"
    op_breakdown = True  # ONNX Runtime's profiler
    android_runner_args = "-e cpu -x {threads} -r {reps} {model}"  # onnxruntime_perf_test
    vision_module = "deltaship.export.onnx.vision"  # vision.onnx, embedding.onnx, decoder_mm.onnx

    def check(self, precision: str, max_context: int, prefill_chunk: int, options: OnnxOptions) -> None:
        if options.onnx_activations is not None and precision not in ("int8", "int4"):
            raise DeltashipError(
                f"--onnx-activations applies to int8/int4 weights (--precision {precision} already "
                f"sets the activations)",
                "drop --onnx-activations, or use --precision int8 or int4",
            )
        if options.accuracy_level != 4 and precision not in ("int8", "int4"):
            raise DeltashipError(
                "--accuracy-level applies to ONNX int8/int4 bundles (MatMulNBits) only", "drop --accuracy-level"
            )

    def activation_dtype(self, precision: str, options) -> str:
        # quantized builds may ask for fp16 activations: ONNX Runtime's CUDA GroupQueryAttention takes fp16 only
        return "float16" if precision == "fp16" or options.get("onnx_activations") == "fp16" else "float32"

    def pipeline(self) -> tuple:
        from deltaship.export import passes as p

        return (
            p.LoadStructure(),
            p.FoldZeroCentredNorms(),
            p.RewriteDeltaNet(),
            p.StaticKVCache(),
            p.FuseProjections(),
            p.LastTokenLogits(),
            p.AssignPrecision(),
            p.Capture(),
        )

    def io_inputs(self, ctx) -> list[dict[str, Any]]:
        from deltaship.export.onnx import model as impl  # the names live beside the lowering that writes them

        return impl.io_inputs(ctx)

    def io_outputs(self, ctx) -> list[dict[str, Any]]:
        from deltaship.export.onnx import model as impl

        return impl.io_outputs(ctx)

    def finish_bundle(self, bundle_dir: Path) -> None:
        from deltaship.export.onnx.genai import adapt_tokenizer_config

        adapt_tokenizer_config(bundle_dir)  # a tokenizer class onnxruntime-genai accepts

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
        self.require_tools(("onnxruntime",))  # its runtime, with the pip extra named when missing
        if runtime == "genai":
            from deltaship.runtimes.genai import GenaiSession

            return GenaiSession(Path(bundle), manifest, threads=threads, prefill_chunk=prefill_chunk)
        from deltaship.runtimes.onnx import OnnxSession

        return OnnxSession(
            Path(bundle), manifest, threads=threads, prefill_chunk=prefill_chunk, provider=provider, **options
        )
