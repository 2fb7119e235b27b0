"""mtp.onnx, the MTP head as a draft model, and the verify I/O of the decoder graph (export option --mtp).

The contract (the manifest's `speculative` block) is described in docs/speculative.md."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from deltaship.lowering.onnx.builder import NP_TO_ONNX, GraphBuilder
from deltaship.lowering.onnx.graph_capture import make_draft_capturable
from deltaship.lowering.onnx.lowering import DATA_FILE, IR_VERSION, MODEL_FILE, OPSET, Lowerer

MTP_FILE = "mtp.onnx"
MTP_DATA_FILE = "mtp.onnx.data"
# The tensors both graphs read (the embedding and the LM head, tied or not). mtp.onnx does not store them
# again: its initializers point into the decoder's external data file (model.onnx.data) at their offsets.
MTP_SHARED = ("model.embed_tokens.weight", "lm_head.weight")


def _external(t: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


class SharingBuilder(GraphBuilder):
    """A GraphBuilder that stores no weight the decoder's external data already holds byte for byte: such an
    initializer points at the decoder's file and offset instead (matched by dtype, shape and sha256)."""

    def __init__(self, external_data: Path, main: GraphBuilder, main_data: Path):
        super().__init__(external_data)
        self.index: dict[tuple, onnx.TensorProto] = {}
        self.shared: dict[str, int] = {}  # initializer -> bytes not stored again
        with open(main_data, "rb") as f:
            for t in main.initializers:
                if t.data_location != onnx.TensorProto.EXTERNAL:
                    continue
                ext = _external(t)
                f.seek(int(ext["offset"]))
                digest = hashlib.sha256(f.read(int(ext["length"]))).hexdigest()
                self.index[(t.data_type, tuple(t.dims), digest)] = t

    def _reuse(self, name: str, key: tuple) -> bool:
        src = self.index.get(key)
        if src is None:
            return False
        t = onnx.TensorProto(name=name, data_type=src.data_type, dims=list(src.dims))
        t.data_location = onnx.TensorProto.EXTERNAL
        t.external_data.extend(src.external_data)
        self.initializers.append(t)
        self._names.add(name)
        self.shared[name] = int(_external(src)["length"])
        return True

    def weight(self, name: str, arr: np.ndarray) -> str:
        arr = np.ascontiguousarray(arr)
        if arr.nbytes >= 1024 and arr.dtype in NP_TO_ONNX:
            key = (NP_TO_ONNX[arr.dtype], tuple(arr.shape), hashlib.sha256(arr.tobytes()).hexdigest())
            if self._reuse(name, key):
                return name
        return super().weight(name, arr)

    def weight_rows(self, name: str, shape: tuple[int, ...], dtype, blocks) -> str:
        h = hashlib.sha256()

        def hashed():
            for blk in blocks:
                blk = np.ascontiguousarray(blk, np.dtype(dtype))
                h.update(blk.tobytes())
                yield blk

        f = self._ext_file
        start = f.tell()
        super().weight_rows(name, shape, dtype, hashed())  # streamed to this file, hashed on the way
        written = self.initializers.pop()
        if self._reuse(name, (NP_TO_ONNX[np.dtype(dtype)], tuple(shape), h.hexdigest())):
            f.truncate(start)  # the decoder's file has it: take the bytes back
            f.seek(start)
            self.weight_bytes -= int(_external(written)["length"])
        else:
            self.initializers.append(written)
        return name


KEEP_ROWS = "num_logits_to_keep"  # the one extra input onnxruntime-genai feeds by itself (int64 [1] = 0)


def add_verify_io(path: Path, spec, capture: bool = False) -> None:
    """Name the verify I/O's dims in the written model.onnx and compute the program's logit_rows in the graph:
    the last max(1, n) rows of the call, n = num_logits_to_keep (its largest element; [T] copies in a verify call,
    so that input_ids [1, T] and it keep ONNX Runtime's memory-pattern key apart from prefill's). A plain call feeds
    [0]: the last row, which is all `logits` needs. Not an initializer that is also an input (ONNX Runtime warns
    about one at every session start, in every app) and not an optional-typed input (onnxruntime-genai reads every
    input's tensor type and crashes on one): a plain int64 input named as the one genai feeds itself, with 0.
    Done on the file, after the decoder's lowering wrote it (its weights stay where they are).

    capture (--onnx-cuda-graph): the rows are a Slice whose bounds come from shape arithmetic alone, which ONNX
    Runtime's CUDA provider keeps on the CPU and takes there (Slice's starts and ends are CPU-memory inputs), instead
    of a Range of indices a Gather reads on the GPU (a Memcpy node, which capture refuses: bench/gpu/placement.py).
    A captured graph replays its bounds as captured: the session keeps one graph per call shape and row count."""

    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    shapes = {
        "logits_rows": (TensorProto.FLOAT, [1, "rows", spec.vocab_size]),
        "hidden_states": (TensorProto.FLOAT, [1, "tokens", spec.hidden_size]),
    }
    for values in (g.input, g.output):
        for i, v in enumerate(values):
            if v.name in shapes:  # hidden_states in the activation dtype the lowering declared (fp16 at fp16)
                elem = v.type.tensor_type.elem_type if v.name == "hidden_states" else shapes[v.name][0]
                values[i].CopyFrom(helper.make_tensor_value_info(v.name, elem, shapes[v.name][1]))
    i = next(k for k, v in enumerate(g.input) if v.name == "logit_rows")
    g.input[i].CopyFrom(helper.make_tensor_value_info(KEEP_ROWS, TensorProto.INT64, ["keep"]))
    g.initializer.extend(
        [
            numpy_helper.from_array(np.array([1], np.int64), "keep_rows_one"),
            numpy_helper.from_array(np.array(1, np.int64), "keep_rows_step"),
        ]
    )
    rows = [
        helper.make_node("Shape", ["input_ids"], ["keep_rows_t"], start=1, end=2),
        helper.make_node("ReduceMax", [KEEP_ROWS], ["keep_rows_asked"], keepdims=1),
        helper.make_node("Max", ["keep_rows_asked", "keep_rows_one"], ["keep_rows_least_one"]),
        helper.make_node("Min", ["keep_rows_least_one", "keep_rows_t"], ["keep_rows_n"]),
        helper.make_node("Sub", ["keep_rows_t", "keep_rows_n"], ["keep_rows_start"]),
        helper.make_node("Squeeze", ["keep_rows_start"], ["keep_rows_start_s"]),
        helper.make_node("Squeeze", ["keep_rows_t"], ["keep_rows_t_s"]),
        helper.make_node("Range", ["keep_rows_start_s", "keep_rows_t_s", "keep_rows_step"], ["logit_rows"]),
    ]
    if capture:
        rows = _sliced_rows(g)
    nodes = rows + list(g.node)
    del g.node[:]
    g.node.extend(nodes)
    onnx.save(model, str(path))


def _sliced_rows(g) -> list:
    """The capture form of the row arithmetic (see add_verify_io): every node reached from Shape(input_ids) and the
    graph input only, and the rows' Gather replaced by a Slice of the last n rows along the same axis."""
    gathers = [n for n in g.node if n.op_type == "Gather" and n.input[1:] == ["logit_rows"]]
    if len(gathers) != 1:
        raise RuntimeError(f"--mtp --onnx-cuda-graph: {len(gathers)} Gathers read logit_rows, not one")
    gather = gathers[0]
    axis = next((a.i for a in gather.attribute if a.name == "axis"), 0)
    g.initializer.append(numpy_helper.from_array(np.array([axis], np.int64), "keep_rows_axis"))
    slice_ = helper.make_node(
        "Slice", [gather.input[0], "keep_rows_start", "keep_rows_t", "keep_rows_axis"], list(gather.output),
        name="n_keep_rows_slice",
    )  # fmt: skip
    g.node.insert(list(g.node).index(gather), slice_)
    g.node.remove(gather)
    return [
        helper.make_node("Shape", ["input_ids"], ["keep_rows_t"], start=1, end=2),
        helper.make_node("Sub", ["keep_rows_t", "keep_rows_t"], ["keep_rows_zero"]),
        helper.make_node("Concat", ["keep_rows_zero", KEEP_ROWS], ["keep_rows_all"], axis=0),
        helper.make_node("ReduceMax", ["keep_rows_all"], ["keep_rows_asked"], keepdims=1),
        helper.make_node("Max", ["keep_rows_asked", "keep_rows_one"], ["keep_rows_least_one"]),
        helper.make_node("Min", ["keep_rows_least_one", "keep_rows_t"], ["keep_rows_n"]),
        helper.make_node("Sub", ["keep_rows_t", "keep_rows_n"], ["keep_rows_start"]),
    ]


def lower_mtp(
    ctx,
    weights,
    out_dir: Path,
    accuracy_level: int,
    deltanet_ops: str,
    progress,
    main: GraphBuilder,
    rollback: dict[str, str] | None = None,
) -> dict:
    """Write mtp.onnx (the MTP head: draft logits from the trunk's hidden states and the next tokens); return its
    manifest's `speculative` block (its `files` are mtp.onnx's). rollback: the decoder's rollback outputs by DeltaNet
    state (None: the graph has none)."""

    program, states = ctx.programs["mtp"]
    hidden = "float16" if ctx.dtype == torch.float16 else "float32"  # the activation dtype: the trunk's hidden states
    if main.external is None:
        raise RuntimeError("--mtp needs the decoder's weights in external data (model.onnx.data) to share them")
    b = SharingBuilder(out_dir / MTP_DATA_FILE, main, out_dir / DATA_FILE)
    lw = Lowerer(
        program,
        ctx.plan,
        weights,
        ctx.quant,
        b,
        accuracy_level=accuracy_level,
        progress=progress,
        deltanet_ops=deltanet_ops,
    )
    lw.run(
        ["hidden_states", "input_ids", "position"] + [s["name"] for s in states],
        ["logits", "mtp_hidden_states"] + [s["output"] for s in states],
    )
    capture = None
    if ctx.options.onnx_cuda_graph:  # the head's GroupQueryAttention lengths on the device, as the decoder's
        capture = make_draft_capturable(b, int(states[0]["shape"][2]))
    b.finish(out_dir / MTP_FILE, {"": OPSET, "com.microsoft": 1}, IR_VERSION, doc="deltaship Qwen3.5 MTP head")
    bases = tuple(n.replace(".", "_") for n in MTP_SHARED)  # the Lowerer names a weight's forms base, base_q, ...
    stored = {t.name: t for t in b.initializers if t.name.startswith(bases) and t.name not in b.shared}
    block = {
        "method": "mtp",
        "mtp_layers": ctx.spec.mtp_num_hidden_layers,
        "draft": {
            "file": MTP_FILE,
            "inputs": [
                {
                    "name": "hidden_states",
                    "shape": [1, "tokens", ctx.spec.hidden_size],
                    "dtype": hidden,
                    "doc": "the decoder's hidden_states at positions q .. q+T-1",
                },
                {
                    "name": "input_ids",
                    "shape": [1, "tokens"],
                    "dtype": "int64",
                    "doc": "the tokens at positions q+1 .. q+T (each one after its hidden state)",
                },
                {"name": "position", "shape": [1], "dtype": "int64", "doc": "q"},
            ],
            "outputs": [
                {
                    "name": "logits",
                    "shape": [1, ctx.draft_vocab_size],
                    "dtype": "float32",
                    "doc": "draft logits for the token at q+T+1 (over draft.vocab's ids when present)",
                },
                {
                    "name": "mtp_hidden_states",
                    "shape": [1, "tokens", ctx.spec.hidden_size],
                    "dtype": hidden,
                    "doc": "the head's hidden states; the last row, with the drafted token, drafts one more",
                },
            ],
            "states": [dict(s, init="zeros", reset="zeros") for s in states],
            **({"cuda_graph": capture} if capture else {}),
        },
        "verify": {
            "file": MODEL_FILE,
            "inputs": [
                {
                    "name": KEEP_ROWS,
                    "shape": ["keep"],
                    "dtype": "int64",
                    "doc": "n (its largest element): logits_rows holds the last max(1, n) rows of the call; a plain "
                    "call feeds [0] (onnxruntime-genai does by itself)",
                }
            ],
            "outputs": [
                {
                    "name": "logits_rows",
                    "shape": [1, "rows", ctx.spec.vocab_size],
                    "dtype": "float32",
                    "doc": "logits after each of the call's last rows (one LM-head matmul; `logits` is its last row)",
                },
                {
                    "name": "hidden_states",
                    "shape": [1, "tokens", ctx.spec.hidden_size],
                    "dtype": hidden,
                    "doc": "final-normed hidden state of every position of the call (the MTP head's input)",
                },
            ],
        },
        "rollback": _rollback_contract(rollback),
        "shares_weights": not stored,
        "shared_tensors": {n: b.shared[n] for n in sorted(b.shared)},
        "duplicated_tensors": sorted(stored),
        "duplicated_bytes": sum(_bytes(t) for t in stored.values()),
        "files": [MTP_FILE, MTP_DATA_FILE],
    }
    for part in (block["draft"], block["verify"]):
        for t in part["inputs"] + part["outputs"]:
            t["kind"] = _SPECULATIVE_KINDS[t["name"]]
    return block


_SPECULATIVE_KINDS = {
    "hidden_states": "hidden_states",
    "mtp_hidden_states": "hidden_states",
    "input_ids": "tokens",
    "position": "position",
    "logits": "logits",
    "logit_rows": "logit_rows",
    KEEP_ROWS: "logits_to_keep",
    "logits_rows": "logits",
}


_SNAPSHOT = (
    "snapshot: keep the DeltaNet conv and recurrent states from before a verify call (bind the call's DeltaNet "
    "state outputs to other buffers than its inputs, so nothing is copied, or copy them); when a draft is rejected, "
    "go back to those states and feed the accepted tokens again at the start of the next verify call"
)


def _rollback_contract(rollback: dict[str, str] | None) -> dict:
    """The manifest's speculative.rollback: with the decoder's rollback outputs or by snapshot alone."""
    block = {"kv_cache": "keep the length pointer: positions past the accepted ones are overwritten by later calls"}
    if not rollback:
        return {**block, "deltanet": _SNAPSHOT + " (this graph outputs no per-position states)"}
    return {
        **block,
        "deltanet": "every call also outputs each DeltaNet state as it was after the call's first token "
        "(deltanet_outputs: state input -> output). A verify call feeds the newest token and its k drafts: when "
        "the first draft is rejected (at depth 1, every rejection), make those outputs the current states and "
        "advance the position by 1 (no call, no copy: swap buffers). Outside verify calls, bind each recurrent "
        "one to the buffer its present state goes to (the graph's second LinearAttention then updates it in "
        "place). A later draft rejected (depth 2+): " + _SNAPSHOT,
        "deltanet_outputs": dict(rollback),
    }


def _bytes(t: onnx.TensorProto) -> int:
    if t.data_location == onnx.TensorProto.EXTERNAL:
        return int(_external(t)["length"])
    return len(t.raw_data) if t.raw_data else onnx.numpy_helper.to_array(t).nbytes
