"""The QNN lowering: the ONNX target's op table with the stateful ops rewritten in ops the HTP validates.

QNN's HTP backend takes static shapes and standard ops only (docs/npu.md lists the op forms it accepted
on the simulator). The ONNX target's contrib ops have no QNN form, so here, over a program captured for a
fixed token count:
- the gated delta rule is one step per token (unrolled over the static token count), batched MatMuls and
  elementwise ops per value head;
- the DeltaNet gates are Softplus and Sigmoid;
- attention writes the new key/value rows into the static cache (Where(one-hot position) for one token, a
  one-hot MatMul for several) and attends
  with MatMul + additive causal mask + Softmax, q heads grouped per KV head (no repeated cache);
- a static `arange` is a constant (no Range node);
- a split is one Slice per piece (see _split);
- RMSNorm normalizes in fp32 (QNN refuses a SimplifiedLayerNormalization of fp16 input and fp32 scale).
Every other op keeps the ONNX target's lowering (the conv as shifted Mul/Add, norms as
SimplifiedLayerNormalization).
"""

from __future__ import annotations

import numpy as np
import torch
from onnx import TensorProto

from deltaship.errors import DeltashipError
from deltaship.lowering.lowerings import OpLowerings
from deltaship.lowering.onnx.lowering import DS, LOWERINGS, TORCH_TO_ONNX, Lowerer, _rms, aten

QNN_LOWERINGS = OpLowerings("qnn")
_OVERRIDES: dict = {}
_NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}
MASKED = -30000.0  # an additive mask that stays finite in fp16 (the HTP computes in fp16)


def _override(op):
    def deco(fn):
        _OVERRIDES[op] = fn
        return fn

    return deco


def _f32(L: Lowerer, a) -> str:
    t = L.as_tensor(a)
    return t if L.dtype_of(a) == torch.float32 else L.b.one("Cast", [t], to=TensorProto.FLOAT)


def _shape(L: Lowerer, t: str, shape) -> str:
    return L.b.one("Reshape", [t, L.b.const(np.array(shape, np.int64))])


def _static_tokens(node, what: str) -> int:
    t = node.args[0].meta["val"].shape[1]
    if not isinstance(t, int):
        raise DeltashipError(
            f"qnn lowering: {what} has a dynamic token dimension (FX node {node.name!r}); QNN needs static shapes",
            "capture the program with a static token count (deltaship.lowering.passes.capture(..., static=T))",
        )
    return t


@_override(DS.gated_delta_rule.default)
def _gated_delta(L: Lowerer, node, q, k, v, g, beta, state):
    """T tokens, one step each (unrolled; T is static): S = exp(g) S; S += k (beta (v - S^T k))^T;
    o = q^T S / sqrt(dk), per value head, fp32."""
    t = _static_tokens(node, "the gated delta rule")
    _, _, hk, dk = L.meta(q).shape
    _, _, hv, dv = L.meta(v).shape
    r = hv // hk

    def per_value_head(x, d: int) -> str:  # [1, T, Hk, d] -> [T, Hv, 1, d]: head h serves value heads h*r .. h*r+r-1
        x = _shape(L, _f32(L, x), [t, hk, 1, d])
        if r > 1:
            x = L.b.one("Expand", [x, L.b.const(np.array([t, hk, r, d], np.int64))])
        return _shape(L, x, [t, hv, 1, d])

    def token(x: str, i: int, shape) -> str:  # row i of x [T, ...] as `shape`
        bounds = [L.b.const(np.array([v], np.int64)) for v in (i, i + 1, 0)]
        return _shape(L, L.b.one("Slice", [x, *bounds]), shape)

    qs = L.b.one("Mul", [per_value_head(q, dk), L.b.const(np.array(dk**-0.5, np.float32))])
    ks = per_value_head(k, dk)
    vs = _shape(L, _f32(L, v), [t, hv, 1, dv])
    decays = L.b.one("Exp", [_shape(L, _f32(L, g), [t, hv, 1, 1])])
    betas = _shape(L, _f32(L, beta), [t, hv, 1, 1])
    s = _shape(L, _f32(L, state), [hv, dk, dv])
    outs = []
    for i in range(t):
        kh = token(ks, i, [hv, 1, dk])
        s = L.b.one("Mul", [s, token(decays, i, [hv, 1, 1])])
        kv_mem = L.b.one("MatMul", [kh, s])  # [Hv, 1, dv]
        delta = L.b.one("Mul", [L.b.one("Sub", [token(vs, i, [hv, 1, dv]), kv_mem]), token(betas, i, [hv, 1, 1])])
        s = L.b.one("Add", [s, L.b.one("MatMul", [L.b.one("Transpose", [kh], perm=[0, 2, 1]), delta])])
        outs.append(L.b.one("MatMul", [token(qs, i, [hv, 1, dk]), s]))  # [Hv, 1, dv]
    o = outs[0] if t == 1 else L.b.one("Concat", outs, axis=1)  # [Hv, T, dv]
    o = _shape(L, L.b.one("Transpose", [o], perm=[1, 0, 2]), [1, t, hv, dv])
    if L.dtype_of(v) != torch.float32:
        o = L.b.one("Cast", [o], to=TORCH_TO_ONNX[L.dtype_of(v)])
    new_state = _shape(L, s, [1, hv, dk, dv])
    if L.dtype_of(state) != torch.float32:
        new_state = L.b.one("Cast", [new_state], to=TORCH_TO_ONNX[L.dtype_of(state)])
    return [o, new_state]


@_override(DS.delta_gates.default)
def _delta_gates(L: Lowerer, node, a, b, dt_bias, decay_scale):
    """g = decay_scale * softplus(a + dt_bias), beta = sigmoid(b), fp32."""
    pre = L.b.one("Add", [_f32(L, a), _f32(L, dt_bias)])
    g = L.b.one("Mul", [_f32(L, decay_scale), L.b.one("Softplus", [pre])])
    return [g, L.b.one("Sigmoid", [_f32(L, b)])]


@_override(DS.attention_with_kv_cache.default)
def _attention(L: Lowerer, node, q, k, v, k_cache, v_cache, pos):
    """Write rows pos .. pos+T-1 of the static cache, attend causally over rows 0 .. pos+t (fp32 scores)."""
    t = _static_tokens(node, "attention")
    _, _, h, d = L.meta(q).shape
    _, hkv, s, _ = L.meta(k_cache).shape
    rep = h // hkv
    cdt = TORCH_TO_ONNX[L.dtype_of(k_cache)]
    rows = L.b.const(np.arange(s, dtype=np.int64).reshape(s, 1))  # [S, 1]
    steps = L.b.const(np.arange(t, dtype=np.int64).reshape(1, t))  # [1, T]
    at = L.b.one("Add", [L.as_tensor(pos), steps])  # [1, T]: the new tokens' positions
    hot = L.b.one("Equal", [rows, at])  # [S, T]

    def write(new, cache) -> str:  # new [1, T, Hkv, D] -> cache [1, Hkv, S, D] with row pos+j = token j
        new = L.b.one("Transpose", [L.as_tensor(new)], perm=[0, 2, 1, 3])  # [1, Hkv, T, D]
        if L.dtype_of(cache) != L.dtype_of(node.args[1]):
            new = L.b.one("Cast", [new], to=cdt)
        if t == 1:
            at_row = L.b.one("Unsqueeze", [hot, L.b.const(np.array([0, 1], np.int64))])  # [1, 1, S, 1]
            return L.b.one("Where", [at_row, new, L.as_tensor(cache)])
        # T rows: the one-hot [S, T] places them (a MatMul, exact: one 1 per row); the other rows keep the cache
        hot_f = L.b.one("Cast", [hot], to=cdt)
        placed = L.b.one("MatMul", [hot_f, new])  # [1, Hkv, S, D]
        written = L.b.one("ReduceMax", [hot_f, L.b.const(np.array([1], np.int64))], keepdims=1)  # [S, 1]
        kept = L.b.one("Mul", [L.as_tensor(cache), L.b.one("Sub", [L.b.const(np.array(1, _NP[cdt])), written])])
        return L.b.one("Add", [kept, placed])

    kc, vc = write(k, k_cache), write(v, v_cache)
    # q heads grouped by KV head: head i reads KV head i // rep
    qg = L.b.one("Transpose", [_shape(L, _f32(L, q), [t, hkv, rep, d])], perm=[1, 2, 0, 3])  # [Hkv, rep, T, D]
    qg = _shape(L, qg, [hkv, rep * t, d])
    keys = _shape(L, kc if cdt == TensorProto.FLOAT else L.b.one("Cast", [kc], to=TensorProto.FLOAT), [hkv, s, d])
    vals = _shape(L, vc if cdt == TensorProto.FLOAT else L.b.one("Cast", [vc], to=TensorProto.FLOAT), [hkv, s, d])
    scores = L.b.one("MatMul", [qg, L.b.one("Transpose", [keys], perm=[0, 2, 1])])  # [Hkv, rep*T, S]
    scores = L.b.one("Mul", [scores, L.b.const(np.array(d**-0.5, np.float32))])
    # position j may see cache rows 0 .. pos+j: masked where row > pos+j
    cols = L.b.const(np.arange(s, dtype=np.int64).reshape(1, s))
    future = L.b.one("Less", [L.b.one("Transpose", [at], perm=[1, 0]), cols])  # [T, S]
    mask = L.b.one("Mul", [L.b.one("Cast", [future], to=TensorProto.FLOAT), L.b.const(np.array(MASKED, np.float32))])
    if rep > 1:
        mask = L.b.one("Tile", [mask, L.b.const(np.array([rep, 1], np.int64))])  # rows ordered (rep, T)
    probs = L.b.one("Softmax", [L.b.one("Add", [scores, mask])], axis=-1)
    out = L.b.one("MatMul", [probs, vals])  # [Hkv, rep*T, D]
    out = L.b.one("Transpose", [_shape(L, out, [hkv, rep, t, d])], perm=[2, 0, 1, 3])  # [T, Hkv, rep, D]
    out = _shape(L, out, [1, t, h, d])
    if L.dtype_of(q) != torch.float32:
        out = L.b.one("Cast", [out], to=TORCH_TO_ONNX[L.dtype_of(q)])
    return [out, kc, vc]


@_override(DS.rms_norm.default)
def _rms_norm(L: Lowerer, node, x, weight, eps):
    """Normalize in the weight's dtype (fp32), as the canonical op computes, then cast back: QNN refuses a
    SimplifiedLayerNormalization whose input and scale differ in dtype ('Failed to add node')."""
    xdt, wdt = L.dtype_of(x), L.dtype_of(weight)
    xin = L.as_tensor(x) if xdt == wdt else L.b.one("Cast", [L.as_tensor(x)], to=TORCH_TO_ONNX[wdt])
    y = _rms(L, xin, L.weight(weight), eps)
    return y if xdt == wdt else L.b.one("Cast", [y], to=TORCH_TO_ONNX[xdt])


@_override(aten.split_with_sizes.default)
def _split(L: Lowerer, node, x, sizes, dim=0):
    """One Slice per piece: on the HTP simulator a Split inside the decode graph gave all-zero outputs (each
    piece 0.0 where ONNX Runtime's CPU gave the values; the same Split alone was exact)."""
    axis = dim % len(L.meta(x).shape)
    t, pieces, start = L.as_tensor(x), [], 0
    for size in sizes:
        bounds = [L.b.const(np.array([v], np.int64)) for v in (start, start + size, axis)]
        pieces.append(L.b.one("Slice", [t, *bounds]))
        start += size
    return pieces


@_override(aten.arange.default)
def _arange(L: Lowerer, node, end, **kwargs):
    if isinstance(end, torch.fx.Node):
        raise DeltashipError(
            f"qnn lowering: arange with a dynamic end (FX node {node.name!r}); QNN needs static shapes",
            "capture the program with a static token count",
        )
    return L.b.const(np.arange(end, dtype=np.int64))


for _op in LOWERINGS:
    QNN_LOWERINGS.add(_op, _OVERRIDES.get(_op, LOWERINGS.get(_op)))
for _op, _fn in _OVERRIDES.items():
    if _op not in QNN_LOWERINGS:
        QNN_LOWERINGS.add(_op, _fn)
