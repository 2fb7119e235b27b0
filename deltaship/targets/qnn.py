"""The qnn target: static-shape ONNX graphs (decode.onnx, prefill.onnx) whose every node runs on Qualcomm's QNN
HTP backend (the Snapdragon NPU), through onnxruntime-qnn with CPU fallback disabled.

Lowering: deltaship/lowering/qnn (on the ONNX target's lowerer); session: deltaship/runtimes/qnn.py. On x86-64
Linux the HTP backend is QNN's simulator: that is where export-time verification runs (docs/npu.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltaship.bundle.paths import beside, bundle_path
from deltaship.bundle.qnn_context import read_context_model
from deltaship.errors import DeltashipError
from deltaship.lowering.qnn.soc import DEFAULT_SOC, SOCS
from deltaship.runtimes.onnx_contract import graph_problems
from deltaship.runtimes.qnn import QnnSession
from deltaship.targets.base import StorageFormat, Target, TargetOptions, option
from deltaship.targets.registry import register
from deltaship.targets.tolerances import Tolerance

# Chunk 16 miscomputes on the HTP simulator (the recurrent state comes back as zeros part-way through the chunk;
# docs/npu.md), chunks 4 and 8 agree with ONNX Runtime's CPU provider on the same graph.
MAX_PREFILL_CHUNK = 8


@dataclass(frozen=True)
class QnnOptions(TargetOptions):
    qnn_soc: str = field(
        default=DEFAULT_SOC,
        metadata=option(
            "the Snapdragon SoC the graphs are opened (and verified) for: "
            + ", ".join(f"{s.name} = {s.chip} {s.marketing} (HTP v{s.htp_arch})" for s in SOCS.values()),
            choices=tuple(SOCS),
        ),
    )
    qnn_context: bool = field(
        default=False,
        metadata=option(
            "also compile each graph ahead of time for --qnn-soc into an EPContext model (<graph>_<soc>_ctx.onnx "
            "and its QNN context binary, what an app ships so the phone does not compile at first launch); "
            "sessions then open the compiled contexts"
        ),
    )


@register
class QnnTarget(Target):
    name = "qnn"
    title = "QNN"
    description = "decode.onnx + prefill.onnx, static shapes, every node on Qualcomm's QNN HTP (NPU)"
    lowering_module = "deltaship.lowering.qnn.model"
    Options = QnnOptions
    precisions = ("fp16",)
    precision_note = "QDQ (quantized) weights for the HTP are not built yet; fp32 is not what the HTP computes in"
    default_prefill_chunk = MAX_PREFILL_CHUNK
    tool_packages = ("onnx", "onnxruntime", "onnxruntime_qnn")
    extra = "qnn"
    usage = (
        "Open decode.onnx and prefill.onnx with ONNX Runtime and the onnxruntime-qnn execution provider "
        "(lowering.provider_options, with backend_path the QNN HTP library; session option "
        "session.disable_cpu_ep_fallback = 1): every node runs on the HTP.",
        "Each call: input_ids int64 [1, T] with T = 1 (decode.onnx) or T = prefill_chunk (prefill.onnx), position "
        "int64 [1] = the tokens the state already holds; logits float32 [1, vocab] are for the call's last token.",
        "Feed a prompt in whole chunks of prefill_chunk tokens through prefill.onnx, the rest one token a call "
        "through decode.onnx (no padding). position + T must stay <= max_context (the static KV buffers).",
        "Feed every state input 'past.L.kind' the output 'present.L.kind' of the previous call; start from zeros "
        "and zero them again to reset.",
    )
    # The HTP computes in fp16 (enable_htp_fp16_precision) with fp32 recurrent states and attention scores. Measured
    # at export on the tiny preset (prompts of 1, 7 and 11 tokens + 8 teacher-forced steps, prefill chunk 8, max
    # context 64, SoC 8elite, the HTP simulator): max |logit diff| 0.0097 of the logit std (0.033 absolute) against
    # the fp32 reference with the bundle's fp16 weights. 0.05 leaves 5x; the chunk-16 miscompute (docs/npu.md) was
    # 4.4 absolute. Not fails_export, as the other fp16 rows: the record says failed and the bundle is written.
    tolerances = {"fp16": Tolerance(0.05, 0.95, 0.05, False)}
    formats = {"fp16": StorageFormat(bits=16, scale=0, block=1, head_copy=False, act=2)}
    runtime_base_bytes = 96 << 20
    # export_weight_factor: the base's default, not measured for this target yet (docs/npu.md, What is left)
    npu_graphs = 2  # decode and prefill, each compiled into a context binary holding the weights
    runtimes = ("onnxruntime-qnn",)
    app_runtimes = {
        "onnxruntime-qnn": "2.7.0 over onnxruntime 1.31 (Python, x86-64 Linux: QNN's HTP simulator, CPU fallback "
        "disabled): export-time verification against transformers; greedy tokens equal the fp32 ONNX bundle's "
        "(tests/test_qnn.py)",
        "onnxruntime-android-qnn": "com.microsoft.onnxruntime:onnxruntime-android-qnn 1.29.0 (the Kotlin kit, "
        "deltaship app --platform android): not compiled or run (no Android SDK, no Snapdragon device); its names, "
        "shapes, dtypes and QNN options are checked against the graphs and its loop replayed in Python on the HTP "
        "simulator (tests/test_qnn_kit.py)",
    }
    app_platforms = {"android": "onnxruntime-android-qnn"}  # the kits that run its bundles (deltaship app)
    host_runtime = None  # the HTP here is a simulator: its speed is not a device's (profile refuses)

    def check(self, precision: str, max_context: int, prefill_chunk: int, options: TargetOptions) -> None:
        if prefill_chunk > MAX_PREFILL_CHUNK:
            raise DeltashipError(
                f"--prefill-chunk {prefill_chunk}: the qnn target builds prefill graphs of at most "
                f"{MAX_PREFILL_CHUNK} tokens (at 16 the QNN HTP simulator miscomputes the unrolled recurrence; "
                "docs/npu.md)",
                f"pass --prefill-chunk {MAX_PREFILL_CHUNK} or less (the default is {MAX_PREFILL_CHUNK})",
            )

    def pipeline(self) -> tuple:
        from deltaship.lowering import passes as p  # lazy: torch
        from deltaship.lowering.qnn.passes import CaptureStatic

        return p.graph_passes(CaptureStatic())

    def io_inputs(self, ctx) -> list[dict[str, Any]]:
        return [
            {
                "name": "input_ids",
                "shape": [1, "tokens"],
                "dtype": "int64",
                "kind": "tokens",
                "doc": "1 token (decode.onnx) or prefill_chunk tokens (prefill.onnx)",
            },
            {
                "name": "position",
                "shape": [1],
                "dtype": "int64",
                "kind": "position",
                "doc": "the tokens the state already holds (the call's first position)",
            },
        ]

    def artifact_problems(self, bundle: Path, manifest: dict[str, Any]) -> list[str]:
        graphs = manifest.get("lowering", {}).get("graphs")
        if not isinstance(graphs, dict) or not graphs:
            return ["lowering.graphs: a qnn bundle's manifest names its graphs there"]
        # each graph's inputs, outputs and states against the manifest's, every graph file read once
        problems = graph_problems(bundle, manifest, entries=[g["file"] for g in graphs.values()])
        context = manifest.get("lowering", {}).get("context") or {}
        for key, made in context.items():  # onnxruntime-qnn opens the binaries an EPContext model names beside it
            field = f"lowering.context.{key}.model"
            model = read_context_model(bundle_path(bundle, manifest, made["model"], field))
            for binary in model.binaries:
                beside(bundle, manifest, made["model"], binary, f"{made['model']} (its EPContext binary)")
        return problems

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
        self.require_tools(("onnxruntime", "onnxruntime_qnn"))  # its runtime, with the pip extra named when missing
        return QnnSession(Path(bundle), manifest, prefill_chunk=prefill_chunk, **options)
