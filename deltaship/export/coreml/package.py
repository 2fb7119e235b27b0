"""Build the Core ML package: static capture per part and function, MIL programs, conversion, spec checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltaship.errors import DeltashipError
from deltaship.export.passes import PassError

PACKAGE = "model.mlpackage"
FUNCTIONS = ("prefill", "decode")

MAX_STATE_POSITIONS = 16384  # a KV-cache state longer than this has a dimension the Neural Engine rejects


def check_options(precision: str, max_context: int, chunk: int, options: dict) -> None:
    if chunk > 64 and chunk % 64 or chunk <= 64 and chunk & (chunk - 1):
        raise DeltashipError(
            f"--prefill-chunk {chunk}: the Core ML prefill chunk must be a power of two up to 64 "
            "or a multiple of 64 (its DeltaNet recurrence is unrolled in chunks of 64)",
            "pass --prefill-chunk 64 (or 16, 32, 128, 256 ...)",
        )
    if max_context > MAX_STATE_POSITIONS:
        raise DeltashipError(
            f"--max-context {max_context}: a Core ML KV-cache state of more than "
            f"{MAX_STATE_POSITIONS} positions has a dimension over the Neural Engine's limit "
            f"({MAX_STATE_POSITIONS})",
            f"pass --max-context {MAX_STATE_POSITIONS} or less",
        )
    bits = options.get("coreml_palettize")
    if bits is not None and (precision != "fp16" or int(bits) not in (2, 3, 4, 6, 8)):
        raise DeltashipError(
            f"--coreml-palettize {bits} needs --precision fp16 and 2, 3, 4, 6 or 8 bits (got precision {precision})",
            "e.g. --precision fp16 --coreml-palettize 4",
        )


class Part(torch.nn.Module):
    """Layers start .. stop-1 of the model; the first part embeds token ids, the last applies the head."""

    def __init__(self, model, start: int, stop: int):
        super().__init__()
        self.m, self.start, self.stop = model, start, stop
        self.first, self.last = start == 0, stop == len(model.model.layers)

    def forward(self, inp, position, states):
        x = self.m.model.embed_tokens(inp) if self.first else inp
        x, new = self.m.run_layers(x, position, states, self.start, self.stop)
        return (self.m.head(x) if self.last else x), new


def _param_bytes(ctx, name: str) -> int:
    n = int(np.prod(ctx.plan.shape(name)))
    q = ctx.quant["linear"].get(name) or ctx.quant["embedding"].get(name)
    if q:
        return n * q["bits"] // 8 + n // q["block_size"] * 2
    return n * (4 if ctx.precision == "fp32" else 2)


def plan_parts(ctx, budget: int) -> list[tuple[int, int]]:
    """Consecutive layer ranges whose weights (embedding with the first, head with the last) fit the budget."""
    layers = len(ctx.spec.layer_types)
    sizes = [0] * layers
    head = 0
    embed = 0
    seen: set[int] = set()
    for name, p in ctx.model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        b = _param_bytes(ctx, name)
        if name.startswith("model.layers."):
            sizes[int(name.split(".")[2])] += b
        elif "embed_tokens" in name:
            embed += b
        else:
            head += b
    if ctx.spec.tie_word_embeddings and ctx.quant["linear"]:
        head += embed  # a quantized tied head is stored a second time for the matmul
    for what, b in (("the embedding", embed), ("the LM head", head)):
        if b > budget:
            raise DeltashipError(
                f"coreml: {what} alone is {b / 1e9:.2f} GB at {ctx.precision}, over the {budget / 1e9:.2f} GB package "
                "budget",
                "export at int8 or int4, or raise the budget with --coreml-part-gb",
            )
    parts, start, cur = [], 0, embed
    for i, b in enumerate(sizes):
        extra = head if i == layers - 1 else 0
        if cur + b + extra > budget and i > start:
            parts.append((start, i))
            start, cur = i, 0
        cur += b + extra
        if cur > budget:
            raise DeltashipError(
                f"coreml: layer {i} needs {cur / 1e9:.2f} GB, over the {budget / 1e9:.2f} GB package budget",
                "export at int8 or int4, or raise the budget with --coreml-part-gb",
            )
    parts.append((start, layers))
    return parts


def _part_states(ctx, start: int, stop: int) -> list[dict]:
    return [s for s in ctx.states if start <= s["layer"] < stop]


def _capture_part(part: Part, states: list[dict], tokens: int, hidden: int, dtype) -> torch.export.ExportedProgram:
    from deltaship.export.passes import example_inputs

    ids, pos, st = example_inputs(states, tokens)
    inp = ids if part.first else torch.zeros(1, tokens, hidden, dtype=dtype, device="meta")
    return torch.export.export(part, (inp, pos, st), strict=False)


class StaticCapture:
    """torch.export at fixed shapes (the prefill chunk and a single token), one pair per package part."""

    name = "static_capture"

    def requires(self, ctx) -> None:
        check_options(ctx.precision, ctx.max_context, int(ctx.options["prefill_chunk"]), ctx.options)

    def run(self, ctx) -> dict[str, int]:
        ctx.states = ctx.model.state_specs(ctx.dtype)
        chunk = int(ctx.options["prefill_chunk"])
        budget = int(float(ctx.options["coreml_part_gb"]) * 1e9)  # weights per package
        ctx.parts = plan_parts(ctx, budget)
        ctx.programs = {}
        for i, (a, b) in enumerate(ctx.parts):
            part, st = Part(ctx.model, a, b), _part_states(ctx, a, b)
            ctx.programs[i] = {
                f: _capture_part(part, st, chunk if f == "prefill" else 1, ctx.spec.hidden_size, ctx.dtype)
                for f in FUNCTIONS
            }
        return {"functions": 2, "prefill_tokens": chunk, "decode_tokens": 1, "packages": len(ctx.parts)}

    def ensures(self, ctx) -> None:
        for i, (a, b) in enumerate(ctx.parts):
            for name, ep in ctx.programs[i].items():
                if len(ep.graph_signature.output_specs) != 1 + len(_part_states(ctx, a, b)):
                    raise PassError(f"part {i} {name}: some state has no output")


def state_modes(ctx) -> dict[str, str]:
    """name -> "state" (Core ML state, fp16) or "io" (fp32 input/output pair)."""
    deltanet = ctx.options["coreml_states"]
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


def part_io(ctx, index: int) -> tuple[str, str]:
    """A part's input (token ids, or the previous part's hidden states) and output (logits or hidden states)."""
    a, b = ctx.parts[index]
    return ("input_ids" if a == 0 else "hidden_in"), ("logits" if b == ctx.spec.num_layers else "hidden_out")


def build_program(ctx, weights, index: int = 0, wcache=None, progress=None):
    """One package part: both functions in one MIL Program, weights deduplicated across them."""
    from coremltools.converters.mil.mil import Program

    from deltaship.export.coreml.lowering import MILLowerer, WeightCache, share_across_functions

    modes = state_modes(ctx)
    wcache = wcache or WeightCache(ctx.plan, weights, ctx.quant, progress)
    a, b = ctx.parts[index]
    states = _part_states(ctx, a, b)
    inp, out = part_io(ctx, index)
    inputs = [inp, "position"]
    state_in = [mil_name(s["name"]) for s in states]
    outs = [out] + [mil_name(s["output"]) for s in states]
    mil_modes = {mil_name(k): v for k, v in modes.items()}
    prog = Program()
    emitted = {}
    for fname in FUNCTIONS:
        func, emitted[fname] = MILLowerer(
            ctx.programs[index][fname], wcache, mil_modes, fname, param_prefix="m."
        ).build(inputs, state_in, outs)
        prog.add_function(fname, func)
    share_across_functions(prog)
    prog.default_function_name = "decode"
    prog.export_as_multifunction = True
    return prog, modes, emitted


def palettize(prog, bits: int) -> dict[str, Any]:
    """Replace the linear and embedding weights by n-bit look-up tables (coremltools.optimize), per
    group of 16 output channels, uniform levels (fast and deterministic on 248320-row heads)."""
    import coremltools.optimize as cto
    from coremltools.converters.mil.mil.passes.graph_pass import PassOption
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    op_cfg = cto.coreml.OpPalettizerConfig(
        nbits=int(bits), mode="uniform", granularity="per_grouped_channel", group_size=16, weight_threshold=2048
    )
    cfg = cto.coreml.OptimizationConfig(op_type_configs={"linear": op_cfg, "gather": op_cfg})
    p = PASS_REGISTRY["compression::palettize_weights"]
    p.set_options([PassOption("config", cfg)])
    p.apply(prog)
    return {
        "scheme": f"{bits}-bit palettization (coremltools, uniform LUT per 16 output channels)",
        "ops": ["linear", "gather"],
    }


def rounded_from_package(
    paths: list[Path], names: dict[str, tuple[str, str, int]], tied: bool = False
) -> dict[str, np.ndarray]:
    """The weight values the saved packages really hold (decompressed), by canonical parameter name."""
    from deltaship.export.coreml.mil_eval import Interpreter, load_program

    pieces: dict[str, list] = {}
    for path in paths:
        prog = load_program(path)
        values = Interpreter(prog)._materialise("decode", prog.functions["decode"])
        for vname, arr in values.items():
            name = vname.removesuffix("_palettized")  # what coremltools' compression passes call the result
            if name in names:
                fqn, form, piece = names[name]
                key = "model.embed_tokens.weight" if form == "embedding" else fqn
                pieces.setdefault(key, []).append((piece, np.asarray(arr, np.float32)))
    out = {k: np.concatenate([a for _, a in sorted(v, key=lambda t: t[0])], axis=0) for k, v in pieces.items()}
    if tied and "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        # identical tables are deduplicated into one const that both the gather and the head read
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def ane_report(prog) -> dict[str, Any]:
    """Ops likely to leave the Neural Engine (a heuristic from what the ANE is known not to take:
    fp32 compute, dimensions over 16384, and a few op types)."""
    from deltaship.export.coreml.lowering import ANE_MAX_DIM

    likely: dict[str, int] = {}
    reasons: dict[str, str] = {}
    unsupported = {
        "cumsum": "cumsum",
        "slice_update": "dynamic slice_update (KV cache write)",
        "gather": "gather (embedding lookup)",
        "less_equal": "integer mask construction",
    }
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
    total = sum(
        1
        for f in prog.functions.values()
        for op in f.operations
        if op.op_type != "const" and not op.op_type.startswith("constexpr")
    )
    return {
        "ops": total,
        "likely_off_ane": sum(likely.values()),
        "by_op": {k: {"count": v, "reason": reasons[k]} for k, v in sorted(likely.items())},
        "note": "heuristic: Core ML decides placement on device; MLComputePlan on a Mac gives the real one",
    }


def check_spec(path: Path, ctx, modes: dict[str, str], emitted: dict[str, list[str]], index: int = 0) -> dict[str, Any]:
    """The saved package against the manifest: deployment target, functions, inputs, states, outputs."""
    import coremltools as ct

    spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
    problems = []
    if spec.specificationVersion < 9:
        problems.append(f"specification version {spec.specificationVersion} < 9 (iOS 18)")
    funcs = {f.name: f for f in spec.description.functions}
    if set(funcs) != set(FUNCTIONS):
        problems.append(f"functions {sorted(funcs)} != {list(FUNCTIONS)}")
    part_states = _part_states(ctx, *ctx.parts[index])
    want_states = {mil_name(s["name"]): s for s in part_states if modes[s["name"]] == "state"}
    want_io = [mil_name(s["name"]) for s in part_states if modes[s["name"]] == "io"]
    for fname, f in funcs.items():
        ins = [i.name for i in f.input]
        if ins != [part_io(ctx, index)[0], "position"] + want_io:
            problems.append(f"{fname}: inputs {ins}")
        states = {st.name: list(st.type.stateType.arrayType.shape) for st in f.state}
        if set(states) != set(want_states) or any(states[n] != want_states[n]["shape"] for n in states):
            problems.append(f"{fname}: states {states}")
        outs = [o.name for o in f.output]
        if outs != emitted[fname]:
            problems.append(f"{fname}: outputs {outs} != {emitted[fname]}")
    if problems:
        raise DeltashipError(
            "coreml: the saved package does not match the manifest: " + "; ".join(problems),
            "this is a deltaship bug; please report it",
        )
    return {
        "specification_version": spec.specificationVersion,
        "deployment_target": "iOS18 / macOS15",
        "functions": list(FUNCTIONS),
        "default_function": spec.description.defaultFunctionName,
        "states": sorted(want_states),
        "checked": True,
    }


def lower(ctx, weights, out_dir: Path, progress=None, tokens: dict | None = None) -> dict[str, Any]:
    import coremltools as ct

    from deltaship.export.coreml.lowering import WeightCache

    say = progress or (lambda m: None)
    n = len(ctx.parts)
    parts, reports, checks = [], [], []
    const_names: dict[str, tuple[str, str, int]] = {}
    for i, (a, b) in enumerate(ctx.parts):
        wcache = WeightCache(ctx.plan, weights, ctx.quant, say)  # per part: only its weights are held
        prog, modes, emitted = build_program(ctx, weights, i, wcache)
        const_names.update(wcache.const_names)
        if ctx.options.get("coreml_palettize"):
            say(f"palettizing part {i + 1}/{n}")
            pal = palettize(prog, int(ctx.options["coreml_palettize"]))
        reports.append(ane_report(prog))
        say(f"converting part {i + 1}/{n} (coremltools)")
        model = ct.convert(
            prog,
            minimum_deployment_target=ct.target.iOS18,
            compute_precision=ct.precision.FLOAT32,
            skip_model_load=True,
        )
        name = PACKAGE if n == 1 else f"model_part{i}.mlpackage"
        model.save(str(out_dir / name))
        del model, prog, wcache
        checks.append(check_spec(out_dir / name, ctx, modes, emitted, i))
        inp, out = part_io(ctx, i)
        parts.append(
            {
                "package": name,
                "layers": [a, b],
                "input": inp,
                "output": out,
                "states": [s["name"] for s in _part_states(ctx, a, b)],
                "functions": emitted,
            }
        )
    if ctx.options.get("coreml_palettize"):  # the matched reference reads the values back from the package
        ctx.rounded = rounded_from_package(
            [out_dir / p["package"] for p in parts], const_names, tied=ctx.spec.tie_word_embeddings
        )
    for s in ctx.states:
        s["mode"] = modes[s["name"]]
        s["coreml_input"] = mil_name(s["name"])
        s["coreml_output"] = mil_name(s["output"]) if modes[s["name"]] == "io" else None
        if modes[s["name"]] == "state":
            s["dtype"] = "float16"
    files = sorted(
        p.relative_to(out_dir).as_posix()
        for p in out_dir.rglob("*")
        if p.is_file() and p.relative_to(out_dir).parts[0].endswith(".mlpackage")
    )
    report = {
        "ops": sum(r["ops"] for r in reports),
        "likely_off_ane": sum(r["likely_off_ane"] for r in reports),
        "by_op": {},
        "note": reports[0]["note"],
    }
    for r in reports:
        for op, v in r["by_op"].items():
            cur = report["by_op"].setdefault(op, {"count": 0, "reason": v["reason"]})
            cur["count"] += v["count"]
    return {
        "files": files,
        "entry": parts[0]["package"],
        "parts": parts,
        **({"quantization": pal} if ctx.options.get("coreml_palettize") else {}),
        "functions": {f: {"tokens": ctx.options["prefill_chunk"] if f == "prefill" else 1} for f in FUNCTIONS},
        "hidden_states": {
            "shape": [1, "T", ctx.spec.hidden_size],
            "dtype": str(ctx.dtype).replace("torch.", ""),
            "doc": "part i's output hidden_out is part i+1's input hidden_in",
        },
        "state_modes": modes,
        "spec_check": {**checks[0], "parts_checked": len(checks)},
        "ane_report": report,
        "compute": "fp32" if ctx.precision == "fp32" else "fp16 (DeltaNet recurrence in fp32)",
    }
