"""The ExecuTorch target: a stateful .pte (XNNPACK) for phones, quantized with torchao.

Lowering: deltaship/lowering/executorch; session: deltaship/runtimes/executorch.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltaship.runtimes.executorch import ExecuTorchSession
from deltaship.runtimes.executorch import runtime as executorch_runtime
from deltaship.runtimes.executorch_contract import program_problems
from deltaship.targets.base import (
    StorageFormat,
    Target,
    TargetOptions,
    TextRuntime,
    draft_vocab_field,
    draft_vocab_text_field,
    option,
)
from deltaship.targets.registry import register
from deltaship.targets.tolerances import Tolerance


@dataclass(frozen=True)
class ExecuTorchOptions(TargetOptions):
    allow_portable_fallback: bool = field(
        default=False, metadata=option("accept nodes XNNPACK does not take (they run as portable kernels)")
    )
    mtp: bool = field(
        default=False,
        metadata=option(
            "export the checkpoint's multi-token-prediction head as the program's method 'mtp_draft', and a method "
            "'verify' (every row's logits), for `generate --speculative mtp`",
        ),
    )
    mtp_draft_vocab: str = draft_vocab_field()
    mtp_draft_vocab_text: str | None = draft_vocab_text_field()


@register
class ExecuTorchTarget(Target):
    name = "executorch"
    title = "ExecuTorch"
    description = "model.pte for the ExecuTorch runtime (XNNPACK), state held in the program"
    lowering_module = "deltaship.lowering.executorch.program"
    Options = ExecuTorchOptions
    tool_packages = ("executorch", "torchao")
    extra = "executorch"
    usage = (
        "Load model.pte with the ExecuTorch runtime (XNNPACK backend). The kernel libraries it needs are listed in "
        "manifest lowering.runtime_requirements: in Python import executorch.extension.llm.custom_ops.custom_ops "
        "(llama:: ops) and, for int8/int4 programs, executorch.kernels.quantized; in C++ link whole-archive "
        "executorch, custom_ops, xnnpack_backend, optimized_native_cpu_ops_lib and, for int8/int4, quantized_ops_lib "
        "(+ quantized_kernels); the Android AAR org.pytorch:executorch-android has them all; on iOS add the "
        "frameworks executorch, executorch_llm, backend_xnnpack, kernels_llm, kernels_optimized (+ kernels_quantized "
        "for int8/int4) with -all_load.",
        "ExecuTorch's LLM runner (TextLLMRunner; Android LlmModule, iOS ExecuTorchLLMTextRunner) runs model.pte with "
        "tokenizer.json unmodified (temperature 0 for greedy; it adds no BOS unless asked, as deltaship): it feeds "
        "prompts in calls of get_max_seq_len (= prefill_chunk) tokens and checks only prompt < get_max_context_len "
        "(= max_context), so ask it for at most max_context - prompt + 1 new tokens: a position past the context "
        "fails in llama::update_cache.",
        "Method 'forward': tokens int64 [1, T] (T = 1 .. prefill_chunk) and input_pos int64 [1] = tokens already "
        "consumed (input_pos + T <= max_context); returns float32 logits [1, vocab] of the last token.",
        "All state lives in the program (mutable buffers). Calling forward with input_pos 0 starts a new sequence: "
        "the DeltaNet state is discarded in the graph, so rewinding the position is a complete reset.",
        "Metadata methods: get_max_seq_len, get_max_context_len, get_vocab_size, get_bos_id, get_eos_ids, "
        "get_n_layers, use_kv_cache, use_sdpa_with_kv_cache, enable_dynamic_shape.",
    )
    # XNNPACK: int8/int4 are torchao 8da8w / 8da4w, i.e. int8 dynamic activations.
    tolerances = {
        "fp32": Tolerance(1e-3, 1.0, 1e-3, True),
        "fp16": Tolerance(0.15, 0.95, 0.05, False),
        "int8": Tolerance(2.0, 0.75, 0.1, False),
        "int4": Tolerance(2.0, 0.75, 0.1, False),
        # fp32 with a narrower KV cache, against the reference that rounds keys and values the same way (so what
        # is left is float order). The dequantization error per element, within the calibrated bound b of a
        # channel (static per-channel scales, deltaship/lowering/kv_quant.py; beyond b the value clips to b):
        # int8 |x - x'| <= b / 254 (scale / 2, scale = b / 127), as on ONNX; int4 |x - x'| <= b / 14 (scale / 2,
        # scale = b / 7); fp16 |x - x'| <= 2^-11 |x| (round to nearest, |x| < 65504). Measured on the trained tiny
        # preset against the same-rounding reference: int4 2.9e-6, fp16 3.2e-5 logit std; against the unrounded
        # fp32 reference, KL 3.4e-3 (int4) and 1.5e-8 (fp16).
        "fp32+kv-int8": Tolerance(0.25, 0.95, 0.05, True),
        "fp32+kv-int4": Tolerance(0.5, 0.9, 0.1, False),
        "fp32+kv-fp16": Tolerance(1e-3, 1.0, 1e-3, True),
    }
    formats = {  # a tied head is stored twice when quantized: a 4/8-bit gather table and the matmul weight
        "fp32": StorageFormat(bits=32, scale=0, block=1, head_copy=False, act=4),
        "fp16": StorageFormat(bits=16, scale=0, block=1, head_copy=False, act=2),
        "int8": StorageFormat(bits=8, scale=4, block=4096, head_copy=True, act=4),
        "int4": StorageFormat(bits=4, scale=4, block=32, head_copy=True, act=4),
    }
    runtimes = ("executorch",)
    vision_module = "deltaship.lowering.executorch.vision"  # vision.pte + decoder_mm.pte (export --vision)
    multimodal_session = "deltaship.runtimes.vision:ExecuTorchMultimodal"  # generate --image beside its session
    vision_precisions = ("fp32", "fp16")
    # ExecuTorch's C++ LLM runner (TextLLMRunner: what the Android LlmModule and the iOS runner wrap), text in/out
    text_runtimes = {
        "et-runner": TextRuntime("deltaship.runtimes.et_runner", "generate_with_runner", "profile_with_runner")
    }
    app_runtimes = {
        "executorch": "1.5.1 (Python runtime, XNNPACK): export-time verification against transformers",
        "executorch TextLLMRunner": "1.5.1 (its Python binding of the C++ runner the Android/iOS LLM APIs wrap): "
        "same greedy text, prompts shorter and longer than a chunk (tests/test_et_runner.py)",
        "executorch-android": "not run (no Android device): the Kotlin kit's names are checked against the program",
    }
    app_platforms = {"android": "executorch-android"}  # the kits that run its bundles (deltaship app)
    runtime_base_bytes = 48 << 20
    export_weight_factor = 1.15  # export peak per fp16 weight byte: the quantized program + XNNPACK's copy
    kv_cache_note = (
        "fp16, int8 and int4 caches (int8/int4 with static scales) are built with fp32 activations (not "
        "--precision fp16), and ExecuTorch's own dynamic per-token cache (llama::custom_quantized_sdpa, scales "
        "and zero points as extra states) is not wired in"
    )
    host_runtime = "executorch"
    android_runner_args = (
        "--model_path {model} --seq_len {total} --prompt_tokens {prompt_length} "
        "--cpu_threads {threads}"
    )  # ExecuTorch's llama_main

    def kv_cache_dtypes(self, precision: str, options: TargetOptions | None = None) -> tuple[str, ...]:
        # fp16, int8 and int4 (packed) caches with fp32 activations: llama::update_cache of the stored values,
        # widened back to fp32 for custom_sdpa (deltaship/lowering/executorch/lowering.py store_kv / load_kv)
        own = super().kv_cache_dtypes(precision, options)
        return own + ("fp16", "int8", "int4") if own == ("fp32",) else own

    def pipeline(self) -> tuple:
        from deltaship.lowering import passes as p  # lazy: torch
        from deltaship.lowering.executorch.modules import XnnpackLayout

        # No projection fusion (XNNPACK cannot split a dynamic-length result) and no capture (export/executorch
        # captures the eager model with its real, quantized weights); XNNPACK's layer layout instead.
        return (
            p.LoadStructure(),
            p.FoldZeroCentredNorms(),
            p.RewriteDeltaNet(),
            p.StaticKVCache(),
            p.LastTokenLogits(),
            XnnpackLayout(),
            p.AssignPrecision(quantize=False),
        )

    def io_inputs(self, ctx) -> list[dict[str, Any]]:
        return [
            {
                "name": "tokens",
                "shape": [1, "tokens"],
                "dtype": "int64",
                "kind": "tokens",
                "doc": "1 to prefill_chunk token ids",
            },
            {
                "name": "input_pos",
                "shape": [1],
                "dtype": "int64",
                "kind": "position",
                "doc": "tokens already consumed; 0 starts a new sequence (resets the state in the graph)",
            },
        ]

    def artifact_problems(self, bundle: Path, manifest: dict[str, Any]) -> list[str]:
        return program_problems(bundle, manifest)

    def load_runtime(self) -> str | None:
        self.require_tools(("executorch",))
        executorch_runtime()  # torch, the pybindings and the kernel libraries
        return "/executorch/"

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
        self.require_tools(("executorch",))  # its runtime, with the pip extra named when missing

        return ExecuTorchSession(Path(bundle), manifest, threads=threads, prefill_chunk=prefill_chunk, **options)
