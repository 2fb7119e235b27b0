"""Where an ONNX decode step's time goes, without the profiler's per-node cost.
Regenerates: docs/results/onnx-decode-split.md.

    python bench/runtimes/onnx_decode_split.py BUNDLE [--threads 2] [--steps 40]

ORT's profiler adds a few microseconds to every node, which at one token is as much as the small
nodes themselves cost (docs/results/onnx-ops.md's decode table is profiled). This measures, unprofiled:
1. one decode step of the bundle at context 128 (the session's own IOBinding path), with the
   DeltaNet recurrent state in one buffer (past == present, as the manifest allows on the CPU) and
   double-buffered;
2. the same MatMulNBits / MatMul nodes alone, with the bundle's weights, in one graph of independent
   nodes (the weight-streaming floor of the step);
3. the bundle's LinearAttention nodes alone at one token (their state traffic), both buffer modes;
4. the cost per node of a trivial op (200 chained Reshapes, then Muls on the hidden size);
5. the step with every weight matmul replaced by a zero tensor of its output shape (what the rest of the
   graph costs in place);
6. the step at several context depths (what the KV cache adds);
7. the int4 kernel on its own: a bank of 24 synthetic MatMulNBits [1024 -> 7168] at block 32 and 128,
   1 and 2 threads, against this machine's read bandwidth at 1 and 2 threads (whether the kernel is
   held back by memory or by compute).
Prints one JSON object: medians in ms.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from deltaship.bundle.reader import read_manifest
from deltaship.runtimes.onnx import OnnxSession
from deltaship.runtimes.onnx_io import session_options

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from bandwidth import bandwidth  # noqa: E402  (bench/tools/)


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
    so = session_options(ort, threads, None)  # the options deltaship's own sessions use
    if not optimize:  # keep every node of a chain (ORT would fold repeated Reshapes into one)
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def standalone(graph: onnx.GraphProto, contrib: bool = True) -> onnx.ModelProto:
    """A model of one graph at the opsets deltaship's ONNX bundles use."""
    opsets = [helper.make_opsetid("", 21)] + ([helper.make_opsetid("com.microsoft", 1)] if contrib else [])
    m = helper.make_model(graph, opset_imports=opsets)
    m.ir_version = 10
    return m


def weight_matmuls(graph: onnx.GraphProto) -> list[tuple[onnx.NodeProto, int, int]]:
    """(node, K, N) of every MatMulNBits / MatMul whose weight is an initializer."""
    init = {i.name: i for i in graph.initializer}
    out = []
    for n in graph.node:
        if n.op_type not in ("MatMulNBits", "MatMul") or n.input[1] not in init:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        k, width = (attrs["K"], attrs["N"]) if n.op_type == "MatMulNBits" else init[n.input[1]].dims
        out.append((n, k, width))
    return out


def decode_steps(
    bundle: Path,
    threads: int,
    steps: int,
    contexts: tuple[int, ...] = (128,),
    in_place: bool = True,
    manifest: dict | None = None,
) -> list[float]:
    """Median ms of one decode step at each context depth, one session."""
    s = OnnxSession(bundle, manifest or read_manifest(bundle), threads=threads, in_place=in_place)
    ids = np.array([5], dtype=np.int64)
    out = []
    for context in contexts:
        s.reset()
        s.seek(context)  # decode cost depends on the depth, not on the state's values
        out.append(median_ms(lambda: s._forward(ids), steps))
    return out


def step_without_matmuls(bundle: Path, manifest: dict, model: onnx.ModelProto, threads: int, steps: int) -> float:
    """The decode step with each weight matmul replaced by zeros of its output shape (3 trivial nodes)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    widths = {n.output[0]: width for n, _, width in weight_matmuls(g)}  # by output name: protobuf wrappers come and go
    nodes = []
    for n in g.node:
        y = n.output[0]
        if y not in widths:
            nodes.append(n)
            continue
        width = widths[y]
        g.initializer.append(helper.make_tensor(f"{y}_n", TensorProto.INT64, [1], [width]))
        nodes += [
            helper.make_node("Shape", [n.input[0]], [f"{y}_lead"], end=-1),
            helper.make_node("Concat", [f"{y}_lead", f"{y}_n"], [f"{y}_shape"], axis=0),
            helper.make_node(
                "ConstantOfShape", [f"{y}_shape"], [y], value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])
            ),
        ]
    used = {i for n in nodes for i in n.input}
    kept = [i for i in g.initializer if i.name in used]
    del g.node[:], g.initializer[:]
    g.node.extend(nodes)
    g.initializer.extend(kept)
    with tempfile.TemporaryDirectory(prefix="deltaship-split-") as d:
        onnx.save(m, str(Path(d) / manifest["entry"]))
        return decode_steps(Path(d), threads, steps, manifest=manifest)[0]


def int4_kernel(threads: int, block: int, steps: int, k: int = 1024, n: int = 7168, layers: int = 24) -> dict:
    """A bank of independent MatMulNBits at one token, random weights: ms and GB/s of stored bytes."""
    rng = np.random.default_rng(0)
    nodes, inputs, outputs, inits = [], [], [], []
    for i in range(layers):
        blocks = k // block
        inits += [
            numpy_helper.from_array(rng.integers(0, 256, (n, blocks, block // 2), dtype=np.uint8), f"w{i}"),
            numpy_helper.from_array(rng.random(n * blocks, dtype=np.float32) * 0.01, f"s{i}"),
        ]
        inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [1, 1, k]))
        nodes.append(
            helper.make_node(
                "MatMulNBits",
                [f"x{i}", f"w{i}", f"s{i}"],
                [f"y{i}"],
                domain="com.microsoft",
                K=k,
                N=n,
                bits=4,
                block_size=block,
                accuracy_level=4,
            )
        )
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    s = session(standalone(helper.make_graph(nodes, "bank", inputs, outputs, inits)), threads)
    feeds = {i.name: rng.standard_normal(i.shape, dtype=np.float32) for i in s.get_inputs()}
    ms = median_ms(lambda: s.run(None, feeds), steps)
    stored = sum(len(t.raw_data) for t in inits)
    return {"threads": threads, "block_size": block, "ms": ms, "stored_mb": stored / 1e6, "gb_s": stored / ms / 1e6}


def matmuls_alone(model: onnx.ModelProto, threads: int, steps: int) -> tuple[float, int]:
    """Every weight matmul of the graph as an independent node fed a [1, 1, K] input."""
    init = {i.name: i for i in model.graph.initializer}
    nodes, inputs, outputs, used = [], [], [], set()
    for i, (n, k, _) in enumerate(weight_matmuls(model.graph)):
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
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


def linear_attention_alone(
    model: onnx.ModelProto, manifest: dict, threads: int, steps: int, in_place: bool
) -> tuple[float, int]:
    la = [n for n in model.graph.node if n.op_type == "LinearAttention"]
    attrs = {a.name: helper.get_attribute_value(a) for a in la[0].attribute}
    h = attrs["kv_num_heads"]
    _, _, dk, dv = next(s["shape"] for s in manifest["states"] if s["kind"] == "deltanet_recurrent")
    hq = attrs["q_num_heads"]
    shapes = {
        "q": [1, 1, hq * dk],
        "k": [1, 1, hq * dk],
        "v": [1, 1, h * dv],
        "s": [1, h, dk, dv],
        "g": [1, 1, h],
        "b": [1, 1, h],
    }
    node = helper.make_node("LinearAttention", list(shapes), ["o", "ns"], domain="com.microsoft", **attrs)
    graph = helper.make_graph(
        [node],
        "la",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, v) for k, v in shapes.items()],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("o", "ns")],
    )
    s = session(standalone(graph), threads)
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal(v, dtype=np.float32) * 0.1 for k, v in shapes.items() if k != "s"}
    feeds["g"] = -np.abs(feeds["g"])
    states = [[ort.OrtValue.ortvalue_from_numpy(np.zeros(shapes["s"], np.float32)) for _ in range(2)] for _ in la]
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
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, width])],
        [helper.make_tensor_value_info(f"y{n - 1}", TensorProto.FLOAT, None)],
        [const],
    )
    s = session(standalone(graph, contrib=False), threads, optimize=False)
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
    out: dict = {
        "bundle": str(a.bundle),
        "threads": a.threads,
        "onnxruntime": ort.__version__,
        "graph_nodes": len(model.graph.node),
    }
    for mode in (True, False, True, False):  # alternated: the machine drifts
        out.setdefault(f"decode_step_ms_{'shared' if mode else 'double'}_state", []).append(
            decode_steps(a.bundle, a.threads, a.steps, in_place=mode)[0]
        )
    out["matmuls_alone_ms"], out["matmul_nodes"] = matmuls_alone(model, a.threads, a.steps)
    for mode in (True, False):
        out[f"linear_attention_alone_ms_{'shared' if mode else 'double'}_state"], out["linear_attention_nodes"] = (
            linear_attention_alone(model, manifest, a.threads, a.steps, mode)
        )
    hidden = manifest["model"]["hidden_size"]
    out["reshape_us_per_node"] = per_node_us("Reshape", hidden, a.threads, a.steps)
    out["mul_us_per_node"] = per_node_us("Mul", hidden, a.threads, a.steps)
    out["step_ms_without_matmuls"] = step_without_matmuls(a.bundle, manifest, model, a.threads, a.steps)
    contexts = (16, 128, 512, min(960, manifest["max_context"] - 2))
    out["decode_step_ms_by_context"] = dict(zip(contexts, decode_steps(a.bundle, a.threads, a.steps, contexts)))
    out["int4_kernel"] = [int4_kernel(t, b, a.steps) for t in (1, 2) for b in (32, 128)]
    out["read_bandwidth_gb_s"] = {t: bandwidth(t) for t in (1, 2)}
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
