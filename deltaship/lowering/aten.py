"""The aten ops both graph lowerers lower the same way: one table over the primitives each lowerer provides.

ONNX (lowering/onnx/lowering.py `Lowerer`) and Core ML (lowering/coreml/lowering.py `MILLowerer`) walk a captured
FX graph node by node. For the ops here the logic is the same in both (which inputs, in which dtype, which axis
once negative axes are normalized against the rank); only the builder call differs, so each lowerer implements
`GraphOps` (its value for an FX argument and six builders) and starts its own table from `GENERIC`.

What stays in each lowerer's own table differs in substance, not in spelling: ONNX graphs keep the token count
dynamic (sym_size, arange, reshape/view and slice build shape tensors at run time) where Core ML functions are
captured at fixed shapes (the same ops become constants); embedding and linear read weights in each target's
storage forms; and the canonical ops are each target's own composites.
"""

from __future__ import annotations

import operator
from typing import Any, Protocol

import torch

from deltaship.lowering.lowerings import OpLowerings

aten = torch.ops.aten

# aten op -> the elementwise kind `GraphOps.elementwise` builds
BINARY = {aten.add.Tensor: "add", aten.sub.Tensor: "sub", aten.mul.Tensor: "mul", aten.div.Tensor: "div"}
UNARY = {
    aten.neg.default: "neg",
    aten.sigmoid.default: "sigmoid",
    aten.cos.default: "cos",
    aten.sin.default: "sin",
    aten.exp.default: "exp",
    aten.softplus.default: "softplus",
    aten.rsqrt.default: "rsqrt",
    aten.silu.default: "silu",
}


class GraphOps(Protocol):
    """What a graph lowerer gives the generic table."""

    def val(self, a: Any) -> Any:
        """The lowered value of an FX argument as it is (lists element by element)."""

    def meta(self, node: torch.fx.Node) -> Any:
        """The node's fake tensor (shape, dtype)."""

    def dtype_of(self, a: torch.fx.Node) -> torch.dtype: ...

    def value(self, a: Any, dtype: torch.dtype | None = None) -> Any:
        """A graph value for an FX argument; a python scalar becomes a constant of `dtype` (fp32 without one)."""

    def elementwise(self, kind: str, inputs: list[Any], dtype: torch.dtype) -> Any:
        """`kind` (a value of BINARY or UNARY) of the inputs; `dtype` is the result's."""

    def cast(self, x: Any, src: torch.dtype, dst: torch.dtype | None) -> Any:
        """x (of `src`) as `dst`; x itself when no cast is needed (dst None, or the same dtype in the graph)."""

    def expand_dims(self, x: Any, axis: int) -> Any: ...

    def concat(self, values: list[Any], axis: int) -> Any: ...

    def split(self, x: Any, sizes: list[int], axis: int) -> list[Any]: ...


GENERIC = OpLowerings("generic")
lowering = GENERIC.register


@lowering(aten._assert_tensor_metadata.default)
def _skip(L: GraphOps, node, *args, **kwargs):
    return None


@lowering(operator.getitem)
def _getitem(L: GraphOps, node, seq, i):
    return L.val(seq)[i]


@lowering(aten.to.dtype, aten._to_copy.default)
def _to(L: GraphOps, node, x, dtype=None, *args, **kwargs):
    return L.cast(L.value(x), L.dtype_of(x), dtype or kwargs.get("dtype"))


def _binary(kind: str):
    def fn(L: GraphOps, node, a, b, *args, **kwargs):
        dt = L.meta(node).dtype  # a python scalar operand is a constant of the result's dtype
        return L.elementwise(kind, [L.value(a, dt), L.value(b, dt)], dt)

    return fn


def _unary(kind: str):
    def fn(L: GraphOps, node, x, *args, **kwargs):
        return L.elementwise(kind, [L.value(x)], L.meta(node).dtype)

    return fn


for _op, _kind in BINARY.items():
    GENERIC.add(_op, _binary(_kind))
for _op, _kind in UNARY.items():
    GENERIC.add(_op, _unary(_kind))


@lowering(aten.unsqueeze.default)
def _unsqueeze(L: GraphOps, node, x, dim):
    return L.expand_dims(L.value(x), dim % len(L.meta(node).shape))


@lowering(aten.cat.default)
def _cat(L: GraphOps, node, tensors, dim=0):
    return L.concat([L.value(t) for t in tensors], dim % len(L.meta(node).shape))


@lowering(aten.split_with_sizes.default)
def _split(L: GraphOps, node, x, sizes, dim=0):
    return L.split(L.value(x), list(sizes), dim % len(L.meta(x).shape))
