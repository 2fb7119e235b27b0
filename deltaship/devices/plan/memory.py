"""The planner's memory arithmetic: a (target, precision, KV dtype)'s bytes at a context, by part.

Memory = weights (as each target stores them) + state at the context (context x KV-cache bytes per token at the
KV dtype + the fixed DeltaNet states) + runtime overhead (the runtime itself and the activations of one prefill
chunk), scaled by the measured terms of memory_terms.toml. Computed from the ModelSpec alone. Each function takes
the Target (or its name); the search resolves it once and passes the Target down.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from deltaship.devices.catalog import GIB, Tier
from deltaship.errors import DeltashipError
from deltaship.models.source import load_source
from deltaship.models.spec import KV_DTYPES, ModelSpec
from deltaship.targets import Target, get_target

KV_ORDER = tuple(KV_DTYPES)  # widest first: fp32, fp16, int8, int4
# A compiled context binary's bytes per byte of its weights (a tied embedding counted twice: the HTP keeps the Gather
# table and the LM head's own copy), the rest being the HTP's schedule. Measured (docs/npu.md): the tiny decode
# graph's binary is 1.09x and the 0.8B's 1.017x of that; 1.1 stays above both.
CONTEXT_BINARY_FACTOR = 1.1
# A smaller prefill chunk changes no output (chunked prefill == one-shot), only prefill speed: ExecuTorch 0.8B
# prefill at chunk 128 is 2-5% slower than at 512 (docs/results/executorch.md); below 128 nothing is measured.
FREE_CHUNK = 128


@dataclass
class PlanRow:
    tier: str
    target: str
    precision: str
    context: int
    weights_bytes: int
    state_bytes: int  # kv_bytes + deltanet_bytes
    overhead_bytes: int  # activation_bytes + runtime_bytes
    total_bytes: int
    budget_bytes: int
    fits: bool
    recommended: bool = False
    kv_dtype: str = ""
    kv_exportable: bool = True  # the target exports this KV dtype (Target.kv_cache_dtypes); else planned
    kv_bytes: int = 0
    deltanet_bytes: int = 0
    activation_bytes: int = 0
    runtime_bytes: int = 0
    capped: bool = False  # the context stopped at the model's max_position_embeddings, not at the budget
    attention_scores_bytes: int = 0  # part of activation_bytes: heads x prefill chunk x context
    kv_scratch_bytes: int = 0  # part of activation_bytes: the attention kernel's scratch (fp16 KV on ORT)
    longest: bool = False  # context is the longest that fits (plan(context="max"))
    fits_at_chunk: int = 0  # when it does not fit: the largest prefill chunk (power of two) at which it would
    prefill_chunk: int = 0  # tokens per prefill call the row was planned at (the target's default unless chosen)
    weights_loaded_bytes: int = 0  # weights as resident once the runtime has loaded them (measured factor)
    terms: str = ""  # where the runtime and activation terms come from (memory_terms.toml, or an estimate)
    context_binary_bytes: int = 0  # an NPU target: one compiled context binary (its graph's weights + schedule)
    npu_problem: str = ""  # an NPU target: why the tier's NPU cannot take it ("" when it can)
    # a prompt cache shipped in the bundle (export --prompt-cache; plan --prompt-cache): its tokens (None: none), its
    # bytes in the bundle, and what restoring it adds to the peak (in total_bytes; see prompt_cache_restore_bytes)
    prompt_cache_tokens: int | None = None
    prompt_cache_bytes: int = 0
    prompt_cache_restore_bytes: int = 0
    prompt_cache_problem: str = ""  # why the context cannot hold the cache ("" when it can)
    block_size: int | None = None  # the quantization block planned (export --block-size); None: the target's default


MEMORY_TERMS = Path(__file__).parents[1] / "memory_terms.toml"


def as_target(target: Target | str) -> Target:
    """The Target itself, or the registered one of that name."""
    return target if isinstance(target, Target) else get_target(target)


@dataclass(frozen=True)
class MemoryTerms:
    """A (target, precision)'s measured memory terms: the process before any weight (the interpreter, the runtime's
    library, the session), resident bytes per stored weight byte once loaded (prepacked copies, originals kept), the
    peak while loading per stored byte (originals and packed copies at once), and the measured growth of one prefill
    chunk relative to activation_bytes()."""

    runtime_bytes: int
    weights_factor: float
    activation_factor: float
    source: str
    load_factor: float = 1.0
    measured: bool = False  # the activations measured: activation_factor scales every layer's (activation_bytes)
    # the part of runtime_bytes that deltaship's Python driver loads and an app does not: the interpreter and, for
    # ExecuTorch, torch (the pybindings link libtorch; an app links the C++ runtime alone). `profile` measures a
    # process that has it; a device tier's plan leaves it out.
    host_bytes: int = 0
    # the resident bytes of the shared objects (*.so) in the profile runtime_bytes was read from: where set, `profile`
    # swaps them for its own process's (their file pages follow the page cache, 9-21 MB apart between two installs of
    # the same wheels); 0: not recorded, runtime_bytes stands whole
    libraries_bytes: int = 0


@cache
def _terms_table() -> dict:
    try:
        with open(MEMORY_TERMS, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:  # a source tree before the first measurement: every term an estimate
        return {}


def memory_terms(
    target: Target | str, precision: str, prepacked: bool = False, block_size: int | None = None
) -> MemoryTerms:
    """Measured terms for (target, precision) from memory_terms.toml; the target's estimate where none was measured.
    prepacked: a session that maps ONNX Runtime's packed weights from a --prepack-cache entry (the row's `prepacked`
    table replaces the terms it names). block_size: a quantized bundle's block where it is not the target's default
    (export --block-size): the row's `blockN` table (and with prepacked its own `prepacked` table) replaces the
    factors, since a runtime's packed layout adds its own bytes per block. A table that was not measured leaves the
    terms before it, and the source says so."""
    tgt = as_target(target)
    table = _terms_table()
    row = table.get(tgt.name, {}).get(precision)
    if row is None:
        return MemoryTerms(tgt.runtime_base_bytes, 1.0, 1.0, "estimate (not measured)")
    machine = table.get("machine", {})
    source = row.get("from", "")
    # the most specific measured table names the factors: the row, its --prepack-cache session's, the block's, the
    # block's --prepack-cache session's (a block table holds factors only: the runtime terms stay the row's)
    tables: list[tuple[str, dict | None]] = []
    if prepacked:
        tables.append(("prepacked", row.get("prepacked")))
    default_block = tgt.storage_format(precision).block
    if block_size is not None and default_block > 1 and block_size != default_block:
        other = row.get(f"block{block_size}")
        tables.append((f"block {block_size}", other))
        if prepacked:
            tables.append(
                (f"block {block_size}, prepacked", other.get("prepacked") if isinstance(other, dict) else None)
            )
    for name, extra in tables:
        if isinstance(extra, dict):
            row = {**row, **{k: v for k, v in extra.items() if not isinstance(v, dict)}}
            source = f"{name}: {extra.get('from', '')}; {source}"
        else:
            source = f"{name}: not measured, the factors before it; {source}"
    return MemoryTerms(
        int(row["runtime_bytes"]),
        float(row["weights_factor"]),
        float(row.get("activation_factor", 1.0)),
        f"measured {machine.get('date', '?')} on {machine.get('name', '?')} ({source})",
        float(row.get("load_factor", row["weights_factor"])),
        "activation_factor" in row,  # without one, the activations stay the estimate's (one layer's)
        int(row.get("host_bytes", 0)),
        int(row.get("libraries_bytes", 0)),
    )


def weight_bytes(spec: ModelSpec, target: Target | str, precision: str, block_size: int | None = None) -> int:
    """The stored bytes of the model's weight matrices at `precision` (block_size: a quantized format's block, when
    not the target's default: each block stores one scale)."""
    f = as_target(target).storage_format(precision)
    p = spec.parameter_count()
    block = block_size if block_size is not None and f.block > 1 else f.block
    per = f.bits / 8 + (f.scale / block if block > 1 else 0)
    matrices = p["embedding"] + p["lm_head"] + p["body"]
    if spec.tie_word_embeddings and f.head_copy:
        matrices += p["embedding"]
    return int(matrices * per)


def default_kv_dtype(target: Target | str, precision: str) -> str:
    """The KV dtype the target's bundles use today: its activation dtype at that precision."""
    tgt = as_target(target)
    act = tgt.storage_format(precision).act
    by_bytes = {f.bits // 8: name for name, f in KV_DTYPES.items() if f.bits >= 8 and not f.token_head_bytes}
    by_bytes.setdefault(1, "int8")
    if act not in by_bytes:
        raise DeltashipError(
            f"target {tgt.name} stores {act}-byte activations at {precision}; the planner knows KV "
            f"caches of {sorted(by_bytes)} bytes an element",
            "fix the target's storage format",
        )
    return by_bytes[act]


def kv_dtypes_for(target: Target | str, precision: str) -> tuple[str, ...]:
    """The target's own KV dtype, then the narrower ones a quantized cache could use."""
    return KV_ORDER[KV_ORDER.index(default_kv_dtype(target, precision)) :]


def exportable_kv_dtypes(target: Target | str, precision: str) -> tuple[str, ...]:
    """The KV dtypes the target's bundles store at `precision` (its own first), as `export --kv-cache` takes them."""
    return as_target(target).kv_cache_dtypes(precision, {})


def kv_bytes_per_token(spec: ModelSpec, target: Target | str, precision: str, kv_dtype: str) -> int:
    """A context token's KV bytes as the target stores it: the exported int8/int4 caches keep static scales in
    the graph (no bytes per token); a planned one is counted with a per-token-per-head scale."""
    return spec.kv_bytes_per_token(kv_dtype, static_scales=kv_dtype in exportable_kv_dtypes(target, precision))


def state_bytes(
    spec: ModelSpec, target: Target | str, precision: str, context: int, kv_dtype: str | None = None
) -> int:
    """Per-sequence state: the fixed DeltaNet states plus context x the KV cache's bytes per token."""
    tgt = as_target(target)
    act = tgt.storage_format(precision).act
    return spec.deltanet_state_bytes(act) + context * kv_bytes_per_token(
        spec, tgt, precision, kv_dtype or default_kv_dtype(tgt, precision)
    )


def prompt_cache_bytes(
    spec: ModelSpec, target: Target | str, precision: str, tokens: int, kv_dtype: str | None = None
) -> int:
    """The tensors of a prompt cache of `tokens` tokens as the bundle ships it (export --prompt-cache:
    prompt_cache.safetensors, a saved chat session): every DeltaNet state whole and each KV cache up to `tokens`,
    i.e. the state at that length. The file adds a header of a few KiB (the token ids, each tensor's sha256)."""
    return state_bytes(spec, target, precision, tokens, kv_dtype)


def prompt_cache_restore_bytes(file_bytes: int, kv_state_bytes: int) -> int:
    """What restoring a shipped prompt cache adds to the peak: the file's bytes plus the larger of the file's bytes
    and one KV cache (one layer's K or V) at the context. `file_bytes`: the cache's file (the manifest's `files`),
    or its tensors (prompt_cache_bytes) when planned from the spec.

    How deltaship's runtimes restore it (deltaship/chat/store.py apply_prompt_cache, when a chat with the cache's
    system message starts and at each reset): read_session_file copies every tensor out of the file into a fresh
    array while safetensors keeps the file mapped, its pages resident until it is closed (measured: the read's peak
    is up to twice the file), then checks each tensor's sha256 through a copy of that one tensor (less than the
    file); checked_state and Session.load_state_file_arrays read and write one state at a time, a KV cache through a
    whole-length copy of that one state: the file's arrays plus one KV cache at the context. All of it is freed when
    the restore returns: the session's state buffers, planned whole at the context already, hold the result (the
    allocator may keep freed pages, which the next restore reuses). So the cache is a transient on the peak, not
    held state; it is counted on top of a prefill chunk's activations, because a chat that resets after a turn
    restores while the runtime's arena still holds them."""
    return file_bytes + max(file_bytes, kv_state_bytes)


def attention_scores_bytes(
    spec: ModelSpec, target: Target | str, precision: str, context: int, prefill_chunk: int | None = None
) -> int:
    """The attention scores of one prefill chunk over the whole static cache (heads x chunk x context), as a
    kernel that materialises them (ORT's CPU GroupQueryAttention does; tiled flash kernels would not)."""
    tgt = as_target(target)
    t = min(prefill_chunk or tgt.default_prefill_chunk, context)
    return tgt.storage_format(precision).act * spec.num_attention_heads * t * context


def activation_bytes(
    spec: ModelSpec,
    target: Target | str,
    precision: str,
    context: int,
    prefill_chunk: int | None = None,
    all_layers: bool = False,
) -> int:
    """One prefill chunk's activations: MLP, projections, the attention scores and one row of logits. all_layers:
    the MLP and projections of every layer, the shape a measured prefill's growth follows across model sizes
    (docs/results/memory.md), which a measured activation_factor (memory_terms) scales to what the runtime holds."""
    tgt = as_target(target)
    act = tgt.storage_format(precision).act
    t = min(prefill_chunk or tgt.default_prefill_chunk, context)
    per_token = (spec.num_layers if all_layers else 1) * (
        2 * spec.intermediate_size + 2 * spec.conv_dim + 6 * spec.hidden_size
    )
    return (
        act * t * per_token + attention_scores_bytes(spec, tgt, precision, context, prefill_chunk) + 4 * spec.vocab_size
    )


def overhead_bytes(
    spec: ModelSpec, target: Target | str, precision: str, context: int, prefill_chunk: int | None = None
) -> int:
    """An app's runtime, plus one prefill chunk's activations (MLP, projections, attention scores, logits), as
    measured."""
    tgt = as_target(target)
    terms = memory_terms(tgt, precision)
    act = activation_bytes(spec, tgt, precision, context, prefill_chunk, all_layers=terms.measured)
    return terms.runtime_bytes - terms.host_bytes + int(act * terms.activation_factor)


def npu_fit(spec: ModelSpec, tier: Tier, target: Target | str, precision: str) -> tuple[int, str]:
    """An NPU target's context binary bytes (one graph) and why the tier's NPU cannot map it ("" when it can); (0, "")
    for a target that does not run on an NPU."""
    tgt = as_target(target)
    if not tgt.npu_graphs:
        return 0, ""
    f = tgt.storage_format(precision)
    tied_copy = spec.parameter_count()["embedding"] * f.bits // 8 if spec.tie_word_embeddings and not f.head_copy else 0
    binary = int((weight_bytes(spec, tgt, precision) + tied_copy) * CONTEXT_BINARY_FACTOR)
    if tier.npu is None:
        return binary, f"tier {tier.name} has no NPU for {tgt.name} (its tiers.toml entry has no npu table)"
    if binary > tier.npu.context_binary_bytes:
        return binary, (
            f"one {tgt.name} context binary would be {binary / GIB:.2f} GiB, over the {tier.npu.soc} NPU's "
            f"{tier.npu.context_binary_bytes / GIB:.2f} GiB per context (a smaller model or quantized weights)"
        )
    return binary, ""


def estimate(
    spec: ModelSpec,
    tier: Tier,
    target: Target | str,
    precision: str,
    context: int,
    kv_dtype: str | None = None,
    prefill_chunk: int | None = None,
    host_driver: bool = False,
    host_bytes: int | None = None,
    libraries_bytes: int | None = None,
    prompt_cache_tokens: int | None = None,
    prompt_cache_file_bytes: int | None = None,
    prepacked: bool = False,
    block_size: int | None = None,
) -> PlanRow:
    """Memory of (target, precision, KV dtype) at `context` tokens on `tier`, by part: an app's process, or with
    host_driver that of deltaship's own Python driver (what `profile` measures: the terms' host_bytes added, or
    `host_bytes` where the driver's part was measured in the process itself). libraries_bytes: the resident bytes of
    the process's shared objects as `profile` measured them, in place of the terms' where they record theirs.
    prompt_cache_tokens: a chat starting from a prompt cache of that many tokens shipped in the bundle (its restore
    counted, prompt_cache_restore_bytes), whose file has prompt_cache_file_bytes (default: its tensors,
    prompt_cache_bytes). prepacked: a session opened with a --prepack-cache entry (memory_terms). block_size: the
    quantization block, where not the target's default (export --block-size)."""
    tgt = as_target(target)
    kv = kv_dtype or default_kv_dtype(tgt, precision)
    terms = memory_terms(tgt, precision, prepacked, block_size)
    w = weight_bytes(spec, tgt, precision, block_size)
    loaded = int(w * terms.weights_factor)
    binary, npu_problem = npu_fit(spec, tier, tgt, precision)
    if binary:  # each compiled graph's context binary holds its own copy of the weights, all mapped at once
        loaded = max(loaded, binary * tgt.npu_graphs)
    dn = spec.deltanet_state_bytes(tgt.storage_format(precision).act)
    kvb = context * kv_bytes_per_token(spec, tgt, precision, kv)
    scratch = context * tier.threads * tgt.kv_scratch_bytes_per_token(spec, kv)
    act = activation_bytes(spec, tgt, precision, context, prefill_chunk, all_layers=terms.measured)
    a = int(act * terms.activation_factor) + scratch
    host = terms.host_bytes if host_bytes is None else host_bytes
    rt = terms.runtime_bytes - terms.host_bytes + (host if host_driver else 0)
    if host_driver and libraries_bytes is not None and terms.libraries_bytes:
        rt += libraries_bytes - terms.libraries_bytes
    cache = restore = 0
    cache_problem = ""
    if prompt_cache_tokens is not None:
        cache = prompt_cache_bytes(spec, tgt, precision, prompt_cache_tokens, kv)
        if prompt_cache_file_bytes is not None:
            cache = prompt_cache_file_bytes
        kv_states = 2 * len(spec.attention_layers)  # K and V of each attention layer, each a state of its own
        restore = prompt_cache_restore_bytes(cache, kvb // kv_states if kv_states else 0)
        if prompt_cache_tokens >= context:
            cache_problem = (
                f"the prompt cache's {prompt_cache_tokens} tokens leave no room in a context of {context} "
                "(a longer --context, or a shorter system message)"
            )
    # the peak is the larger of loading (originals and prepacked copies at once) and running a prefill chunk (with a
    # prompt cache being restored: see prompt_cache_restore_bytes)
    total = rt + max(loaded + dn + kvb + a + restore, int(w * terms.load_factor))
    return PlanRow(
        tier.name,
        tgt.name,
        precision,
        context,
        w,
        dn + kvb,
        total - w - dn - kvb,  # the runtime, the activations, a prompt cache's restore, what loading adds
        total,
        tier.budget_bytes,
        total <= tier.budget_bytes and not npu_problem and not cache_problem,
        kv_dtype=kv,
        kv_exportable=kv in exportable_kv_dtypes(tgt, precision),
        kv_bytes=kvb,
        deltanet_bytes=dn,
        activation_bytes=a,
        runtime_bytes=rt,
        attention_scores_bytes=attention_scores_bytes(spec, tgt, precision, context, prefill_chunk),
        kv_scratch_bytes=scratch,
        weights_loaded_bytes=loaded,
        terms=terms.source,
        context_binary_bytes=binary,
        npu_problem=npu_problem,
        prompt_cache_tokens=prompt_cache_tokens,
        prompt_cache_bytes=cache,
        prompt_cache_restore_bytes=restore,
        prompt_cache_problem=cache_problem,
        block_size=block_size,
    )


def planned_peak(
    manifest: dict,
    prompt_length: int,
    threads: int | None = None,
    host_bytes: int | None = None,
    prepacked: bool = False,
    libraries_bytes: int | None = None,
) -> dict | None:
    """The plan's memory for a bundle as `profile` runs it (its context, a prefill of `prompt_length` tokens in the
    bundle's chunks, its quantization block), by part; None when the bundle's model cannot be loaded here (a
    checkpoint not on this machine). `profile` prints it beside the measured peak RSS. host_bytes: the Python
    driver's part as the profiled process measured it (in place of the terms' host_bytes). prepacked: the session
    mapped a --prepack-cache entry. libraries_bytes: the process's shared objects' resident bytes as measured
    (estimate's libraries_bytes).

    A bundle that ships a prompt cache (the manifest's chat.prompt_cache) gets `prompt_cache`: its tokens and file
    bytes, as the manifest records them, what restoring it adds (prompt_cache_restore_bytes) and the total of a
    chat that starts from it. `total_bytes` leaves the restore out: profile's workload prefills from an empty
    state and never reads the cache."""
    try:
        spec = load_source(manifest["source"]["model"]).spec
    except (DeltashipError, KeyError, OSError):
        return None
    chunk = min(prompt_length, manifest.get("prefill_chunk") or prompt_length)
    ctx = manifest["max_context"]
    block = (manifest.get("quantization") or {}).get("block_size")
    tier = Tier("host", "host", 1 << 62, 1 << 62, (manifest["target"],), (manifest["precision"],), ctx, threads or 1)

    def at(cache_tokens: int | None = None, cache_file_bytes: int | None = None) -> PlanRow:
        return estimate(
            spec,
            tier,
            manifest["target"],
            manifest["precision"],
            ctx,
            None,
            chunk,
            host_driver=True,
            host_bytes=host_bytes,
            libraries_bytes=libraries_bytes,
            prompt_cache_tokens=cache_tokens,
            prompt_cache_file_bytes=cache_file_bytes,
            prepacked=prepacked,
            block_size=block,
        )

    row = at()
    plan = {
        "total_bytes": row.total_bytes,
        "weights_loaded_bytes": row.weights_loaded_bytes,
        "state_bytes": row.state_bytes,
        "activation_bytes": row.activation_bytes,
        "runtime_bytes": row.runtime_bytes,
        "context": row.context,
        "prefill_chunk": chunk,
        "terms": row.terms,
        "prepacked": prepacked,
        "host_bytes": memory_terms(manifest["target"], manifest["precision"]).host_bytes
        if host_bytes is None
        else host_bytes,
        "host": "terms" if host_bytes is None else "measured in the profiled process",
    }
    lib_terms = memory_terms(manifest["target"], manifest["precision"], prepacked, block).libraries_bytes
    if lib_terms:  # the terms record their shared objects' bytes: swapped for the process's, where measured
        swapped = libraries_bytes is not None
        plan["libraries_bytes"] = libraries_bytes if swapped else lib_terms
        plan["libraries"] = "measured in the profiled process" if swapped else "terms"
    record = (manifest.get("chat") or {}).get("prompt_cache")
    if isinstance(record, dict):  # the manifest's own numbers: its token count and its file's bytes
        file_bytes = manifest["files"][record["file"]]["bytes"]
        chat = at(record["tokens"], file_bytes)
        plan["prompt_cache"] = {
            "tokens": record["tokens"],
            "file_bytes": file_bytes,
            "restore_bytes": chat.prompt_cache_restore_bytes,
            "chat_total_bytes": chat.total_bytes,
        }
    return plan


# ---- an export's own memory (deltaship export, before it starts) -------------------------------------------
EXPORT_BASE_BYTES = 400 << 20  # the interpreter with torch, transformers and a toolchain imported
VERIFY_RUNTIME_BYTES = 200 << 20  # the runtime's own libraries and buffers in the verification session


def export_peak_bytes(
    spec: ModelSpec, target: Target | str, precision: str, verify: bool, budget: int | None = None
) -> int:
    """The resident peak of `deltaship export` (an estimate fitted to docs/results/export-memory.md). With
    verification add the bundle's session and the fp32 transformers reference, which export skips (and so does
    this estimate) when it needs more than 0.6 of `budget`, as deltaship.oracle.budget.reference_fits does."""
    tgt = as_target(target)
    fp16 = 2 * spec.parameter_count()["total"]
    peak = EXPORT_BASE_BYTES + int(tgt.export_weight_factor * fp16)  # the target's fit (Target.export_weight_factor)
    if verify:
        reference = int(spec.parameter_count()["total"] * 4 * 1.3)
        if budget is None or reference <= 0.6 * budget:
            peak += reference
        peak += weight_bytes(spec, tgt, precision) + VERIFY_RUNTIME_BYTES
    return peak
