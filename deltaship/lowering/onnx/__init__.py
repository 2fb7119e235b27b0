"""The ONNX target's lowering: the captured program -> model.onnx for ONNX Runtime (CPU, CUDA), as
onnxruntime-genai, onnxruntime-web/-node and onnxruntime-android drive it.

`model.py` writes the model (`lower`, the graph's I/O contract, which states may share a buffer),
`lowering.py` lowers each captured op, `builder.py` streams weights into the graph (int8/int4 packing:
deltaship/quant.py), `genai.py` writes genai_config.json.
"""
