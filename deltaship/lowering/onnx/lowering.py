"""Lower a captured program (torch.export FX graph) to ONNX, one FX node at a time.

Canonical ops go to ONNX Runtime's com.microsoft contrib ops (CausalConvWithState,
LinearAttention, GroupQueryAttention, GatedRMSNorm); aten ops to standard ONNX. At opset 27 the DeltaNet
ops are the standard ai.onnx LinearAttention and CausalConvWithState (channels-first conv state) and the
norms the standard RMSNormalization. Weights come
from the weight plan one at a time, quantized on the fly where the precision asks for it. An FX
op with no lowering fails the export, naming the op and the node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import torch
from onnx import TensorProto

from deltaship.errors import DeltashipError
from deltaship.lowering.aten import GENERIC
from deltaship.lowering.lowerings import OpLowerings
from deltaship.lowering.onnx.builder import GraphBuilder
from deltaship.lowering.weight_plan import WeightPlan
from deltaship.models import ops as _canonical  # noqa: F401  (registers torch.ops.deltaship.*)
from deltaship.quant import pack, quantize_blocks, quantize_matmul_weight

aten = torch.ops.aten
DS = torch.ops.deltaship
MS = "com.microsoft"
TORCH_TO_ONNX = {
    torch.float32: TensorProto.FLOAT,
    torch.float16: TensorProto.FLOAT16,
    torch.int64: TensorProto.INT64,
    torch.int32: TensorProto.INT32,
    torch.bool: TensorProto.BOOL,
}
TORCH_TO_NP = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.int32: np.int32}
INT64_MAX = 2**63 - 1
# the generic table's elementwise kinds (deltaship/lowering/aten.py) as ONNX ops; rsqrt and silu are composed
ELEMENTWISE = {
    "add": "Add",
    "sub": "Sub",
    "mul": "Mul",
    "div": "Div",
    "neg": "Neg",
    "sigmoid": "Sigmoid",
    "cos": "Cos",
    "sin": "Sin",
    "exp": "Exp",
    "softplus": "Softplus",
}
ROW_BLOCK = 16384  # tensors with more rows (embedding, LM head) are converted and written in blocks of rows


@dataclass
class Sym:
    """A symbolic integer (e.g. the prompt length) held as an int64 scalar tensor."""

    name: str


class Lowerer:
    def __init__(
        self,
        program: torch.export.ExportedProgram,
        plan: WeightPlan,
        weights,
        quant: dict,
        builder: GraphBuilder,
        accuracy_level: int = 4,
        progress: Callable[[str], None] | None = None,
        deltanet_ops: str = "standard",
        opset: int = 21,
        lowerings: OpLowerings | None = None,
        kv_scales: Mapping[int, Mapping[str, Any]] | None = None,
        rollback: dict[str, str] | None = None,
    ):
        """kv_scales: an int8/int4 KV cache's static scales by attention layer (deltaship/lowering/kv_quant.py);
        rollback: {} (--mtp) to have every DeltaNet state's value after the call's first token written to an output
        rollback.* (named here, {past state name: rollback output}; the caller declares them, model.py)."""
        self.ep, self.plan, self.weights, self.quant = program, plan, weights, quant
        self.lowerings = lowerings if lowerings is not None else LOWERINGS  # a target's own table (export/qnn)
        self.b = builder
        self.accuracy_level = accuracy_level
        self.deltanet_ops = deltanet_ops  # "standard" or "contrib" (see DELTANET_OPS in export/onnx)
        self.kv_scales = kv_scales or {}
        self.rollback = rollback
        self.opset = opset  # 27: DeltaNet in the standard ai.onnx ops (see STANDARD_OPSET in export/onnx/model.py)
        self.progress = progress
        self.env: dict[str, Any] = {}
        sig = program.graph_signature
        self.param_of = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
        self._weights: dict[tuple[str, str], Any] = {}
        # Parameters an embedding gathers from: a tied LM head reuses them instead of a transposed copy.
        self.gathered = {n.args[0].name for n in program.graph.nodes if n.target == aten.embedding.default}
        self.shape_value: str | None = None  # Shape(input_ids), built on demand

    # ---- values ------------------------------------------------------------------------
    def val(self, a):
        if isinstance(a, torch.fx.Node):
            return self.env[a.name]
        if isinstance(a, (list, tuple)):
            return [self.val(x) for x in a]
        return a

    @staticmethod
    def meta(node: torch.fx.Node):
        return node.meta.get("val")

    def dtype_of(self, a) -> torch.dtype:
        return self.meta(a).dtype

    def as_tensor(self, a, like_dtype: torch.dtype | None = None) -> str:
        """A tensor name for an FX arg: a node's value, a Sym, or a python scalar as a constant."""
        if isinstance(a, torch.fx.Node):
            if a.name in self.param_of:
                return self.weight(a)
            v = self.env[a.name]
            return v.name if isinstance(v, Sym) else v
        if isinstance(a, Sym):
            return a.name
        return self.b.const(np.array(a, dtype=TORCH_TO_NP.get(like_dtype, np.float32)))

    def int_list(self, items) -> str:
        """A 1-D int64 tensor from a list of python ints and symbolic sizes."""
        vals = [self.val(x) if isinstance(x, torch.fx.Node) else x for x in items]
        if all(isinstance(v, int) for v in vals):
            return self.b.const(np.array(vals, dtype=np.int64))
        parts = []
        for v in vals:
            if isinstance(v, Sym):
                parts.append(self.b.one("Unsqueeze", [v.name, self.b.const(np.array([0], np.int64))]))
            else:
                parts.append(self.b.const(np.array([v], np.int64)))
        return self.b.one("Concat", parts, axis=0)

    # ---- weights -----------------------------------------------------------------------
    def param_name(self, node: torch.fx.Node) -> str | None:
        return self.param_of.get(node.name) if node.op == "placeholder" else None

    def _np_dtype(self, node: torch.fx.Node):
        return TORCH_TO_NP[self.dtype_of(node)]

    def weight(self, node: torch.fx.Node, form: str = "plain") -> Any:
        """A parameter in the form an op wants: plain, transposed (for MatMul) or quantized."""
        fqn = self.param_name(node)
        key = (fqn, form)
        if key in self._weights:
            return self._weights[key]
        if self.progress:
            self.progress(fqn)
        dt = self._np_dtype(node)
        base = fqn.replace(".", "_")
        shape = self.plan.shape(fqn)
        if form == "plain" and len(shape) == 2 and shape[0] > ROW_BLOCK:
            out = self.b.weight_rows(base, shape, dt, (self._rows(fqn, r).astype(dt) for r in self._row_slices(fqn)))
        elif form == "plain":
            out = self.b.weight(base, self.plan.tensor(fqn, self.weights).astype(dt))
        elif form == "matmul" and self.quant["linear"].get(fqn) and shape[0] > ROW_BLOCK:
            q = self.quant["linear"][fqn]
            scales: list[np.ndarray] = []

            nb = -(-shape[1] // q["block_size"])

            def blocks():
                for r in self._row_slices(fqn):
                    packed, sc = quantize_matmul_weight(self._rows(fqn, r), q["bits"], q["block_size"])
                    scales.append(sc.reshape(-1, nb))
                    yield packed

            packed_name = self.b.weight_rows(
                base + "_q", (shape[0], nb, q["block_size"] * q["bits"] // 8), np.uint8, blocks()
            )
            out = (packed_name, self.b.weight(base + "_scales", np.concatenate(scales).astype(dt)), q, shape)
        elif form == "matmul":
            q = self.quant["linear"].get(fqn)
            w = self.plan.tensor(fqn, self.weights)
            if q:  # scales [N, blocks]: a tied embedding's GatherBlockQuantized can read them as they are
                packed, scales = quantize_matmul_weight(w, q["bits"], q["block_size"])
                out = (
                    self.b.weight(base + "_q", packed),
                    self.b.weight(base + "_scales", scales.reshape(packed.shape[0], -1).astype(dt)),
                    q,
                    w.shape,
                )
            else:
                out = self.b.weight(base + "_t", np.ascontiguousarray(w.T).astype(dt))
        elif form == "conv":
            w = self.plan.tensor(fqn, self.weights)
            out = self.b.weight(base, w.reshape(w.shape[0], 1, w.shape[1]).astype(dt))
        elif form == "taps":  # [C, K] -> K vectors [C], one per kernel tap, in the activation dtype
            w = self.plan.tensor(fqn, self.weights)
            out = [self.b.weight(f"{base}_tap{j}", np.ascontiguousarray(w[:, j]).astype(dt)) for j in range(w.shape[1])]
        else:
            raise ValueError(form)
        self._weights[key] = out
        return out

    def _row_slices(self, fqn: str) -> list[slice]:
        return [slice(r, r + ROW_BLOCK) for r in range(0, self.plan.shape(fqn)[0], ROW_BLOCK)]

    def _rows(self, fqn: str, rows: slice) -> np.ndarray:
        return self.plan.tensor(fqn, self.weights, rows)

    # ---- the primitives of the generic aten table (deltaship/lowering/aten.py) -------
    def value(self, a, dtype: torch.dtype | None = None) -> str:
        return self.as_tensor(a, dtype)

    def elementwise(self, kind: str, inputs: list[str], dtype: torch.dtype) -> str:
        if kind == "rsqrt":
            return self.b.one("Reciprocal", [self.b.one("Sqrt", inputs)])
        if kind == "silu":
            return _silu_of(self, inputs[0])
        return self.b.one(ELEMENTWISE[kind], inputs)

    def cast(self, x: str, src: torch.dtype, dst: torch.dtype | None) -> str:
        return x if dst is None or dst == src else self.b.one("Cast", [x], to=TORCH_TO_ONNX[dst])

    def expand_dims(self, x: str, axis: int) -> str:
        return self.b.one("Unsqueeze", [x, self.b.const(np.array([axis], np.int64))])

    def concat(self, values: list[str], axis: int) -> str:
        return self.b.one("Concat", values, axis=axis)

    def split(self, x: str, sizes: list[int], axis: int) -> list[str]:
        return self.b.node("Split", [x, self.b.const(np.array(sizes, np.int64))], n_out=len(sizes), axis=axis)

    # ---- driver ------------------------------------------------------------------------
    def run(self, input_names: list[str], output_names: list[str]) -> None:
        user = [n for n in self.ep.graph.nodes if n.op == "placeholder" and n.name not in self.param_of]
        if len(user) != len(input_names):
            raise RuntimeError(f"{len(user)} program inputs but {len(input_names)} names")
        for node, name in zip(user, input_names):
            val = self.meta(node)
            shape = [d if isinstance(d, int) else "tokens" for d in val.shape]
            self.env[node.name] = self.b.add_input(name, TORCH_TO_ONNX[val.dtype], shape)
        for node in self.ep.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                self._outputs(node, output_names)
                continue
            fn = self.lowerings.get(node.target)
            if fn is None:
                raise DeltashipError(
                    f"onnx lowering: no lowering for op {node.target} (FX node {node.name!r}, from "
                    f"{node.meta.get('stack_trace', '').strip().splitlines()[-1:] or 'unknown source'})",
                    "this model uses an op the ONNX target does not support yet; please report it",
                )
            self.env[node.name] = fn(self, node, *node.args, **node.kwargs)

    def _outputs(self, node: torch.fx.Node, names: list[str]) -> None:
        flat = [x for x in torch.utils._pytree.tree_leaves(node.args[0])]
        if len(flat) != len(names):
            raise RuntimeError(f"{len(flat)} program outputs but {len(names)} names")
        for src, name in zip(flat, names):
            val = self.meta(src)
            self.b.node("Identity", [self.as_tensor(src)], outputs=[name])
            shape = [d if isinstance(d, int) else "tokens" for d in val.shape]
            self.b.add_output(name, TORCH_TO_ONNX[val.dtype], shape)


LOWERINGS = OpLowerings("onnx").include(GENERIC)  # the generic aten ops (deltaship/lowering/aten.py), then ONNX's own
lowering = LOWERINGS.register


# ---- aten: where ONNX differs (dynamic token counts, weight forms) -------------------------
@lowering(aten.sym_size.int)
def _sym_size(L: Lowerer, node, x, dim):
    shape = L.b.one("Shape", [L.as_tensor(x)])
    return Sym(L.b.one("Gather", [shape, L.b.const(np.array(dim, np.int64))], axis=0))


@lowering(aten.sum.dim_IntList)
def _sum(L, node, x, dims, keepdim=False, dtype=None):
    return L.b.one("ReduceSum", [L.as_tensor(x), L.b.const(np.array(dims, np.int64))], keepdims=int(keepdim))


@lowering(aten.arange.default)
def _arange(L, node, end, **kwargs):
    end_t = L.as_tensor(end) if isinstance(end, torch.fx.Node) else L.b.const(np.array(end, np.int64))
    return L.b.one("Range", [L.b.const(np.array(0, np.int64)), end_t, L.b.const(np.array(1, np.int64))])


@lowering(aten.reshape.default, aten.view.default)
def _reshape(L, node, x, shape):
    return L.b.one("Reshape", [L.as_tensor(x), L.int_list(shape)])


@lowering(aten.slice.Tensor)
def _slice(L, node, x, dim=0, start=None, end=None, step=1):
    rank = len(L.meta(x).shape)
    start = 0 if start is None else start
    end = INT64_MAX if end is None else end
    return L.b.one(
        "Slice",
        [
            L.as_tensor(x),
            L.int_list([start]),
            L.int_list([end]),
            L.b.const(np.array([dim % rank], np.int64)),
            L.b.const(np.array([step], np.int64)),
        ],
    )


@lowering(aten.index_select.default)
def _index_select(L, node, x, dim, index):
    return L.b.one("Gather", [L.as_tensor(x), L.as_tensor(index)], axis=dim)


@lowering(aten.select.int)
def _select(L, node, x, dim, index):
    rank = len(L.meta(x).shape)
    return L.b.one("Gather", [L.as_tensor(x), L.b.const(np.array(index, np.int64))], axis=dim % rank)


@lowering(aten.embedding.default)
def _embedding(L: Lowerer, node, weight, ids, *args):
    name = L.param_name(weight)
    q = L.quant["embedding"].get(name)
    head = L.quant["linear"].get(name)  # set when the table is also the (tied, quantized) LM head
    rows, cols = L.plan.shape(name)
    if (
        q
        and head
        and (head["bits"], head["block_size"]) == (q["bits"], q["block_size"])
        and cols % q["block_size"] == 0
    ):
        # One quantized table for both uses: the gather reads the LM head's MatMulNBits tensor itself, [N, K/block,
        # block*bits/8] quantized along its last axis, and gives [.., K/block, block], viewed as [.., K] after. A
        # Reshape of the table to [N, K*bits/8] (genai's builder) is constant-folded by ONNX Runtime into a second
        # resident copy (0.12 GiB at 0.8B, docs/results/memory.md); only the scales, which GatherBlockQuantized
        # wants at the data's rank and MatMulNBits at rank 2, are reshaped ([N, K/block, 1]: their folded copy is a
        # quarter of the table's bytes at int4, block 32 and fp32 scales).
        packed, scales, _, _ = L.weight(weight, "matmul")
        nb = cols // q["block_size"]
        scales3 = L.b.one("Reshape", [scales, L.b.const(np.array([rows, nb, 1], np.int64))])
        rows_out = L.b.one(
            "GatherBlockQuantized",
            [packed, L.as_tensor(ids), scales3],
            domain=MS,
            bits=q["bits"],
            block_size=q["block_size"],
            gather_axis=0,
            quantize_axis=2,
        )
        keep = [0] * len(L.meta(ids).shape)  # Reshape's 0: the ids' dimensions as they are
        return L.b.one("Reshape", [rows_out, L.b.const(np.array([*keep, cols], np.int64))])
    if q:
        data, scales = L.weight_gather_quantized(weight, q)
    else:
        return L.b.one("Gather", [L.weight(weight), L.as_tensor(ids)], axis=0)
    return L.b.one(
        "GatherBlockQuantized",
        [data, L.as_tensor(ids), scales],
        domain=MS,
        bits=q["bits"],
        block_size=q["block_size"],
        gather_axis=0,
        quantize_axis=1,
    )


def _weight_gather_quantized(L: Lowerer, node, q):
    """Embedding rows quantized along the hidden axis, in row blocks to bound memory."""
    fqn = L.param_name(node)
    key = (fqn, "gather")
    if key in L._weights:
        return L._weights[key]

    if L.progress:
        L.progress(fqn)
    rows, cols = L.plan.shape(fqn)
    scales: list[np.ndarray] = []

    def blocks():
        for r in L._row_slices(fqn):
            codes, sc = quantize_blocks(L._rows(fqn, r), q["bits"], q["block_size"])
            scales.append(sc)
            yield pack(codes, q["bits"]).reshape(codes.shape[0], -1)

    base = fqn.replace(".", "_")
    data = L.b.weight_rows(base + "_gq", (rows, cols * q["bits"] // 8), np.uint8, blocks())
    out = (data, L.b.weight(base + "_gscales", np.concatenate(scales).astype(L._np_dtype(node))))
    L._weights[key] = out
    return out


Lowerer.weight_gather_quantized = _weight_gather_quantized


@lowering(aten.linear.default)
def _linear(L: Lowerer, node, x, weight, bias=None):
    if bias is not None:
        raise DeltashipError(f"onnx lowering: linear with bias at {node.name} is not expected in Qwen3.5")
    if not L.quant["linear"].get(L.param_name(weight)) and len(L.meta(x).shape) == 2:
        # the LM head: Gemm on the [N, K] table as stored (shared with a tied embedding, never transposed)
        return L.b.one("Gemm", [L.as_tensor(x), L.weight(weight)], transB=1)
    w = L.weight(weight, "matmul")
    if isinstance(w, tuple):
        packed, scales, q, (n, k) = w
        return L.b.one(
            "MatMulNBits",
            [L.as_tensor(x), packed, scales],
            domain=MS,
            K=k,
            N=n,
            bits=q["bits"],
            block_size=q["block_size"],
            accuracy_level=L.accuracy_level,
        )
    return L.b.one("MatMul", [L.as_tensor(x), w])


# ---- the model file: opset, IR version, file names (model.py and mtp.py write them) ---------
OPSET = 21
IR_VERSION = 10  # ONNX Runtime 1.31 reads IR <= 13; onnx 1.23 would write 14 by default
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
STANDARD_OPSET = 27  # onnx 1.23: ai.onnx LinearAttention and CausalConvWithState (ONNX Runtime >= 1.32)


# ---- canonical ops -------------------------------------------------------------------------


def _rms(L: Lowerer, x: str, scale: str, eps: float) -> str:
    """RMSNorm over the last axis in fp32: ONNX Runtime's SimplifiedLayerNormalization (registered in the
    ai.onnx domain by ONNX Runtime only), or at opset 27 the standard RMSNormalization (ai.onnx 23)."""
    op = "RMSNormalization" if L.opset >= STANDARD_OPSET else "SimplifiedLayerNormalization"
    return L.b.one(op, [x, scale], axis=-1, epsilon=float(eps), stash_type=1)


@lowering(DS.rms_norm.default)
def _rms_norm(L: Lowerer, node, x, weight, eps):
    xdt, wdt = L.dtype_of(x), L.dtype_of(weight)
    xin = L.as_tensor(x)
    if L.opset >= STANDARD_OPSET and wdt != xdt:
        # RMSNormalization with fp16 X and an fp32 scale: onnx 1.23's inference types Y as X and ONNX Runtime 1.32
        # refuses the model (a Mul of mixed types): normalize in the weight's dtype (fp32), as the canonical op
        # computes, then cast back
        xin = L.b.one("Cast", [xin], to=TORCH_TO_ONNX[wdt])
    y = _rms(L, xin, L.weight(weight), eps)
    return y if L.dtype_of(weight) == xdt else L.b.one("Cast", [y], to=TORCH_TO_ONNX[xdt])


def _silu_of(L: Lowerer, t: str) -> str:
    return L.b.one("Mul", [t, L.b.one("Sigmoid", [t])])  # ONNX Runtime fuses this pair (QuickGelu)


@lowering(DS.gated_rms_norm.default)
def _gated_rms_norm(L: Lowerer, node, x, gate, weight, eps):
    w = L.weight(weight)
    if L.dtype_of(weight) != L.dtype_of(x):
        w = L.b.one("Cast", [w], to=TORCH_TO_ONNX[L.dtype_of(x)])
    if L.deltanet_ops == "contrib":
        # No `activation` attribute: ORT 1.30 (the npm builds apps ship) has none and rejects it; its gate is
        # always SiLU, and 1.31's attribute defaults to "silu", so both compute the same graph.
        return L.b.one("GatedRMSNorm", [L.as_tensor(x), w, L.as_tensor(gate)], domain=MS, epsilon=float(eps))
    normed = _rms(L, L.as_tensor(x), w, eps)
    return L.b.one("Mul", [normed, _silu_of(L, L.as_tensor(gate))])


@lowering(DS.causal_conv_with_state.default)
def _conv(L: Lowerer, node, x, state, weight):
    xdt = L.dtype_of(x)
    if L.opset >= STANDARD_OPSET:
        # ai.onnx::CausalConvWithState is channels-first: x [1, T, C] is transposed in and out; the state input
        # and output are [1, C, K-1] as they are (the manifest's conv state layout at this opset)
        w = L.weight(weight, "conv")
        if L.dtype_of(weight) != xdt:
            w = L.b.one("Cast", [w], to=TORCH_TO_ONNX[xdt])
        xt = L.b.one("Transpose", [L.as_tensor(x)], perm=[0, 2, 1])
        st = L.as_tensor(state)
        if L.dtype_of(state) != xdt:
            st = L.b.one("Cast", [st], to=TORCH_TO_ONNX[xdt])
        y, new_state = L.b.node("CausalConvWithState", [xt, w, "", st], n_out=2, activation="silu")
        if L.dtype_of(state) != xdt:
            new_state = L.b.one("Cast", [new_state], to=TORCH_TO_ONNX[L.dtype_of(state)])
        if L.rollback is not None:
            full = L.b.one("Concat", [st, xt], axis=2)
            _conv_rollback(L, state, full, xdt, L.meta(weight).shape[-1], axis=2)
        return [L.b.one("Transpose", [y], perm=[0, 2, 1]), new_state]
    if L.deltanet_ops == "contrib":
        w = L.weight(weight, "conv")
        if L.dtype_of(weight) != xdt:
            w = L.b.one("Cast", [w], to=TORCH_TO_ONNX[xdt])
        if L.rollback is not None:
            st = L.as_tensor(state)
            if L.dtype_of(state) != xdt:
                st = L.b.one("Cast", [st], to=TORCH_TO_ONNX[xdt])
            full = L.b.one("Concat", [st, L.as_tensor(x)], axis=1)
            _conv_rollback(L, state, full, xdt, L.meta(weight).shape[-1], axis=1)
        return L.b.node(
            "CausalConvWithState",
            [L.as_tensor(x), w, "", L.as_tensor(state)],
            n_out=2,
            domain=MS,
            activation="silu",
            channels_last=1,
            ndim=1,
        )
    # K shifted multiply-adds over concat(state, x) along time (channels last): tap j is rows j .. j+T-1
    taps = L.weight(weight, "taps")
    k = len(taps)
    st = L.as_tensor(state)
    if L.dtype_of(state) != xdt:
        st = L.b.one("Cast", [st], to=TORCH_TO_ONNX[xdt])
    full = L.b.one("Concat", [st, L.as_tensor(x)], axis=1)
    one = L.b.const(np.array([1], np.int64))
    acc = None
    for j, w in enumerate(taps):
        end = np.array([j - (k - 1) if j < k - 1 else INT64_MAX], np.int64)
        tap = L.b.one("Slice", [full, L.b.const(np.array([j], np.int64)), L.b.const(end), one])
        term = L.b.one("Mul", [tap, w])
        acc = term if acc is None else L.b.one("Add", [acc, term])
    new_state = L.b.one(
        "Slice", [full, L.b.const(np.array([-(k - 1)], np.int64)), L.b.const(np.array([INT64_MAX], np.int64)), one]
    )
    _conv_rollback(L, state, full, xdt, k, axis=1)  # the same concat(state, x)
    if L.dtype_of(state) != xdt:
        new_state = L.b.one("Cast", [new_state], to=TORCH_TO_ONNX[L.dtype_of(state)])
    return [_silu_of(L, acc), new_state]


def rollback_name(state: str) -> str:
    """The --mtp graph output holding DeltaNet state `state` (past.*) after the call's first token."""
    if not state.startswith("past."):
        raise RuntimeError(f"a DeltaNet state read from {state!r}, not from a graph input past.*")
    return "rollback." + state.removeprefix("past.")


def _conv_rollback(L: Lowerer, state, full: str, dtype: torch.dtype, k: int, axis: int) -> None:
    """--mtp: the conv state after the call's first token, the K-1 steps of full = concat(state, x) from the second
    (of `dtype`, in the layout of the op's state), written to the graph output rollback.* (no copy)."""
    if L.rollback is None:
        return
    name = rollback_name(L.as_tensor(state))
    bounds = [L.b.const(np.array([v], np.int64)) for v in (1, k, axis)]
    if L.dtype_of(state) == dtype:
        L.b.node("Slice", [full, *bounds], outputs=[name])
    else:
        L.b.node("Cast", [L.b.one("Slice", [full, *bounds])], outputs=[name], to=TORCH_TO_ONNX[L.dtype_of(state)])
    L.rollback[L.as_tensor(state)] = name


def _first_and_rest(L: Lowerer, t: str) -> str:
    """Split sizes [1, T-1] along the tokens of t [1, T, ...] (made once per graph)."""
    cache = getattr(L, "_split_first", None)
    if cache is None:
        tokens = L.b.one("Gather", [L.b.one("Shape", [t]), L.b.const(np.array([1], np.int64))], axis=0)
        one = L.b.const(np.array([1], np.int64))
        cache = L._split_first = L.b.one("Concat", [one, L.b.one("Sub", [tokens, one])], axis=0)
    return cache


def _packed_heads(L: Lowerer, t: str, heads: int, dim: int, repeat: int) -> str:
    """[1, T, H, D] -> [1, T, H*repeat*D], each head repeated `repeat` times consecutively."""
    if repeat > 1:
        t = L.b.one("Unsqueeze", [t, L.b.const(np.array([3], np.int64))])
        t = L.b.one("Expand", [t, L.b.const(np.array([1, 1, 1, repeat, 1], np.int64))])
    return L.b.one("Reshape", [t, L.b.const(np.array([1, -1, heads * repeat * dim], np.int64))])


@lowering(DS.gated_delta_rule.default)
def _gated_delta(L: Lowerer, node, q, k, v, g, beta, state):
    _, _, hk, dk = L.meta(q).shape
    _, _, hv, dv = L.meta(v).shape
    r = hv // hk
    qp = _packed_heads(L, L.as_tensor(q), hk, dk, r)
    kp = _packed_heads(L, L.as_tensor(k), hk, dk, r)
    vp = _packed_heads(L, L.as_tensor(v), hv, dv, 1)
    ins = [qp, kp, vp, L.as_tensor(state), L.as_tensor(g), L.as_tensor(beta)]

    def attend(ins: list[str], outputs: list[str] | None = None) -> list[str]:
        return L.b.node(
            "LinearAttention",
            ins,
            n_out=2,
            outputs=outputs,
            domain="" if L.opset >= STANDARD_OPSET else MS,  # same attributes and semantics in both domains
            q_num_heads=hv,
            kv_num_heads=hv,
            update_rule="gated_delta",
            scale=float(dk) ** -0.5,
            chunk_size=64,
        )

    if L.rollback is None:
        out, new_state = attend(ins)
    else:
        # --mtp: the recurrent state after the call's first token is an output too (rollback.*: the state to keep
        # when the first draft is rejected). Two calls, over token 0 and over tokens 1 .. T-1 (none for T = 1: the
        # op passes the state through, in place where the caller binds rollback.* and present.* to one buffer);
        # the same result as one call (checked equal to the last bit on ONNX Runtime 1.31).
        sizes = _first_and_rest(L, qp)
        parts = [qp, kp, vp, L.as_tensor(g), L.as_tensor(beta)]
        head, tail = zip(*(L.b.node("Split", [t, sizes], n_out=2, axis=1) for t in parts))
        head, tail = list(head), list(tail)
        name = rollback_name(ins[3])
        out1, mid = attend(head[:3] + [ins[3]] + head[3:], outputs=[L.b.fresh("linearattention"), name])
        out2, new_state = attend(tail[:3] + [mid] + tail[3:])
        out = L.b.one("Concat", [out1, out2], axis=1)
        L.rollback[ins[3]] = name
    out = L.b.one("Reshape", [out, L.b.const(np.array([1, -1, hv, dv], np.int64))])
    return [out, new_state]


@lowering(DS.attention_with_kv_cache.default)
def _attention(L: Lowerer, node, q, k, v, k_cache, v_cache, pos):
    _, _, h, d = L.meta(q).shape
    hkv = L.meta(k).shape[2]
    qp = L.b.one("Reshape", [L.as_tensor(q), L.b.const(np.array([1, -1, h * d], np.int64))])
    kp = L.b.one("Reshape", [L.as_tensor(k), L.b.const(np.array([1, -1, hkv * d], np.int64))])
    vp = L.b.one("Reshape", [L.as_tensor(v), L.b.const(np.array([1, -1, hkv * d], np.int64))])
    seqlens_k, total = _attention_lengths(L, L.as_tensor(pos), qp)
    past_k, past_v = L.as_tensor(k_cache), L.as_tensor(v_cache)
    inputs, quant = [qp, kp, vp, past_k, past_v, seqlens_k, total], {}
    kvq = L.kv_scales.get(int(past_k.split(".")[1])) if past_k.startswith("past.") else None
    if kvq:  # int8/int4 cache, static per-channel scales (deltaship/lowering/kv_quant.py)
        inputs += ["", "", "", "", "", L.b.const(kvq["key"]), L.b.const(kvq["value"])]
        quant = {"k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL", "kv_cache_bit_width": kvq["bits"]}
    out, kc, vc = L.b.node(
        "GroupQueryAttention",
        inputs,
        n_out=3,
        domain=MS,
        num_heads=h,
        kv_num_heads=hkv,
        scale=float(d) ** -0.5,
        **quant,
    )
    out = L.b.one("Reshape", [out, L.b.const(np.array([1, -1, h, d], np.int64))])
    return [out, kc, vc]


def _attention_lengths(L: Lowerer, pos: str, query: str) -> tuple[str, str]:
    """GQA's seqlens_k (= pos + T - 1, int32 [1]) and total_sequence_length (= pos + T, int32 scalar)."""
    cache = getattr(L, "_attn_lengths", None)
    if cache is not None:
        return cache
    t = L.b.one("Gather", [L.b.one("Shape", [query]), L.b.const(np.array([1], np.int64))], axis=0)
    total64 = L.b.one("Add", [pos, t])
    seqlens = L.b.one("Cast", [L.b.one("Sub", [total64, L.b.const(np.array([1], np.int64))])], to=TensorProto.INT32)
    total = L.b.one("Cast", [L.b.one("Squeeze", [total64, L.b.const(np.array([0], np.int64))])], to=TensorProto.INT32)
    L._attn_lengths = (seqlens, total)
    return seqlens, total


def _as_float32(L: Lowerer, a) -> str:
    t = L.as_tensor(a)
    return t if L.dtype_of(a) == torch.float32 else L.b.one("Cast", [t], to=TensorProto.FLOAT)


@lowering(DS.l2norm.default)
def _l2norm(L: Lowerer, node, x):
    # x / sqrt(sum(x^2) + 1e-6) == RMSNorm with eps 1e-6/d, scaled by d^-1/2: one fused normalization node
    d = int(L.meta(x).shape[-1])
    scale = L.b.const(np.full(d, d**-0.5, np.float32))
    return _rms(L, _as_float32(L, x), scale, 1e-6 / d)


@lowering(DS.delta_gates.default)
def _delta_gates(L: Lowerer, node, a, b, dt_bias, decay_scale):
    if L.opset >= STANDARD_OPSET:  # standard ops: g = decay_scale * softplus(a + dt_bias), beta = sigmoid(b)
        pre = L.b.one("Add", [_as_float32(L, a), _as_float32(L, dt_bias)])
        g = L.b.one("Mul", [_as_float32(L, decay_scale), L.b.one("Softplus", [pre])])
        return [g, L.b.one("Sigmoid", [_as_float32(L, b)])]
    return L.b.node(
        "LinearAttentionGate",
        [_as_float32(L, a), _as_float32(L, dt_bias), _as_float32(L, decay_scale), _as_float32(L, b)],
        n_out=2,
        domain=MS,
    )
