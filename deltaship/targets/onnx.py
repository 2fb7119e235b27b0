"""The ONNX target: model.onnx for ONNX Runtime (CPU and CUDA execution providers).

Lowering: deltaship/lowering/onnx; session: deltaship/runtimes/onnx.py."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltaship.errors import DeltashipError, DeltashipUnavailable
from deltaship.lowering.onnx.genai import adapt_tokenizer_config
from deltaship.runtimes.genai import GenaiSession
from deltaship.runtimes.onnx import OnnxSession
from deltaship.runtimes.onnx_contract import graph_problems
from deltaship.runtimes.ort_worker import ENV, RemoteOnnxSession, required_onnxruntime, version_tuple
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
    mtp: bool = field(
        default=False,
        metadata=option(
            "export the checkpoint's multi-token-prediction head (mtp.onnx) and a decoder that verifies drafts, for "
            "`generate --speculative mtp`",
        ),
    )
    mtp_draft_vocab: str = draft_vocab_field()
    mtp_draft_vocab_text: str | None = draft_vocab_text_field()
    onnx_cuda_graph: bool = field(
        default=False,
        metadata=option(
            "a decoder whose one-token call ONNX Runtime's CUDA provider can capture as a CUDA graph "
            "(`generate --provider cuda --cuda-graph`): GroupQueryAttention's sequence lengths computed on the "
            "device, total_sequence_length fixed at --max-context; with --precision fp16 or --onnx-activations fp16",
        ),
    )
    external_data: bool = field(
        default=False, metadata=option("write the weights to model.onnx.data even when the model is under 2 GB")
    )
    onnx_opset: int = field(
        default=21,
        metadata=option(
            "ONNX opset: 21 (ONNX Runtime >= 1.30), or 27 to write DeltaNet as the standard ai.onnx "
            "LinearAttention and CausalConvWithState ops (onnx 1.23; needs ONNX Runtime >= 1.32; conv states "
            "channels first [1, C, K-1])",
            choices=(21, 27),
        ),
    )


@register
class OnnxTarget(Target):
    name = "onnx"
    title = "ONNX"
    description = "model.onnx for ONNX Runtime (CPU, CUDA)"
    lowering_module = "deltaship.lowering.onnx.model"
    Options = OnnxOptions
    prepacks = True
    tool_packages = ("onnx", "onnxruntime")
    extra = "onnx"
    usage = (
        "Open model.onnx with ONNX Runtime (com.microsoft contrib ops: CPU and CUDA execution providers).",
        "Each call: input_ids int64 [1, T] (T = 1 .. prefill_chunk; 1 to decode), current_sequence_length int32 [1] "
        "= p + T and past_sequence_length int32 [1, 1] = p + T - 1, where p is the number of tokens the state already "
        "holds (onnxruntime-genai's pair; the graph takes p = current_sequence_length - T and does not read "
        "past_sequence_length).",
        "Feed every state input 'past.L.kind' the output 'present.L.kind' of the previous call; start from zeros "
        "and zero them again to reset.",
        "KV-cache states hold max_context positions; GroupQueryAttention writes the new positions in place, so "
        "present.L.key/value may be bound to the same buffer as past.L.key/value (IOBinding).",
        "A state whose entry lists 'in_place' execution providers may share one buffer between past and present "
        "on them (IOBinding); elsewhere give present its own buffer and swap the two after each call.",
        "logits float32 [1, 1, vocab] are for the last token of the call.",
        "onnxruntime-genai runs the bundle as it is: og.Model(bundle_dir) reads genai_config.json.",
        "A bundle whose lowering.opset is 27 writes DeltaNet in the standard ai.onnx LinearAttention and "
        "CausalConvWithState ops and needs ONNX Runtime >= 1.32 (lowering.runtime_requirements); its conv states "
        "are channels first, [1, C, K-1] (states[].layout).",
    )
    tolerances = {
        "fp32": Tolerance(1e-3, 1.0, 1e-3, True),
        "fp16": Tolerance(0.15, 0.95, 0.05, False),
        # MatMulNBits at accuracy_level 4 quantizes activations to int8 blocks: that noise, not the
        # weights, is what these bounds cover (with --accuracy-level 0 the fp32 row applies).
        "int8": Tolerance(2.0, 0.75, 0.1, False),
        "int4": Tolerance(2.0, 0.75, 0.1, False),
        # fp32 with an int8/int4 KV cache (static per-channel scales, deltaship/lowering/kv_quant.py), against the
        # reference that rounds keys and values with the same scales: what is left is an element whose
        # rounding flips with the float order (one scale step), which a random-weights model amplifies (0.12
        # measured on tests' odd_heads checkpoint; 0.0024 on the trained tiny model).
        "fp32+kv-int8": Tolerance(0.25, 0.95, 0.05, True),
        "fp32+kv-int4": Tolerance(0.5, 0.9, 0.1, False),
    }
    formats = {  # the int8/int4 gather and MatMulNBits share one table
        "fp32": StorageFormat(bits=32, scale=0, block=1, head_copy=False, act=4),
        "fp16": StorageFormat(bits=16, scale=0, block=1, head_copy=False, act=2),
        "int8": StorageFormat(bits=8, scale=4, block=32, head_copy=False, act=4),
        "int4": StorageFormat(bits=4, scale=4, block=32, head_copy=False, act=4),
    }
    runtime_base_bytes = 96 << 20
    export_weight_factor = 0.07  # export peak per fp16 weight byte: the weights stream tensor by tensor
    kv_cache_note = (
        "int8/int4 KV caches (GroupQueryAttention's quantized cache) are built with fp32 activations only "
        "(--precision fp32, or int8/int4 weights without --onnx-activations fp16)"
    )
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
    # the kits that run its bundles (deltaship app)
    app_platforms = {"android": "onnxruntime-android", "web": "onnxruntime-web", "desktop": "onnxruntime-node"}
    host_runtime = "onnxruntime"

    def kv_scratch_bytes_per_token(self, spec, kv_dtype: str) -> int:
        # ONNX Runtime's CPU GroupQueryAttention computes in fp32: with an fp16 cache, each worker thread converts
        # the K (then the V) rows of the KV head it attends into an fp32 buffer of head_dim x (T + context) floats
        # (contrib_ops/cpu/bert/gqa_attention_base.h, ComputeAttentionProbs / ComputeVxAttentionScore), which
        # ORT's arena keeps. Measured at 0.8B, 2 threads: RSS growth 1.16-1.18x the fp16 cache alone at 128K-262K,
        # 1 + 2 x 4 x 256 / 12,288 = 1.167 predicted (docs/results/longctx.md). fp32 caches are read in place,
        # and int8/int4 ones measured within 4% of their arithmetic at 128K-262K (no scratch of this size).
        return 4 * spec.head_dim if kv_dtype == "fp16" else 0

    op_breakdown = True  # ONNX Runtime's profiler
    android_runner_args = "-e cpu -x {threads} -r {reps} {model}"  # onnxruntime_perf_test
    vision_module = "deltaship.lowering.onnx.multimodal"  # vision.onnx, embedding.onnx, decoder_mm.onnx
    multimodal_session = "deltaship.runtimes.vision:OnnxMultimodal"  # generate --image beside its session
    vision_precisions = ("fp32", "fp16")

    def check(self, precision: str, max_context: int, prefill_chunk: int, options: OnnxOptions) -> None:
        if options.onnx_activations is not None and precision not in ("int8", "int4"):
            raise DeltashipError(
                f"--onnx-activations applies to int8/int4 weights (--precision {precision} already "
                f"sets the activations)",
                "drop --onnx-activations, or use --precision int8 or int4",
            )
        if options.onnx_opset == 27 and options.onnx_deltanet_ops == "contrib":
            raise DeltashipError(
                "--onnx-opset 27 writes DeltaNet in the standard LinearAttention/CausalConvWithState ops; "
                "--onnx-deltanet-ops contrib asks for ONNX Runtime's contrib ops instead",
                "drop one of --onnx-opset 27 and --onnx-deltanet-ops contrib",
            )
        if options.onnx_cuda_graph and precision != "fp16" and options.onnx_activations != "fp16":
            raise DeltashipError(
                "--onnx-cuda-graph is for ONNX Runtime's CUDA provider, whose GroupQueryAttention takes fp16 "
                f"activations only; --precision {precision} with fp32 activations runs attention on the CPU there",
                "use --precision fp16, or int8/int4 with --onnx-activations fp16",
            )
        if options.accuracy_level != 4 and precision not in ("int8", "int4"):
            raise DeltashipError(
                "--accuracy-level applies to ONNX int8/int4 bundles (MatMulNBits) only", "drop --accuracy-level"
            )

    def activation_dtype(self, precision: str, options: OnnxOptions | None = None) -> str:
        # quantized builds may ask for fp16 activations: ONNX Runtime's CUDA GroupQueryAttention takes fp16 only
        fp16 = precision == "fp16" or self.typed_options(options).onnx_activations == "fp16"
        return "float16" if fp16 else "float32"

    def kv_cache_dtypes(self, precision: str, options: OnnxOptions | None = None) -> tuple[str, ...]:
        # GroupQueryAttention's quantized cache (k/v_quant_type PER_CHANNEL, kv_cache_bit_width 8 or 4) runs
        # on the CPU EP of ONNX Runtime 1.31 with fp32 activations; with fp16 ones it was not checked.
        own = super().kv_cache_dtypes(precision, options)
        return own + ("int8", "int4") if own == ("fp32",) else own

    def pipeline(self) -> tuple:
        from deltaship.lowering import passes as p  # lazy: torch

        return p.graph_passes(p.Capture())

    def io_inputs(self, ctx) -> list[dict[str, Any]]:
        # lazy: torch
        from deltaship.lowering.onnx import model as impl  # the names live beside the lowering that writes them

        return impl.io_inputs(ctx)

    def io_outputs(self, ctx) -> list[dict[str, Any]]:
        from deltaship.lowering.onnx import model as impl  # lazy: torch

        return impl.io_outputs(ctx)

    def finish_bundle(self, bundle_dir: Path) -> None:
        adapt_tokenizer_config(bundle_dir)  # a tokenizer class onnxruntime-genai accepts

    def artifact_problems(self, bundle: Path, manifest: dict[str, Any]) -> list[str]:
        return graph_problems(bundle, manifest)

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
            return GenaiSession(Path(bundle), manifest, threads=threads, prefill_chunk=prefill_chunk)
        need_newer = _needs_newer_onnxruntime(manifest)
        if need_newer:
            if runtime == "genai" or not os.environ.get(ENV) or provider != "cpu" or options:
                raise DeltashipUnavailable(
                    f"{bundle}: this bundle needs onnxruntime >= {need_newer[0]} (lowering.opset "
                    f"{manifest['lowering'].get('opset')}); onnxruntime {need_newer[1]} is installed",
                    f"pip install 'onnxruntime>={need_newer[0]}', or set {ENV} to a Python that has it (CPU, "
                    "deltaship's own session only), or export without --onnx-opset 27",
                )
            return RemoteOnnxSession(
                os.environ[ENV], Path(bundle), manifest, threads=threads, prefill_chunk=prefill_chunk
            )

        return OnnxSession(
            Path(bundle), manifest, threads=threads, prefill_chunk=prefill_chunk, provider=provider, **options
        )


def _needs_newer_onnxruntime(manifest: dict[str, Any]) -> tuple[str, str] | None:
    """(required, installed) when the bundle names a newer onnxruntime than the installed one (opset 27)."""
    import onnxruntime  # lazy: onnxruntime

    need = required_onnxruntime(manifest)
    if need and version_tuple(onnxruntime.__version__) < version_tuple(need):
        return need, onnxruntime.__version__
    return None
