"""The ONNX target's --vision lowering: the graphs of export/onnx/vision.py, with decoder_mm.onnx (model.onnx
rewritten there) given back the multimodal decoder's position input, position_ids int64 [1, positions].

model.onnx takes onnxruntime-genai's sequence-length pair (current_sequence_length, past_sequence_length) so that
genai's prefill and decode calls get ONNX Runtime memory patterns of their own (export/onnx/model.py _genai_io);
the multimodal decoder keeps position_ids, beside its 3-row M-RoPE rope_position_ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deltaship.export.onnx import vision
from deltaship.export.onnx.model import position_ids_io


def lower_vision(bundle: Path, source, ctx) -> dict[str, Any]:
    block = vision.lower_vision(bundle, source, ctx)
    position_ids_io(bundle / vision.DECODER_FILE)
    return block
