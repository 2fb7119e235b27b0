"""The export passes: an explicit ordered pipeline from the checkpoint's structure to a captured program.

Each pass checks what it requires, does one thing, checks what it ensures and returns counts of
what it changed; the counts go into the bundle manifest. Passes change module structure and the
weight plan, never weight values. A pass that makes a product of the context (the module tree, the quantization
choices, the captured programs, the states) returns it (`Made`); run_pipeline hands the next pass a new context
with it: nothing is set on a context after it is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from deltaship.errors import DeltashipError
from deltaship.lowering.settings import KvCachePlan, LoweringSettings
from deltaship.lowering.weight_plan import WeightPlan
from deltaship.models.families import family_of_architecture
from deltaship.models.spec import ModelSpec
from deltaship.models.weights import expected_tensors
from deltaship.progress import Progress, heartbeat


class PassError(RuntimeError):
    pass


@dataclass(frozen=True)
class Made:
    """What a pass returns when it makes products: its counts (the manifest's `passes`) and the ExportContext fields
    it made, by name. A pass that only rewrites the module tree or adds to the weight plan returns its counts."""

    counts: dict[str, int]
    products: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ExportContext:
    """What the passes read (`settings`) and what they made, pass by pass (the products: each pass's `Made`,
    applied by run_pipeline to a new context). Frozen: a lowering returns what it makes in its `Lowered`."""

    settings: LoweringSettings
    model: nn.Module | None = None  # the checkpoint module tree, rewritten pass by pass
    plan: WeightPlan = field(default_factory=WeightPlan)
    # use ("linear" or "embedding") -> param (every alias of a tied tensor) -> {"bits", "block_size"}
    quant: dict[str, dict[str, dict[str, Any]]] = field(default_factory=lambda: {"linear": {}, "embedding": {}})
    program: torch.export.ExportedProgram | None = None
    states: list[dict] = field(default_factory=list)
    report: list[dict] = field(default_factory=list)
    programs: dict[Any, Any] = field(default_factory=dict)  # fixed-shape programs (Core ML: by part and function)
    parts: list[tuple[int, int]] = field(default_factory=list)  # layer ranges of a target split into packages
    mtp_states: list[dict] = field(default_factory=list)  # --mtp: the draft head's own states (Core ML)

    @property
    def spec(self) -> ModelSpec:
        return self.settings.spec

    @property
    def precision(self) -> str:
        return self.settings.precision

    @property
    def max_context(self) -> int:
        return self.settings.max_context

    @property
    def target(self) -> str:
        return self.settings.target

    @property
    def options(self) -> Any:
        """The target's typed options (a deltaship.targets TargetOptions)."""
        return self.settings.options

    @property
    def kv(self) -> KvCachePlan:
        return self.settings.kv

    @property
    def kv_scales(self) -> Mapping[int, Mapping[str, Any]]:
        """An int8/int4 KV cache's static scales by attention layer (deltaship/lowering/kv_quant.py); else empty."""
        return self.settings.kv_scales

    @property
    def draft_ids(self) -> np.ndarray | None:
        """--mtp-draft-vocab N: the token ids (ascending) the MTP head's logits cover (None: the whole vocabulary)."""
        return self.settings.draft_ids

    @property
    def family(self):
        """The model family's module (deltaship/models/families.py): what the passes ask for classes."""
        return family_of_architecture(self.spec.architecture)

    @property
    def draft_vocab_size(self) -> int:
        """Entries of the draft head's logits: N with --mtp-draft-vocab N, else the vocabulary."""
        return self.spec.vocab_size if self.draft_ids is None else int(self.draft_ids.size)

    @property
    def dtype(self) -> torch.dtype:
        """Activation dtype, as the target computes at this precision (Target.activation_dtype, in the settings)."""
        return getattr(torch, self.settings.activation_dtype)


def _modules(model: nn.Module, cls: type) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, cls)]


def _replace(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


class LoadStructure:
    """Build the checkpoint's module tree on the meta device and a plan that maps every tensor 1:1."""

    name = "load_structure"

    def requires(self, ctx: ExportContext) -> None:
        if ctx.model is not None:
            raise PassError("a model is already loaded")

    def run(self, ctx: ExportContext) -> Made:
        mtp = bool(getattr(ctx.options, "mtp", False))  # the multi-token-prediction head too (export option --mtp)
        model = ctx.family.build_source_model(ctx.spec, mtp=True) if mtp else ctx.family.build_source_model(ctx.spec)
        expected = expected_tensors(ctx.spec, mtp=mtp)
        for name, p in model.named_parameters():
            src = ctx.family.checkpoint_name(name)
            if src not in expected:
                raise PassError(f"parameter {name} has no checkpoint tensor {src}")
            ctx.plan.add_source(name, src, tuple(p.shape))
        if ctx.spec.tie_word_embeddings:
            ctx.plan.alias("lm_head.weight", "model.embed_tokens.weight")
        if mtp and ctx.draft_ids is not None:  # --mtp-draft-vocab N: the head's logits over N ids, from lm_head's rows
            model.add_draft_head(int(ctx.draft_ids.size))
            ctx.plan.take_rows("mtp.draft_head.weight", "lm_head.weight", ctx.draft_ids)
        ctx.plan.add_constant(
            "model.rotary.inv_freq", lambda: ctx.family.rotary_inv_freq(ctx.spec), (ctx.spec.rotary_dim // 2,)
        )
        counts = {
            "layers": ctx.spec.num_layers,
            "tensors": len(expected),
            "tied_lm_head": int(ctx.spec.tie_word_embeddings),
            **({"mtp_layers": ctx.spec.mtp_num_hidden_layers} if mtp else {}),
            **({"mtp_draft_vocab": ctx.draft_vocab_size} if mtp and ctx.draft_ids is not None else {}),
        }
        return Made(counts, {"model": model})

    def ensures(self, ctx: ExportContext) -> None:
        params = {n for n, _ in ctx.model.named_parameters()}
        missing = params - set(ctx.plan.names())
        if missing:
            raise PassError(f"parameters with no weight recipe: {sorted(missing)[:5]}")


class FoldZeroCentredNorms:
    """Qwen3.5's RMSNorms scale by (1 + w): fold the 1 into the weight, use the canonical rms_norm."""

    name = "fold_zero_centred_norms"

    def requires(self, ctx: ExportContext) -> None:
        if not _modules(ctx.model, ctx.family.ZeroCentredRMSNorm):
            raise PassError("no zero-centred norms to fold (already folded?)")

    def run(self, ctx: ExportContext) -> dict[str, int]:
        found = _modules(ctx.model, ctx.family.ZeroCentredRMSNorm)
        for path, m in found:
            new = ctx.family.RMSNorm(m.weight.shape[0], m.eps)
            new.weight = m.weight
            _replace(ctx.model, path, new)
            ctx.plan.add_fixup(
                f"{path}.weight", "fold_zero_centred_norm", ctx.family.fold_zero_centred_norm, dtype="float32"
            )
        return {"norms_folded": len(found)}

    def ensures(self, ctx: ExportContext) -> None:
        if _modules(ctx.model, ctx.family.ZeroCentredRMSNorm):
            raise PassError("zero-centred norms left after folding")


class RewriteDeltaNet:
    """Each Gated DeltaNet layer -> causal_conv_with_state + gated_delta_rule with explicit state."""

    name = "rewrite_deltanet"

    def requires(self, ctx: ExportContext) -> None:
        if len(_modules(ctx.model, ctx.family.SourceGatedDeltaNet)) != len(ctx.spec.deltanet_layers):
            raise PassError("the model does not hold one source DeltaNet module per linear_attention layer")

    def run(self, ctx: ExportContext) -> dict[str, int]:
        found = _modules(ctx.model, ctx.family.SourceGatedDeltaNet)
        for path, src in found:
            _replace(ctx.model, path, ctx.family.StatefulGatedDeltaNet(ctx.spec, src))
            for old, new in ctx.family.StatefulGatedDeltaNet.renames.items():
                ctx.plan.rename(f"{path}.{old}", f"{path}.{new}")
            ctx.plan.add_fixup(
                f"{path}.decay_scale", "decay_scale_from_a_log", ctx.family.decay_scale_from_a_log, dtype="float32"
            )
            ctx.plan.add_fixup(
                f"{path}.conv_weight",
                "squeeze_conv_weight",
                ctx.family.squeeze_conv_weight,
                shape=(ctx.spec.conv_dim, ctx.spec.linear_conv_kernel_dim),
            )
            ctx.plan.add_fixup(f"{path}.dt_bias", "keep_fp32", lambda w: w, dtype="float32")
            ctx.plan.add_fixup(f"{path}.norm_weight", "keep_fp32", lambda w: w, dtype="float32")
        return {"deltanet_layers_rewritten": len(found), "states_added": 2 * len(found)}

    def ensures(self, ctx: ExportContext) -> None:
        if _modules(ctx.model, ctx.family.SourceGatedDeltaNet):
            raise PassError("source DeltaNet modules left after the rewrite")


class StaticKVCache:
    """Each attention layer -> attention_with_kv_cache over a static cache of max_context positions."""

    name = "static_kv_cache"

    def requires(self, ctx: ExportContext) -> None:
        if _modules(ctx.model, ctx.family.ZeroCentredRMSNorm):
            raise PassError("fold the zero-centred q/k norms first")
        if ctx.max_context < 1:
            raise PassError("max_context must be positive")

    def run(self, ctx: ExportContext) -> dict[str, int]:
        found = _modules(ctx.model, ctx.family.SourceAttention)
        for path, src in found:
            _replace(ctx.model, path, ctx.family.StaticCacheAttention(ctx.spec, src, ctx.max_context))
            for old, new in ctx.family.StaticCacheAttention.renames.items():
                ctx.plan.rename(f"{path}.{old}", f"{path}.{new}")
        return {"attention_layers_rewritten": len(found), "kv_caches": 2 * len(found), "max_context": ctx.max_context}

    def ensures(self, ctx: ExportContext) -> None:
        if _modules(ctx.model, ctx.family.SourceAttention):
            raise PassError("source attention modules left after the rewrite")


class FuseProjections:
    """Linear maps of the same input become one matmul and a split (DeltaNet in_proj, QKV, gate/up)."""

    name = "fuse_projections"

    def requires(self, ctx: ExportContext) -> None:
        if _modules(ctx.model, ctx.family.SourceModule):
            raise PassError("rewrite the token mixers before fusing their projections")

    def run(self, ctx: ExportContext) -> dict[str, int]:
        counts = {"deltanet_in_proj": 0, "attention_qkv": 0, "mlp_gate_up": 0}
        key = {"proj": "deltanet_in_proj", "qkv": "attention_qkv", "gate_up": "mlp_gate_up"}
        for path, group in _modules(ctx.model, ctx.family.Projections):
            names = [f"{path}.parts.{n}.weight" for n in group.parts]
            group.fuse()
            ctx.plan.fuse(names, f"{path}.fused.weight")
            counts[key[path.rsplit(".", 1)[-1]]] += 1
        return counts

    def ensures(self, ctx: ExportContext) -> None:
        params = {n for n, _ in ctx.model.named_parameters()}
        missing = params - set(ctx.plan.names())
        if missing:
            raise PassError(f"parameters with no weight recipe after fusing: {sorted(missing)[:5]}")


class LastTokenLogits:
    """Compute the LM head for the last position only (an app never needs the others)."""

    name = "last_token_logits"

    def requires(self, ctx: ExportContext) -> None:
        if ctx.model.last_token_only:
            raise PassError("already last-token only")

    def run(self, ctx: ExportContext) -> dict[str, int]:
        ctx.model.last_token_only = True
        return {"lm_head_positions": 1}

    def ensures(self, ctx: ExportContext) -> None:
        pass


class AssignPrecision:
    """Set parameter dtypes and choose the quantization of each matmul weight and the embedding.

    quantize=False: dtypes only, for targets whose toolchain quantizes (ExecuTorch with torchao).
    """

    name = "assign_precision"

    def __init__(self, quantize: bool = True):
        self.quantize = quantize

    def requires(self, ctx: ExportContext) -> None:
        if ctx.precision not in ("fp32", "fp16", "int8", "int4"):
            raise PassError(f"unknown precision {ctx.precision!r}")

    def run(self, ctx: ExportContext) -> Made:
        model, plan = ctx.model, ctx.plan
        quant: dict[str, dict[str, dict[str, Any]]] = {"linear": {}, "embedding": {}}
        kept = 0
        for name, p in model.named_parameters():
            keep32 = plan.recipes[name].dtype == "float32"
            kept += keep32
            p.data = p.data.to(torch.float32 if keep32 else ctx.dtype)
        for name, b in model.named_buffers():  # constants: fp32 unless their recipe follows the model
            model_dtype = name in plan.recipes and plan.recipes[name].dtype == "model"
            b.data = b.data.to(ctx.dtype if model_dtype else torch.float32)
        counts = {"params_kept_fp32": kept, "params_at_model_dtype": sum(1 for _ in model.parameters()) - kept}
        if ctx.precision in ("int8", "int4") and self.quantize:
            bits = 8 if ctx.precision == "int8" else 4
            block, params = ctx.settings.block_size, ctx.settings.params
            dn8 = ctx.settings.deltanet_int8 and bits == 4
            per_channel8 = params.int8_block == "channel"
            divide = params.block_must_divide
            # MatMulNBits and GatherBlockQuantized take their scales in the activations' type
            scale_dt = params.scale_dtype or ("float16" if ctx.dtype == torch.float16 else "float32")
            for mname, m in model.named_modules():
                if isinstance(m, nn.Linear):
                    b = 8 if dn8 and ".linear_attn." in mname else bits
                    blk = m.in_features if (b == 8 and per_channel8) else block
                    if divide and m.in_features % blk:
                        blk = next(
                            (x for x in (blk // 2, blk // 4, blk // 8) if x >= 4 and m.in_features % x == 0),
                            m.in_features,
                        )
                    for alias in plan.aliases(f"{mname}.weight"):
                        quant["linear"][alias] = {"bits": b, "block_size": blk, "scale_dtype": scale_dt}
            # Gathered embedding rows cannot be padded: the block must divide the hidden size.
            emb_block = next(
                (b for b in (block, block // 2, block // 4) if b >= 16 and ctx.spec.hidden_size % b == 0), 0
            )
            if emb_block:
                if bits == 8 and per_channel8:
                    emb_block = ctx.spec.hidden_size
                for alias in plan.aliases("model.embed_tokens.weight"):
                    quant["embedding"][alias] = {"bits": bits, "block_size": emb_block, "scale_dtype": scale_dt}
            counts["embedding_quantized"] = int(bool(emb_block))
            for b in (4, 8):
                n = sum(1 for q in quant["linear"].values() if q["bits"] == b)
                if n:
                    counts[f"weights_int{b}"] = n
        return Made(counts, {"quant": quant})

    def ensures(self, ctx: ExportContext) -> None:
        for name, p in ctx.model.named_parameters():
            want = torch.float32 if ctx.plan.recipes[name].dtype == "float32" else ctx.dtype
            if p.dtype != want:
                raise PassError(f"{name} is {p.dtype}, expected {want}")


class Capture:
    """torch.export the canonical model on meta tensors, prompt length dynamic (1 .. max_context)."""

    name = "capture"

    def requires(self, ctx: ExportContext) -> None:
        left = _modules(ctx.model, ctx.family.SourceModule)
        if left:
            raise PassError(f"checkpoint-layout modules left: {[n for n, _ in left][:3]}")

    def run(self, ctx: ExportContext) -> Made:
        states = ctx.model.state_specs(ctx.dtype)
        programs = dict(ctx.programs)
        if getattr(ctx.model, "mtp", None) is not None:  # --mtp: the verify-capable decoder and the MTP head
            program, mtp_program, mtp_states = capture_speculative(ctx.model, states, ctx.max_context, ctx.dtype)
            programs["mtp"] = (mtp_program, mtp_states)
        else:
            program = capture(ctx.model, states, ctx.max_context)
        counts: dict[str, int] = {}
        for node in program.graph.nodes:
            if node.op == "call_function" and str(node.target).startswith("deltaship."):
                key = str(node.target).split(".")[1]
                counts[key] = counts.get(key, 0) + 1
        counts["graph_nodes"] = sum(1 for n in program.graph.nodes if n.op == "call_function")
        return Made(counts, {"states": states, "program": program, "programs": programs})

    def ensures(self, ctx: ExportContext) -> None:
        sig = ctx.program.graph_signature
        user_in = [s for s in sig.input_specs if s.kind == torch.export.graph_signature.InputKind.USER_INPUT]
        extra = 1 if "mtp" in ctx.programs else 0  # logit_rows in; the rows' logits and hidden states out
        if len(user_in) != 2 + len(ctx.states) + extra:
            raise PassError(f"captured program takes {len(user_in)} inputs, expected 2 + {len(ctx.states)} states")
        if len(sig.output_specs) != 1 + len(ctx.states) + 2 * extra:
            raise PassError(
                f"captured program returns {len(sig.output_specs)} outputs, expected 1 + "
                f"{len(ctx.states)} states: some state has no output"
            )
        n_dn = len(ctx.spec.deltanet_layers)
        calls = [str(n.target) for n in ctx.program.graph.nodes if n.op == "call_function"]
        for op, want in (
            ("gated_delta_rule", n_dn),
            ("causal_conv_with_state", n_dn),
            ("attention_with_kv_cache", len(ctx.spec.attention_layers)),
        ):
            got = sum(1 for c in calls if c == f"deltaship.{op}.default")
            if got != want:
                raise PassError(f"captured program has {got} {op} ops, expected {want}")


def example_inputs(states: list[dict], length: int, device: str = "meta") -> tuple:
    ids = torch.zeros(1, length, dtype=torch.long, device=device)
    pos = torch.zeros(1, dtype=torch.long, device=device)
    st = [torch.zeros(s["shape"], dtype=getattr(torch, s["dtype"]), device=device) for s in states]
    return ids, pos, st


def graph_passes(capture_pass) -> tuple:
    """The passes of a target that lowers a captured graph (ONNX, Core ML, qnn), in order, ending with its own
    capture pass (dynamic, static per part, or static per token count)."""
    return (
        LoadStructure(),
        FoldZeroCentredNorms(),
        RewriteDeltaNet(),
        StaticKVCache(),
        FuseProjections(),
        LastTokenLogits(),
        AssignPrecision(),
        capture_pass,
    )


def capture(
    model: nn.Module, states: list[dict], max_context: int, static: int | None = None
) -> torch.export.ExportedProgram:
    """The program for any prompt length 1 .. max_context, or for exactly `static` tokens."""
    if static is not None:
        return torch.export.export(model, example_inputs(states, static), strict=False)
    t = torch.export.Dim("tokens", min=1, max=max_context)
    args = example_inputs(states, 2)
    return torch.export.export(model, args, dynamic_shapes=({1: t}, None, [None] * len(states)), strict=False)


def capture_speculative(
    model: nn.Module, states: list[dict], max_context: int, dtype: torch.dtype
) -> tuple[torch.export.ExportedProgram, torch.export.ExportedProgram, list[dict]]:
    """The decoder with verify outputs (logit_rows in; logits of those rows and every position's final-normed
    hidden state out) and the MTP head's program (hidden [1, T, H], input_ids [1, T], position [1], its KV cache)."""
    model.speculative = True
    t = torch.export.Dim("tokens", min=1, max=max_context)
    rows = torch.export.Dim("rows", min=1, max=max_context)
    ids, pos, st = example_inputs(states, 3)
    decoder = torch.export.export(
        model,
        (ids, pos, st, torch.arange(1, 3, device="meta")),
        dynamic_shapes=({1: t}, None, [None] * len(states), {0: rows}),
        strict=False,
    )
    mtp_states = model.mtp_state_specs(dtype)
    hidden = torch.zeros(1, 3, model.spec.hidden_size, dtype=dtype, device="meta")
    _, _, mst = example_inputs(mtp_states, 3)
    prog = model.mtp_program()
    mtp = torch.export.export(
        prog, (hidden, ids, pos, mst), dynamic_shapes=({1: t}, {1: t}, None, [None] * len(mtp_states)), strict=False
    )
    return decoder, mtp, mtp_states


def run_pipeline(ctx: ExportContext, passes: tuple, progress=None) -> ExportContext:
    """Run `passes` (a target's pipeline, in order) from ctx; returns the context with every pass's products, and
    each pass's counts in its report."""
    done = [r["pass"] for r in ctx.report]  # passes already run on this context, in order
    beat = (lambda m: progress(m, inline=True)) if isinstance(progress, Progress) else None
    for p in passes:
        if progress:
            progress(f"pass {p.name}")
        try:
            p.requires(ctx)
            with heartbeat(beat, f"still in pass {p.name}"):
                made = p.run(ctx)
            made = made if isinstance(made, Made) else Made(made)
            ctx = replace(ctx, **made.products)  # a new context: the products so far and this pass's
            p.ensures(ctx)
        except DeltashipError as e:  # the user's input or options: keep the message and its fix
            raise DeltashipError(f"{e.message} (in export pass {p.name!r})", e.fix) from e
        except Exception as e:
            before = ", ".join(done) or "none"
            raise PassError(f"export pass {p.name!r} failed (after: {before}): {e}") from e
        ctx = replace(ctx, report=[*ctx.report, {"pass": p.name, "counts": made.counts}])
        done.append(p.name)
    return ctx


def rerun_pipeline(ctx: ExportContext, pipeline: tuple) -> ExportContext:
    """A second context with ctx's settings and the products empty, through `pipeline` (the target's) again: a
    second decoder, e.g. the multimodal one that export --vision wraps after the text lowering consumed ctx's."""
    return run_pipeline(ExportContext(ctx.settings), pipeline)


def materialize(
    model: nn.Module, plan: WeightPlan, weights, prefix: str | None = None, allocate: bool = True
) -> nn.Module:
    """Give a meta model real weights from the plan (for eager runs and toolchains that need them).

    allocate=False with a prefix fills only that part of an already allocated model, so a caller can
    fill and compress one layer at a time (untouched allocations cost no resident memory).
    """
    tied: dict[int, torch.Tensor] = {}
    if allocate:
        model.to_empty(device="cpu")
    with torch.no_grad():
        for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
            if id(t) in tied or (prefix is not None and not name.startswith(prefix)):
                continue
            t.copy_(torch.from_numpy(np.array(plan.tensor(name, weights))).to(t.dtype))
            tied[id(t)] = t
    return model
