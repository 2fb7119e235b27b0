"""Lowering: the checkpoint's module tree -> a target's artifact. `passes.py` rewrites the model (DeltaNet
into stateful recurrent ops, quantization), one package per target writes its artifact (onnx/, executorch/,
coreml/, qnn/ on onnx/), `lowerings.py` is the op table each fills. The orchestrator that calls these is
deltaship.compile (`deltaship.export()`); nothing here imports the runtimes, the registry or verification.
"""
