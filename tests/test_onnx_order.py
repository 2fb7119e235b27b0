"""The decoder graph's node order (deltaship/bundle/node_order.py): written in the order ONNX Runtime's own walk
gives, so that the runtime's default execution order writes each layer's state outputs as it leaves the layer instead
of keeping every layer's chunk-sized tensors alive to the end of the call (docs/results/memory.md)."""

from __future__ import annotations

import onnx
import onnxruntime as ort

from deltaship.bundle.node_order import runtime_order
from deltaship.bundle.reader import read_manifest


def _bundle(shared_export):
    return shared_export("memory-plan-tiny-onnx-int4", "qwen3.5-tiny", target="onnx", precision="int4", verify=False)


def test_runtime_order_is_onnxruntimes_own(shared_export, tmp_path):
    """The walk runtime_order emulates is ONNX Runtime's: the graph it saves at ORT_DISABLE_ALL (no node changed)
    with its initializers in a file apart has its nodes in its topological order, which is runtime_order's. (Saved
    with the initializers inline, the nodes come in another order from the sixth on: that path does not walk.)"""
    bundle = _bundle(shared_export)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.optimized_model_filepath = str(tmp_path / "saved.onnx")
    opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", "saved.onnx.data")
    ort.InferenceSession(str(bundle / "model.onnx"), opts, providers=["CPUExecutionProvider"])
    ours = onnx.load(str(bundle / "model.onnx"), load_external_data=False).graph.node
    saved = onnx.load(str(tmp_path / "saved.onnx"), load_external_data=False).graph.node
    assert len(saved) == len(ours) > 100
    assert [n.name for n in saved] == [ours[i].name for i in runtime_order(ours)]


def test_the_runtime_writes_every_state_before_the_lm_head(shared_export):
    """In the order ONNX Runtime runs the exported graph, every state output is written before the LM head runs:
    each layer's inputs to its new states die with the layer, not at the end of the call."""
    bundle = _bundle(shared_export)
    nodes = onnx.load(str(bundle / "model.onnx"), load_external_data=False).graph.node
    ran = [nodes[i] for i in runtime_order(nodes)]
    at = {out: k for k, n in enumerate(ran) for out in n.output}
    states = [s["output"] for s in read_manifest(bundle)["states"]]
    head = max(at["logits"], *(k for k, n in enumerate(ran) if n.op_type == "MatMulNBits"))  # the LM head: the last
    assert len(states) > 4 and all(at[s] < head for s in states), sorted((at[s], s) for s in states)[-3:]
    # layer by layer: the states are written in the order of their layers
    assert [at[s] for s in states] == sorted(at[s] for s in states)
