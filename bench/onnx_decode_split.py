"""Where an ONNX decode step's time goes, without the profiler's per-node cost.

    python bench/onnx_decode_split.py BUNDLE [--threads 2] [--steps 40]

ORT's profiler adds a few microseconds to every node, which at one token is as much as the small
nodes themselves cost (bench/ONNX_OPS.md's decode table is profiled). This measures, unprofiled:
1. one decode step of the bundle at context 128 (the session's own IOBinding path), with the
   DeltaNet recurrent state in one buffer (past == present, as the manifest allows on the CPU) and
   double-buffered;
2. the same MatMulNBits / MatMul nodes alone, with the bundle's weights, in one graph of independent
   nodes (the weight-streaming floor of the step);
3. the bundle's LinearAttention nodes alone at one token (their state traffic), both buffer modes;
4. the cost per node of a trivial op (200 chained Reshapes, then Muls on the hidden size).
Prints one JSON object: medians in ms.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from deltaship.runtimes.bundle import read_manifest
from deltaship.runtimes.onnx import OnnxSession, _options


def median_ms(fn, steps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts) * 1e3)


def session(model: onnx.ModelProto | bytes, threads: int, optimize: bool = True) -> ort.InferenceSession:
    so = _options(ort, threads, None)  # the options deltaship's own sessions use
    if not optimize:  # keep every node of a chain (ORT would fold repeated Reshapes into one)
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def decode_step(bundle: Path, threads: int, steps: int, in_place: bool) -> float:
    s = OnnxSession(bundle, read_manifest(bundle), threads=threads, in_place=in_place)
    s.reset()
    s.prefill(list(range(1, 129)))
    ids = np.array([5], dtype=np.int64)
    return median_ms(lambda: s._forward(ids), steps)


def matmuls_alone(model: onnx.ModelProto, threads: int, steps: int) -> tuple[float, int]:
    """Every weight matmul of the graph as an independent node fed a [1, 1, K] input."""
    g = model.graph
    init = {i.name: i for i in g.initializer}
    nodes, inputs, outputs, used = [], [], [], set()
    for i, n in enumerate(x for x in g.node if x.op_type in ("MatMulNBits", "MatMul") and x.input[1] in init):
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        k = attrs["K"] if n.op_type == "MatMulNBits" else init[n.input[1]].dims[0]
        inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [1, 1, k]))
        nodes.append(helper.make_node(n.op_type, [f"x{i}", *n.input[1:]], [f"y{i}"], domain=n.domain or None, **attrs))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
        used.update(n.input[1:])
    graph = helper.make_graph(nodes, "matmuls", inputs, outputs, [init[u] for u in used if u in init])
    m = helper.make_model(graph, opset_imports=list(model.opset_import))
    m.ir_version = model.ir_version
    s = session(m, threads)
    feeds = {i.name: np.random.default_rng(0).standard_normal(i.shape, dtype=np.float32) for i in s.get_inputs()}
    return median_ms(lambda: s.run(None, feeds), steps), len(nodes)


def linear_attention_alone(model: onnx.ModelProto, manifest: dict, threads: int, steps: int,
                           in_place: bool) -> tuple[float, int]:
    la = [n for n in model.graph.node if n.op_type == "LinearAttention"]
    attrs = {a.name: helper.get_attribute_value(a) for a in la[0].attribute}
    h = attrs["kv_num_heads"]
    _, _, dk, dv = next(s["shape"] for s in manifest["states"] if s["kind"] == "deltanet_recurrent")
    hq = attrs["q_num_heads"]
    shapes = {"q": [1, 1, hq * dk], "k": [1, 1, hq * dk], "v": [1, 1, h * dv], "s": [1, h, dk, dv], "g": [1, 1, h],
              "b": [1, 1, h]}
    node = helper.make_node("LinearAttention", list(shapes), ["o", "ns"], domain="com.microsoft", **attrs)
    graph = helper.make_graph([node], "la", [helper.make_tensor_value_info(k, TensorProto.FLOAT, v)
                                             for k, v in shapes.items()],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("o", "ns")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    s = session(m, threads)
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal(v, dtype=np.float32) * 0.1 for k, v in shapes.items() if k != "s"}
    feeds["g"] = -np.abs(feeds["g"])
    states = [[ort.OrtValue.ortvalue_from_numpy(np.zeros(shapes["s"], np.float32)) for _ in range(2)]
              for _ in la]
    bindings = []
    for pair in states:
        io = s.io_binding()
        for k, v in feeds.items():
            io.bind_cpu_input(k, v)
        io.bind_ortvalue_input("s", pair[0])
        io.bind_ortvalue_output("ns", pair[0] if in_place else pair[1])
        io.bind_output("o", "cpu")
        bindings.append(io)

    def run():
        for io in bindings:
            s.run_with_iobinding(io)
    return median_ms(run, steps), len(la)


def per_node_us(op: str, width: int, threads: int, steps: int, n: int = 200) -> float:
    if op == "Reshape":
        const = helper.make_tensor("c", TensorProto.INT64, [3], [1, 1, width])
    else:
        const = helper.make_tensor("c", TensorProto.FLOAT, [width], np.ones(width, np.float32).tolist())
    nodes = [helper.make_node(op, ["x" if i == 0 else f"y{i - 1}", "c"], [f"y{i}"]) for i in range(n)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, width])],
                              [helper.make_tensor_value_info(f"y{n - 1}", TensorProto.FLOAT, None)], [const])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    s = session(m, threads, optimize=False)
    x = np.ones((1, 1, width), np.float32)
    return median_ms(lambda: s.run(None, {"x": x}), steps) * 1e3 / n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    manifest = read_manifest(a.bundle)
    model = onnx.load(str(a.bundle / manifest["entry"]))
    out: dict = {"bundle": str(a.bundle), "threads": a.threads, "onnxruntime": ort.__version__,
                 "graph_nodes": len(model.graph.node)}
    for mode in (True, False, True, False):  # alternated: the machine drifts
        out.setdefault(f"decode_step_ms_{'shared' if mode else 'double'}_state", []).append(
            decode_step(a.bundle, a.threads, a.steps, mode))
    out["matmuls_alone_ms"], out["matmul_nodes"] = matmuls_alone(model, a.threads, a.steps)
    for mode in (True, False):
        out[f"linear_attention_alone_ms_{'shared' if mode else 'double'}_state"], out["linear_attention_nodes"] = \
            linear_attention_alone(model, manifest, a.threads, a.steps, mode)
    hidden = manifest["model"]["hidden_size"]
    out["reshape_us_per_node"] = per_node_us("Reshape", hidden, a.threads, a.steps)
    out["mul_us_per_node"] = per_node_us("Mul", hidden, a.threads, a.steps)
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
