"""The .pte: the eager model with ExecuTorch's kernels, quantized, exported, lowered to XNNPACK, written."""

from __future__ import annotations

import contextlib
import copy
import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deltaship.bundle.writer import tool_versions
from deltaship.errors import DeltashipError
from deltaship.lowering.executorch import quant as q
from deltaship.lowering.executorch.lowering import ExecuTorchKernels
from deltaship.lowering.executorch.requirements import program_operators, runtime_requirements
from deltaship.lowering.kv_quant import stored_states
from deltaship.lowering.lowered import Lowered
from deltaship.lowering.passes import materialize
from deltaship.oracle.budget import reference_fits
from deltaship.progress import heartbeat

PTE_FILE = "model.pte"
# Nodes that legitimately run outside XNNPACK (names as get_delegation_info reports them): the
# canonical stateful kernels (llama::*, the KV-cache write), the (quantized) embedding gather,
# symbolic-size arithmetic and asserts, and the few scalar/mask ops around positions.
PORTABLE_OK_PREFIXES = (
    "llama_",
    "auto_functionalized",
    "aten_embedding",
    "quantized_decomposed_embedding",
    "aten_arange",
    "aten_eq_scalar",
    "aten_ne_scalar",
    "aten_add_tensor",
    "aten_cat_default",
    "aten__to_copy",
    "aten_sym_size",
    "aten__local_scalar_dense",
    "aten__assert",
    # data movement at partition boundaries (views are free after memory planning)
    "aten_view_copy",
    "aten_slice_copy",
    "aten_split_with_sizes_copy",
    "aten_unsqueeze_copy",
    "aten_expand_copy",
    "aten_select_copy",
    "aten_squeeze_copy",
    "aten_permute_copy",
)
PORTABLE_OK_SYMBOLIC = (
    "add",
    "sub",
    "mul",
    "ge",
    "le",
    "lt",
    "gt",
    "eq",
    "floordiv",
    "getitem",
    "sym_size",
    "_assert_scalar",
    "_local_scalar_dense",
)


# What a stored KV cache (--kv-cache int8/int4, lowering.store_kv / load_kv) adds outside XNNPACK, per K or V of a
# layer: the rounding, int4's packing, and the dequantization.
KV_PORTABLE = {
    "int8": {"aten_round_default", "aten_mul_tensor"},
    "int4": {
        "aten_round_default",
        "aten_mul_tensor",
        "aten_sub_tensor",
        "aten_bitwise_or_tensor",
        "aten_bitwise_left_shift_tensor_scalar",
        "aten_bitwise_and_scalar",
        "aten_bitwise_right_shift_tensor_scalar",
    },
}


def kv_detail(ctx) -> str:
    """The manifest's note on a KV cache narrower than fp32 (lowering.kv_cache)."""
    if ctx.kv.quantized:
        packed = ", two 4-bit codes a byte (q + 8; channel 2i low nibble)" if ctx.kv.dtype == "int4" else ""
        return (
            f"; {ctx.kv.dtype} with static per-channel scales{packed}, dequantized to fp32 (one layer at a time) "
            "for custom_sdpa"
        )
    if ctx.kv.narrower:
        return f"; {ctx.kv.dtype}, widened to fp32 (one layer at a time) for custom_sdpa"
    return ""


def expected_portable(op: str) -> bool:
    return op in PORTABLE_OK_SYMBOLIC or op.startswith(PORTABLE_OK_PREFIXES)


def check_portable(portable: dict[str, int], kv_cache: str | None = None, n_kv: int = 0, allow: bool = False) -> None:
    """Refuse a program with nodes XNNPACK did not take (op -> count, as get_delegation_info names them) beyond the
    expected ones, unless `allow` (--allow-portable-fallback). A stored int8/int4 KV cache (`kv_cache`) rounds the
    new keys/values, (un)packs and dequantizes the cache outside XNNPACK: up to `n_kv` of those ops (one each for K
    and V a layer)."""
    kv_ops = KV_PORTABLE.get(kv_cache, set()) if kv_cache else set()
    unexpected = {op: n for op, n in portable.items() if not expected_portable(op) and not (op in kv_ops and n <= n_kv)}
    if unexpected and not allow:
        raise DeltashipError(
            "executorch lowering: XNNPACK does not take these nodes, which would run as slow portable kernels: "
            + ", ".join(f"{op} x{n}" for op, n in sorted(unexpected.items())),
            "report this; or pass --allow-portable-fallback to accept the portable kernels",
        )


class ProgramState(nn.Module):
    """Holds every state tensor as a buffer and threads them through the canonical model."""

    def __init__(self, model: nn.Module, states: list[dict], kernels):
        super().__init__()
        self.model, self.kernels = model, kernels
        self.names = []
        for s in states:
            name = s["name"].replace(".", "_")
            self.register_buffer(name, torch.zeros(s["shape"], dtype=getattr(torch, s["dtype"])))
            self.names.append(name)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        self.kernels.position = input_pos
        bufs = [getattr(self, n) for n in self.names]
        logits, new = self.model(tokens, input_pos, bufs)
        with torch.no_grad():
            for buf, value in zip(bufs, new):
                if value is not buf:  # the KV cache is written in place by llama::update_cache
                    buf.copy_(value)
        return logits


class VerifyState(ProgramState):
    """Method 'verify' (--mtp): the decoder over the same buffers (the same names: the program shares them with
    'forward', share_mutable_buffers), returning the logits after each of `logit_rows` ([1, rows, V], one LM-head
    matmul) and the final-normed hidden state of every position ([1, T, H]: the draft head's input)."""

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, logit_rows: torch.Tensor):
        self.kernels.position = input_pos
        bufs = [getattr(self, n) for n in self.names]
        m = self.model
        x, new = m.run_layers(m.model.embed_tokens(tokens), input_pos, bufs)
        hidden = m.model.norm(x)
        rows = m.lm_head(hidden.index_select(1, logit_rows)).float()
        with torch.no_grad():
            for buf, value in zip(bufs, new):
                if value is not buf:
                    buf.copy_(value)
        return rows, hidden.float()


class DraftState(ProgramState):
    """Method 'mtp_draft' (--mtp): the MTP head over its own KV cache buffers (mtp_past_*), reading the decoder's
    embedding and LM head (the same parameters: the program stores them once). dtype: the activations', which the
    decoder's hidden states are cast to."""

    def __init__(self, model: nn.Module, states: list[dict], kernels, dtype: torch.dtype):
        super().__init__(model, states, kernels)
        self.dtype = dtype

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, input_pos: torch.Tensor):
        self.kernels.position = input_pos
        bufs = [getattr(self, n) for n in self.names]
        logits, out, new = self.model.mtp_forward(hidden.to(self.dtype), tokens, input_pos, bufs)
        with torch.no_grad():
            for buf, value in zip(bufs, new):
                if value is not buf:
                    buf.copy_(value)
        return logits, out.float()


def program_states(states: list[dict]) -> list[dict]:
    """The canonical state contract in ExecuTorch's layouts: KV cache [1, S, Hkv, D], always fp32."""
    out = []
    for s in states:
        s = dict(s, buffer=s["name"].replace(".", "_"))
        if s["kind"].startswith("kv_cache"):
            b, h, t, d = s["shape"]
            s.update(shape=[b, t, h, d], dtype="float32")
        out.append(s)
    return out


def use_kernels(model: nn.Module, kernels) -> int:
    n = 0
    for m in model.modules():
        if hasattr(m, "kernels"):
            m.kernels = kernels
            n += 1
    return n


def static_conv_weights(model: nn.Module) -> None:
    """[C, K] -> a [C, 1, K] parameter: XNNPACK delegates a depthwise conv only with a static weight."""
    for m in model.modules():
        if hasattr(m, "conv_weight") and m.conv_weight.dim() == 2:
            m.conv_weight = nn.Parameter(m.conv_weight.detach().unsqueeze(1), requires_grad=False)


def reshape_inferring_partitioner():
    """XNNPACK's partitioner, rewriting each method's reshapes (infer_reshape_dims) on the way.

    infer_reshape_dims needs the functional ATen graph, which to_edge_transform_and_lower builds itself (its
    run_decompositions({})) between the partitioner's two hooks: transform_for_pre_decomposition, then
    ops_to_not_decompose on the functional program. Rewriting there spares a whole re-trace of every method (a
    run_decompositions({}) of deltaship's own beforehand, which ExecuTorch's then repeated); the program is the same
    bytes. `reshapes` counts the rewrites."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner  # lazy: executorch

    class ReshapeInferring(XnnpackPartitioner):
        reshapes = 0
        _functional_next = False

        def transform_for_pre_decomposition(self, exported_program):
            self._functional_next = True  # ExecuTorch functionalizes the program next, then asks which ops to keep
            return super().transform_for_pre_decomposition(exported_program)

        def ops_to_not_decompose(self, ep):
            if self._functional_next:  # once a method, on its functional graph
                self._functional_next = False
                self.reshapes += infer_reshape_dims(ep)
            return super().ops_to_not_decompose(ep)

    return ReshapeInferring()


def infer_reshape_dims(ep: torch.export.ExportedProgram) -> int:
    """Reshapes whose target shape has exactly one symbolic size get -1 there instead.

    torch.export spells a dynamic reshape with the symbolic prompt length; XNNPACK's static_reshape
    rejects symbolic sizes but takes one inferred (-1) dimension, so without this every reshape on
    the prompt axis splits the delegate. Returns how many were rewritten."""
    aten = torch.ops.aten
    n = 0
    for node in ep.graph.nodes:
        if node.op == "call_function" and node.target in (
            aten.view.default,
            aten._unsafe_view.default,
            aten.reshape.default,
        ):
            shape = list(node.args[1])
            symbolic = [i for i, d in enumerate(shape) if not isinstance(d, int)]
            if len(symbolic) == 1 and -1 not in shape:
                shape[symbolic[0]] = -1
                node.args = (node.args[0], shape)
                n += 1
    ep.graph_module.graph.eliminate_dead_code()
    ep.graph_module.recompile()
    return n


@contextlib.contextmanager
def preprocess_shares_weights():
    """Within this block, the copy of each partition that ExecuTorch hands to XNNPACK's preprocess shares
    its weight storage with the partition instead of deep-copying it.

    `lower_all_submodules_to_backend` deep-copies every partition's program, weights included, before the
    first preprocess and keeps all the copies until the last one is done: one more copy of the quantized
    model at the peak (4B int4: +4.4 GiB). XNNPACK's preprocess reads the weights to pack its own blobs and
    writes into none of them (tested: test_xnnpack_preprocess_shares_and_leaves_weights_untouched), so the
    copy keeps its own graph and tables but not its own storage, as ExecuTorch's CUDA backend does in its
    low-memory mode (whose copies share the tensor objects themselves; here each copy gets its own tensor
    objects on the shared storage). It swaps a class attribute of ExecuTorch's XnnpackBackend for the
    duration: not for concurrent lowerings in threads of one process."""
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend  # lazy: executorch
    from executorch.exir.backend.backend_details import BackendDetails

    name = "copy_exported_program_for_preprocess"
    if not hasattr(BackendDetails, name):  # the hook of executorch 1.5; without it the copies would be back
        raise RuntimeError(
            f"executorch {tool_versions('executorch')['executorch']} has no BackendDetails.{name}: "
            "deltaship's ExecuTorch lowering is written for executorch 1.5.1"
        )
    own = vars(XnnpackBackend).get(name)

    def share(cls, edge_program, compile_specs):
        # New tensor objects on the same storage: preprocess replaces some entries of its copy (the conv
        # weights' unsqueeze pass puts a view in the copy's state dict), which must stay in the copy.
        memo = {
            id(t): _same_storage(t)
            for table in (edge_program.state_dict, edge_program.constants)
            for t in table.values()
            if isinstance(t, torch.Tensor)
        }
        return copy.deepcopy(edge_program, memo)

    setattr(XnnpackBackend, name, classmethod(share))
    try:
        yield
    finally:
        if own is None:
            delattr(XnnpackBackend, name)
        else:
            setattr(XnnpackBackend, name, own)


@contextlib.contextmanager
def xnnpack_passes_that_apply():
    """Within this block, XNNPACK's preprocess runs on each partition only the passes of its list that can change it.

    XnnpackBackend.preprocess runs its whole pass list (17 passes) on every partition, and each pass re-traces the
    partition with fake tensors whether it rewrote anything or not. Five rewrite ops a partition may not hold:
    bilinear upsampling, the SDPA pattern (left out when an op of every variant of the pattern is missing, so the
    subgraph matcher cannot match), batch norm (two passes) and PReLU; a partition without them skips those five
    re-traces. The passes left run as before, in order, so the program is the same bytes. It swaps the module
    attribute xnnpack_preprocess.XNNPACKPassManager for the duration: not for lowerings in threads of one process."""
    from executorch.backends.xnnpack import xnnpack_preprocess  # lazy: executorch

    own = xnnpack_preprocess.XNNPACKPassManager

    class Applicable(own):
        def __init__(self, exported_program, passes=None):
            super().__init__(exported_program, passes)
            if not passes:  # the default list (an explicit one is the caller's choice)
                self.passes = applicable_xnnpack_passes(self.passes, exported_program.graph)

    xnnpack_preprocess.XNNPACKPassManager = Applicable
    try:
        yield
    finally:
        xnnpack_preprocess.XNNPACKPassManager = own


def applicable_xnnpack_passes(passes: list, graph: torch.fx.Graph) -> list:
    """`passes` without the pattern passes of xnnpack_passes_that_apply that cannot match an op of `graph`."""
    from executorch.backends.xnnpack._passes import (  # lazy: executorch
        ConvertToSDPAPass,
        ConvertToUpsampleBilinear2d,
        DecomposeBatchNorm,
        FuseBatchNormPass,
        PReLUReshapePass,
    )
    from executorch.backends.xnnpack.partition.graphs import sdpa  # lazy: executorch
    from executorch.exir.dialects._ops import ops as exir_ops  # lazy: executorch

    edge = exir_ops.edge.aten
    present = {n.target for n in graph.nodes if n.op == "call_function"}
    # copies the passes before these may add or remove (clone removal, dim-order reverts) never rule a pattern out
    dim_order = exir_ops.edge.dim_order_ops
    copies = {
        edge.clone.default,
        edge._to_copy.default,
        dim_order._clone_dim_order.default,
        dim_order._to_dim_order_copy.default,
    }

    def may_match(patterns) -> bool:
        return any({n.target for n in g.graph.nodes if n.op == "call_function"} - copies <= present for g in patterns)

    batch_norm = {edge.native_batch_norm.default, edge._native_batch_norm_legit_no_training.default}
    needed = {
        ConvertToUpsampleBilinear2d: lambda: edge.upsample_bilinear2d.vec in present,  # its patterns: this op alone
        ConvertToSDPAPass: lambda: may_match(sdpa.get_graphs()),
        FuseBatchNormPass: lambda: bool(batch_norm & present),
        DecomposeBatchNorm: lambda: bool(batch_norm & present),
        PReLUReshapePass: lambda: edge._prelu_kernel.default in present,
    }
    return [p for p in passes if p not in needed or needed[p]()]


def _same_storage(t: torch.Tensor) -> torch.Tensor:
    return nn.Parameter(t.detach(), requires_grad=False) if isinstance(t, nn.Parameter) else t.detach()


def release_lowered_weights(edge) -> int:
    """Swap the weights each XNNPACK delegate keeps of the program it was lowered from for placeholders.

    A LoweredBackendModule holds its original ExportedProgram, state dict included, so after lowering
    the quantized weights stay alive beside the delegates' packed copies through to_executorch and the
    write of the .pte. Serialisation only traces that program with fake tensors (it needs each weight's
    shape, dtype and device, not its values), so every weight becomes a zero-stride view of one element.
    Returns the bytes released."""
    from executorch.exir.lowered_backend_module import LoweredBackendModule  # lazy: executorch

    released, seen = 0, set()
    for node in edge.exported_program().graph_module.modules():
        if not isinstance(node, LoweredBackendModule):
            continue
        original = node.original_module
        for table in (original._state_dict, original._constants):
            for name, t in list(table.items()):
                if not isinstance(t, torch.Tensor):
                    continue
                for st in _storages(t):
                    if st.data_ptr() not in seen:
                        seen.add(st.data_ptr())
                        released += st.nbytes()
                table[name] = _placeholder(t)
    return released


def _storages(t: torch.Tensor) -> list:
    """The storages behind a tensor, looking through tensor subclasses (torchao's quantized weights)."""
    if _is_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [s for n in names for s in _storages(getattr(t, n))]
    return [t.untyped_storage()]


def _is_subclass(t: torch.Tensor) -> bool:
    return hasattr(t, "__tensor_flatten__") and type(t) not in (torch.Tensor, nn.Parameter)


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    """Same type, shape, dtype and device as t, backed by one element."""
    if _is_subclass(t):
        names, meta = t.__tensor_flatten__()
        return type(t).__tensor_unflatten__({n: _placeholder(getattr(t, n)) for n in names}, meta, t.shape, t.stride())
    cheap = torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape)
    return nn.Parameter(cheap, requires_grad=False) if isinstance(t, nn.Parameter) else cheap


def metadata(ctx, tokens: dict[str, Any]) -> dict[str, Any]:
    """The constant methods ExecuTorch's LLM runner reads (extension/llm/runner/constants.h).

    The runner splits a prompt into calls of get_max_seq_len tokens (text_prefiller.cpp), so that is the
    prefill chunk the token dimension is bounded by; get_max_context_len is the KV cache. With
    seq_len < context the runner checks only the prompt against the context, not position + prompt
    (text_llm_runner.cpp treats it as a sliding window): past the context the program itself fails, in
    llama::update_cache's bounds check (a program without attention layers has no cache to overflow)."""
    eos = tokens.get("eos") or []
    chunk = ctx.settings.prefill_chunk
    return {
        "get_max_seq_len": min(chunk, ctx.max_context),
        "get_max_context_len": ctx.max_context,
        "get_vocab_size": ctx.spec.vocab_size,
        "get_n_layers": ctx.spec.num_layers,
        "get_bos_id": tokens.get("bos") if tokens.get("bos") is not None else (eos[0] if eos else 0),
        "get_eos_ids": list(eos),
        "use_kv_cache": True,
        "use_sdpa_with_kv_cache": True,
        "enable_dynamic_shape": True,
    }


@dataclass(frozen=True)
class Prepared:
    """`prepare`'s result: the eager model as the program will hold it (its own copy of the passes' module tree, with
    real weights and ExecuTorch's kernels), the kernels, the manifest's quantization block, the kernels swapped in,
    the state contract in ExecuTorch's layouts as the program stores it, --mtp's draft-head states (None without
    the head), and the quantized weights dequantized (None: fp32/fp16, or no verification to read them)."""

    model: nn.Module
    kernels: ExecuTorchKernels
    quant: dict[str, Any]
    swapped: int
    states: list[dict]
    mtp_states: list[dict] | None
    rounded: dict[str, Any] | None


def prepare(ctx, weights, say=lambda m: None) -> Prepared:
    """The eager model as the program will hold it: real weights, ExecuTorch kernels, quantized; with the states in
    ExecuTorch's layouts and the rounded weights (`Prepared`)."""

    model = copy.deepcopy(ctx.model).eval()  # the lowering's own: the passes' meta tree stays as they left it
    for p in model.parameters():
        p.requires_grad_(False)
    model.to_empty(device="cpu")  # untouched allocations cost no resident memory
    quantized = ctx.precision in ("int8", "int4")
    group = ctx.settings.block_size
    quant: dict[str, Any] = (
        q.describe(ctx.precision, group) if quantized else {"scheme": "none", "weights": ctx.precision}
    )
    # Fill (and quantize) one part at a time: only one layer is ever held in full precision; the
    # vocabulary tables of a quantized build are quantized from the plan a block of rows at a time.
    units = (
        ["model.embed_tokens."]
        + [f"model.layers.{i}." for i in range(ctx.spec.num_layers)]
        + ["model.norm.", "model.rotary.", "lm_head."]
        + (["mtp."] if getattr(model, "mtp", None) is not None else [])  # --mtp: the draft head's own weights
    )
    for i, unit in enumerate(units):
        say(f"materialising {unit.rstrip('.')} ({i + 1}/{len(units)})")
        table = unit.rstrip(".") + ".weight"
        if quantized and unit == "model.embed_tokens.":
            model.model.embed_tokens, quant["embedding"] = q.quantized_embedding(
                lambda rows: ctx.plan.tensor(table, weights, rows), ctx.plan.shape(table), ctx.precision
            )
        elif quantized and unit == "lm_head.":  # also unties a tied head: the two uses are quantized apart
            model.lm_head.weight = nn.Parameter(
                q.quantized_table_linear(
                    lambda rows: ctx.plan.tensor(table, weights, rows), ctx.plan.shape(table), ctx.precision, group
                ),
                requires_grad=False,
            )
        else:
            materialize(model, ctx.plan, weights, prefix=unit, allocate=False)
            if quantized and unit.startswith(("model.layers.", "mtp.")):
                q.quantize_linears(model, ctx.precision, group, prefix=unit)
    if quantized:
        plain = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and type(m.weight) is nn.Parameter]
        if plain:
            raise RuntimeError(f"executorch: linears left unquantized at {ctx.precision}: {plain[:5]}")
    kernels = ExecuTorchKernels()
    swapped = use_kernels(model, kernels)
    static_conv_weights(model)
    # the KV caches as the plan stores them (fp16, or int8/int4 codes), widened for custom_sdpa
    states = stored_states(program_states(model.state_specs(ctx.dtype)), ctx.kv)
    mtp_states = None
    if getattr(model, "mtp", None) is not None:  # --mtp: the draft head's own KV cache (fp32, never quantized)
        mtp_states = program_states(model.mtp_state_specs(ctx.dtype))
    # --kv-cache int8/int4: the scales deltaship/lowering/kv_quant.py calibrated, in [1, 1, Hkv, D]
    for i, layer in enumerate(model.model.layers):
        if i in ctx.kv_scales:
            for kind in ("key", "value"):
                s = torch.from_numpy(ctx.kv_scales[i][kind]).transpose(1, 2)
                # a fresh tensor: ExecuTorch refuses the zero strides numpy gives the unit axes
                layer.mixer.register_buffer(f"{kind[0]}_scale", torch.empty(s.shape).copy_(s))
    rounded = None
    if quantized and ctx.settings.verify and reference_fits(ctx.spec):
        rounded = q.rounded_weights(model)  # only verification needs the dequantized copy
    return Prepared(model, kernels, quant, swapped, states, mtp_states, rounded)


def lower(ctx, weights, out_dir: Path, progress=None, tokens: dict | None = None) -> Lowered:
    from executorch.devtools.backend_debug import get_delegation_info  # lazy: executorch
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass  # lazy: executorch
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    say = progress or (lambda m: None)
    prep = prepare(ctx, weights, say)
    model, kernels, quant, swapped, states = prep.model, prep.kernels, prep.quant, prep.swapped, prep.states
    mtp_states, rounded = prep.mtp_states, prep.rounded
    wrapper = ProgramState(model, states, kernels).eval()
    chunk = ctx.settings.prefill_chunk
    say("torch.export (dynamic prompt length)")
    t = torch.export.Dim("tokens", min=1, max=chunk)
    example = (torch.zeros(1, min(2, chunk), dtype=torch.long), torch.zeros(1, dtype=torch.long))
    with torch.no_grad(), heartbeat(say, "torch.export"):
        ep = torch.export.export(wrapper, example, dynamic_shapes=({1: t} if chunk > 1 else None, None), strict=False)
    programs: Any = ep
    speculative = mtp_states is not None
    if speculative:  # --mtp: methods 'verify' and 'mtp_draft' beside 'forward', one set of weights and states
        programs = {"forward": ep, **export_speculative(ctx, prep, chunk, say)}
    partitioner = reshape_inferring_partitioner()
    say("lowering to XNNPACK")
    with preprocess_shares_weights(), xnnpack_passes_that_apply(), heartbeat(say, "still lowering to XNNPACK"):
        edge = to_edge_transform_and_lower(
            # One partitioner for every precision: ExecuTorch's dynamically-quantized partitioner works op by
            # op, which puts each linear in a delegate call of its own (about 7 per layer).
            programs,
            partitioner=[partitioner],
            compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True),
            constant_methods=metadata(ctx, tokens or {}),
        )
    # The weights now live in the delegates' blobs: drop the eager model, the captured program and the
    # copies of the weights each delegate keeps for debugging.
    del model, wrapper, ep, programs, prep
    released = release_lowered_weights(edge)
    gc.collect()
    say(f"released {released / 2**30:.2f} GiB of pre-lowering weights")
    info = get_delegation_info(edge.exported_program().graph_module)
    portable = {op: int(v.non_delegated) for op, v in info.delegation_by_operator.items() if v.non_delegated}
    if speculative:  # the other methods' nodes must pass the same check; index_select picks verify's rows
        for other in ("verify", "mtp_draft"):
            more = get_delegation_info(edge.exported_program(other).graph_module)
            for op, v in more.delegation_by_operator.items():
                if v.non_delegated and op != "aten_index_select_default":
                    portable[op] = max(portable.get(op, 0), int(v.non_delegated))
    check_portable(
        portable, ctx.kv.dtype if ctx.kv_scales else None, 2 * len(ctx.kv_scales), ctx.options.allow_portable_fallback
    )
    say("to_executorch")
    with heartbeat(say, "to_executorch (memory planning, serialization)"):
        prog = edge.to_executorch(
            ExecutorchBackendConfig(
                extract_delegate_segments=True,
                do_quant_fusion_and_const_prop=True,
                # --mtp: 'verify' reads and writes the very buffers 'forward' does (shared by name)
                memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False, share_mutable_buffers=speculative),
                sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),
                emit_mutable_buffer_names=True,
            )
        )
    with open(out_dir / PTE_FILE, "wb") as f:  # segment by segment: no second copy of the program in memory
        prog.write_to_file(f)
    operators, delegates = program_operators(prog.executorch_program)
    return Lowered(
        files=[PTE_FILE],
        entry=PTE_FILE,
        states=states,
        rounded=rounded,
        quantization=quant,
        speculative=speculative_block(ctx, mtp_states) if mtp_states is not None else None,
        details=lower_details(ctx, info, portable, swapped, partitioner.reshapes, chunk, operators, delegates),
    )


def lower_details(ctx, info, portable, swapped, reshapes, chunk, operators, delegates) -> dict[str, Any]:
    """The manifest's `lowering` block of a .pte."""
    n_layers = ctx.spec.num_layers
    return {
        "delegate_partitions": int(info.num_delegated_subgraphs),
        "delegate_partitions_per_layer": round(info.num_delegated_subgraphs / n_layers, 2),
        "portable_nodes": portable,
        "kernels_swapped": swapped,
        "reshapes_inferred": reshapes,
        "gated_delta_rule": "llama::gated_delta_rule (ExecuTorch custom op; all T tokens in one call, "
        "a token loop inside the kernel)",
        "kv_cache": "llama::update_cache + llama::custom_sdpa, in place, layout " + "[1, S, Hkv, D]" + kv_detail(ctx),
        "prefill": f"1 .. {chunk} tokens per call (dynamic shape)",
        "operators": operators,
        "runtime_requirements": runtime_requirements(operators, delegates, tool_versions("executorch")["executorch"]),
    }


def export_speculative(ctx, prep: Prepared, chunk: int, say) -> dict[str, torch.export.ExportedProgram]:
    """torch.export of the methods 'verify' and 'mtp_draft' (--mtp), over the same eager model as 'forward'."""
    model, kernels = prep.model, prep.kernels
    t = torch.export.Dim("tokens", min=1, max=chunk)
    rows = torch.export.Dim("rows", min=1, max=chunk)
    dyn = {1: t} if chunk > 1 else None
    n = min(2, chunk)
    verify = VerifyState(model, prep.states, kernels).eval()
    draft = DraftState(model, prep.mtp_states, kernels, ctx.dtype).eval()
    ids = torch.zeros(1, n, dtype=torch.long)
    pos = torch.zeros(1, dtype=torch.long)
    hidden = torch.zeros(1, n, ctx.spec.hidden_size)
    out = {}
    with torch.no_grad():
        say("torch.export: method verify")
        with heartbeat(say, "torch.export: method verify"):
            out["verify"] = torch.export.export(
                verify,
                (ids, pos, torch.arange(n, dtype=torch.long)),
                dynamic_shapes=(dyn, None, {0: rows} if chunk > 1 else None),
                strict=False,
            )
        say("torch.export: method mtp_draft")
        with heartbeat(say, "torch.export: method mtp_draft"):
            out["mtp_draft"] = torch.export.export(
                draft, (hidden, ids, pos), dynamic_shapes=(dyn, dyn, None), strict=False
            )
    return out


def speculative_block(ctx, mtp_states: list[dict]) -> dict[str, Any]:
    """The manifest's `speculative` block of a .pte exported with --mtp (docs/speculative.md)."""
    h, v = ctx.spec.hidden_size, ctx.spec.vocab_size
    tokens = {"name": "tokens", "shape": [1, "tokens"], "dtype": "int64", "kind": "tokens"}
    return {
        "method": "mtp",
        "mtp_layers": ctx.spec.mtp_num_hidden_layers,
        "draft": {
            "file": PTE_FILE,
            "program_method": "mtp_draft",
            "inputs": [
                {
                    "name": "hidden_states",
                    "shape": [1, "tokens", h],
                    "dtype": "float32",
                    "kind": "hidden_states",
                    "doc": "verify's hidden_states at positions q .. q+T-1",
                },
                dict(tokens, doc="the tokens at positions q+1 .. q+T (each one after its hidden state)"),
                {"name": "input_pos", "shape": [1], "dtype": "int64", "kind": "position", "doc": "q"},
            ],
            "outputs": [
                {
                    "name": "logits",
                    "shape": [1, ctx.draft_vocab_size],
                    "dtype": "float32",
                    "kind": "logits",
                    "doc": "draft logits for the token at q+T+1 (over draft.vocab's ids when present)",
                },
                {
                    "name": "mtp_hidden_states",
                    "shape": [1, "tokens", h],
                    "dtype": "float32",
                    "kind": "hidden_states",
                    "doc": "the head's hidden states; the last row, with the drafted token, drafts one more",
                },
            ],
            # mutable buffers of the program, used by mtp_draft only
            "states": [dict(s, init="zeros", reset="zeros") for s in mtp_states],
        },
        "verify": {
            "file": PTE_FILE,
            "program_method": "verify",
            "inputs": [
                dict(tokens, doc="1 to prefill_chunk token ids, as forward"),
                {"name": "input_pos", "shape": [1], "dtype": "int64", "kind": "position", "doc": "as forward"},
                {
                    "name": "logit_rows",
                    "shape": ["rows"],
                    "dtype": "int64",
                    "kind": "logit_rows",
                    "doc": "rows of this call whose logits come back",
                },
            ],
            "outputs": [
                {
                    "name": "logits_rows",
                    "shape": [1, "rows", v],
                    "dtype": "float32",
                    "kind": "logits",
                    "doc": "logits after each row in logit_rows (one LM-head matmul)",
                },
                {
                    "name": "hidden_states",
                    "shape": [1, "tokens", h],
                    "dtype": "float32",
                    "kind": "hidden_states",
                    "doc": "final-normed hidden state of every position of the call (the MTP head's input)",
                },
            ],
        },
        "rollback": {
            "kv_cache": "keep the length pointer: positions past the accepted ones are overwritten by later calls",
            "deltanet": "snapshot: copy the DeltaNet conv and recurrent buffers (the program's mutable buffers, "
            "shared by forward and verify) before a verify call; when a draft is rejected, copy them back and feed "
            "the accepted tokens again at the start of the next verify call",
        },
        "shares_weights": True,  # one program: XNNPACK's weights and the program's constants are stored by hash
        "duplicated_bytes": 0,
        "files": [PTE_FILE],
    }
