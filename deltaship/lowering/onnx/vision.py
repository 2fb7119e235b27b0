"""The multimodal side of an ONNX bundle: vision.onnx, embedding.onnx and decoder_mm.onnx.

- vision.onnx: Qwen3.5's vision tower for one image (or one video clip), built node by node: patch rows
  [N, C*T*P*P] (the Conv3d with stride == kernel is exactly a MatMul over the row) and image_grid_thw [1, 3], from
  which the graph computes the position-table interpolation indices/weights [N, 4] and 2-D rotary cos/sin
  [N, head_dim] (as models/vision/rope.py does on the host); N is dynamic (a multiple of 4). Output: merged features
  [N/4, text hidden]. onnxruntime-genai feeds exactly these two inputs, once per image.
- embedding.onnx: input_ids [1, T] and image_features [K, hidden] -> inputs_embeds [1, T, hidden]: the
  token embedding with the i-th image-token row of the call replaced by image_features[i] (i < K; K may be 0).
- decoder_mm.onnx: the text decoder (model.onnx) taking inputs_embeds [1, T, hidden] instead of input_ids, and
  rope_position_ids [3, 1, T] (interleaved M-RoPE T/H/W rows) for the attention layers' rotary. It is model.onnx
  rewritten at its two entry points (the embedding gather and the rotary angles); everything else, states
  included, is the same graph and the same weights (shared through the external data file when there is one).
  multimodal.py then gives it onnxruntime-genai's inputs (position_ids, attention_mask).
model.onnx itself is untouched: text-only prompts keep the text-only fast path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from deltaship.errors import DeltashipError
from deltaship.lowering.onnx.builder import GraphBuilder
from deltaship.models.vision import (
    GELU_APPROXIMATION,
    PREPROCESSOR_CONFIG,
    VIDEO_PREPROCESSOR_CONFIG,
    VisionSpec,
    VisionWeights,
    check_vision,
    interleave_mask,
    write_preprocessor,
)

VISION_FILE = "vision.onnx"
EMBEDDING_FILE = "embedding.onnx"
DECODER_FILE = "decoder_mm.onnx"
ROPE_INPUT = "rope_position_ids"  # renamed position_ids by multimodal.multimodal_io (genai's name)
LN_EPS = 1e-6  # the tower's LayerNorms (transformers hard-codes it)
_ONNX = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}


def _grid_tensors(b: GraphBuilder, spec: VisionSpec, grid: str, elem: int) -> tuple[str, str, str, str]:
    """models/vision/rope.py's position_interpolation and rotary_cos_sin in the graph, from image_grid_thw [1, 3]:
    position-table indices int64 [N, 4] and weights [N, 4], rotary cos, sin [N, head_dim], N = t*h*w patch rows
    in merge-block order. Same float32 operations in the same order as the host code."""
    m, side = spec.spatial_merge_size, spec.grid_side
    i64 = np.int64

    def dim(k: int) -> str:  # [1]
        return b.one(
            "Reshape", [b.one("Slice", [grid, b.const([0, k], i64), b.const([1, k + 1], i64)]), b.const([1], i64)]
        )

    t, h, w = dim(0), dim(1), dim(2)
    hw = b.one("Mul", [h, w])
    n = b.one("Range", [b.const(0, i64), b.one("Squeeze", [b.one("Mul", [t, hw])]), b.const(1, i64)])
    q = b.one("Mod", [n, hw])  # the row within its temporal patch
    blk, r = b.one("Div", [q, b.const(m * m, i64)]), b.one("Mod", [q, b.const(m * m, i64)])
    wb = b.one("Div", [w, b.const(m, i64)])
    rows = b.one("Add", [b.one("Mul", [b.one("Div", [blk, wb]), b.const(m, i64)]), b.one("Div", [r, b.const(m, i64)])])
    cols = b.one("Add", [b.one("Mul", [b.one("Mod", [blk, wb]), b.const(m, i64)]), b.one("Mod", [r, b.const(m, i64)])])
    f32 = TensorProto.FLOAT

    def taps(index: str, size: str) -> tuple[str, str]:  # [N, 2] table rows and weights along one axis
        denom = b.one("Cast", [b.one("Max", [b.one("Sub", [size, b.const(1, i64)]), b.const(1, i64)])], to=f32)
        src = b.one("Div", [b.one("Mul", [b.one("Cast", [index], to=f32), b.const(np.float32(side - 1))]), denom])
        floor = b.one("Floor", [src])
        frac = b.one("Sub", [src, floor])  # weight of the upper tap; 1 - frac the lower's
        lo = b.one("Cast", [floor], to=TensorProto.INT64)
        tap = b.one(
            "Concat",
            [b.one("Unsqueeze", [x, b.const([1], i64)]) for x in (lo, b.one("Add", [lo, b.const(1, i64)]))],
            axis=1,
        )
        tap = b.one("Clip", [tap, b.const(0, i64), b.const(side - 1, i64)])
        wt = [b.one("Sub", [b.const(np.float32(1)), frac]), frac]
        return tap, b.one("Concat", [b.one("Unsqueeze", [x, b.const([1], i64)]) for x in wt], axis=1)

    ht, hwt = taps(rows, h)
    wt, wwt = taps(cols, w)
    col_axis, row_axis = b.const([1], i64), b.const([2], i64)
    flat = b.const([-1, 4], i64)
    idx = b.one(
        "Add",
        [b.one("Mul", [b.one("Unsqueeze", [ht, row_axis]), b.const(side, i64)]), b.one("Unsqueeze", [wt, col_axis])],
    )
    wts = b.one("Mul", [b.one("Unsqueeze", [hwt, row_axis]), b.one("Unsqueeze", [wwt, col_axis])])
    idx, wts = b.one("Reshape", [idx, flat]), b.one("Reshape", [wts, flat])
    half = spec.head_dim // 2
    inv_freq = 1.0 / (spec.rope_theta ** (np.arange(0, half, 2, dtype=np.float32) / np.float32(half)))
    inv = b.const(inv_freq.astype(np.float32).reshape(1, -1))
    fh = b.one("Mul", [b.one("Unsqueeze", [b.one("Cast", [rows], to=f32), col_axis]), inv])
    fw = b.one("Mul", [b.one("Unsqueeze", [b.one("Cast", [cols], to=f32), col_axis]), inv])
    freqs = b.one("Concat", [fh, fw, fh, fw], axis=-1)
    cos, sin = b.one("Cos", [freqs]), b.one("Sin", [freqs])
    if elem != f32:
        wts, cos, sin = (b.one("Cast", [x], to=elem) for x in (wts, cos, sin))
    return idx, wts, cos, sin


def build_vision(spec: VisionSpec, weights: VisionWeights, path: Path, dtype=np.float32) -> None:
    """vision.onnx for one image (N patches, full bidirectional attention over them)."""
    b = GraphBuilder()
    elem = _ONNX[dtype]
    d, heads, hd = spec.hidden_size, spec.num_heads, spec.head_dim
    v = "model.visual."

    def w(name: str, transpose: bool = False) -> str:
        arr = weights.read(v + name).astype(np.float32)
        if transpose:
            arr = arr.reshape(arr.shape[0], -1).T
        return b.weight(name, arr.astype(dtype))

    def linear(x: str, name: str) -> str:
        return b.one("Add", [b.one("MatMul", [x, w(name + ".weight", True)]), w(name + ".bias")])

    def layer_norm(x: str, name: str) -> str:
        return b.one("LayerNormalization", [x, w(name + ".weight"), w(name + ".bias")], axis=-1, epsilon=LN_EPS)

    px = b.add_input("pixel_values", elem, ["patches", spec.patch_dim])
    # [1, 3]: one image per call (onnxruntime-genai loops over images when dim 0 is not symbolic)
    grid = b.add_input("image_grid_thw", TensorProto.INT64, [1, 3])
    idx, wts, cos, sin = _grid_tensors(b, spec, grid, elem)

    x = linear(px, "patch_embed.proj")  # Conv3d, stride == kernel: a MatMul over the flattened patch
    table = b.one("Gather", [w("pos_embed.weight"), idx], axis=0)  # [N, 4, D]
    pos = b.one(
        "ReduceSum", [b.one("Mul", [table, b.one("Unsqueeze", [wts, b.const([-1])])]), b.const([1])], keepdims=0
    )
    x = b.one("Add", [x, pos])
    cos3 = b.one("Unsqueeze", [cos, b.const([1])])  # [N, 1, hd]
    sin3 = b.one("Unsqueeze", [sin, b.const([1])])
    heads_shape = b.const([0, heads, hd])

    def rotate(t: str) -> str:  # t [N, H, hd]: t * cos + rotate_half(t) * sin
        x1, x2 = b.node("Split", [t, b.const([hd // 2, hd // 2])], n_out=2, axis=-1)
        rot = b.one("Concat", [b.one("Neg", [x2]), x1], axis=-1)
        return b.one("Add", [b.one("Mul", [t, cos3]), b.one("Mul", [rot, sin3])])

    for i in range(spec.depth):
        p = f"blocks.{i}."
        h = layer_norm(x, p + "norm1")
        qkv = linear(h, p + "attn.qkv")  # [N, 3D]: q, k, v, each heads x hd
        q, k, vv = b.node("Split", [qkv, b.const([d, d, d])], n_out=3, axis=-1)
        q = b.one("Transpose", [rotate(b.one("Reshape", [q, heads_shape]))], perm=[1, 0, 2])  # [H, N, hd]
        k = b.one("Transpose", [rotate(b.one("Reshape", [k, heads_shape]))], perm=[1, 2, 0])  # [H, hd, N]
        vv = b.one("Transpose", [b.one("Reshape", [vv, heads_shape])], perm=[1, 0, 2])
        scores = b.one("Mul", [b.one("MatMul", [q, k]), b.const(np.array(hd**-0.5, dtype))])
        att = b.one("MatMul", [b.one("Softmax", [scores], axis=-1), vv])  # [H, N, hd]
        att = b.one("Reshape", [b.one("Transpose", [att], perm=[1, 0, 2]), b.const([0, d])])
        x = b.one("Add", [x, linear(att, p + "attn.proj")])
        h = layer_norm(x, p + "norm2")
        h = b.one("Gelu", [linear(h, p + "mlp.linear_fc1")], approximate=GELU_APPROXIMATION[spec.hidden_act])
        x = b.one("Add", [x, linear(h, p + "mlp.linear_fc2")])
    # the 2x2 merger: LayerNorm per patch, 4 consecutive patch rows side by side, Linear, exact GELU, Linear
    x = layer_norm(x, "merger.norm")
    x = b.one("Reshape", [x, b.const([-1, d * spec.merge_unit])])
    x = b.one("Gelu", [linear(x, "merger.linear_fc1")], approximate="none")
    b.node(
        "Add",
        [b.one("MatMul", [x, w("merger.linear_fc2.weight", True)]), w("merger.linear_fc2.bias")],
        outputs=["image_features"],
    )
    b.add_output("image_features", elem, ["merged", spec.out_hidden_size])
    b.finish(path, {"": 21}, 10, doc=f"deltaship Qwen3.5 vision tower, {spec.depth} blocks x {d}")


def _producers(graph) -> dict[str, onnx.NodeProto]:
    return {o: n for n in graph.node for o in n.output}


def _prune(graph) -> None:
    """Drop nodes and initializers no graph output depends on."""
    prod = _producers(graph)
    live, todo = set(), [o.name for o in graph.output]
    keep_nodes = set()
    while todo:
        name = todo.pop()
        if name in live:
            continue
        live.add(name)
        n = prod.get(name)
        if n is not None and id(n) not in keep_nodes:
            keep_nodes.add(id(n))
            todo += list(n.input)
    nodes = [n for n in graph.node if id(n) in keep_nodes]
    del graph.node[:]
    graph.node.extend(nodes)
    inits = [t for t in graph.initializer if t.name in live]
    del graph.initializer[:]
    graph.initializer.extend(inits)


def _embedding_node(graph) -> onnx.NodeProto:
    users = [n for n in graph.node if "input_ids" in n.input and n.op_type != "Shape"]
    if len(users) != 1:
        raise DeltashipError(
            f"model.onnx: expected one embedding node reading input_ids, found {[n.op_type for n in users]}",
            "this is a deltaship bug: export without --vision and report it",
        )
    return users[0]


def build_decoder_mm(
    bundle: Path, mrope_section: tuple[int, ...], inv_freq: np.ndarray, hidden: int, elem: int
) -> None:
    """decoder_mm.onnx: model.onnx on inputs_embeds with M-RoPE positions (see the module docstring)."""
    model = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    g = model.graph
    emb = _embedding_node(g)
    embeds_out = emb.output[0]
    g.node.remove(emb)
    for n in g.node:  # the embedding's consumers (and Shape(input_ids), whose dim 1 is T either way)
        for i, name in enumerate(n.input):
            if name in (embeds_out, "input_ids"):
                n.input[i] = "inputs_embeds"
    trig = [n for n in g.node if n.op_type in ("Cos", "Sin")]
    if len(trig) != 2 or trig[0].input[0] != trig[1].input[0]:
        raise DeltashipError(
            "model.onnx: expected one Cos and one Sin of the rotary angles", "this is a deltaship bug: report it"
        )
    angles = trig[0].input[0]
    half = inv_freq.size
    mask = interleave_mask(mrope_section, half).reshape(3, 1, 1, half)
    extra = []

    def node(op, inputs, out, **attrs):
        extra.append(helper.make_node(op, inputs, [out], name="mm_" + out, **attrs))
        return out

    def const(name, arr):
        g.initializer.append(onnx.numpy_helper.from_array(np.asarray(arr), "mm_" + name))
        return "mm_" + name

    p = node("Cast", ["rope_position_ids"], "mm_pos_f", to=TensorProto.FLOAT)
    p = node("Unsqueeze", [p, const("axis_last", np.array([-1], np.int64))], "mm_pos_u")  # [3, 1, T, 1]
    f = node("Mul", [p, const("inv_freq", inv_freq.astype(np.float32))], "mm_freqs3")  # [3, 1, T, half]
    f = node("Mul", [f, const("section_mask", mask)], "mm_freqs3_masked")
    f = node("ReduceSum", [f, const("axis0", np.array([0], np.int64))], "mm_freqs", keepdims=0)  # [1, T, half]
    f = node("Concat", [f, f], "mm_emb", axis=-1)
    node("Unsqueeze", [f, const("axis2", np.array([2], np.int64))], angles + "_mrope")  # [1, T, 1, rot]
    for n in trig:
        n.input[0] = angles + "_mrope"
    # keep the node list topologically sorted: the new nodes read only graph inputs and constants
    nodes = extra + list(g.node)
    del g.node[:]
    g.node.extend(nodes)
    inputs = [i for i in g.input if i.name != "input_ids"]
    inputs[0:0] = [
        helper.make_tensor_value_info("inputs_embeds", elem, [1, "tokens", hidden]),
        helper.make_tensor_value_info("rope_position_ids", TensorProto.INT64, [3, 1, "tokens"]),
    ]
    del g.input[:]
    g.input.extend(inputs)
    _prune(g)
    onnx.save(model, str(bundle / DECODER_FILE))


def build_embedding(bundle: Path, image_token_ids: list[int], hidden: int, elem: int) -> None:
    """embedding.onnx: model.onnx's token embedding, with the image-token rows spliced from image_features."""
    model = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    src = model.graph
    emb = _embedding_node(src)
    inits = {t.name: t for t in src.initializer}
    prod = _producers(src)
    # the embedding node and whatever it reads besides input_ids (weights, scales, small constant subgraphs)
    nodes, todo, seen = [], [i for i in emb.input if i != "input_ids"], set()
    used_inits = []
    while todo:
        name = todo.pop()
        if name in seen or not name:
            continue
        seen.add(name)
        if name in inits:
            used_inits.append(inits[name])
        elif name in prod:
            nodes.insert(0, prod[name])
            todo += list(prod[name].input)
    nodes.append(emb)
    is_img = None
    extra_inits = []

    def c(name, arr):
        extra_inits.append(onnx.numpy_helper.from_array(np.asarray(arr), name))
        return name

    out = []
    for k, tok in enumerate(image_token_ids):
        eq = f"is_image_{k}"
        out.append(helper.make_node("Equal", ["input_ids", c(f"image_token_{k}", np.array(tok, np.int64))], [eq]))
        if is_img is not None:
            out.append(helper.make_node("Or", [is_img, eq], [f"is_image_any_{k}"]))
            eq = f"is_image_any_{k}"
        is_img = eq
    # row r of the call's image tokens takes image_features[r]; an image token past the rows given (a generated
    # one, or a call with no rows: image_features [0, hidden]) keeps its token embedding
    zero_row = c("zero_row", np.zeros((1, hidden), {v: k for k, v in _ONNX.items()}[elem]))
    out += [
        helper.make_node("Cast", [is_img], ["image_count"], to=TensorProto.INT64),
        helper.make_node("CumSum", ["image_count", c("axis1", np.array(1, np.int64))], ["image_rank"]),
        helper.make_node("Sub", ["image_rank", c("one", np.array(1, np.int64))], ["image_row0"]),
        helper.make_node("Max", ["image_row0", c("zero", np.array(0, np.int64))], ["image_row"]),
        helper.make_node("Shape", ["image_features"], ["features_shape"], start=0, end=1),
        helper.make_node("Less", ["image_row0", "features_shape"], ["has_row"]),
        helper.make_node("And", [is_img, "has_row"], ["splice"]),
        helper.make_node("Concat", ["image_features", zero_row], ["padded_features"], axis=0),
        helper.make_node("Gather", ["padded_features", "image_row"], ["image_rows"], axis=0),  # [1, T, H]
        helper.make_node("Unsqueeze", ["splice", c("last", np.array([-1], np.int64))], ["splice_3d"]),
        helper.make_node("Where", ["splice_3d", "image_rows", emb.output[0]], ["inputs_embeds"]),
    ]
    graph = helper.make_graph(
        nodes + out,
        "deltaship_embedding",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "tokens"]),
            helper.make_tensor_value_info("image_features", elem, ["image_rows", hidden]),
        ],
        [helper.make_tensor_value_info("inputs_embeds", elem, [1, "tokens", hidden])],
        used_inits + extra_inits,
    )
    m = helper.make_model(graph, opset_imports=list(model.opset_import), producer_name="deltaship")
    m.ir_version = model.ir_version
    onnx.save(m, str(bundle / EMBEDDING_FILE))


def lower_vision(bundle: Path, source, ctx) -> dict[str, Any]:
    """Write the multimodal graphs and preprocessor_config.json into the bundle; return the manifest's
    `vision` block."""
    from deltaship.models.qwen3_5 import rotary_inv_freq  # lazy: torch

    vspec, pre, pre_cfg, mrope = check_vision(source, ctx.spec)
    spec = ctx.spec
    weights = VisionWeights(source.weights.files, vspec, str(source.path))
    dtype = np.float16 if ctx.precision == "fp16" else np.float32  # as model.onnx's activations
    build_vision(vspec, weights, bundle / VISION_FILE, dtype)
    elem = _ONNX[dtype]
    build_embedding(bundle, [vspec.image_token_id, vspec.video_token_id], spec.hidden_size, elem)
    build_decoder_mm(bundle, tuple(mrope), rotary_inv_freq(spec), spec.hidden_size, elem)
    write_preprocessor(bundle, source, pre_cfg)
    return {
        "spec": vspec.to_dict(),
        "mrope_section": list(mrope),
        "graphs": {"vision": VISION_FILE, "embedding": EMBEDDING_FILE, "decoder": DECODER_FILE},
        "preprocessor": PREPROCESSOR_CONFIG,
        "video_preprocessor": VIDEO_PREPROCESSOR_CONFIG,
        "min_image_tokens": pre.min_image_tokens(),
        "max_image_tokens": pre.max_image_tokens(),
        "max_pixels": pre.max_pixels,
        "min_pixels": pre.min_pixels,
        "images_per_call": 1,
        "dtype": np.dtype(dtype).name,
    }
