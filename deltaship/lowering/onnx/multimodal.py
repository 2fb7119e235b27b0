"""The ONNX target's --vision lowering: the graphs of export/onnx/vision.py, with decoder_mm.onnx (model.onnx
rewritten there) given onnxruntime-genai's multimodal decoder inputs, and genai_config.json rewritten for genai's
`qwen3_5` type (with its image processor's processor_config.json), so that onnxruntime-genai runs image + text
prompts on the same files deltaship's own driver (runtimes/vision.py) does.

model.onnx takes genai's sequence-length pair (current_sequence_length, past_sequence_length) so that genai's
prefill and decode calls get ONNX Runtime memory patterns of their own (export/onnx/model.py _genai_io); the
multimodal decoder takes attention_mask [1, p + T] (the start position from its length) and the 3-row M-RoPE
position_ids [3, 1, T], the inputs genai's Qwen VL position code feeds (export/onnx/model.py multimodal_io)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deltaship.errors import DeltashipError
from deltaship.lowering.onnx import vision
from deltaship.lowering.onnx.genai import GENAI_CONFIG, PROCESSOR_CONFIG, multimodal_genai_config, processor_config
from deltaship.lowering.onnx.model import multimodal_io
from deltaship.models.vision import Preprocessor, VisionSpec


def lower_vision(bundle: Path, source, ctx, pipeline: tuple) -> dict[str, Any]:
    """`pipeline`: the target's passes (unused here: the ONNX decoder_mm.onnx is derived from model.onnx)."""
    if ctx.options.onnx_cuda_graph:
        raise DeltashipError(
            "--onnx-cuda-graph rewrites the text decoder only; decoder_mm.onnx (--vision) is derived from the "
            "plain graph",
            "drop one of --onnx-cuda-graph and --vision",
        )
    block = vision.lower_vision(bundle, source, ctx)
    multimodal_io(bundle / vision.DECODER_FILE, vision.ROPE_INPUT)
    pre = Preprocessor.from_config(json.loads((bundle / block["preprocessor"]).read_text()))
    (bundle / PROCESSOR_CONFIG).write_text(json.dumps(processor_config(pre), indent=2) + "\n")
    if not (bundle / GENAI_CONFIG).is_file():  # no EOS id: no genai config (the manifest's app_runtimes says why)
        return block
    text = json.loads((bundle / GENAI_CONFIG).read_text())
    cfg = multimodal_genai_config(text, VisionSpec(**block["spec"]), block["graphs"])
    (bundle / GENAI_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    block["genai"] = {"config": GENAI_CONFIG, "type": cfg["model"]["type"], "processor": PROCESSOR_CONFIG}
    return block
