"""Graph fusions of the CUDA decoder (--onnx-cuda-graph): fewer nodes, so fewer kernels in a captured decode step.

A captured step costs about the same per kernel however small it is (docs/results/gpu.md), so these fold node
pairs into ONNX Runtime contrib ops that its CUDA provider runs as one kernel. They are a choice of the CUDA
lowering, recorded in the manifest (lowering.fusions), not of every bundle: the CPU bundles keep the graph the
apps' runtimes (onnxruntime-web, the QNN lowering built on this one) were checked with. The CPU provider runs the
fused ops too, which is how the tests check them.

skip_norm: the residual Add and the RMSNorm that reads it, `y = SimplifiedLayerNormalization(a + b, gamma)`, become
one SkipSimplifiedLayerNormalization(a, b, gamma) whose fourth output is the sum (the residual stream goes on from
it). Its inputs, gamma and output share one type: with fp16 activations and an fp32 gamma the norm's fp32 output
is cast back to fp16 by a Cast, which the fused op absorbs (gamma is stored again in fp16): three nodes become one.
It normalizes the unrounded fp32 sum, where the unfused graph normalizes the fp16-rounded one.
"""

from __future__ import annotations

import numpy as np
import onnx

from deltaship.lowering.onnx.builder import GraphBuilder

MS = "com.microsoft"


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def fuse_skip_norms(b: GraphBuilder) -> int:
    """Fold Add -> SimplifiedLayerNormalization (-> Cast to the Add's type) into SkipSimplifiedLayerNormalization,
    in place; return the number of nodes removed."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in b.nodes:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    graph_outputs = {o.name for o in b.outputs}
    dtype = {t.name: t.data_type for t in b.initializers}
    gone: set[int] = set()
    replace: dict[int, onnx.NodeProto] = {}
    fp16_gamma: dict[str, str] = {}
    removed = 0
    for k, add in enumerate(b.nodes):
        if add.op_type != "Add" or add.domain not in ("", "ai.onnx"):
            continue
        norms = [
            n
            for n in readers.get(add.output[0], [])
            if n.op_type == "SimplifiedLayerNormalization" and n.input[0] == add.output[0]
        ]
        if len(norms) != 1 or _attr(norms[0], "axis", -1) != -1 or norms[0].input[1] not in dtype:
            continue
        norm = norms[0]
        if len(norm.output) > 1 and any(norm.output[1:]):  # its inv_std_var is read: keep it as it is
            continue
        gamma, out, absorbed = norm.input[1], norm.output[0], [norm]
        users = readers.get(out, [])
        cast = users[0] if len(users) == 1 and users[0].op_type == "Cast" and out not in graph_outputs else None
        if (
            dtype[gamma] == onnx.TensorProto.FLOAT
            and cast is not None
            and _attr(cast, "to") == onnx.TensorProto.FLOAT16
        ):
            # fp16 activations around an fp32 norm: the fused op works in the Cast's type, gamma stored in fp16
            if gamma not in fp16_gamma:
                fp16_gamma[gamma] = b.weight(b.fresh(gamma + "_fp16"), b.read(gamma).astype(np.float16))
            gamma, out = fp16_gamma[gamma], cast.output[0]
            absorbed.append(cast)
        elif cast is not None and _attr(cast, "to") != dtype[gamma]:
            continue
        fused = onnx.helper.make_node(
            "SkipSimplifiedLayerNormalization",
            [add.input[0], add.input[1], gamma],
            [out, "", "", add.output[0]],
            name=b.fresh("n_SkipSimplifiedLayerNormalization"),
            domain=MS,
            epsilon=float(_attr(norm, "epsilon", 1e-5)),
        )
        # the fused node stands where the last absorbed node stood: every input is ready there; the sum's other
        # readers must come after it
        at = max(b.nodes.index(n) for n in absorbed)
        if any(b.nodes.index(n) < at for n in readers[add.output[0]] if n is not norm):
            continue
        replace[at] = fused
        gone.add(k)
        gone.update(b.nodes.index(n) for n in absorbed if b.nodes.index(n) != at)
        removed += len(absorbed)
    b.nodes[:] = [replace.get(i, n) for i, n in enumerate(b.nodes) if i not in gone]
    _drop_unread(b)
    return removed


def _drop_unread(b: GraphBuilder) -> None:
    """Initializers no node reads any more (an fp32 gamma stored again in fp16)."""
    read = {i for n in b.nodes for i in n.input}
    keep = [t for t in b.initializers if t.name in read]
    if len(keep) != len(b.initializers):
        b.initializers[:] = keep
        b._consts = {k: v for k, v in b._consts.items() if v in read}
