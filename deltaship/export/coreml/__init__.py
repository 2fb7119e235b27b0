"""The Core ML target: one stateful multifunction .mlpackage (iOS 18 / macOS 15).

Two functions share every weight: `prefill` over a fixed chunk of tokens and `decode` over one,
both at fixed shapes (the Neural Engine needs them). The KV cache is a Core ML state (MLState,
fp16); the DeltaNet conv and recurrent states travel as fp32 inputs/outputs (default, chosen by
measured drift: see the README) or as fp16 states (`coreml_states="state"`). An fp32 build keeps
every state as fp32 inputs/outputs for exact structure checks against transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltaship.errors import DeltashipError
from deltaship.export.passes import PIPELINE as _CANONICAL, PassError, capture

PACKAGE = "model.mlpackage"
TOOL_PACKAGES = ("coremltools",)
FUNCTIONS = ("prefill", "decode")
DEFAULT_CHUNK = 64
# Option defaults of this target: int8 per output channel, fp16 scales, blocks that divide each row.
OPTIONS = {"int8_block": "channel", "scale_dtype": "float16", "block_must_divide": True}
USAGE = [
    "Load model.mlpackage with Core ML (iOS 18 / macOS 15): MLModel(configuration:) with functionName "
    "'prefill' or 'decode'; both share the weights and the states.",
    "prefill takes exactly prefill_chunk tokens, decode exactly one: feed full chunks to prefill and the rest "
    "of a prompt token by token to decode.",
    "Inputs: input_ids int32 [1, T], position int32 [1] = tokens already consumed.",
    "KV cache: Core ML states (make the state once with model.makeState() and pass it to every prediction of "
    "both functions); reset = a new state.",
    "DeltaNet states listed as kind 'deltanet_*' with mode 'io' are fp32 inputs 'past_L_kind' whose values come "
    "from the previous call's outputs 'present_L_kind' (zeros at the start and on reset).",
    "logits float32 [1, vocab] for the last token of the call.",
]


class StaticCapture:
    """torch.export at fixed shapes: the prefill chunk and a single token."""

    name = "static_capture"

    def requires(self, ctx) -> None:
        chunk = int(ctx.options["prefill_chunk"])
        if chunk > 64 and chunk % 64 or chunk <= 64 and chunk & (chunk - 1):
            raise PassError(f"the Core ML prefill chunk must be a power of two up to 64 or a multiple of 64, "
                            f"got {chunk}")

    def run(self, ctx) -> dict[str, int]:
        ctx.states = ctx.model.state_specs(ctx.dtype)
        chunk = int(ctx.options["prefill_chunk"])
        ctx.programs = {"prefill": capture(ctx.model, ctx.states, ctx.max_context, static=chunk),
                        "decode": capture(ctx.model, ctx.states, ctx.max_context, static=1)}
        return {"functions": 2, "prefill_tokens": chunk, "decode_tokens": 1}

    def ensures(self, ctx) -> None:
        for name, ep in ctx.programs.items():
            if len(ep.graph_signature.output_specs) != 1 + len(ctx.states):
                raise PassError(f"{name}: some state has no output")


PIPELINE = _CANONICAL[:-1] + (StaticCapture(),)


def state_modes(ctx) -> dict[str, str]:
    """name -> "state" (Core ML state, fp16) or "io" (fp32 input/output pair)."""
    deltanet = ctx.options.get("coreml_states", "io")
    if deltanet not in ("io", "state"):
        raise DeltashipError(f"coreml_states must be 'io' or 'state', got {deltanet!r}", "use io or state")
    modes = {}
    for s in ctx.states:
        if ctx.precision == "fp32":
            modes[s["name"]] = "io"  # Core ML states are fp16 only: an fp32 build keeps everything exact
        elif s["kind"].startswith("kv_cache"):
            modes[s["name"]] = "state"
        else:
            modes[s["name"]] = deltanet
    return modes


def mil_name(name: str) -> str:
    return name.replace(".", "_")


def build_program(ctx, weights, progress=None):
    """Both functions in one MIL Program, weights deduplicated across them."""
    from coremltools.converters.mil.mil import Program
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    from deltaship.export.coreml.lowering import MILLowerer, WeightCache

    modes = state_modes(ctx)
    wcache = WeightCache(ctx.plan, weights, ctx.quant, progress)
    inputs = ["input_ids", "position"]
    state_in = [mil_name(s["name"]) for s in ctx.states]
    outs = ["logits"] + [mil_name(s["output"]) for s in ctx.states]
    mil_modes = {mil_name(k): v for k, v in modes.items()}
    prog = Program()
    emitted = {}
    for fname in FUNCTIONS:
        func, emitted[fname] = MILLowerer(ctx.programs[fname], wcache, mil_modes, fname).build(inputs, state_in, outs)
        prog.add_function(fname, func)
    PASS_REGISTRY["common::const_deduplication"]._deduplicate_const_across_functions(prog)
    prog.default_function_name = "decode"
    prog.export_as_multifunction = True
    return prog, modes, emitted


def ane_report(prog) -> dict[str, Any]:
    """Ops likely to leave the Neural Engine (a heuristic from what the ANE is known not to take:
    fp32 compute, dimensions over 16384, and a few op types)."""
    from deltaship.export.coreml.lowering import ANE_MAX_DIM
    likely: dict[str, int] = {}
    reasons: dict[str, str] = {}
    unsupported = {"cumsum": "cumsum", "slice_update": "dynamic slice_update (KV cache write)",
                   "gather": "gather (embedding lookup)", "less_equal": "integer mask construction"}
    for f in prog.functions.values():
        for op in f.operations:
            if op.op_type in ("const", "read_state", "coreml_update_state") or op.op_type.startswith("constexpr"):
                continue
            outs = [o for o in op.outputs if hasattr(o, "dtype")]
            why = None
            if op.op_type in unsupported:
                why = unsupported[op.op_type]
            elif any(o.dtype.__name__ == "fp32" for o in outs if hasattr(o.dtype, "__name__")):
                why = "fp32 compute (the ANE computes in fp16)"
            elif any(isinstance(d, int) and d > ANE_MAX_DIM for o in outs for d in (o.shape or ())):
                why = f"a dimension over {ANE_MAX_DIM}"
            if why:
                key = f"{op.op_type}"
                likely[key] = likely.get(key, 0) + 1
                reasons[key] = why
    total = sum(1 for f in prog.functions.values() for op in f.operations
                if op.op_type != "const" and not op.op_type.startswith("constexpr"))
    return {"ops": total, "likely_off_ane": sum(likely.values()),
            "by_op": {k: {"count": v, "reason": reasons[k]} for k, v in sorted(likely.items())},
            "note": "heuristic: Core ML decides placement on device; MLComputePlan on a Mac gives the real one"}


def check_spec(path: Path, ctx, modes: dict[str, str], emitted: dict[str, list[str]]) -> dict[str, Any]:
    """The saved package against the manifest: deployment target, functions, inputs, states, outputs."""
    import coremltools as ct
    spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
    problems = []
    if spec.specificationVersion < 9:
        problems.append(f"specification version {spec.specificationVersion} < 9 (iOS 18)")
    funcs = {f.name: f for f in spec.description.functions}
    if set(funcs) != set(FUNCTIONS):
        problems.append(f"functions {sorted(funcs)} != {list(FUNCTIONS)}")
    want_states = {mil_name(s["name"]): s for s in ctx.states if modes[s["name"]] == "state"}
    want_io = [mil_name(s["name"]) for s in ctx.states if modes[s["name"]] == "io"]
    for fname, f in funcs.items():
        ins = [i.name for i in f.input]
        if ins != ["input_ids", "position"] + want_io:
            problems.append(f"{fname}: inputs {ins}")
        states = {st.name: list(st.type.stateType.arrayType.shape) for st in f.state}
        if set(states) != set(want_states) or any(states[n] != want_states[n]["shape"] for n in states):
            problems.append(f"{fname}: states {states}")
        outs = [o.name for o in f.output]
        if outs != emitted[fname]:
            problems.append(f"{fname}: outputs {outs} != {emitted[fname]}")
    if problems:
        raise DeltashipError("coreml: the saved package does not match the manifest: " + "; ".join(problems),
                             "this is a deltaship bug; please report it")
    return {"specification_version": spec.specificationVersion, "deployment_target": "iOS18 / macOS15",
            "functions": list(FUNCTIONS), "default_function": spec.description.defaultFunctionName,
            "states": sorted(want_states), "checked": True}


def lower(ctx, weights, out_dir: Path, progress=None, tokens: dict | None = None) -> dict[str, Any]:
    import coremltools as ct

    say = progress or (lambda m: None)
    prog, modes, emitted = build_program(ctx, weights, say)
    report = ane_report(prog)
    say("converting (coremltools)")
    model = ct.convert(prog, minimum_deployment_target=ct.target.iOS18, compute_precision=ct.precision.FLOAT32,
                       skip_model_load=True)
    say("saving the package")
    path = out_dir / PACKAGE
    model.save(str(path))
    checked = check_spec(path, ctx, modes, emitted)
    for s in ctx.states:
        s["mode"] = modes[s["name"]]
        s["coreml_input"] = mil_name(s["name"])
        s["coreml_output"] = mil_name(s["output"]) if modes[s["name"]] == "io" else None
        if modes[s["name"]] == "state":
            s["dtype"] = "float16"
    files = sorted(p.relative_to(out_dir).as_posix() for p in path.rglob("*") if p.is_file())
    return {"files": files, "entry": PACKAGE, "functions": {f: {"tokens": ctx.options["prefill_chunk"] if f == "prefill"
                                                                 else 1, "outputs": emitted[f]} for f in FUNCTIONS},
            "state_modes": modes, "spec_check": checked, "ane_report": report,
            "compute": "fp32" if ctx.precision == "fp32" else "fp16 (DeltaNet recurrence in fp32)"}


def io_inputs(ctx) -> list[dict]:
    return [{"name": "input_ids", "shape": [1, "T"], "dtype": "int32", "kind": "tokens",
             "doc": "prefill: exactly prefill_chunk tokens; decode: exactly 1"},
            {"name": "position", "shape": [1], "dtype": "int32", "kind": "position",
             "doc": "tokens already consumed by the state"}]
