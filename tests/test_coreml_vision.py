"""Core ML images (issue 18): the vision tower as fixed-shape functions vision_N with a padding mask, and the
bundle's multimodal.mlpackage (vision, token embedding, M-RoPE decoder), evaluated op by op on Linux against
transformers."""

from __future__ import annotations

import numpy as np
import pytest
from test_vision import (  # noqa: F401  (module fixtures)
    END,
    IMAGE,
    START,
    VIDEO,
    _hf_tower,
    _image,
    _reference,
    _tower_cases,
    _video_reference,
    hf_model,
    tiny_vl_preset,
    vl_checkpoint,
)

from deltaship.errors import DeltashipError


@pytest.mark.slow  # Core ML conversion and op-by-op evaluation
def test_coreml_vision_encoder_matches_transformers(vl_checkpoint, hf_model, tmp_path):  # noqa: F811
    """Two enumerated patch counts in one package: a 6x10 grid (60 patches, padded to 64), a 4x4 grid (16, padded
    to 64) and a 16x16 grid (256, exact); the padding is masked out of attention and dropped after the merger."""
    import coremltools as ct

    from deltaship.bundle.vision_io import padded_inputs
    from deltaship.lowering.coreml.vision import lower_vision_package
    from deltaship.runtimes.mil_eval import Interpreter, load_program
    from deltaship.runtimes.vision import encode_padded

    spec, weights, cases = _tower_cases(vl_checkpoint)
    counts = (64, 256)
    info = lower_vision_package(spec, weights, tmp_path / "vision.mlpackage", counts)
    assert info["functions"] == {"64": "vision_64", "256": "vision_256"}
    mlspec = ct.models.MLModel(str(tmp_path / "vision.mlpackage"), skip_model_load=True).get_spec()
    assert sorted(f.name for f in mlspec.description.functions) == ["vision_256", "vision_64"]
    interp = Interpreter(load_program(tmp_path / "vision.mlpackage"))
    padded = 0
    for grid, inputs in cases:
        got = encode_padded(interp, inputs, counts)
        want = _hf_tower(hf_model, grid, inputs)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-4)
        padded += padded_inputs(inputs, counts)[1]["key_bias"].min() < 0
    assert padded == 2  # two of the three images ran padded
    # the mask does the work: without it the padded image's features change
    fname, feeds = padded_inputs(cases[0][1], counts)
    feeds["key_bias"][:] = 0
    unmasked = np.asarray(interp.run(fname, feeds, {})["image_features"])[:15]
    assert np.abs(unmasked - _hf_tower(hf_model, *cases[0])).max() > 1e-3


def test_coreml_vision_refusals():
    from deltaship.bundle.vision_io import check_patch_counts, padded_inputs

    with pytest.raises(DeltashipError, match="multiple of 4"):
        check_patch_counts((64, 30))
    with pytest.raises(DeltashipError, match="over the largest"):
        padded_inputs({"pixel_values": np.zeros((300, 8), np.float32)}, (64, 256))


@pytest.mark.slow
def test_coreml_bundle_images_match_transformers(vl_checkpoint, hf_model, tmp_path):  # noqa: F811
    """A Core ML bundle with --vision: multimodal.mlpackage's vision_N, token_embedding_T and text_decoder_T give
    transformers' greedy tokens for two images (the second with prefill chunk boundaries inside its span, both
    padded to an enumerated patch count) and for a 2-frame video; the text path stays model.mlpackage."""

    from deltaship.compile import export
    from deltaship.models.vision import preprocess_frames, preprocess_image
    from deltaship.runtimes.vision import CoreMLMultimodal
    from deltaship.targets import open_bundle, open_multimodal

    out = tmp_path / "cm"
    m = export(str(vl_checkpoint), out, target="coreml", max_context=128, prefill_chunk=8, progress=False,
               vision=True, fidelity=False)  # fmt: skip
    v = m["vision"]
    assert v["verification"]["status"] == "passed"  # checked at export, as the ONNX and ExecuTorch bundles
    assert v["functions"]["decoder"] == {"1": "text_decoder_1", "8": "text_decoder_8"}
    assert any(f.startswith("multimodal.mlpackage/") for f in m["files"]) and "model.mlpackage" in m["entry"]
    mm = open_multimodal(open_bundle(out))
    assert isinstance(mm, CoreMLMultimodal)
    images = [_image(64, 96, seed=0), _image(160, 96, seed=1)]
    ims = [preprocess_image(im, mm.pre) for im in images]
    prompt = [5, START, IMAGE, END, 6, START, IMAGE, END, 7, 8]
    gen = mm.generate(prompt, ims, 16, keep_logits=True, stop_at_eos=False)
    second = gen.input_ids.index(IMAGE) + 6 + 3  # the second span: 6 tokens of the first image, END, 6, START
    assert gen.input_ids[second] == IMAGE and second % 8 and (second + 15) // 8 > second // 8 + 1
    ref, ref_logits = _reference(hf_model, gen.input_ids, images, 16)
    assert len(set(ref)) > 3 and gen.output_ids == ref
    assert np.abs(np.stack(gen.logits) - ref_logits).max() / ref_logits.std() < 1e-3
    # a 2-frame video (grid t = 1)
    video = preprocess_frames([_image(64, 96, seed=5), _image(64, 96, seed=6)], mm.pre)
    gen = mm.generate([5, START, VIDEO, END, 7, 8], [video], 16, keep_logits=True, stop_at_eos=False)
    ref, _ = _video_reference(hf_model, gen.input_ids, video, 16)
    assert len(set(ref)) > 3 and gen.output_ids == ref
    text = open_bundle(out).generate([5, 6, 7], 8).output_ids  # model.mlpackage: the text-only path
    assert open_multimodal(open_bundle(out)).generate([5, 6, 7], [], 8).output_ids == text


@pytest.mark.slow
def test_coreml_random_preset_with_other_vision_shapes_verifies(tiny_vl_preset, tmp_path):  # noqa: F811
    """Other vision shapes (a two-block 64-wide tower with 4 heads, the published preprocessor): export --vision
    for Core ML verifies its image prompts against transformers holding the same random weights; the image
    limit (1,024 merged tokens) gives the enumerated patch counts up to 4,096."""
    from deltaship.compile import export

    m = export(tiny_vl_preset, tmp_path / "b", target="coreml", max_context=128, prefill_chunk=8, vision=True,
               progress=False, fidelity=False)  # fmt: skip
    v = m["vision"]
    assert v["verification"]["status"] == "passed"
    assert v["functions"]["vision"] == {str(n): f"vision_{n}" for n in (64, 256, 1024, 4096)}
    assert v["max_image_tokens"] == 1024
