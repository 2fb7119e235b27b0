"""Static-shape ONNX graphs for Qualcomm's QNN HTP backend (onnxruntime-qnn); see docs/npu.md.

Not a registered target yet: the decode graph is built and checked on the HTP simulator, prefill is not."""
