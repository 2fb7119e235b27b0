"""Build the Core ML package: static capture per part and function, MIL programs, conversion, spec checks."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from deltaship.errors import DeltashipError
from deltaship.lowering.coreml.lowering import ANE_MAX_DIM, MILLowerer, WeightCache, share_across_functions
from deltaship.lowering.lowered import Lowered
from deltaship.lowering.passes import Made, PassError, example_inputs
from deltaship.progress import heartbeat

PACKAGE = "model.mlpackage"
FUNCTIONS = ("prefill", "decode")
DRAFT_FUNCTION = "mtp_draft"  # --mtp: the MTP head over one position, its own KV cache


def verify_sizes(chunk: int) -> tuple[int, ...]:
    """--mtp: token counts of the verify functions (fixed shapes): a call of any length runs as a sum of them,
    largest first. 2 and 3 are what depth 1 and 2 feed in steady state; the chunk takes the prompt."""
    return tuple(sorted({1, 2, 3, chunk}))


def verify_function(tokens: int) -> str:
    return f"verify_{tokens}"


MAX_STATE_POSITIONS = 16384  # a KV-cache state longer than this has a dimension the Neural Engine rejects


def check_options(precision: str, max_context: int, chunk: int, options) -> None:
    """The Core ML combinations of `options` (its typed CoreMLOptions) with the precision, context and chunk."""
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
    bits = options.coreml_palettize
    if bits is not None and (precision != "fp16" or int(bits) not in (2, 3, 4, 6, 8)):
        raise DeltashipError(
            f"--coreml-palettize {bits} needs --precision fp16 and 2, 3, 4, 6 or 8 bits (got precision {precision})",
            "e.g. --precision fp16 --coreml-palettize 4",
        )


class VerifyPart(torch.nn.Module):
    """--mtp: the whole decoder over T tokens, returning every row's logits and every position's final-normed
    hidden state (the draft head's input) besides the states."""

    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, inp, position, states):
        m = self.m
        x, new = m.run_layers(m.model.embed_tokens(inp), position, states)
        hidden = m.model.norm(x)
        return m.lm_head(hidden).float(), hidden, new


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
    ids, pos, st = example_inputs(states, tokens)
    inp = ids if part.first else torch.zeros(1, tokens, hidden, dtype=dtype, device="meta")
    return torch.export.export(part, (inp, pos, st), strict=False)


class StaticCapture:
    """torch.export at fixed shapes (the prefill chunk and a single token), one pair per package part."""

    name = "static_capture"

    def requires(self, ctx) -> None:
        check_options(ctx.precision, ctx.max_context, ctx.settings.prefill_chunk, ctx.options)

    def run(self, ctx) -> Made:
        states = ctx.model.state_specs(ctx.dtype)
        chunk = ctx.settings.prefill_chunk
        budget = int(float(ctx.options.coreml_part_gb) * 1e9)  # weights per package
        parts = plan_parts(ctx, budget)
        part_states = replace(ctx, states=states)  # what _part_states reads
        programs: dict[int, dict[str, Any]] = {}
        for i, (a, b) in enumerate(parts):
            part, st = Part(ctx.model, a, b), _part_states(part_states, a, b)
            programs[i] = {
                f: _capture_part(part, st, chunk if f == "prefill" else 1, ctx.spec.hidden_size, ctx.dtype)
                for f in FUNCTIONS
            }
        counts = {"functions": 2, "prefill_tokens": chunk, "decode_tokens": 1, "packages": len(parts)}
        mtp_states: list[dict] = []
        if getattr(ctx.model, "mtp", None) is not None:  # --mtp: verify functions and the draft head
            if len(parts) > 1:
                raise DeltashipError(
                    f"--mtp: the model's weights need {len(parts)} Core ML packages; speculative decoding is "
                    "built for a single package",
                    "raise --coreml-part-gb, export at int8/int4, or drop --mtp",
                )

            verify = VerifyPart(ctx.model)
            for t in verify_sizes(chunk):
                programs[0][verify_function(t)] = torch.export.export(verify, example_inputs(states, t), strict=False)
            mtp_states = ctx.model.mtp_state_specs(ctx.dtype)
            _, pos, mst = example_inputs(mtp_states, 1)
            ids = torch.zeros(1, 1, dtype=torch.long, device="meta")
            hidden = torch.zeros(1, 1, ctx.spec.hidden_size, dtype=ctx.dtype, device="meta")
            programs[0][DRAFT_FUNCTION] = torch.export.export(
                ctx.model.mtp_program(), (hidden, ids, pos, mst), strict=False
            )
            counts["functions"] = len(programs[0])
            counts["verify_tokens"] = max(verify_sizes(chunk))
        return Made(counts, {"states": states, "parts": parts, "programs": programs, "mtp_states": mtp_states})

    def ensures(self, ctx) -> None:
        for i, (a, b) in enumerate(ctx.parts):
            for name, ep in ctx.programs[i].items():
                states = ctx.mtp_states if name == DRAFT_FUNCTION else _part_states(ctx, a, b)
                extra = 0 if name in FUNCTIONS else 1  # verify and draft also return hidden states
                if len(ep.graph_signature.output_specs) != 1 + extra + len(states):
                    raise PassError(f"part {i} {name}: some state has no output")


def state_modes(ctx) -> dict[str, str]:
    """name -> "state" (Core ML state, fp16) or "io" (fp32 input/output pair)."""
    deltanet = ctx.options.coreml_states
    if deltanet not in ("io", "state"):
        raise DeltashipError(f"coreml_states must be 'io' or 'state', got {deltanet!r}", "use io or state")
    modes = {}
    for s in ctx.states + ctx.mtp_states:
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
    from coremltools.converters.mil.mil import Program  # lazy: coremltools

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
    for fname, ep in ctx.programs[index].items():
        if fname == DRAFT_FUNCTION:
            mst = ctx.mtp_states
            func, emitted[fname] = MILLowerer(ep, wcache, mil_modes, fname).build(
                ["hidden_states", "input_ids", "position"],
                [mil_name(s["name"]) for s in mst],
                ["logits", "mtp_hidden_states"] + [mil_name(s["output"]) for s in mst],
            )
        else:
            func_outs = outs if fname in FUNCTIONS else [outs[0], "hidden_states"] + outs[1:]
            func, emitted[fname] = MILLowerer(ep, wcache, mil_modes, fname, param_prefix="m.").build(
                inputs, state_in, func_outs
            )
        prog.add_function(fname, func)
    share_across_functions(prog)
    prog.default_function_name = "decode"
    prog.export_as_multifunction = True
    return prog, modes, emitted


def palettize(prog, bits: int) -> dict[str, Any]:
    """Replace the linear and embedding weights by n-bit look-up tables (coremltools.optimize), per
    group of 16 output channels, uniform levels (fast and deterministic on 248320-row heads)."""
    import coremltools.optimize as cto  # lazy: coremltools
    from coremltools.converters.mil.mil.passes.graph_pass import PassOption
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY  # lazy: coremltools

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
    package_constants: Callable[[Path], Mapping[str, np.ndarray]],
    paths: list[Path],
    names: dict[str, tuple[str, str, int]],
    tied: bool = False,
) -> dict[str, np.ndarray]:
    """The weight values the saved packages really hold (decompressed), by canonical parameter name.
    `package_constants` reads a package's constants back (deltaship.runtimes.mil_eval, which the lowering does not
    import: the target passes it in)."""
    pieces: dict[str, list] = {}
    for path in paths:
        for vname, arr in package_constants(path).items():
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
    import coremltools as ct  # lazy: coremltools

    spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
    problems = []
    if spec.specificationVersion < 9:
        problems.append(f"specification version {spec.specificationVersion} < 9 (iOS 18)")
    funcs = {f.name: f for f in spec.description.functions}
    if set(funcs) != set(emitted):
        problems.append(f"functions {sorted(funcs)} != {sorted(emitted)}")
    part_states = _part_states(ctx, *ctx.parts[index])
    draft_states = ctx.mtp_states
    want_states = {mil_name(s["name"]): s for s in part_states if modes[s["name"]] == "state"}
    for fname, f in funcs.items():
        states_of = draft_states if fname == DRAFT_FUNCTION else part_states
        first = ["hidden_states", "input_ids", "position"] if fname == DRAFT_FUNCTION else None
        want_io = [mil_name(s["name"]) for s in states_of if modes[s["name"]] == "io"]
        want = {mil_name(s["name"]): s for s in states_of if modes[s["name"]] == "state"}
        ins = [i.name for i in f.input]
        if ins != (first or [part_io(ctx, index)[0], "position"]) + want_io:
            problems.append(f"{fname}: inputs {ins}")
        states = {st.name: list(st.type.stateType.arrayType.shape) for st in f.state}
        if set(states) != set(want) or any(states[n] != want[n]["shape"] for n in states):
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
        "functions": list(emitted),
        "default_function": spec.description.defaultFunctionName,
        "states": sorted(want_states),
        "checked": True,
    }


def lower(
    ctx,
    weights,
    out_dir: Path,
    progress=None,
    tokens: dict | None = None,
    *,
    package_constants: Callable[[Path], Mapping[str, np.ndarray]],
) -> Lowered:
    """Write the package(s) for the passes' result; `package_constants` reads a saved package's weights back
    (for the matched reference of a palettized build)."""
    import coremltools as ct  # lazy: coremltools

    say = progress or (lambda m: None)
    n = len(ctx.parts)
    parts, reports, checks = [], [], []
    const_names: dict[str, tuple[str, str, int]] = {}
    for i, (a, b) in enumerate(ctx.parts):
        wcache = WeightCache(ctx.plan, weights, ctx.quant, say)  # per part: only its weights are held
        prog, modes, emitted = build_program(ctx, weights, i, wcache)
        const_names.update(wcache.const_names)
        if ctx.options.coreml_palettize:
            say(f"palettizing part {i + 1}/{n}")
            pal = palettize(prog, int(ctx.options.coreml_palettize))
        reports.append(ane_report(prog))
        say(f"converting part {i + 1}/{n} (coremltools)")
        with heartbeat(say, f"still converting part {i + 1}/{n} (coremltools)"):
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
    rounded = None
    if ctx.options.coreml_palettize:  # the matched reference reads the values back from the package
        rounded = rounded_from_package(
            package_constants, [out_dir / p["package"] for p in parts], const_names, tied=ctx.spec.tie_word_embeddings
        )
    states = [  # the manifest's states: each one's mode and Core ML names
        dict(
            s,
            mode=modes[s["name"]],
            coreml_input=mil_name(s["name"]),
            coreml_output=mil_name(s["output"]) if modes[s["name"]] == "io" else None,
            **({"dtype": "float16"} if modes[s["name"]] == "state" else {}),
        )
        for s in ctx.states
    ]
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
    details = {
        "parts": parts,
        "functions": {f: {"tokens": ctx.settings.prefill_chunk if f == "prefill" else 1} for f in FUNCTIONS},
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
    return Lowered(
        files=files,
        entry=parts[0]["package"],
        states=states,
        rounded=rounded,
        details=details,
        quantization=pal if ctx.options.coreml_palettize else None,
        speculative=speculative_block(ctx, modes, out_dir / PACKAGE) if _has_mtp(ctx) else None,
    )


def _has_mtp(ctx) -> bool:
    return bool(ctx.mtp_states)


def blob_sharing(path: Path) -> dict[str, int]:
    """How the package's weight blob is shared: its size, the entries any function's const points at, those
    read by more than one function, and bytes stored twice (distinct entries with identical contents)."""

    import coremltools as ct  # lazy: coremltools

    spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
    users: dict[int, set[str]] = {}
    for fname, f in spec.mlProgram.functions.items():
        for block in f.block_specializations.values():
            for op in block.operations:
                if op.type != "const" or "val" not in op.attributes:
                    continue
                val = op.attributes["val"]
                if val.WhichOneof("value") == "blobFileValue":
                    users.setdefault(val.blobFileValue.offset, set()).add(fname)
    blob = (path / "Data" / "com.apple.CoreML" / "weights" / "weight.bin").read_bytes()
    by_digest: dict[str, list[int]] = {}
    for off in users:
        sentinel, _dtype, size, data_off = struct.unpack_from("<IIQQ", blob, off)
        if sentinel != 0xDEADBEEF:
            raise DeltashipError(f"coreml: no blob entry at offset {off} of {path}", "this is a deltaship bug")
        by_digest.setdefault(hashlib.sha1(blob[data_off : data_off + size]).hexdigest(), []).append(size)
    twice = [size for sizes in by_digest.values() for size in sizes[1:]]
    return {
        "blob_bytes": len(blob),
        "entries": len(users),
        "entries_read_by_several_functions": sum(1 for u in users.values() if len(u) > 1),
        # weights (entries of 1 KiB or more) stored twice; coremltools' constant folding makes a few small
        # per-function constants (masks) after the functions' weights were shared: counted apart
        "duplicated_bytes": sum(s for s in twice if s >= 1024),
        "small_constants_duplicated_bytes": sum(s for s in twice if s < 1024),
    }


def speculative_block(ctx, modes: dict[str, str], package: Path) -> dict[str, Any]:
    """The manifest's `speculative` block of a package exported with --mtp (docs/speculative.md)."""
    h, v = ctx.spec.hidden_size, ctx.spec.vocab_size
    hdt = str(ctx.dtype).replace("torch.", "")
    sizes = verify_sizes(ctx.settings.prefill_chunk)
    sharing = blob_sharing(package)
    draft_states = [
        dict(
            s,
            init="zeros",
            reset="zeros",
            mode=modes[s["name"]],
            coreml_input=mil_name(s["name"]),
            coreml_output=mil_name(s["output"]) if modes[s["name"]] == "io" else None,
            **({"dtype": "float16"} if modes[s["name"]] == "state" else {}),
        )
        for s in ctx.mtp_states
    ]
    return {
        "method": "mtp",
        "mtp_layers": ctx.spec.mtp_num_hidden_layers,
        "draft": {
            "file": PACKAGE,
            "function": DRAFT_FUNCTION,
            "tokens": 1,
            "inputs": [
                {
                    "name": "hidden_states",
                    "shape": [1, 1, h],
                    "dtype": hdt,
                    "kind": "hidden_states",
                    "doc": "a verify function's hidden_states row at position q",
                },
                {
                    "name": "input_ids",
                    "shape": [1, 1],
                    "dtype": "int32",
                    "kind": "tokens",
                    "doc": "the token at position q+1",
                },
                {"name": "position", "shape": [1], "dtype": "int32", "kind": "position", "doc": "q"},
            ],
            "outputs": [
                {
                    "name": "logits",
                    "shape": [1, ctx.draft_vocab_size],
                    "dtype": "float32",
                    "kind": "logits",
                    "doc": "draft logits for the token at q+2 (over draft.vocab's ids when present)",
                },
                {
                    "name": "mtp_hidden_states",
                    "shape": [1, 1, h],
                    "dtype": hdt,
                    "kind": "hidden_states",
                    "doc": "the head's hidden state; with the drafted token at q+2, it drafts one more (position q+1)",
                },
            ],
            # its own KV cache: Core ML states in their own MLState (make it from the mtp_draft function), or
            # io tensors in an fp32 build
            "states": draft_states,
        },
        "verify": {
            "file": PACKAGE,
            "functions": {str(t): verify_function(t) for t in sizes},
            "inputs": [
                {
                    "name": "input_ids",
                    "shape": [1, "T"],
                    "dtype": "int32",
                    "kind": "tokens",
                    "doc": f"exactly T tokens for function verify_T, T in {list(sizes)}: a longer call runs as a "
                    "sum of them, largest first",
                },
                {"name": "position", "shape": [1], "dtype": "int32", "kind": "position", "doc": "as decode"},
            ],
            "outputs": [
                {
                    "name": "logits",
                    "shape": [1, "T", v],
                    "dtype": "float32",
                    "kind": "logits",
                    "doc": "logits after every row of the call",
                },
                {
                    "name": "hidden_states",
                    "shape": [1, "T", h],
                    "dtype": hdt,
                    "kind": "hidden_states",
                    "doc": "final-normed hidden state of every position of the call (the MTP head's input)",
                },
            ],
            "states": "the decoder's (the same MLState as prefill and decode; io states as decode)",
        },
        "rollback": {
            "kv_cache": "keep the length pointer: positions past the accepted ones are overwritten by later calls",
            "deltanet": "snapshot: before a verify call copy the DeltaNet conv and recurrent states (io states: the "
            "arrays the app holds; Core ML states: MLState.withMultiArray(for:) on iOS 18 / macOS 15); when a "
            "draft is rejected, copy them back and feed the accepted tokens again at the start of the next verify "
            "call",
        },
        "shares_weights": sharing["duplicated_bytes"] == 0,
        "duplicated_bytes": sharing["duplicated_bytes"],
        "weight_blob": sharing,
        "files": [PACKAGE],
    }
