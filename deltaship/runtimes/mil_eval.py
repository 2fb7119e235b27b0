"""Evaluate a converted Core ML ML program on Linux, op by op, with numpy.

Linux has no Core ML runtime. The saved .mlpackage is loaded back into a MIL program
(coremltools' milproto loader) and interpreted: most MIL ops implement `value_inference`; the
ones that do not, or that are too slow that way, have implementations here, each unit-tested
against torch (tests/test_coreml.py): constexpr_* weight decompression, read_state /
coreml_update_state, silu, and linear / matmul (computed in fp32, cast to the op's dtype).
This checks the program Core ML would run; it does not measure how fast a device runs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def load_program(path: str | Path):
    """The MIL program (every function) of a saved .mlpackage; no Core ML runtime needed."""
    import coremltools as ct  # lazy: coremltools
    from coremltools.converters.mil.frontend.milproto.load import load as milproto_load

    m = ct.models.MLModel(str(path), skip_model_load=True)
    spec = m.get_spec()
    prog = milproto_load(spec, spec.specificationVersion, m.weights_dir)
    for f in prog.functions.values():  # numpy 2 rejects np.bool_ where a python bool is meant
        for op in f.operations:
            if op.op_type == "const" and isinstance(op.outputs[0].val, np.bool_):
                op.outputs[0]._sym_val.val = bool(op.outputs[0].val)
    if spec.description.defaultFunctionName:
        prog.default_function_name = spec.description.defaultFunctionName
    return prog


def package_constants(path: str | Path, function: str = "decode") -> dict[str, np.ndarray]:
    """Every constant `function` of a saved .mlpackage holds, decompressed (constexpr_* ops evaluated), by its MIL
    value name: the weights as Core ML would compute with them."""
    prog = load_program(path)
    return Interpreter(prog)._materialise(function, prog.functions[function])


def _np_dtype(var) -> np.dtype:
    from coremltools.converters.mil.mil import types  # lazy: coremltools

    return np.dtype(types.nptype_from_builtin(var.dtype))


# ---- our implementations (unit-tested against torch) --------------------------------------------
def silu(x: np.ndarray) -> np.ndarray:
    xf = x.astype(np.float32)
    return (xf / (1.0 + np.exp(-xf))).astype(x.dtype)


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, out_dtype) -> np.ndarray:
    y = x.astype(np.float32) @ weight.astype(np.float32).T
    if bias is not None:
        y = y + bias.astype(np.float32)
    return y.astype(out_dtype)


def matmul(x: np.ndarray, y: np.ndarray, transpose_x: bool, transpose_y: bool, out_dtype) -> np.ndarray:
    a, b = x.astype(np.float32), y.astype(np.float32)
    if transpose_x:
        a = np.swapaxes(a, -1, -2)
    if transpose_y:
        b = np.swapaxes(b, -1, -2)
    return np.matmul(a, b).astype(out_dtype)


def blockwise_shift_scale(data: np.ndarray, scale: np.ndarray, offset: np.ndarray | None) -> np.ndarray:
    """constexpr_blockwise_shift_scale: (data - offset) * scale, each scale covering a block."""
    reps = [d // s for d, s in zip(data.shape, scale.shape)]
    sc = scale
    for axis, r in enumerate(reps):
        if r > 1:
            sc = np.repeat(sc, r, axis=axis)
    d = data.astype(np.float32)
    if offset is not None:
        off = offset
        for axis, r in enumerate(reps):
            if r > 1:
                off = np.repeat(off, r, axis=axis)
        d = d - off.astype(np.float32)
    return (d * sc.astype(np.float32)).astype(scale.dtype)


class Interpreter:
    """Runs the functions of one MIL program; weights are materialised once and kept."""

    def __init__(self, program):
        self.program = program
        self._consts: dict[str, dict[str, np.ndarray]] = {}

    def _materialise(self, fname: str, func) -> dict[str, np.ndarray]:
        if fname in self._consts:
            return self._consts[fname]
        out: dict[str, np.ndarray] = {}
        for op in func.operations:
            t = op.op_type
            if t == "const":
                out[op.outputs[0].name] = op.outputs[0].val
            elif t == "constexpr_blockwise_shift_scale":
                off = op.inputs.get("offset")
                out[op.outputs[0].name] = blockwise_shift_scale(
                    op.inputs["data"].val, op.inputs["scale"].val, off.val if off is not None else None
                )
            elif t.startswith("constexpr_"):
                out[op.outputs[0].name] = op.materialized_val_inference()
        self._consts[fname] = out
        return out

    def run(self, fname: str, feeds: dict[str, np.ndarray], states: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one function. `states` (Core ML states) are updated in place; returns the outputs."""
        from coremltools.converters.mil.mil import types  # lazy: coremltools

        func = self.program.functions[fname]
        env: dict[str, Any] = dict(self._materialise(fname, func))
        for name, var in func.inputs.items():
            if types.is_state(var.sym_type):
                env[var.name] = states[name]
            else:
                env[var.name] = np.asarray(feeds[name]).astype(_np_dtype(var))

        def val(v):
            if v.name in env:
                return env[v.name]
            if v.val is not None:
                return v.val
            raise KeyError(f"{fname}: value {v.name} used before it is computed")

        for op in func.operations:
            t = op.op_type
            if t == "const" or t.startswith("constexpr_"):
                continue
            o = op.outputs[0]
            if t == "read_state":
                env[o.name] = env[op.inputs["input"].name].copy()
            elif t == "coreml_update_state":
                new = val(op.inputs["value"])
                state = env[op.inputs["state"].name]
                state[...] = new
                env[o.name] = new
            elif t == "silu":
                env[o.name] = silu(val(op.inputs["x"]))
            elif t == "linear":
                b = op.inputs.get("bias")
                env[o.name] = linear(
                    val(op.inputs["x"]), val(op.inputs["weight"]), val(b) if b is not None else None, _np_dtype(o)
                )
            elif t == "matmul":
                env[o.name] = matmul(
                    val(op.inputs["x"]),
                    val(op.inputs["y"]),
                    bool(op.inputs["transpose_x"].val),
                    bool(op.inputs["transpose_y"].val),
                    _np_dtype(o),
                )
            else:
                self._generic(op, val, env)
        return {v.name: env[v.name] for v in func.outputs}

    @staticmethod
    def _generic(op, val, env) -> None:
        """Any other op through coremltools' own value_inference, its inputs made concrete for the call."""
        saved = {}
        for v in op.inputs.values():
            for vv in v if isinstance(v, (list, tuple)) else [v]:
                if vv.val is None:
                    saved[vv] = vv._sym_val
                    concrete = vv.sym_type()
                    concrete.val = np.asarray(val(vv))
                    vv._sym_val = concrete
        try:
            out = op.value_inference()
        except NotImplementedError:
            raise NotImplementedError(f"MIL op {op.op_type} ({op.name}) has no evaluation on Linux") from None
        finally:
            for vv, s in saved.items():
                vv._sym_val = s
        outs = out if isinstance(out, (tuple, list)) else [out]
        for o, r in zip(op.outputs, outs):
            env[o.name] = np.asarray(r).astype(_np_dtype(o))
