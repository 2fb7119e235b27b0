"""Images through Qwen3.5's vision tower: host preprocessing and positions against transformers, and an ONNX
bundle exported with --vision against transformers' Qwen3_5ForConditionalGeneration (greedy tokens, logits)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from deltaship.errors import DeltashipError
from deltaship.models.vision import (
    DEFAULT_PREPROCESSOR,
    DEFAULT_VIDEO_PREPROCESSOR,
    Preprocessor,
    VisionSpec,
    interleave_mask,
    position_interpolation,
    preprocess_image,
    rope_positions,
    rotary_cos_sin,
)

L, F = "linear_attention", "full_attention"
VOCAB = 160
IMAGE, VIDEO, START, END, IM_START, IM_END, EOS = 150, 151, 152, 153, 154, 155, 159
# small pixel limits: 4 .. 64 merged tokens per image (32 x 32 pixels each)
PRE = DEFAULT_PREPROCESSOR | {"size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 64}}
# video: pixel limits over a whole clip (frames x height x width), 2 frames per second
VIDEO_PRE = DEFAULT_VIDEO_PREPROCESSOR | {"size": {"shortest_edge": 32 * 32 * 8, "longest_edge": 32 * 32 * 256}}
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    layer_types=[L, F, L, F],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    eos_token_id=EOS,
    tie_word_embeddings=True,
    # rotary_dim 16: 8 frequencies, split T/H/W 3/3/2
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    },
)
# other shapes than the published ones: 2 blocks, 2 heads of 16, an 8 x 8 position table
VISION = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, num_position_embeddings=64
)
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)


def _image(h: int, w: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _hf_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**{k: v for k, v in PRE.items() if k != "image_processor_type"})


def _write_tokenizer(d: Path) -> None:
    """A word-level tokenizer with Qwen3.5's vision and chat markers at this vocabulary's ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "describe the image what is in it two images compare and".split()
    vocab = {"[UNK]": 0} | {w: i + 1 for i, w in enumerate(words)}
    special = {
        "<|image_pad|>": IMAGE,
        "<|video_pad|>": VIDEO,
        "<|vision_start|>": START,
        "<|vision_end|>": END,
        "<|im_start|>": IM_START,
        "<|im_end|>": IM_END,
        "<|endoftext|>": EOS,
        "user": 156,
        "assistant": 157,
    }
    tok = Tokenizer(models.WordLevel(vocab | special, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([k for k in special if k.startswith("<|")])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Qwen3_5ForConditionalGeneration with a larger init (std 0.15) so greedy tokens differ."""
    import torch
    from helpers import randomize
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = Qwen3_5Config(text_config=TEXT, vision_config=VISION, tie_word_embeddings=True, **TOKENS)
    model = Qwen3_5ForConditionalGeneration(cfg)
    randomize(model, 3)
    d = tmp_path_factory.mktemp("vl")
    model.save_pretrained(d)
    (d / "preprocessor_config.json").write_text(json.dumps(PRE))
    (d / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PRE))
    _write_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def vl_bundle(vl_checkpoint, tmp_path_factory) -> Path:
    from deltaship.bundle import read_manifest, schema_problems
    from deltaship.compile import export

    out = tmp_path_factory.mktemp("vlb") / "bundle"
    # verified at export: the text path, then image + text prompts against transformers (vision.verification)
    export(str(vl_checkpoint), out, max_context=128, prefill_chunk=8, progress=False, vision=True, fidelity=False)
    assert not schema_problems(read_manifest(out))
    return out


@pytest.fixture(scope="module")
def hf_model(vl_checkpoint):
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(vl_checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run all the steps, EOS included as a plain token
    return model


def _spec(ckpt: Path) -> VisionSpec:
    return VisionSpec.from_config(json.loads((ckpt / "config.json").read_text()))


# ---- host side ------------------------------------------------------------------------------------
@pytest.mark.parametrize("h, w", [(64, 64), (70, 100), (150, 90), (500, 300), (20, 30)])
def test_preprocessing_matches_transformers(h, w):
    """Resize (incl. down to max_pixels and up to min_pixels), normalize, merge-block patch order, grid."""
    img = _image(h, w, seed=h * w)
    mine = preprocess_image(img, Preprocessor.from_config(PRE))
    ref = _hf_processor()(images=[img], return_tensors="np")
    assert [list(mine.grid)] == ref["image_grid_thw"].tolist()
    assert mine.patches.shape == ref["pixel_values"].shape
    np.testing.assert_allclose(mine.patches, ref["pixel_values"], atol=1e-6)


@pytest.mark.parametrize("grid", [(1, 4, 6), (1, 10, 6), (2, 4, 4), (1, 60, 2)])
def test_grid_tensors_match_transformers(grid):
    """Position-table interpolation and the 2-D rotary, as transformers computes them from grid_thw."""
    import torch
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionRotaryEmbedding
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

    spec = VisionSpec.from_config({"model_type": "qwen3_5", "vision_config": VISION} | TOKENS)
    g = torch.tensor([grid])
    idx, wts = get_vision_interpolation_indices_and_weights(
        g, spec.grid_side, mode="bilinear", align_corners=True, spatial_merge_size=2
    )
    my_idx, my_wts = position_interpolation(spec, grid)
    np.testing.assert_array_equal(my_idx, idx.numpy())
    np.testing.assert_allclose(my_wts, wts.numpy(), atol=1e-6)
    rot = Qwen3_5VisionRotaryEmbedding(Qwen3_5VisionConfig(**VISION))
    cos, sin = rot(torch.zeros(1), get_vision_position_ids(g, 2))
    my_cos, my_sin = rotary_cos_sin(spec, grid)
    np.testing.assert_allclose(my_cos, cos.numpy(), atol=1e-6)
    np.testing.assert_allclose(my_sin, sin.numpy(), atol=1e-6)


@pytest.mark.parametrize("grid", [(1, 4, 6), (1, 10, 6), (2, 4, 4), (1, 60, 2), (1, 2, 2)])
def test_vision_graph_computes_the_grid_tensors(grid, tmp_path):
    """vision.onnx computes from image_grid_thw what the host computes (models/vision/rope.py): same indices, weights
    within float rounding, same rotary (what onnxruntime-genai relies on: it feeds only pixels and the grid)."""
    import onnxruntime as ort
    from onnx import TensorProto

    from deltaship.lowering.onnx.builder import GraphBuilder
    from deltaship.lowering.onnx.vision import _grid_tensors

    spec = VisionSpec.from_config({"model_type": "qwen3_5", "vision_config": VISION} | TOKENS)
    b = GraphBuilder()
    g = b.add_input("image_grid_thw", TensorProto.INT64, [1, 3])
    names = ("pos_indices", "pos_weights", "rope_cos", "rope_sin")
    for name, out in zip(names, _grid_tensors(b, spec, g, TensorProto.FLOAT)):
        b.node("Identity", [out], outputs=[name])
        b.add_output(name, TensorProto.INT64 if name == "pos_indices" else TensorProto.FLOAT, None)
    b.finish(tmp_path / "grid.onnx", {"": 21}, 10)
    got = ort.InferenceSession(str(tmp_path / "grid.onnx")).run(list(names), {"image_grid_thw": np.array([grid])})
    idx, wts = position_interpolation(spec, grid)
    cos, sin = rotary_cos_sin(spec, grid)
    np.testing.assert_array_equal(got[0], idx)
    for a, want in zip(got[1:], (wts, cos, sin)):
        np.testing.assert_allclose(a, want, atol=1e-6)


def test_rope_positions_match_get_rope_index(vl_checkpoint, hf_model):
    import torch

    spec = _spec(vl_checkpoint)
    grids = [(1, 4, 6), (1, 10, 6)]
    ids = [1, 2, START] + [IMAGE] * 6 + [END, 3, START] + [IMAGE] * 15 + [END, 4, 5, 6]
    t = torch.tensor([ids])
    ref, delta = hf_model.model.get_rope_index(
        t, ((t == IMAGE) | (t == VIDEO)).int(), image_grid_thw=torch.tensor(grids)
    )
    mine, my_delta = rope_positions(ids, grids, spec)
    np.testing.assert_array_equal(mine, ref[:, 0].numpy())
    assert my_delta == int(delta) and my_delta < 0  # later tokens sit at cache position + delta
    with pytest.raises(DeltashipError, match="placeholders for 2 image"):
        rope_positions(ids, grids + [(1, 4, 4)], spec)


def test_mrope_section_must_fit_the_rotary():
    assert interleave_mask((3, 3, 2), 8)[:, :4].tolist() == [[1, 0, 0, 1], [0, 1, 0, 0], [0, 0, 1, 0]]
    with pytest.raises(DeltashipError, match="summing to 8"):
        interleave_mask((11, 11, 10), 8)


def test_export_vision_refusals(checkpoints, vl_checkpoint, tmp_path):
    from deltaship.compile import export

    with pytest.raises(DeltashipError, match="fp32 or fp16 only"):  # the published-shape preset's tower is found
        export("qwen3.5-0.8b", tmp_path / "a", precision="int8", vision=True, verify=False, progress=False)
    with pytest.raises(DeltashipError, match="text-only checkpoint"):
        export("qwen3.5-tiny", tmp_path / "a", vision=True, verify=False, progress=False)
    with pytest.raises(DeltashipError, match="text-only checkpoint"):
        export(str(checkpoints["base"]), tmp_path / "b", vision=True, verify=False, progress=False)
    with pytest.raises(DeltashipError, match="int4; other vision bundles are not verified"):
        export(str(vl_checkpoint), tmp_path / "c", precision="int4", vision=True, verify=False, progress=False)
    with pytest.raises(DeltashipError, match="fp32 only"):  # Core ML too (tests/test_coreml_vision.py)
        export(str(vl_checkpoint), tmp_path / "d", target="coreml", precision="fp16", vision=True, progress=False)
    assert not any(tmp_path.iterdir())


def test_lowering_the_vision_tower_is_never_silent(vl_checkpoint, tmp_path, monkeypatch):
    """The vision tower's lowering reports its elapsed time while it runs (the lowerings say nothing themselves:
    ExecuTorch's XNNPACK lowering or Core ML's conversion of a real tower takes minutes). A lowering made to take
    1.5 s here must report at least once, as detail of the "lowering the vision tower" step."""
    import time

    from deltaship.compile import export
    from deltaship.lowering.onnx import multimodal

    lower = multimodal.lower_vision

    def slow(*args, **kwargs):
        time.sleep(1.5)
        return lower(*args, **kwargs)

    monkeypatch.setattr(multimodal, "lower_vision", slow)
    said: list[tuple[str, bool]] = []
    export(str(vl_checkpoint), tmp_path / "b", max_context=64, prefill_chunk=8, vision=True, verify=False,
           progress=lambda msg, inline=False: said.append((msg, inline)))  # fmt: skip
    start = said.index(("lowering the vision tower", False))
    beats = [m for m, inline in said[start + 1 :] if inline and m.startswith("still lowering the vision tower, ")]
    assert beats, said[start:]


def test_published_presets_carry_their_vision_tower():
    """Random towers at the published shapes, beside (not inside) the text weights, read like a checkpoint's."""
    import torch
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    from deltaship.models.presets import PRESETS
    from deltaship.models.source import load_source
    from deltaship.models.vision import VisionWeights, vision_spec_of, vision_tensors

    shapes = {"qwen3.5-0.8b": (12, 768, 12), "qwen3.5-2b": (24, 1024, 16), "qwen3.5-9b": (27, 1152, 16)}
    for name, (depth, width, heads) in shapes.items():
        src = load_source(name)
        vs = vision_spec_of(src)
        assert (vs.depth, vs.hidden_size, vs.num_heads, vs.patch_size, vs.num_position_embeddings) == (
            depth,
            width,
            heads,
            16,
            2304,
        )
        assert not src.spec.is_multimodal
        assert not any(n.startswith("model.visual.") for n in src.weights.names())  # the text path is unchanged
        assert vs.out_hidden_size == src.spec.hidden_size
    weights = VisionWeights(src.weights.files, vs, name)  # every tensor at its vision_config shape
    qkv = weights.read("model.visual.blocks.3.attn.qkv.weight")
    assert qkv.shape == (3 * 1152, 1152) and abs(float(qkv.std()) - 0.02) < 1e-3
    assert np.array_equal(qkv, weights.read("model.visual.blocks.3.attn.qkv.weight"))  # seeded
    assert not np.array_equal(qkv, weights.read("model.visual.blocks.4.attn.qkv.weight"))
    assert (weights.read("model.visual.merger.norm.weight") == 1).all()
    assert (weights.read("model.visual.blocks.0.mlp.linear_fc1.bias") == 0).all()

    for preset in ("qwen3.5-0.8b", "qwen3.5-4b"):  # transformers' tower at that vision_config: the same tensors
        vc = {k: v for k, v in PRESETS[preset].multimodal_config()["vision_config"].items() if k != "model_type"}
        with torch.device("meta"):
            hf = Qwen3_5VisionModel(Qwen3_5VisionConfig(**vc))
        got = {"model.visual." + n: tuple(p.shape) for n, p in hf.named_parameters()}
        assert got == vision_tensors(vision_spec_of(load_source(preset)))


def test_tiny_preset_mrope_section_fits():
    from deltaship.models.source import load_source

    spec = load_source("qwen3.5-tiny").spec
    assert sum(spec.mrope_section) == spec.rotary_dim // 2


# ---- the bundle against transformers ---------------------------------------------------------------
def _reference(hf_model, ids: list[int], images, steps: int) -> tuple[list[int], np.ndarray]:
    """transformers' own cached greedy generation (prefill with the pixels, M-RoPE decode by rope delta)."""
    import torch

    px = _hf_processor()(images=images, return_tensors="pt")
    t = torch.tensor([ids])
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=t,
            pixel_values=px["pixel_values"],
            image_grid_thw=px["image_grid_thw"],
            mm_token_type_ids=((t == IMAGE) | (t == VIDEO)).int(),
            max_new_tokens=steps,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(ids) :].tolist(), torch.cat(out.logits).float().numpy()


def _video_reference(hf_model, ids: list[int], video, steps: int) -> tuple[list[int], np.ndarray]:
    """_reference for one preprocessed video (its patches and grid as deltaship made them)."""
    import torch

    t = torch.tensor([ids])
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=t,
            pixel_values_videos=torch.from_numpy(video.patches),
            video_grid_thw=torch.tensor([video.grid]),
            mm_token_type_ids=(t == VIDEO).int() * 2,
            max_new_tokens=steps,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(ids) :].tolist(), torch.cat(out.logits).float().numpy()


CASES = {
    "square": [(64, 64)],  # 2 x 2 merged tokens
    "odd_width": [(64, 96)],  # merged grid 2 x 3
    "tall_chunk_boundary": [(160, 96)],  # 5 x 3 = 15 tokens from position 4: prefill chunks of 8 cut it twice
    "two_images": [(64, 96), (96, 64)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_image_generation_matches_transformers(case, vl_bundle, hf_model):
    from deltaship.targets import open_bundle, open_multimodal

    images = [_image(h, w, seed=i + h) for i, (h, w) in enumerate(CASES[case])]
    mm = open_multimodal(open_bundle(vl_bundle))
    ims = [preprocess_image(im, mm.pre) for im in images]
    prompt = [5, 6]
    for _ in images:
        prompt += [START, IMAGE, END]
    prompt += [7, 8, 9]
    gen = mm.generate(prompt, ims, 16, keep_logits=True, stop_at_eos=False)
    n_img = sum(im.tokens(2) for im in ims)
    assert len(gen.input_ids) == len(prompt) - len(images) + n_img
    if case == "tall_chunk_boundary":
        first = gen.input_ids.index(IMAGE)
        assert first % 8 != 0 and (first + n_img) // 8 > first // 8 + 1  # boundaries inside the span
    ref, ref_logits = _reference(hf_model, gen.input_ids, images, 16)
    assert len(set(ref)) > 3, f"degenerate reference {ref}: the test would prove nothing"
    assert gen.output_ids == ref
    logits = np.stack(gen.logits)
    assert np.abs(logits - ref_logits).max() / ref_logits.std() < 1e-3


@pytest.mark.parametrize("n_frames", [2, 3, 4])
def test_video_matches_transformers(n_frames, vl_bundle, hf_model):
    """A video of 2, 3 (padded with its last frame) or 4 frames between text: one timestamped span per frame
    pair, against transformers' video path (its get_rope_index splits video_grid_thw per temporal patch)."""

    from deltaship.models.vision import preprocess_frames
    from deltaship.targets import open_bundle, open_multimodal

    mm = open_multimodal(open_bundle(vl_bundle))
    frames = [np.asarray(_image(64, 96, seed=5 + i)) for i in range(n_frames)]
    video = preprocess_frames(frames, mm.pre, mm.video_pre)
    groups = (n_frames + 1) // 2
    assert video.grid == (groups, 4, 6) and video.video
    assert video.timestamps == [(2 * g + min(2 * g + 1, n_frames - 1)) / 2 / 2 for g in range(groups)]
    rows = video.patches.reshape(groups, -1, 3, 2, 256)  # (group, patch, channel, frame, pixels)
    # the patch row is (channel, frame, row, col): frame 0 then frame 1 of each channel
    still = preprocess_image(frames[0], mm.pre).patches.reshape(-1, 3, 2, 256)
    np.testing.assert_array_equal(rows[0, :, :, 0], still[:, :, 0])
    assert not np.array_equal(rows[0, :, :, 1], still[:, :, 1])
    if n_frames % 2:  # the odd frame count is padded with the last frame
        np.testing.assert_array_equal(rows[-1, :, :, 1], rows[-1, :, :, 0])
    prompt = [5]
    for g in range(groups):
        prompt += [10 + g, START, VIDEO, END]  # a text token where the timestamp text goes
    prompt += [7, 8]
    gen = mm.generate(prompt, [video], 16, keep_logits=True, stop_at_eos=False)
    assert gen.input_ids.count(VIDEO) == 6 * groups
    ref, ref_logits = _video_reference(hf_model, gen.input_ids, video, 16)
    assert len(set(ref)) > 3 and gen.output_ids == ref
    assert np.abs(np.stack(gen.logits) - ref_logits).max() / ref_logits.std() < 1e-3
    if groups > 1:  # one span for a whole multi-pair video is refused, naming the layout
        with pytest.raises(DeltashipError, match="placeholder span"):
            mm.generate([5, START, VIDEO, END], [video], 4)


def _transformers_video_functions() -> dict:
    """smart_resize, and Qwen3VLVideoProcessor's sample_frames and patchify, compiled from transformers' own
    source: the module refuses to import without torchvision, which does not import with the pinned torch."""
    import ast
    import math

    import torch
    import transformers.models.qwen3_vl as pkg

    src = (Path(pkg.__file__).parent / "video_processing_qwen3_vl.py").read_text()
    tree = ast.parse(src)
    keep = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize"]
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen3VLVideoProcessor")
    keep += [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in ("sample_frames", "patchify")]
    for fn in keep:
        fn.decorator_list = []
        for a in fn.args.args + fn.args.kwonlyargs:
            a.annotation = None
        fn.returns = None
    ns = {"math": math, "np": np, "torch": torch, "logger": None}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "video_processing_qwen3_vl.py", "exec"), ns)
    assert {"smart_resize", "sample_frames", "patchify"} <= set(ns)
    return ns


def test_video_prompt_text():
    """A video in a text prompt: per temporal patch its time (one decimal, as Qwen3VLProcessor writes it) then
    its span; a user's own <|video_pad|> marker (bare or in its vision span) is replaced in place."""
    from deltaship.models.vision import ImageInput
    from deltaship.runtimes.vision import image_prompt

    clip = ImageInput(np.zeros((48, 1)), (2, 4, 6), (64, 96), (64, 96), video=True, timestamps=[0.25, 1.5])
    spans = "<0.2 seconds><|vision_start|><|video_pad|><|vision_end|><1.5 seconds><|vision_start|><|video_pad|>" \
        "<|vision_end|>"  # fmt: skip
    assert image_prompt("what happens", 1, False, [clip]) == (
        "<|vision_start|><|image_pad|><|vision_end|>" + spans + "what happens"
    )
    for marked in ("in <|vision_start|><|video_pad|><|vision_end|> what", "in <|video_pad|> what"):
        assert (
            image_prompt(marked, 0, True, [clip])
            == f"<|im_start|>user\nin {spans} what<|im_end|>\n<|im_start|>assistant\n"
        )
    with pytest.raises(DeltashipError, match="1 <|video_pad|> marker"):
        image_prompt("<|video_pad|>", 0, False, [clip, clip])


def test_video_preprocessing_matches_transformers():
    """Resize rule, pair padding + patch layout, frame sampling and timestamps against transformers' own
    Qwen3VLVideoProcessor / Qwen3VLProcessor code."""
    from types import SimpleNamespace

    import torch
    from transformers.models.qwen3_vl import processing_qwen3_vl as proc

    fns = _transformers_video_functions()
    vp = SimpleNamespace(
        smart_resize=fns["smart_resize"],
        Qwen3VLVideoProcessor=SimpleNamespace(sample_frames=fns["sample_frames"], patchify=fns["patchify"]),
    )

    from deltaship.models.vision import (
        VideoPreprocessor,
        frame_timestamps,
        preprocess_frames,
        sample_indices,
        video_smart_resize,
    )

    for frames, h, w, lo, hi in ((3, 64, 96, 8192, 262144), (5, 300, 500, 4096, 200000), (2, 40, 20, 65536, 10**6)):
        assert video_smart_resize(frames, h, w, 2, 32, lo, hi) == vp.smart_resize(frames, h, w, 2, 32, lo, hi)
    pre = Preprocessor.from_config(PRE)
    vpre = VideoPreprocessor.from_config(VIDEO_PRE)
    frames = [np.asarray(_image(64, 96, seed=i)) for i in range(3)]
    ours = preprocess_frames(frames, pre, vpre)
    x = torch.from_numpy(np.stack(frames).astype(np.float32).transpose(0, 3, 1, 2) / 255 - 0.5) / 0.5
    theirs, *grid = vp.Qwen3VLVideoProcessor.patchify(None, x[None], 16, 2, 2)
    assert tuple(grid) == ours.grid
    np.testing.assert_allclose(ours.patches, theirs[0].numpy(), atol=1e-6)
    stub = SimpleNamespace(fps=2, min_frames=vpre.min_frames, max_frames=vpre.max_frames)
    for total, video_fps, fps in ((24, 8.0, 2.0), (300, 30.0, 1.0), (5, 25.0, 2.0), (2000, 24.0, 12.0)):
        meta = SimpleNamespace(total_num_frames=total, fps=video_fps)
        want = vp.Qwen3VLVideoProcessor.sample_frames(stub, meta, fps=fps)
        idx = sample_indices(total, video_fps, fps, vpre)
        np.testing.assert_array_equal(idx, want)
        assert frame_timestamps(idx, video_fps, 2) == proc.Qwen3VLProcessor._calculate_timestamps(
            None, list(want), video_fps, 2
        )


def _solid_frames(n: int, h: int = 64, w: int = 96) -> list[np.ndarray]:
    """Frame i is one flat grey of level 10 * i: which frame a sample is can be read back after lossy coding."""
    return [np.full((h, w, 3), 10 * i, dtype=np.uint8) for i in range(n)]


@pytest.mark.parametrize("kind,rate,fps", [("mp4", 8, 2.0), ("gif", 4, 1.0)])  # GIF delays are in 1/100 s
def test_video_file_frame_sampling(kind, rate, fps, tmp_path):
    """A 24-frame clip (3 s at 8 fps, 6 s at 4 fps) sampled at 2 (1) fps keeps transformers' 6 evenly spaced
    frames, each temporal patch stamped with its frames' mean time."""
    from deltaship.models.vision import VideoPreprocessor, load_video

    frames = _solid_frames(24)
    path = tmp_path / f"clip.{kind}"
    if kind == "mp4":
        av = pytest.importorskip("av", reason="the `video` extra (PyAV) decodes MP4")
        with av.open(str(path), "w") as out:
            stream = out.add_stream("mpeg4", rate=rate)
            stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
            stream.options = {"qscale": "2"}
            for f in frames:
                out.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
            out.mux(stream.encode())
    else:
        from PIL import Image

        ims = [Image.fromarray(f) for f in frames]
        ims[0].save(path, save_all=True, append_images=ims[1:], duration=1000 // rate, loop=0)
    got, stamps = load_video(path, fps, VideoPreprocessor.from_config(VIDEO_PRE))
    picked = [round(float(np.asarray(f, dtype=np.float32).mean()) / 10) for f in got]
    assert picked == [0, 5, 9, 14, 18, 23]
    assert stamps == pytest.approx([(0 + 5) / 2 / rate, (9 + 14) / 2 / rate, (18 + 23) / 2 / rate])


def test_cli_generate_with_video_file(vl_bundle, tmp_path):
    """--video FILE --fps through the CLI: timestamped spans, one per frame pair, in the prompt."""
    from PIL import Image

    path = tmp_path / "clip.gif"
    ims = [Image.fromarray(np.asarray(_image(64, 96, seed=i))) for i in range(8)]
    ims[0].save(path, save_all=True, append_images=ims[1:], duration=250, loop=0)  # 4 fps, 2 s
    r = _cli("generate", str(vl_bundle), "--video", str(path), "--fps", "2", "--prompt", "describe",
             "--max-new-tokens", "3", "--json", "--no-stop-at-eos")  # fmt: skip
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    # int(8 / 4 * 2) = 4 frames (0, 2, 5, 7 at 4 fps): 2 temporal patches of 2 x 3 merged tokens
    assert res["images"][0]["grid_thw"] == [2, 4, 6] and res["images"][0]["timestamps"] == [0.25, 1.5]
    ids = res["input_ids"]
    assert ids.count(START) == 2 and ids.count(VIDEO) == 12 and len(res["output_ids"]) == 3


@pytest.mark.slow  # ~40 s on ONNX (a second export with its text verification), minutes on ExecuTorch
@pytest.mark.parametrize("target", ["onnx", "executorch"])
def test_fp16_vision_bundle_verifies(target, vl_checkpoint, hf_model, tmp_path):
    """export --vision --precision fp16: the tower, splice and decoder in fp16, verified at export against
    transformers with the weights rounded to fp16, within the target's fp16 tolerance row; greedy tokens of a
    4-frame video prompt match that reference."""

    from deltaship.bundle import read_manifest, schema_problems
    from deltaship.check.vision import round_to_fp16
    from deltaship.compile import export
    from deltaship.models.vision import preprocess_frames
    from deltaship.targets import open_bundle, open_multimodal, tolerance

    out = tmp_path / "fp16"
    if target == "executorch":
        pytest.importorskip("executorch")
    export(str(vl_checkpoint), out, target=target, max_context=128, prefill_chunk=8, progress=False, vision=True,
           precision="fp16", fidelity=False)  # fmt: skip
    m = read_manifest(out)
    assert not schema_problems(m)
    v, tol = m["vision"], tolerance(target, "fp16")
    assert v["dtype"] == "float16" and "rounded to fp16" in v["verification"]["reference"]
    assert v["verification"]["status"] == "passed", v["verification"]
    assert 0 < v["verification"]["max_rel_logit_diff"] <= tol.max_rel_logit_diff
    mm = open_multimodal(open_bundle(out))
    video = preprocess_frames([np.asarray(_image(64, 96, seed=20 + i)) for i in range(4)], mm.pre, mm.video_pre)
    prompt = [5, 10, START, VIDEO, END, 11, START, VIDEO, END, 7, 8]
    gen = mm.generate(prompt, [video], 16, keep_logits=True, stop_at_eos=False)
    ref_model = copy.deepcopy(hf_model)
    round_to_fp16(ref_model, None, tied=True)
    ref, ref_logits = _video_reference(ref_model, gen.input_ids, video, 16)
    assert gen.output_ids == ref
    rel = np.abs(np.stack(gen.logits).astype(np.float32) - ref_logits).max() / ref_logits.std()
    assert rel <= tol.max_rel_logit_diff


def test_mrope_positions_matter(vl_bundle, monkeypatch):
    """Feeding the image span 1-D positions changes the logits far past the tolerance: the 3-row path is live."""
    from deltaship.targets import open_bundle, open_multimodal

    mm = open_multimodal(open_bundle(vl_bundle))
    im = preprocess_image(_image(160, 96, seed=1), mm.pre)
    ids = mm.expand([5, START, IMAGE, END, 7], [im])
    right = mm.prefill(ids, [im])
    monkeypatch.setattr(
        "deltaship.runtimes.vision.rope_positions", lambda ids, grids, spec: (np.tile(np.arange(len(ids)), (3, 1)), 0)
    )
    wrong = mm.prefill(ids, [im])
    assert np.abs(right - wrong).max() > 100 * 1e-3 * right.std()


def test_text_prompt_on_vision_bundle_takes_the_text_graph(vl_bundle, bundles):
    from deltaship.bundle import read_manifest
    from deltaship.targets import open_bundle

    m = read_manifest(vl_bundle)
    assert m["entry"] == "model.onnx" and m["vision"]["graphs"]["decoder"] == "decoder_mm.onnx"
    assert m["vision"]["max_image_tokens"] == 64 and m["vision"]["min_image_tokens"] == 4
    rec = m["vision"]["verification"]
    assert rec["status"] == "passed" and len(rec["images"]) == 3 and rec["greedy_agreement"] == 1.0
    assert {r["grid_thw"][2] // 2 for r in rec["images"]} >= {2, 3}  # square and odd merged widths
    assert (vl_bundle / "preprocessor_config.json").is_file()
    s = open_bundle(vl_bundle)
    a = s.generate([5, 6, 7], 8).output_ids
    from deltaship.targets import open_multimodal

    b = open_multimodal(open_bundle(vl_bundle)).generate([5, 6, 7], [], 8).output_ids
    assert a == b  # with no image, M-RoPE is 1-D RoPE: both graphs agree


# ---- the CLI ------------------------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltaship", *args], capture_output=True, text=True, timeout=300)


def test_cli_generate_with_images(vl_bundle, tmp_path):
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    _image(64, 96, 0).save(a)
    _image(600, 400, 1).save(b)  # over max_pixels: resized, with a notice
    r = _cli("generate", str(vl_bundle), "--image", str(a), "--image", str(b), "--prompt", "compare the two images",
             "--max-new-tokens", "4", "--json", "--no-stop-at-eos")  # fmt: skip
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["image_tokens"][0] == 6 and res["image_tokens"][1] <= 64
    assert any("resized" in n for n in res["notices"])
    ids = res["input_ids"]
    assert ids[:3] == [IM_START, 156, START] and ids.count(IMAGE) == sum(res["image_tokens"])
    assert len(res["output_ids"]) == 4


def test_image_generation_on_onnx_imports_no_torch(vl_bundle, tmp_path):
    a = tmp_path / "a.png"
    _image(64, 96, 0).save(a)
    code = (
        "import sys; from deltaship.commands import generate; "
        f"r = generate({str(vl_bundle)!r}, input_ids=[5, {START}, {IMAGE}, {END}], images=[{str(a)!r}], "
        "max_new_tokens=2); assert r['image_tokens'] == [6], r; assert 'torch' not in sys.modules"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_cli_image_errors(vl_bundle, bundles, tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    good = tmp_path / "good.png"
    _image(64, 64, 0).save(good)
    r = _cli("generate", str(vl_bundle), "--image", str(bad), "--input-ids", f"1,{IMAGE},2")
    assert r.returncode != 0 and "not a readable image" in r.stderr and "Traceback" not in r.stderr
    r = _cli("generate", str(vl_bundle), "--image", str(good), "--input-ids", "1,2,3")
    assert r.returncode != 0 and "0 image/video placeholder span" in r.stderr and "Traceback" not in r.stderr
    r = _cli("generate", str(vl_bundle), "--video", f"{good},{good}", "--input-ids", f"1,{IMAGE},2")
    assert r.returncode != 0 and "is for an image but the input in its place is a video" in r.stderr
    r = _cli("generate", str(bundles("base")), "--image", str(good), "--input-ids", "1,2,3")
    assert r.returncode != 0 and "no vision tower" in r.stderr and "Traceback" not in r.stderr


# ---- the canonical torch tower and ExecuTorch's vision_encoder ---------------------------------------------
def _tower_cases(ckpt: Path):
    from deltaship.models.source import load_source
    from deltaship.models.vision import VisionWeights, encoder_inputs

    spec = _spec(ckpt)
    weights = VisionWeights(load_source(str(ckpt)).weights.files, spec, str(ckpt))
    pre = Preprocessor.from_config(PRE)
    images = [preprocess_image(_image(h, w, seed=h), pre) for h, w in ((96, 160), (64, 64), (256, 256))]
    return spec, weights, [(im.grid, encoder_inputs(spec, im)) for im in images]


def _hf_tower(hf_model, grid, inputs):
    import torch

    with torch.no_grad():
        px = torch.from_numpy(inputs["pixel_values"])
        return hf_model.model.visual(px, grid_thw=torch.tensor([grid])).pooler_output.numpy()


def test_torch_tower_matches_transformers(vl_checkpoint, hf_model):
    """The canonical module (patch embed as a Linear, host grid tensors) against transformers' tower."""
    import torch

    from deltaship.models.qwen3_5_vision import load_tower

    spec, weights, cases = _tower_cases(vl_checkpoint)
    tower = load_tower(spec, weights)
    for grid, inputs in cases:
        with torch.no_grad():
            got = tower(**{k: torch.from_numpy(v) for k, v in inputs.items()}).numpy()
        np.testing.assert_allclose(got, _hf_tower(hf_model, grid, inputs), atol=1e-5)


@pytest.fixture(scope="module")
def et_vl_bundle(vl_checkpoint, tmp_path_factory) -> tuple[Path, dict]:
    """An ExecuTorch bundle with --vision (verified at export, as the ONNX one), and its manifest."""
    from deltaship.compile import export

    out = tmp_path_factory.mktemp("et-vl") / "bundle"
    m = export(str(vl_checkpoint), out, target="executorch", max_context=128, prefill_chunk=8, progress=False,
               vision=True, fidelity=False)  # fmt: skip
    return out, m


@pytest.mark.slow
def test_executorch_vision_encoder(et_vl_bundle, vl_checkpoint, hf_model):
    """The bundle's vision.pte method `vision_encoder`, dynamic patch count: three image sizes through one program,
    up to the bound the preprocessor allows (256 patches, the largest image's)."""
    import torch
    from executorch.runtime import Runtime

    from deltaship.lowering.executorch.vision import INPUTS, METHOD

    out, m = et_vl_bundle
    spec, _, cases = _tower_cases(vl_checkpoint)
    assert (
        m["vision"]["max_image_tokens"] * spec.merge_unit
        == 256
        == max(inputs[INPUTS[0]].shape[0] for _, inputs in cases)
    )
    assert m["vision"]["graphs"]["vision"] == METHOD
    method = Runtime.get().load_program(str(out / m["vision"]["graphs"]["program"])).load_method(METHOD)
    for grid, inputs in cases:
        got = method.execute([torch.from_numpy(inputs[n]) for n in INPUTS])[0].numpy()
        np.testing.assert_allclose(got, _hf_tower(hf_model, grid, inputs), atol=1e-4)


@pytest.mark.slow
def test_executorch_bundle_images_match_transformers(et_vl_bundle, hf_model):
    """An ExecuTorch bundle with --vision: vision.pte's vision_encoder, token_embedding and text_decoder give
    transformers' greedy tokens for two images, with prefill chunk boundaries inside the second image's span."""
    from deltaship.runtimes.vision import ExecuTorchMultimodal
    from deltaship.targets import open_bundle, open_multimodal

    out, m = et_vl_bundle
    assert m["vision"]["verification"]["status"] == "passed"  # checked at export, as the ONNX bundle
    assert {"vision.pte", "decoder_mm.pte", "model.pte"} <= set(m["files"])
    mm = open_multimodal(open_bundle(out))
    assert isinstance(mm, ExecuTorchMultimodal)
    images = [_image(64, 96, seed=0), _image(160, 96, seed=1)]
    ims = [preprocess_image(im, mm.pre) for im in images]
    prompt = [5, START, IMAGE, END, 6, START, IMAGE, END, 7, 8]
    gen = mm.generate(prompt, ims, 16, keep_logits=True, stop_at_eos=False)
    ref, ref_logits = _reference(hf_model, gen.input_ids, images, 16)
    assert len(set(ref)) > 3 and gen.output_ids == ref
    assert np.abs(np.stack(gen.logits) - ref_logits).max() / ref_logits.std() < 1e-3
    text = open_bundle(out).generate([5, 6, 7], 8).output_ids  # model.pte: the text-only path
    assert open_multimodal(open_bundle(out)).generate([5, 6, 7], [], 8).output_ids == text


@pytest.fixture
def tiny_vl_preset(monkeypatch):
    """A random-weights preset at the tiny text shape with a two-block tower (the published presets' code path,
    at a size a test can export)."""
    from deltaship.models.presets import _TINY, PRESETS, Preset, _vision

    markers = {"image_token_id": 259, "video_token_id": 260, "vision_start_token_id": 261, "vision_end_token_id": 262}
    cfg = {**_TINY, "vision_config": _vision(2, 64, 4, 128, _TINY["hidden_size"]), **markers}
    monkeypatch.setitem(PRESETS, "tiny-vl-test", Preset("tiny-vl-test", cfg, 256, "test preset"))
    return "tiny-vl-test"


def test_preset_reference_holds_the_preset_tower(tiny_vl_preset):
    """The transformers reference built for a random preset (verification's oracle) runs the same tower as
    the canonical module on the preset's random vision weights."""
    import torch

    from deltaship.check.vision import preset_reference
    from deltaship.models.qwen3_5_vision import load_tower
    from deltaship.models.source import load_source
    from deltaship.models.vision import VisionWeights, encoder_inputs, vision_spec_of

    src = load_source(tiny_vl_preset)
    vs = vision_spec_of(src)
    tower = load_tower(vs, VisionWeights(src.weights.files, vs, tiny_vl_preset))
    ref = preset_reference(src)
    im = preprocess_image(_image(64, 96, seed=3), Preprocessor.from_config(PRE))
    inputs = encoder_inputs(vs, im)
    with torch.no_grad():
        got = tower(**{k: torch.from_numpy(v) for k, v in inputs.items()}).numpy()
    np.testing.assert_allclose(got, _hf_tower(ref, im.grid, inputs), atol=1e-5)
    assert float(np.abs(got).std()) > 1e-3  # random weights, not a degenerate tower


@pytest.mark.slow
def test_random_preset_exports_and_verifies_with_vision(tiny_vl_preset, tmp_path):
    """export --vision from a random-weights preset (no checkpoint directory): preprocessor synthesized, the
    image prompts verified against transformers holding the same random weights."""
    from deltaship.compile import export

    manifest = export(tiny_vl_preset, tmp_path / "b", vision=True, progress=False, fidelity=False)
    assert manifest["vision"]["verification"]["status"] == "passed"
    pre = json.loads((tmp_path / "b" / "preprocessor_config.json").read_text())
    assert (pre["patch_size"], pre["merge_size"], pre["temporal_patch_size"]) == (16, 2, 2)
    assert pre["image_mean"] == pre["image_std"] == [0.5] * 3


# ---- profiling: image encode, memory and image + question TTFT per image size ------------------------------
def test_profile_image_sizes(vl_bundle, tmp_path):
    """`deltaship profile` on a --vision bundle adds per-image-size records (one fresh worker per size) to the
    JSON, the text table and the HTML report; a page-sized image is resized into the bundle's limit first."""
    from deltaship.profiling.profile import profile
    from deltaship.profiling.report import format_results
    from deltaship.profiling.vision import check_sizes, parse_sizes

    assert parse_sizes("64,96x64,page") == ["64x64", "96x64", "page"] and parse_sizes("none") == []
    with pytest.raises(DeltashipError, match="not an image size"):
        parse_sizes("64x")
    report = tmp_path / "r.html"
    doc = profile(vl_bundle, prompt_lengths=[8], gen=2, contexts=[16], warmups=0, reps=2, min_seconds=0,
                  breakdown=False, image_sizes="64,page", report=report, json_out=tmp_path / "p.json")  # fmt: skip
    rows = {(r["metric"], r.get("image")): r for r in doc["results"]}
    assert not any(r.get("status") == "died" for r in doc["results"]), doc["results"]
    small, page = rows[("image_encode_s", "64x64")], rows[("image_encode_s", "page")]
    assert small["image_tokens"] == 4 and small["resized"] == [64, 64] and small["n"] >= 2
    assert page["image_tokens"] <= 64 and page["resized"] != [2200, 1700]  # resized into max_pixels
    for name in ("64x64", "page"):
        ttft, enc = rows[("image_ttft_s", name)], rows[("image_encode_s", name)]
        # TTFT = preprocess + encode + prefill, but measured in calls of its own: comparing the two medians is a timing
        # race under load (reps=2), so only that both were measured
        assert ttft["median"] > 0 and enc["median"] > 0 and ttft["n"] >= 2 and enc["n"] >= 2
        assert rows[("image_peak_rss_bytes", name)]["median"] >= rows[("image_rss_growth_bytes", name)]["median"]
    assert ("prefill_tok_s", None) in rows  # the text records are still there
    text = format_results(doc)
    assert "image_ttft_ms" in text and "img page" in text  # the table names metrics in the unit it shows
    page_html = report.read_text()
    assert "images.png" in page_html and "image_encode_ms (img 64x64 (4 tok))" in page_html
    assert json.loads((tmp_path / "p.json").read_text())["results"] == json.loads(json.dumps(doc["results"]))
    # a text-only bundle: none by default, refused when asked for
    with pytest.raises(DeltashipError, match="no vision tower"):
        check_sizes({}, "224", "host", "cpu", None)
    assert check_sizes({}, None, "host", "cpu", None) == []
