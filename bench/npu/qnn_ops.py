"""Which ONNX op forms QNN's HTP backend accepts, for a decomposed DeltaNet decode step.
Regenerates: the op-form table of docs/npu.md.

    python bench/npu/qnn_ops.py [--soc 69 --arch 79] [--only NAME ...] [--out OUT.md]

Builds one tiny static-shape model per op form (fp16 unless the name says otherwise), opens it with
onnxruntime-qnn's HTP backend (the x86-64 simulator here) with CPU fallback disabled, and records QNN's
validation line for each node, then runs the accepted ones and compares with ONNX Runtime's CPU
provider on the same model (max abs difference). Prints a markdown table.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from deltaship.errors import DeltashipError
from deltaship.runtimes.qnn import DEFAULT_HTP_ARCH, DEFAULT_SOC_MODEL, open_htp

F16, F32, I64, I32, BOOL = (
    TensorProto.FLOAT16,
    TensorProto.FLOAT,
    TensorProto.INT64,
    TensorProto.INT32,
    TensorProto.BOOL,
)
_NP = {F16: np.float16, F32: np.float32, I64: np.int64, I32: np.int32, BOOL: np.bool_}
H, DK, DV, C, K = 4, 32, 32, 192, 4  # tiny preset sizes: value heads, head dims, conv channels, conv kernel
CTX = 64  # a static KV buffer


@dataclass
class Case:
    name: str
    nodes: list
    inputs: list  # (name, dtype, shape) or (name, dtype, shape, array)
    outputs: list  # (name, dtype, shape)
    inits: dict = field(default_factory=dict)
    opset: int = 21


def _feed(spec, rng):
    name, dtype, shape = spec[:3]
    shape = [1 if isinstance(d, str) else d for d in shape]  # a dynamic dimension is fed as 1
    if len(spec) == 4:
        return name, spec[3]
    if dtype == BOOL:
        return name, rng.random(shape) > 0.5
    if dtype in (I64, I32):
        return name, rng.integers(0, 4, shape).astype(_NP[dtype])
    return name, rng.standard_normal(shape).astype(_NP[dtype])


def _model(case: Case) -> bytes:
    inits = [numpy_helper.from_array(v, k) for k, v in case.inits.items()]
    g = helper.make_graph(
        case.nodes,
        case.name,
        [helper.make_tensor_value_info(s[0], s[1], s[2]) for s in case.inputs],
        [helper.make_tensor_value_info(*s) for s in case.outputs],
        inits,
    )
    m = helper.make_model(
        g, opset_imports=[helper.make_opsetid("", case.opset), helper.make_opsetid("com.microsoft", 1)]
    )
    m.ir_version = 10
    if (
        case.name != "SimplifiedLayerNormalization" and "microsoft" not in case.name
    ):  # an ONNX Runtime op in the ONNX domain, not in the spec
        onnx.checker.check_model(m)
    return m.SerializeToString()


def n(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, **attrs)


def unary(op, dtype=F16, shape=(H, DV), positive=False):
    x = ("x", dtype, list(shape))
    if positive:  # Log, Sqrt, Reciprocal: inputs in [0.5, 2.5)
        x = (*x, (np.random.default_rng(4).random(shape) * 2 + 0.5).astype(_NP[dtype]))
    return Case(
        f"{op}" + ("" if dtype == F16 else f" ({_NP[dtype].__name__})"),
        [n(op, ["x"], ["y"])],
        [x],
        [("y", dtype, list(shape))],
    )


def binary(op, shape_b=(H, DV)):
    return Case(
        f"{op} (broadcast {list(shape_b)})" if shape_b != (H, DV) else op,
        [n(op, ["a", "b"], ["y"])],
        [("a", F16, [H, DV]), ("b", F16, list(shape_b))],
        [("y", F16, [H, DV])],
    )


def cases() -> list[Case]:
    w = np.random.default_rng(1).standard_normal((256, 192)).astype(np.float16) * np.float16(0.05)
    pos = np.array([5], np.int64)
    out = [
        Case(
            "MatMul (activation x fp16 weight)",
            [n("MatMul", ["x", "w"], ["y"])],
            [("x", F16, [1, 256])],
            [("y", F16, [1, 192])],
            {"w": w},
        ),
        Case(
            "MatMul (fp32)",
            [n("MatMul", ["x", "w"], ["y"])],
            [("x", F32, [1, 256])],
            [("y", F32, [1, 192])],
            {"w": w.astype(np.float32)},
        ),
        Case(
            "MatMul batched [H,1,dk]x[H,dk,dv]",
            [n("MatMul", ["q", "s"], ["y"])],
            [("q", F16, [H, 1, DK]), ("s", F16, [H, DK, DV])],
            [("y", F16, [H, 1, DV])],
        ),
        Case(
            "MatMul outer [H,dk,1]x[H,1,dv]",
            [n("MatMul", ["k", "v"], ["y"])],
            [("k", F16, [H, DK, 1]), ("v", F16, [H, 1, DV])],
            [("y", F16, [H, DK, DV])],
        ),
        binary("Mul"),
        binary("Add"),
        binary("Sub"),
        Case(
            "Div",
            [n("Div", ["a", "b"], ["y"])],
            [
                ("a", F16, [H, DV]),
                ("b", F16, [H, DV], (np.random.default_rng(5).random((H, DV)) * 2 + 0.5).astype(np.float16)),
            ],
            [("y", F16, [H, DV])],
        ),
        binary("Mul", (H, 1)),
        binary("Add", (1, DV)),
        unary("Exp"),
        unary("Exp", F32),
        unary("Sigmoid"),
        unary("Softplus"),
        unary("Log", positive=True),
        unary("Neg"),
        unary("Sqrt", positive=True),
        unary("Reciprocal", positive=True),
        unary("Relu"),
        unary("Tanh"),
        unary("Abs"),
        Case(
            "Softplus as Log(1+Exp(x))",
            [n("Exp", ["x"], ["e"]), n("Add", ["e", "one"], ["a"]), n("Log", ["a"], ["y"])],
            [("x", F16, [H, DV])],
            [("y", F16, [H, DV])],
            {"one": np.array(1, np.float16)},
        ),
        Case(
            "SiLU as x*Sigmoid(x)",
            [n("Sigmoid", ["x"], ["s"]), n("Mul", ["x", "s"], ["y"])],
            [("x", F16, [1, C])],
            [("y", F16, [1, C])],
        ),
        Case(
            "Pow (x^2)",
            [n("Pow", ["x", "two"], ["y"])],
            [("x", F16, [H, DV])],
            [("y", F16, [H, DV])],
            {"two": np.array(2, np.float16)},
        ),
        Case(
            "ReduceSum (axes input)",
            [n("ReduceSum", ["x", "ax"], ["y"], keepdims=1)],
            [("x", F16, [H, DK, DV])],
            [("y", F16, [H, 1, DV])],
            {"ax": np.array([1], np.int64)},
        ),
        Case(
            "ReduceMean (last axis)",
            [n("ReduceMean", ["x", "ax"], ["y"], keepdims=1)],
            [("x", F16, [1, 256])],
            [("y", F16, [1, 1])],
            {"ax": np.array([-1], np.int64)},
            opset=18,
        ),
        Case(
            "ReduceMax",
            [n("ReduceMax", ["x", "ax"], ["y"], keepdims=1)],
            [("x", F16, [H, DV])],
            [("y", F16, [H, 1])],
            {"ax": np.array([-1], np.int64)},
            opset=18,
        ),
        Case(
            "Reshape",
            [n("Reshape", ["x", "s"], ["y"])],
            [("x", F16, [1, H * DV])],
            [("y", F16, [H, 1, DV])],
            {"s": np.array([H, 1, DV], np.int64)},
        ),
        Case(
            "Transpose",
            [n("Transpose", ["x"], ["y"], perm=[0, 2, 1])],
            [("x", F16, [H, DK, DV])],
            [("y", F16, [H, DV, DK])],
        ),
        Case(
            "Concat",
            [n("Concat", ["a", "b"], ["y"], axis=-1)],
            [("a", F16, [1, C, K - 1]), ("b", F16, [1, C, 1])],
            [("y", F16, [1, C, K])],
        ),
        Case(
            "Slice (static)",
            [n("Slice", ["x", "st", "en", "ax"], ["y"])],
            [("x", F16, [1, C, K])],
            [("y", F16, [1, C, K - 1])],
            {"st": np.array([1], np.int64), "en": np.array([K], np.int64), "ax": np.array([2], np.int64)},
        ),
        Case(
            "Split",
            [n("Split", ["x", "sp"], ["a", "b"], axis=-1)],
            [("x", F16, [1, C])],
            [("a", F16, [1, 128]), ("b", F16, [1, 64])],
            {"sp": np.array([128, 64], np.int64)},
        ),
        Case(
            "Unsqueeze + Squeeze",
            [n("Unsqueeze", ["x", "ax"], ["u"]), n("Squeeze", ["u", "ax"], ["y"])],
            [("x", F16, [H, DV])],
            [("y", F16, [H, DV])],
            {"ax": np.array([1], np.int64)},
        ),
        Case(
            "Expand (repeat k heads)",
            [n("Expand", ["x", "s"], ["y"])],
            [("x", F16, [2, 1, DK])],
            [("y", F16, [2, 2, DK])],
            {"s": np.array([2, 2, DK], np.int64)},
        ),
        Case(
            "Tile",
            [n("Tile", ["x", "r"], ["y"])],
            [("x", F16, [2, DK])],
            [("y", F16, [4, DK])],
            {"r": np.array([2, 1], np.int64)},
        ),
        Case(
            "Gather (embedding, int64 ids)",
            [n("Gather", ["e", "ids"], ["y"])],
            [("ids", I64, [1])],
            [("y", F16, [1, 192])],
            {"e": w},
        ),
        Case(
            "Gather (embedding, int32 ids)",
            [n("Gather", ["e", "ids"], ["y"])],
            [("ids", I32, [1])],
            [("y", F16, [1, 192])],
            {"e": w},
        ),
        Case(
            "Gather (RoPE table row at position)",
            [n("Gather", ["t", "p"], ["y"])],
            [("p", I64, [1], pos)],
            [("y", F16, [1, 16])],
            {"t": np.random.default_rng(2).standard_normal((CTX, 16)).astype(np.float16)},
        ),
        Case(
            "ScatterND (KV row at position)",
            [n("Unsqueeze", ["p", "ax"], ["idx"]), n("ScatterND", ["kv", "idx", "row"], ["y"])],
            [("kv", F16, [CTX, 2, 64]), ("p", I64, [1], pos), ("row", F16, [1, 2, 64])],
            [("y", F16, [CTX, 2, 64])],
            {"ax": np.array([1], np.int64)},
        ),
        Case(
            "ScatterElements (KV row at position)",
            [n("ScatterElements", ["kv", "idx", "row"], ["y"], axis=0)],
            [("kv", F16, [CTX, 8]), ("idx", I64, [1, 8], np.full((1, 8), 5, np.int64)), ("row", F16, [1, 8])],
            [("y", F16, [CTX, 8])],
        ),
        Case(
            "KV update as Where(one-hot position)",
            [n("Equal", ["r", "p"], ["hot"]), n("Where", ["hot", "row", "kv"], ["y"])],
            [("kv", F16, [CTX, 128]), ("p", I64, [1, 1], pos.reshape(1, 1)), ("row", F16, [1, 128])],
            [("y", F16, [CTX, 128])],
            {"r": np.arange(CTX, dtype=np.int64).reshape(CTX, 1)},
        ),
        Case(
            "KV update as Where(one-hot position, int32)",
            [n("Equal", ["r", "p"], ["hot"]), n("Where", ["hot", "row", "kv"], ["y"])],
            [("kv", F16, [CTX, 128]), ("p", I32, [1, 1], pos.reshape(1, 1).astype(np.int32)), ("row", F16, [1, 128])],
            [("y", F16, [CTX, 128])],
            {"r": np.arange(CTX, dtype=np.int32).reshape(CTX, 1)},
        ),
        Case(
            "KV update as one-hot blend kv*(1-m)+row*m (fp16 mask input)",
            [
                n("Sub", ["one", "m"], ["keep"]),
                n("Mul", ["kv", "keep"], ["a"]),
                n("Mul", ["row", "m"], ["b"]),
                n("Add", ["a", "b"], ["y"]),
            ],
            [
                ("kv", F16, [CTX, 128]),
                ("m", F16, [CTX, 1], (np.arange(CTX) == 5).astype(np.float16).reshape(CTX, 1)),
                ("row", F16, [1, 128]),
            ],
            [("y", F16, [CTX, 128])],
            {"one": np.array(1, np.float16)},
        ),
        Case(
            "Where (bool mask input)",
            [n("Where", ["m", "a", "b"], ["y"])],
            [("m", BOOL, [1, CTX]), ("a", F16, [1, CTX]), ("b", F16, [1, CTX])],
            [("y", F16, [1, CTX])],
        ),
        Case(
            "Less (causal mask from position)",
            [n("Less", ["p", "r"], ["m"]), n("Cast", ["m"], ["y"], to=F16)],
            [("p", I64, [1, 1], pos.reshape(1, 1))],
            [("y", F16, [1, CTX])],
            {"r": np.arange(CTX, dtype=np.int64).reshape(1, CTX)},
        ),
        Case(
            "Softmax (last axis)",
            [n("Softmax", ["x"], ["y"], axis=-1)],
            [("x", F16, [4, 1, CTX])],
            [("y", F16, [4, 1, CTX])],
        ),
        Case(
            "Softmax + additive mask",
            [n("Add", ["x", "m"], ["a"]), n("Softmax", ["a"], ["y"], axis=-1)],
            [
                ("x", F16, [4, 1, CTX]),
                ("m", F16, [1, 1, CTX], np.where(np.arange(CTX) < 6, 0, -30000).astype(np.float16).reshape(1, 1, CTX)),
            ],
            [("y", F16, [4, 1, CTX])],
        ),
        Case(
            "Conv1d depthwise (group=C, kernel 4, valid)",
            [n("Conv", ["x", "cw"], ["y"], group=C, kernel_shape=[K])],
            [("x", F16, [1, C, K])],
            [("y", F16, [1, C, 1])],
            {"cw": np.random.default_rng(3).standard_normal((C, 1, K)).astype(np.float16)},
        ),
        Case(
            "conv step as Mul + ReduceSum over the kernel",
            [n("Mul", ["x", "cw"], ["p"]), n("ReduceSum", ["p", "ax"], ["y"], keepdims=0)],
            [("x", F16, [1, C, K])],
            [("y", F16, [1, C])],
            {
                "cw": np.random.default_rng(3).standard_normal((1, C, K)).astype(np.float16),
                "ax": np.array([2], np.int64),
            },
        ),
        Case(
            "RMSNorm as Pow/ReduceMean/Add/Sqrt/Div/Mul",
            [
                n("Pow", ["x", "two"], ["sq"]),
                n("ReduceMean", ["sq", "ax"], ["ms"], keepdims=1),
                n("Add", ["ms", "eps"], ["a"]),
                n("Sqrt", ["a"], ["r"]),
                n("Div", ["x", "r"], ["xn"]),
                n("Mul", ["xn", "g"], ["y"]),
            ],
            [("x", F16, [1, 256])],
            [("y", F16, [1, 256])],
            {
                "two": np.array(2, np.float16),
                "ax": np.array([-1], np.int64),
                "eps": np.array(1e-6, np.float16),
                "g": np.ones(256, np.float16),
            },
            opset=18,
        ),
        Case(
            "RMSNorm as Mul/ReduceMean/Add/Sqrt/Reciprocal/Mul",
            [
                n("Mul", ["x", "x"], ["sq"]),
                n("ReduceMean", ["sq", "ax"], ["ms"], keepdims=1),
                n("Add", ["ms", "eps"], ["a"]),
                n("Sqrt", ["a"], ["r"]),
                n("Reciprocal", ["r"], ["ir"]),
                n("Mul", ["x", "ir"], ["xn"]),
                n("Mul", ["xn", "g"], ["y"]),
            ],
            [("x", F16, [1, 256])],
            [("y", F16, [1, 256])],
            {"ax": np.array([-1], np.int64), "eps": np.array(1e-6, np.float16), "g": np.ones(256, np.float16)},
            opset=18,
        ),
        Case(
            "LayerNormalization",
            [n("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=1e-6)],
            [("x", F16, [1, 256])],
            [("y", F16, [1, 256])],
            {"g": np.ones(256, np.float16), "b": np.zeros(256, np.float16)},
        ),
        Case(
            "SimplifiedLayerNormalization",
            [n("SimplifiedLayerNormalization", ["x", "g"], ["y"], axis=-1, epsilon=1e-6)],
            [("x", F16, [1, 256])],
            [("y", F16, [1, 256])],
            {"g": np.ones(256, np.float16)},
        ),
        Case(
            "RMSNormalization (opset 23)",
            [n("RMSNormalization", ["x", "g"], ["y"], axis=-1, epsilon=1e-6)],
            [("x", F16, [1, 256])],
            [("y", F16, [1, 256])],
            {"g": np.ones(256, np.float16)},
            opset=23,
        ),
        Case(
            "L2 norm as ReduceL2 + Div",
            [n("ReduceL2", ["x", "ax"], ["l"], keepdims=1), n("Div", ["x", "l"], ["y"])],
            [("x", F16, [H, DK])],
            [("y", F16, [H, DK])],
            {"ax": np.array([-1], np.int64)},
            opset=18,
        ),
        Case("Cast fp16 -> fp32", [n("Cast", ["x"], ["y"], to=F32)], [("x", F16, [H, DV])], [("y", F32, [H, DV])]),
        Case("Cast fp32 -> fp16", [n("Cast", ["x"], ["y"], to=F16)], [("x", F32, [H, DV])], [("y", F16, [H, DV])]),
        Case("Cast int64 -> int32", [n("Cast", ["x"], ["y"], to=I32)], [("x", I64, [1, 8])], [("y", I32, [1, 8])]),
        Case(
            "ArgMax (greedy token)",
            [n("ArgMax", ["x"], ["y"], axis=-1, keepdims=0)],
            [("x", F16, [1, 272])],
            [("y", I64, [1])],
        ),
        Case(
            "Cos / Sin",
            [n("Cos", ["x"], ["c"]), n("Sin", ["x"], ["s"]), n("Add", ["c", "s"], ["y"])],
            [("x", F16, [1, 16])],
            [("y", F16, [1, 16])],
        ),
        Case(
            "Einsum (bhk,bkv->bhv)",
            [n("Einsum", ["a", "b"], ["y"], equation="hik,hkv->hiv")],
            [("a", F16, [H, 1, DK]), ("b", F16, [H, DK, DV])],
            [("y", F16, [H, 1, DV])],
        ),
        # Refusals, kept as evidence of what a lowering must avoid.
        Case(
            "MatMul with a dynamic token dimension",
            [n("MatMul", ["x", "w"], ["y"])],
            [("x", F16, ["T", 256])],
            [("y", F16, ["T", 192])],
            {"w": w},
        ),
        Case(
            "com.microsoft LinearAttention (gated_delta)",
            [
                helper.make_node(
                    "LinearAttention",
                    ["q", "k", "v", "s", "g", "b"],
                    ["y", "s2"],
                    domain="com.microsoft",
                    update_rule="gated_delta",
                    q_num_heads=H,
                    kv_num_heads=H,
                    scale=DK**-0.5,
                )
            ],
            [
                ("q", F32, [1, 1, H * DK]),
                ("k", F32, [1, 1, H * DK]),
                ("v", F32, [1, 1, H * DV]),
                ("s", F32, [1, H, DK, DV]),
                ("g", F32, [1, 1, H]),
                ("b", F32, [1, 1, H]),
            ],
            [("y", F32, [1, 1, H * DV]), ("s2", F32, [1, H, DK, DV])],
        ),
    ]
    return out


def run_case(case: Case, soc: str, arch: str) -> tuple[str, str, str]:
    import onnxruntime as ort

    model = _model(case)
    rng = np.random.default_rng(0)
    feed = dict(_feed(s, rng) for s in case.inputs)
    try:
        opened = open_htp(model, soc_model=soc, htp_arch=arch, evidence=True)
    except DeltashipError as e:
        return "refused", e.args[0].split("graph: ", 1)[-1][:240], ""
    mapped = ", ".join(dict.fromkeys(c.op for c in opened.checks if c.passed))
    quiet = ort.RunOptions()
    quiet.log_severity_level = 3
    got = opened.session.run(None, feed, quiet)
    try:
        want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feed)
        diff = max(float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64)))) for g, w in zip(got, want))
        diff_s = f"{diff:.2g}"
    except Exception as e:  # the CPU provider lacks some fp16 kernels
        diff_s = f"no CPU reference ({type(e).__name__})"
    return "HTP", f"Validation PASSED: {mapped}", diff_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--soc", default=DEFAULT_SOC_MODEL)
    ap.add_argument("--arch", default=DEFAULT_HTP_ARCH)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    rows = ["| op form (static shapes) | on the HTP? | QNN validation | max abs diff vs CPU EP |", "|---|---|---|---|"]
    for case in cases():
        if a.only and not any(o.lower() in case.name.lower() for o in a.only):
            continue
        verdict, log, diff = run_case(case, a.soc, a.arch)
        rows.append(f"| {case.name} | {verdict} | {log.replace('|', '/')} | {diff} |")
        print(rows[-1], flush=True)
    if a.out:
        a.out.write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
