"""Lower a static-shape captured program (torch.export FX graph) to one MIL function.

Canonical ops become MIL composites: RMSNorm as layer_norm over [x, -x] (no fp16 overflow of x^2
on the Neural Engine), the causal conv as K shifted multiply-adds, the gated delta rule as the
recurrent step (T = 1) or the chunked form with the nilpotent-product inverse (T > 1: batched
matmuls only), attention as slice_update into the cache + masked matmul softmax. A state is either
a Core ML state (MLState, fp16: read_state / coreml_update_state) or a pair of fp32 input/output
tensors. Weights become consts (or constexpr_blockwise_shift_scale when quantized), one per
parameter, so two functions built from the same parameters share them after deduplication.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from deltaship.errors import DeltashipError
from deltaship.lowering.aten import GENERIC
from deltaship.lowering.lowerings import OpLowerings
from deltaship.models import ops as _canonical  # noqa: F401  (registers torch.ops.deltaship.*)
from deltaship.quant import quantize_blocks

aten = torch.ops.aten
DS = torch.ops.deltaship
ANE_MAX_DIM = 16384  # larger dimensions do not run on the Neural Engine
NEG = -30000.0  # a fp16-safe "minus infinity" for attention masks


@dataclass
class StateRef:
    """A Core ML state input: read with read_state, written with coreml_update_state."""

    var: Any


@dataclass
class Written:
    """A state's new value that was written back in place (not a function output)."""

    var: Any


def _mil():
    from coremltools.converters.mil import Builder as mb  # lazy: coremltools
    from coremltools.converters.mil.mil import types

    return mb, types


NP = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.int64: np.int32,
    torch.int32: np.int32,
    torch.bool: np.bool_,
}
MILDT = {torch.float32: "fp32", torch.float16: "fp16", torch.int64: "int32", torch.int32: "int32", torch.bool: "bool"}


def weight_const_name(fqn: str, form: str, piece: int | None = None) -> str:
    return f"w_{form}_{fqn.replace('.', '_')}" + (f"_piece{piece}" if piece is not None else "")


class WeightCache:
    """One array per (parameter, form), in its final dtype, shared by every function that uses it.

    Quantized weights are produced in blocks of rows straight into their final int4/int8 array, so
    a 248320-row table never exists in fp32 at once; the MIL consts reference these arrays (no
    copies), and `share_across_functions` lets both functions point at the same blob."""

    ROW_BLOCK = 16384

    def __init__(self, plan, weights, quant: dict, progress: Callable[[str], None] | None):
        self.plan, self.weights, self.quant, self.progress = plan, weights, quant, progress
        self._arrays: dict[tuple, Any] = {}
        self.const_names: dict[str, tuple[str, str, int]] = {}  # MIL const name -> (parameter, form, piece)

    def named(self, fqn: str, form: str, piece: int | None = None) -> str:
        name = weight_const_name(fqn, form, piece)
        self.const_names[name] = (fqn, form, piece or 0)
        return name

    def _row_blocks(self, fqn: str):
        rows = self.plan.shape(fqn)[0]
        if rows <= self.ROW_BLOCK:
            yield slice(0, rows), self.plan.tensor(fqn, self.weights)
            return
        for r in range(0, rows, self.ROW_BLOCK):
            sl = slice(r, min(rows, r + self.ROW_BLOCK))
            yield sl, self.plan.tensor(fqn, self.weights, sl)

    def get(self, fqn: str, form: str, dtype) -> Any:
        """("dense", array, None, None) or ("quantized", int4/int8 codes [N, K], fp16 scales [N, K/block], bits)."""
        key = (fqn, form, np.dtype(dtype).str)
        if key not in self._arrays:
            if self.progress:
                self.progress(fqn)
            q = self.quant[form].get(fqn) if form in ("linear", "embedding") else None
            shape = self.plan.shape(fqn)
            if q is not None:
                from coremltools.converters.mil.mil import types  # lazy: coremltools

                bits, block = q["bits"], q["block_size"]
                half = 1 << (bits - 1)
                data = np.empty(shape, dtype=types.np_int4_dtype if bits == 4 else np.int8)
                scales = np.empty((shape[0], -(-shape[1] // block)), np.float16)
                for sl, w in self._row_blocks(fqn):
                    codes, sc = quantize_blocks(w, bits, block)
                    data[sl] = (codes.reshape(w.shape[0], -1)[:, : shape[1]].astype(np.int16) - half).astype(np.int8)
                    scales[sl] = sc
                self._arrays[key] = ("quantized", data, scales, bits)
            else:
                data = np.empty(shape, dtype=dtype)
                for sl, w in self._row_blocks(fqn):
                    data[sl] = w
                self._arrays[key] = ("dense", data, None, None)
        return self._arrays[key]

    def piece(self, fqn: str, form: str, dtype, rows: slice) -> Any:
        """A block of rows of a (possibly quantized) weight: views, cached so every function gets the same."""
        key = (fqn, form, np.dtype(dtype).str, rows.start, rows.stop)
        if key not in self._arrays:
            kind, data, scales, bits = self.get(fqn, form, dtype)
            self._arrays[key] = (kind, data[rows], None if scales is None else scales[rows], bits)
        return self._arrays[key]


def share_across_functions(prog) -> dict[str, int]:
    """Give identical consts of different functions one weight_id, so they share one blob in the package.

    coremltools' own pass compares candidates with np.allclose, which upcasts both to float64: for a
    quantized 248320-row table that is gigabytes. Here consts are matched by identity (WeightCache hands
    every function the same array) and otherwise by dtype, shape and a hash of their bytes."""

    from coremltools.converters.mil.mil import ListVar  # lazy: coremltools

    groups: dict[tuple, list] = {}
    digests: dict[int, str] = {}
    for func in prog.functions.values():
        for op in func.operations:
            if op.op_type != "const" or isinstance(op.outputs[0], ListVar):
                continue
            val = op.outputs[0].val
            if not isinstance(val, np.ndarray) or val.size < 2:
                continue
            if id(val) not in digests:
                digests[id(val)] = hashlib.sha1(np.ascontiguousarray(val).view(np.uint8).reshape(-1)).hexdigest()
            key = (str(op.outputs[0].dtype), val.shape, digests[id(val)])
            groups.setdefault(key, []).append(op)
    shared = 0
    for i, ops in enumerate(g for g in groups.values() if len(g) > 1):
        for op in ops:
            op.weight_id = str(i)
        shared += 1
    return {"shared_consts": shared}


class MILLowerer:
    def __init__(
        self,
        program: torch.export.ExportedProgram,
        weights: WeightCache,
        state_modes: dict[str, str],
        name: str,
        param_prefix: str = "",
    ):
        self.ep, self.w, self.state_modes, self.fname = program, weights, state_modes, name
        sig = program.graph_signature
        self.param_of = {
            k: v.removeprefix(param_prefix) for k, v in {**sig.inputs_to_parameters, **sig.inputs_to_buffers}.items()
        }
        self.env: dict[str, Any] = {}
        self.mb, self.types = _mil()
        self._n = 0

    def uname(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def meta(self, node):
        return node.meta.get("val")

    def dtype_of(self, a) -> torch.dtype:
        return self.meta(a).dtype

    def val(self, a):
        if isinstance(a, torch.fx.Node):
            if a.name in self.param_of:
                return self.param(a)
            return self.env[a.name]
        if isinstance(a, (list, tuple)):
            return [self.val(x) for x in a]
        return a

    def tensor(self, a, dtype: torch.dtype | None = None):
        """A MIL value for an FX arg; python scalars become constants of `dtype`."""
        v = self.val(a)
        if isinstance(v, StateRef):
            return self.mb.read_state(input=v.var)
        if isinstance(v, (int, float, bool)) and not isinstance(v, np.ndarray):
            return np.array(v, dtype=NP.get(dtype or torch.float32, np.float32))
        return v

    def param(self, node):
        fqn = self.param_of[node.name]
        dt = NP[self.dtype_of(node)]
        kind, data, scales, bits = self.w.get(fqn, "plain", dt)
        return data

    def weight_for(self, node, form: str):
        """A linear/embedding weight: a const, or constexpr_blockwise_shift_scale when quantized."""
        fqn = self.param_of[node.name]
        dt = NP[self.dtype_of(node)]
        kind, data, scales, bits = self.w.get(fqn, form, dt)
        if kind == "dense":  # named after the parameter, so compressed values can be mapped back
            return self.mb.const(val=data, name=self.w.named(fqn, form))
        w = self.mb.constexpr_blockwise_shift_scale(data=data, scale=scales, name=self.uname(fqn.replace(".", "_")))
        return w if dt == np.float16 else self.mb.cast(x=w, dtype="fp32")

    # ---- the primitives of the generic aten table (deltaship/lowering/aten.py) --------------------
    def value(self, a, dtype: torch.dtype | None = None):
        return self.tensor(a, dtype)

    def elementwise(self, kind: str, inputs: list, dtype: torch.dtype):
        if kind == "neg":
            return self.mb.mul(x=inputs[0], y=np.array(-1, dtype=NP[dtype]))
        op = getattr(self.mb, "real_div" if kind == "div" else kind)  # MIL's other kinds are named as ours
        return op(x=inputs[0], y=inputs[1]) if len(inputs) == 2 else op(x=inputs[0])

    def cast(self, x, src: torch.dtype, dst: torch.dtype | None):
        return x if dst is None or MILDT[dst] == MILDT[src] else self.mb.cast(x=x, dtype=MILDT[dst])

    def expand_dims(self, x, axis: int):
        return self.mb.expand_dims(x=x, axes=[axis])

    def concat(self, values: list, axis: int):
        return self.mb.concat(values=values, axis=axis)

    def split(self, x, sizes: list[int], axis: int) -> list:
        return list(self.mb.split(x=x, split_sizes=np.array(sizes, np.int32), axis=axis))

    # ---- driver ------------------------------------------------------------------------------
    def build(self, input_names: list[str], state_names: list[str], output_names: list[str]):
        """Build the MIL function; returns (function, output name list actually emitted)."""
        import coremltools as ct  # lazy: coremltools
        from coremltools.converters.mil.mil import Function

        mb, types = self.mb, self.types
        user = [n for n in self.ep.graph.nodes if n.op == "placeholder" and n.name not in self.param_of]
        names = input_names + state_names
        placeholders = {}
        kinds = {}
        for node, name in zip(user, names):
            val = self.meta(node)
            dt = {torch.int64: types.int32, torch.float16: types.fp16, torch.float32: types.fp32}[val.dtype]
            if self.state_modes.get(name) == "state":
                placeholders[name] = mb.state_tensor_placeholder(tuple(val.shape), types.fp16)
                kinds[node.name] = "state"
            else:
                placeholders[name] = mb.placeholder(tuple(val.shape), dtype=dt)
                kinds[node.name] = "input"
        with Function(placeholders, opset_version=ct.target.iOS18) as func:
            for node, name in zip(user, names):
                var = func.inputs[name]
                self.env[node.name] = StateRef(var) if kinds[node.name] == "state" else var
            outputs = None
            for node in self.ep.graph.nodes:
                if node.op == "placeholder":
                    continue
                if node.op == "output":
                    outputs = node.args[0]
                    break
                fn = MIL_LOWERINGS.get(node.target)
                if fn is None:
                    raise DeltashipError(
                        f"coreml lowering: no lowering for op {node.target} (FX node {node.name!r}, "
                        f"{(node.meta.get('stack_trace') or '').strip().splitlines()[-1:] or 'unknown source'})",
                        "this model uses an op the Core ML target does not support yet; please report it",
                    )
                self.env[node.name] = fn(self, node, *node.args, **node.kwargs)
            flat = torch.utils._pytree.tree_leaves(outputs)
            outs, emitted = [], []
            for src, oname in zip(flat, output_names):
                v = self.env[src.name]
                if isinstance(v, Written):
                    continue  # a state written in place
                outs.append(mb.identity(x=v, name=oname))
                emitted.append(oname)
            func.set_outputs(outs)
        return func, emitted


MIL_LOWERINGS = OpLowerings("coreml").include(GENERIC)  # the generic aten ops (lowering/aten.py), then Core ML's
lowering = MIL_LOWERINGS.register


# ---- aten: where Core ML differs (fixed shapes, weight forms, the vision tower's ops) ----------------
@lowering(aten.sym_size.int)
def _sym_size(L, node, x, dim):
    return int(L.meta(x).shape[dim])


@lowering(aten.arange.default)
def _arange(L, node, end, **kwargs):
    return np.arange(int(L.val(end)), dtype=np.int32)


@lowering(aten.reshape.default, aten.view.default)
def _reshape(L, node, x, shape):
    return L.mb.reshape(x=L.tensor(x), shape=np.array(list(L.meta(node).shape), dtype=np.int32))


@lowering(aten.slice.Tensor)
def _slice(L, node, x, dim=0, start=None, end=None, step=1):
    shape = list(L.meta(x).shape)
    dim %= len(shape)
    s, e, st = slice(start, end, step).indices(shape[dim])
    begin = [0] * len(shape)
    stop = list(shape)
    begin[dim], stop[dim] = s, e
    stride = [1] * len(shape)
    stride[dim] = st
    return L.mb.slice_by_index(
        x=L.tensor(x), begin=np.array(begin, np.int32), end=np.array(stop, np.int32), stride=np.array(stride, np.int32)
    )


@lowering(aten.select.int)
def _select(L, node, x, dim, index):
    shape = list(L.meta(x).shape)
    dim %= len(shape)
    index %= shape[dim]
    begin, stop = [0] * len(shape), list(shape)
    begin[dim], stop[dim] = index, index + 1
    squeeze = [False] * len(shape)
    squeeze[dim] = True
    return L.mb.slice_by_index(
        x=L.tensor(x), begin=np.array(begin, np.int32), end=np.array(stop, np.int32), squeeze_mask=squeeze
    )


@lowering(aten.chunk.default)
def _chunk(L, node, x, chunks, dim=0):
    shape = list(L.meta(x).shape)
    dim %= len(shape)
    size = -(-shape[dim] // chunks)
    sizes = [min(size, shape[dim] - i) for i in range(0, shape[dim], size)]
    return list(L.mb.split(x=L.tensor(x), split_sizes=np.array(sizes, np.int32), axis=dim))


@lowering(aten.unbind.int)
def _unbind(L, node, x, dim=0):
    shape = list(L.meta(x).shape)
    dim %= len(shape)
    parts = L.mb.split(x=L.tensor(x), num_splits=shape[dim], axis=dim)
    return [L.mb.squeeze(x=p, axes=[dim]) for p in (parts if isinstance(parts, (list, tuple)) else [parts])]


@lowering(aten.transpose.int)
def _transpose(L, node, x, dim0, dim1):
    rank = len(L.meta(x).shape)
    perm = list(range(rank))
    perm[dim0 % rank], perm[dim1 % rank] = perm[dim1 % rank], perm[dim0 % rank]
    return L.mb.transpose(x=L.tensor(x), perm=perm)


@lowering(aten.matmul.default)
def _matmul(L, node, x, y):
    return L.mb.matmul(x=L.tensor(x), y=L.tensor(y))


@lowering(aten.softmax.int, aten._softmax.default)
def _softmax(L, node, x, dim, *args):
    return L.mb.softmax(x=L.tensor(x), axis=dim)


@lowering(aten.gelu.default)
def _gelu(L, node, x, approximate="none"):
    mode = {"none": "EXACT", "tanh": "TANH_APPROXIMATION"}[approximate]
    return L.mb.gelu(x=L.tensor(x), mode=mode)


@lowering(aten.layer_norm.default)
def _layer_norm(L, node, x, shape, weight=None, bias=None, eps=1e-5, *args):
    xv = L.tensor(x)
    axes = list(range(-len(shape), 0))
    kw = {}
    if weight is not None:
        kw["gamma"] = L.tensor(weight)
    if bias is not None:
        kw["beta"] = L.tensor(bias)
    return L.mb.layer_norm(x=xv, axes=axes, epsilon=np.array(eps, dtype=_np_of(xv)), **kw)


@lowering(aten.sum.dim_IntList)
def _sum(L, node, x, dims, keepdim=False, dtype=None):
    return L.mb.reduce_sum(x=L.tensor(x), axes=list(dims), keep_dims=bool(keepdim))


@lowering(aten.embedding.default)
def _embedding(L, node, weight, ids, *args):
    return L.mb.gather(x=L.weight_for(weight, "embedding"), indices=L.tensor(ids), axis=0)


@lowering(aten.linear.default)
def _linear(L, node, x, weight, bias=None):
    xv = L.tensor(x)
    n = L.meta(weight).shape[0]
    if bias is not None:  # the vision tower's linears (the decoder's have none)
        if n > ANE_MAX_DIM:
            raise DeltashipError(
                f"coreml lowering: a linear with a bias and {n} outputs (over {ANE_MAX_DIM})",
                "this model uses a layer the Core ML target does not split yet; please report it",
            )
        return L.mb.linear(x=xv, weight=L.weight_for(weight, "linear"), bias=L.tensor(bias))
    if n <= ANE_MAX_DIM:
        return L.mb.linear(x=xv, weight=L.weight_for(weight, "linear"))
    # Split a wide projection (the 248320-wide LM head) so no dimension exceeds the Neural Engine's.
    fqn = L.param_of[weight.name]
    dt = NP[L.dtype_of(weight)]
    pieces = math.ceil(n / ANE_MAX_DIM)
    size = math.ceil(n / pieces)
    outs = []
    for i in range(pieces):
        rows = slice(i * size, min(n, (i + 1) * size))
        kind, data, scales, bits = L.w.piece(fqn, "linear", dt, rows)
        if kind == "dense":
            w = L.mb.const(val=data, name=L.w.named(fqn, "linear", i))
        else:
            mb = L.mb
            w = mb.constexpr_blockwise_shift_scale(
                data=data, scale=scales, name=L.uname(f"{fqn}_{i}".replace(".", "_"))
            )
            if dt != np.float16:
                w = mb.cast(x=w, dtype="fp32")
        outs.append(L.mb.linear(x=xv, weight=w))
    return L.mb.concat(values=outs, axis=-1)


# ---- canonical ops -----------------------------------------------------------------------------
def _rms(L, x, eps: float):
    """x / sqrt(mean(x^2) + eps) as layer_norm over concat([x, -x]) (mean exactly 0, no x^2 overflow)."""
    mb = L.mb
    d = x.shape[-1]
    both = mb.concat(values=[x, mb.mul(x=x, y=np.array(-1, dtype=_np_of(x)))], axis=-1)
    normed = mb.layer_norm(x=both, axes=[-1], epsilon=np.array(eps, dtype=_np_of(x)))
    shape = list(x.shape)
    return mb.slice_by_index(x=normed, begin=np.zeros(len(shape), np.int32), end=np.array(shape[:-1] + [d], np.int32))


def _np_of(v) -> type:
    return np.float16 if v.dtype.__name__ == "fp16" else np.float32


def _norm_scaled(L, x, weight, eps):
    y = _rms(L, x, eps)
    w = weight.astype(_np_of(x)) if isinstance(weight, np.ndarray) else L.mb.cast(x=weight, dtype=x.dtype.__name__)
    return L.mb.mul(x=y, y=w)


@lowering(DS.rms_norm.default)
def _rms_norm(L, node, x, weight, eps):
    return _norm_scaled(L, L.tensor(x), L.tensor(weight), float(eps))


@lowering(DS.gated_rms_norm.default)
def _gated_rms_norm(L, node, x, gate, weight, eps):
    y = _norm_scaled(L, L.tensor(x), L.tensor(weight), float(eps))
    return L.mb.mul(x=y, y=L.mb.silu(x=L.tensor(gate)))


@lowering(DS.l2norm.default)
def _l2norm(L, node, x):
    # x / sqrt(sum(x^2) + 1e-6) == D^-1/2 * x / sqrt(mean(x^2) + 1e-6 / D)
    xv = L.tensor(x)
    if xv.dtype.__name__ != "fp32":
        xv = L.mb.cast(x=xv, dtype="fp32")
    d = int(L.meta(x).shape[-1])
    return L.mb.mul(x=_rms(L, xv, 1e-6 / d), y=np.array(d**-0.5, np.float32))


@lowering(DS.delta_gates.default)
def _delta_gates(L, node, a, b, dt_bias, decay_scale):
    mb = L.mb
    af = mb.cast(x=L.tensor(a), dtype="fp32") if L.dtype_of(a) != torch.float32 else L.tensor(a)
    bf = mb.cast(x=L.tensor(b), dtype="fp32") if L.dtype_of(b) != torch.float32 else L.tensor(b)
    g = mb.mul(
        x=L.tensor(decay_scale).astype(np.float32),
        y=mb.softplus(x=mb.add(x=af, y=L.tensor(dt_bias).astype(np.float32))),
    )
    return [g, mb.sigmoid(x=bf)]


def _state_in(L, a):
    """The current value of a state argument, and the state var when it is a Core ML state."""
    v = L.val(a)
    if isinstance(v, StateRef):
        return L.mb.read_state(input=v.var), v.var
    return v, None


def _state_out(L, state_var, value, dtype: str):
    """Write a Core ML state (returns the marker and the written value, which downstream ops should
    read so the write stays in place), or pass an io-state's new value through."""
    if state_var is None:
        return value, value
    mb = L.mb
    if value.dtype.__name__ != "fp16":
        value = mb.cast(x=value, dtype="fp16")
    return Written(state_var), mb.coreml_update_state(state=state_var, value=value)


@lowering(DS.causal_conv_with_state.default)
def _conv(L, node, x, state, weight):
    mb = L.mb
    xv = L.tensor(x)
    sv, svar = _state_in(L, state)
    if sv.dtype.__name__ != xv.dtype.__name__:
        sv = mb.cast(x=sv, dtype=xv.dtype.__name__)
    w = L.tensor(weight)  # [C, K] numpy
    c, k = w.shape
    t = int(L.meta(x).shape[1])
    full = mb.concat(values=[sv, xv], axis=1)  # [1, K-1+T, C]
    acc = None
    for j in range(k):
        tap = mb.slice_by_index(x=full, begin=np.array([0, j, 0], np.int32), end=np.array([1, j + t, c], np.int32))
        term = mb.mul(x=tap, y=w[:, j].astype(_np_of(xv)))
        acc = term if acc is None else mb.add(x=acc, y=term)
    new = mb.slice_by_index(x=full, begin=np.array([0, t, 0], np.int32), end=np.array([1, t + k - 1, c], np.int32))
    if L.dtype_of(state) != L.dtype_of(x) and svar is None:
        new = mb.cast(x=new, dtype=MILDT[L.dtype_of(state)])
    return [mb.silu(x=acc), _state_out(L, svar, new, "fp16")[0]]


def _unit_lower_inverse(mb, strict, c: int):
    """(I + L)^-1 for strictly lower-triangular L [..., c, c]: (I - L)(I + L^2)(I + L^4)... up to the first
    power L^(2^m) with 2^m >= c (L^c = 0), so any c works."""
    eye = np.eye(c, dtype=np.float32)
    n = mb.mul(x=strict, y=np.float32(-1))
    inv = mb.add(x=n, y=eye)
    p = n
    for _ in range(math.ceil(math.log2(c)) - 1):
        p = mb.matmul(x=p, y=p)
        inv = mb.matmul(x=inv, y=mb.add(x=p, y=eye))
    return inv


@lowering(DS.gated_delta_rule.default)
def _gated_delta(L, node, q, k, v, g, beta, state):
    mb = L.mb
    _, t, hk, dk = L.meta(q).shape
    hv, dv = L.meta(v).shape[2], L.meta(v).shape[3]
    r = hv // hk
    f32 = lambda x: x if x.dtype.__name__ == "fp32" else mb.cast(x=x, dtype="fp32")  # noqa: E731
    qv, kv, vv, gv, bv = (f32(L.tensor(a)) for a in (q, k, v, g, beta))
    sv, svar = _state_in(L, state)
    s = f32(sv)

    def heads_first(x, h, d):  # [1, T, h, d] -> [1, Hv, T, d] (q/k repeated per value head)
        x = mb.transpose(x=x, perm=[0, 2, 1, 3])
        if r > 1 and h == hk:
            x = mb.reshape(
                x=mb.tile(x=mb.expand_dims(x=x, axes=[2]), reps=[1, 1, r, 1, 1]),
                shape=np.array([1, hv, t, d], np.int32),
            )
        return x

    qh = mb.mul(x=heads_first(qv, hk, dk), y=np.float32(dk**-0.5))
    kh, vh = heads_first(kv, hk, dk), heads_first(vv, hv, dv)
    gh = mb.transpose(x=gv, perm=[0, 2, 1])  # [1, Hv, T]
    bh = mb.transpose(x=bv, perm=[0, 2, 1])
    if t == 1:
        decay = mb.expand_dims(x=mb.exp(x=gh), axes=[3])  # [1, Hv, 1, 1]
        s = mb.mul(x=s, y=decay)
        kv_mem = mb.matmul(x=kh, y=s)  # [1, Hv, 1, dv]
        delta = mb.mul(x=mb.sub(x=vh, y=kv_mem), y=mb.expand_dims(x=bh, axes=[3]))
        s = mb.add(x=s, y=mb.matmul(x=kh, y=delta, transpose_x=True))
        o = mb.matmul(x=qh, y=s)
    else:
        c = min(t, 64)  # any length up to 64 (the verify functions' 2 and 3); longer: multiples of 64
        if t % c:
            raise DeltashipError(
                f"coreml: the prefill chunk ({t}) must be a power of two up to 64 or a multiple of 64",
                "pass --prefill-chunk 64 (or 16, 32, 128, 256 ...)",
            )
        outs = []
        tri = np.tril(np.ones((c, c), np.float32))
        strict_mask = tri - np.eye(c, dtype=np.float32)
        for i in range(t // c):
            sl = lambda x, d: mb.slice_by_index(  # noqa: E731
                x=x,
                begin=np.array([0, 0, i * c] + [0] * (d - 3), np.int32),
                end=np.array([1, hv, (i + 1) * c] + ([x.shape[3]] if d == 4 else []), np.int32),
            )
            qc, kc, vc, gc, bc = sl(qh, 4), sl(kh, 4), sl(vh, 4), sl(gh, 3), sl(bh, 3)
            cum = mb.cumsum(x=gc, axis=2)  # [1, Hv, c]
            diff = mb.sub(x=mb.expand_dims(x=cum, axes=[3]), y=mb.expand_dims(x=cum, axes=[2]))  # [.., c, c]
            # exp of the lower triangle only (the upper one is masked to 0 before exp would overflow)
            decay = mb.mul(x=mb.exp(x=mb.mul(x=diff, y=tri)), y=tri)
            k_beta = mb.mul(x=kc, y=mb.expand_dims(x=bc, axes=[3]))
            strict = mb.mul(x=mb.mul(x=mb.matmul(x=k_beta, y=kc, transpose_y=True), y=decay), y=strict_mask)
            inv = _unit_lower_inverse(mb, strict, c)
            u = mb.matmul(x=inv, y=mb.mul(x=vc, y=mb.expand_dims(x=bc, axes=[3])))
            ecum = mb.expand_dims(x=mb.exp(x=cum), axes=[3])
            w = mb.matmul(x=inv, y=mb.mul(x=k_beta, y=ecum))
            attn = mb.mul(x=mb.matmul(x=qc, y=kc, transpose_y=True), y=decay)
            last = mb.slice_by_index(x=cum, begin=np.array([0, 0, c - 1], np.int32), end=np.array([1, hv, c], np.int32))
            k_dec = mb.mul(x=kc, y=mb.expand_dims(x=mb.exp(x=mb.sub(x=last, y=cum)), axes=[3]))
            v_new = mb.sub(x=u, y=mb.matmul(x=w, y=s))
            outs.append(mb.add(x=mb.matmul(x=mb.mul(x=qc, y=ecum), y=s), y=mb.matmul(x=attn, y=v_new)))
            s = mb.add(
                x=mb.mul(x=s, y=mb.expand_dims(x=mb.exp(x=last), axes=[3])),
                y=mb.matmul(x=k_dec, y=v_new, transpose_x=True),
            )
        o = outs[0] if len(outs) == 1 else mb.concat(values=outs, axis=2)
    o = mb.transpose(x=o, perm=[0, 2, 1, 3])  # [1, T, Hv, dv]
    if L.dtype_of(node.args[2]) != torch.float32:
        o = mb.cast(x=o, dtype=MILDT[L.dtype_of(node.args[2])])
    return [o, _state_out(L, svar, s, "fp16")[0]]


@lowering(DS.attention_with_kv_cache.default)
def _attention(L, node, q, k, v, k_cache, v_cache, pos):
    mb = L.mb
    _, t, h, d = L.meta(q).shape
    hkv, s = L.meta(k_cache).shape[1], L.meta(k_cache).shape[2]
    rep = h // hkv
    qv, kv, vv = L.tensor(q), L.tensor(k), L.tensor(v)
    kc, kvar = _state_in(L, k_cache)
    vc, vvar = _state_in(L, v_cache)
    cdt = kc.dtype.__name__
    p = L.tensor(pos)  # int32 [1]
    zero = np.array([0], np.int32)
    begin = mb.concat(values=[zero, zero, p, zero], axis=0)
    end = mb.concat(
        values=[
            np.array([1], np.int32),
            np.array([hkv], np.int32),
            mb.add(x=p, y=np.int32(t)),
            np.array([d], np.int32),
        ],
        axis=0,
    )
    cast = lambda x: x if x.dtype.__name__ == cdt else mb.cast(x=x, dtype=cdt)  # noqa: E731
    # each state write directly after the op that produces it (coremltools' canonical in-place order)
    kc = mb.slice_update(x=kc, update=cast(mb.transpose(x=kv, perm=[0, 2, 1, 3])), begin=begin, end=end)
    new_k, kc = _state_out(L, kvar, kc, "fp16")
    vc = mb.slice_update(x=vc, update=cast(mb.transpose(x=vv, perm=[0, 2, 1, 3])), begin=begin, end=end)
    new_v, vc = _state_out(L, vvar, vc, "fp16")
    adt = qv.dtype.__name__
    kca = kc if cdt == adt else mb.cast(x=kc, dtype=adt)
    vca = vc if cdt == adt else mb.cast(x=vc, dtype=adt)
    # query heads grouped by their KV head: [1, Hkv, rep*T, D]
    qg = mb.reshape(x=mb.transpose(x=qv, perm=[0, 2, 1, 3]), shape=np.array([1, hkv, rep * t, d], np.int32))
    scores = mb.mul(x=mb.matmul(x=qg, y=kca, transpose_y=True), y=np.array(d**-0.5, dtype=_np_of(qv)))
    # key j is visible to new token i when j <= pos + i
    limit = mb.add(x=mb.expand_dims(x=np.tile(np.arange(t, dtype=np.int32), rep), axes=[1]), y=p)  # [rep*T, 1]
    visible = mb.less_equal(x=np.arange(s, dtype=np.int32)[None, :], y=limit)  # [rep*T, S]
    # (visible - 1) * 30000: 0 where visible, a fp16-safe -30000 elsewhere (select with scalar branches
    # gets a scalar type from coremltools' type inference, whatever the condition's shape)
    bias = mb.mul(
        x=mb.sub(x=mb.cast(x=visible, dtype=adt), y=np.array(1, dtype=_np_of(qv))), y=np.array(-NEG, dtype=_np_of(qv))
    )
    probs = mb.softmax(x=mb.add(x=scores, y=bias), axis=-1)
    out = mb.matmul(x=probs, y=vca)  # [1, Hkv, rep*T, D]
    out = mb.transpose(x=mb.reshape(x=out, shape=np.array([1, h, t, d], np.int32)), perm=[0, 2, 1, 3])
    return [out, new_k, new_v]
