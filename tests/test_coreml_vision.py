"""Core ML vision encoder (issue 18, first piece): the tower as fixed-shape functions vision_N with a padding
mask, evaluated op by op on Linux against transformers' own tower."""

from __future__ import annotations

import numpy as np
import pytest
from test_vision import _hf_tower, _tower_cases, hf_model, vl_checkpoint  # noqa: F401  (module fixtures)

from deltaship.errors import DeltashipError


@pytest.mark.slow  # Core ML conversion and op-by-op evaluation
def test_coreml_vision_encoder_matches_transformers(vl_checkpoint, hf_model, tmp_path):  # noqa: F811
    """Two enumerated patch counts in one package: a 6x10 grid (60 patches, padded to 64), a 4x4 grid (16, padded
    to 64) and a 16x16 grid (256, exact); the padding is masked out of attention and dropped after the merger."""
    import coremltools as ct

    from deltaship.export.coreml.mil_eval import Interpreter, load_program
    from deltaship.export.coreml.vision import encode, lower_vision_package, padded_inputs

    spec, weights, cases = _tower_cases(vl_checkpoint)
    counts = (64, 256)
    info = lower_vision_package(spec, weights, tmp_path / "vision.mlpackage", counts)
    assert info["functions"] == {"64": "vision_64", "256": "vision_256"}
    mlspec = ct.models.MLModel(str(tmp_path / "vision.mlpackage"), skip_model_load=True).get_spec()
    assert sorted(f.name for f in mlspec.description.functions) == ["vision_256", "vision_64"]
    interp = Interpreter(load_program(tmp_path / "vision.mlpackage"))
    padded = 0
    for grid, inputs in cases:
        got = encode(interp, inputs, counts)
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
    from deltaship.export.coreml.vision import check_patch_counts, padded_inputs

    with pytest.raises(DeltashipError, match="multiple of 4"):
        check_patch_counts((64, 30))
    with pytest.raises(DeltashipError, match="over the largest"):
        padded_inputs({"pixel_values": np.zeros((300, 8), np.float32)}, (64, 256))
