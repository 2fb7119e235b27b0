"""The qnn target's lowering: static-shape ONNX graphs for Qualcomm's QNN HTP backend (onnxruntime-qnn); see
docs/npu.md. passes.py captures the model for 1 token and for the prefill chunk, lowering.py is the op table (the
ONNX target's, with the stateful ops rewritten), model.py writes decode.onnx + prefill.onnx, context.py compiles them
into EPContext models for a SoC (soc.py)."""
