"""Core ML target: the Linux evaluator's own op implementations, the package contract, the LM-head split."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import reference, reference_greedy, write_checkpoint

from deltaship.errors import DeltashipError
from deltaship.quant import quantize_blocks
from deltaship.runtimes import mil_eval
from deltaship.targets import open_bundle


# ---- the evaluator's own implementations, against torch -------------------------------------------
def test_silu_linear_matmul_against_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g)
    np.testing.assert_allclose(mil_eval.silu(x.numpy()), F.silu(x).numpy(), rtol=1e-6, atol=1e-6)
    h = x.half().numpy()
    np.testing.assert_allclose(mil_eval.silu(h).astype(np.float32), F.silu(x.half().float()).numpy(), atol=2e-3)
    w, b = torch.randn(7, 16, generator=g), torch.randn(7, generator=g)
    np.testing.assert_allclose(
        mil_eval.linear(x.numpy(), w.numpy(), b.numpy(), np.float32), F.linear(x, w, b).numpy(), rtol=1e-5, atol=1e-5
    )
    a, c = torch.randn(2, 4, 6, generator=g), torch.randn(2, 5, 6, generator=g)
    np.testing.assert_allclose(
        mil_eval.matmul(a.numpy(), c.numpy(), False, True, np.float32),
        (a @ c.transpose(1, 2)).numpy(),
        rtol=1e-5,
        atol=1e-5,
    )
    np.testing.assert_allclose(
        mil_eval.matmul(a.numpy(), a.numpy(), True, False, np.float32),
        (a.transpose(1, 2) @ a).numpy(),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("bits,block", [(4, 32), (8, 48)])
def test_blockwise_shift_scale_against_coremltools_and_torch(bits, block):
    from coremltools.converters.mil.mil.ops.defs.iOS18.compression import constexpr_blockwise_shift_scale

    w = torch.randn(6, 96, generator=torch.Generator().manual_seed(1)).numpy()
    codes, scales = quantize_blocks(w, bits, block)
    data = (codes.astype(np.int16) - (1 << (bits - 1))).astype(np.int8).reshape(6, -1)
    ours = mil_eval.blockwise_shift_scale(data, scales.astype(np.float16), None)
    theirs = constexpr_blockwise_shift_scale.decompress(data, scales.astype(np.float16), None)
    np.testing.assert_array_equal(ours, theirs)
    # and it is a faithful rounding of the original weights: half a step, except that the far side of
    # each block's extreme may be clipped by up to one step (the scale carries the extreme's sign)
    step = np.repeat(np.abs(scales), block, axis=1)
    err = np.abs(ours.astype(np.float32) - w)
    assert (err <= step * 1.01 + 1e-3).all() and (err / step).mean() < 0.3


def test_states_are_updated_in_place_by_the_interpreter(tmp_path):
    """A two-function program with a shared state: read_state / coreml_update_state semantics."""
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import Function, Program, types

    prog = Program()
    for name, scale in (("prefill", 2.0), ("decode", 3.0)):
        with Function(
            {"x": mb.placeholder((1, 4), dtype=types.fp16), "acc": mb.state_tensor_placeholder((1, 4), types.fp16)},
            opset_version=ct.target.iOS18,
        ) as f:
            old = mb.read_state(input=f.inputs["acc"])
            new = mb.add(x=old, y=mb.mul(x=f.inputs["x"], y=np.float16(scale)))
            upd = mb.coreml_update_state(state=f.inputs["acc"], value=new)
            f.set_outputs([mb.identity(x=upd, name="out")])
        prog.add_function(name, f)
    prog.default_function_name = "decode"
    prog.export_as_multifunction = True
    ct.convert(prog, minimum_deployment_target=ct.target.iOS18, skip_model_load=True).save(
        str(tmp_path / "m.mlpackage")
    )
    it = mil_eval.Interpreter(mil_eval.load_program(tmp_path / "m.mlpackage"))
    state = {"acc": np.zeros((1, 4), np.float16)}
    x = np.array([[1, 2, 3, 4]], np.float16)
    it.run("prefill", {"x": x}, state)
    out = it.run("decode", {"x": x}, state)
    np.testing.assert_array_equal(state["acc"], 5 * x)
    np.testing.assert_array_equal(out["out"], 5 * x)


# ---- the package -------------------------------------------------------------------------------
def test_package_contract(bundles):
    path = bundles("grouped_values", "coreml", "fp16")
    m = json.loads((path / "manifest.json").read_text())
    lw = m["lowering"]
    assert lw["spec_check"]["checked"] and lw["spec_check"]["specification_version"] >= 9
    assert set(lw["functions"]) == {"prefill", "decode"} and lw["functions"]["prefill"]["tokens"] == 8
    modes = {s["kind"]: s["mode"] for s in m["states"]}
    assert modes == {
        "deltanet_conv": "io",
        "deltanet_recurrent": "io",
        "kv_cache_key": "state",
        "kv_cache_value": "state",
    }
    assert all(s["dtype"] == "float16" for s in m["states"] if s["mode"] == "state")
    assert any(f.endswith("weight.bin") for f in m["files"])
    assert lw["ane_report"]["ops"] > 0 and "by_op" in lw["ane_report"]
    # the weights are stored once for both functions
    prog = mil_eval.load_program(path / "model.mlpackage")
    assert set(prog.functions) == {"prefill", "decode"}


def test_wide_lm_head_is_split_under_the_ane_limit(tmp_path):
    """A vocabulary over 16384: the head becomes pieces of at most 16384 outputs, and parity holds."""
    ckpt = write_checkpoint("base", tmp_path / "wide", seed=3, vocab_size=20000)
    from deltaship.compile import export

    m = export(
        str(ckpt),
        tmp_path / "b",
        target="coreml",
        precision="fp32",
        max_context=32,
        prefill_chunk=8,
        progress=False,
        fidelity=False,
    )
    assert m["verification"]["status"] == "passed"
    prog = mil_eval.load_program(tmp_path / "b" / "model.mlpackage")
    widths = [op.outputs[0].shape[-1] for op in prog.functions["decode"].operations if op.op_type == "linear"]
    assert max(widths) <= 16384 and sum(w for w in widths if w >= 10000) == 20000


def test_fp32_build_matches_transformers_through_the_saved_program(bundles, checkpoints):
    """End to end through the saved .mlpackage, prompt spanning prefill chunks and decode."""
    s = open_bundle(bundles("odd_heads", "coreml", "fp32"))
    assert "not Core ML" in s.runtime_name()  # on Linux, honest about what ran
    prompt = np.random.default_rng(0).integers(0, 150, 19).tolist()  # 2 prefill calls + 3 decode calls
    toks, rows = reference_greedy(reference(checkpoints["odd_heads"]), prompt, 6)
    gen = s.generate(prompt, 6, stop_at_eos=False, keep_logits=True)
    assert gen.output_ids == toks
    assert np.abs(np.stack(gen.logits) - rows).max() / rows.std() < 1e-3


def test_refusals(tmp_path, checkpoints):
    from deltaship.compile import export

    long_ctx = write_checkpoint("base", tmp_path / "long", seed=4, max_position_embeddings=65536)
    with pytest.raises(DeltashipError, match="prefill chunk must be a power of two"):
        export(
            str(checkpoints["base"]),
            tmp_path / "x",
            target="coreml",
            prefill_chunk=12,
            max_context=64,
            progress=False,
            verify=False,
        )
    with pytest.raises(DeltashipError, match="16384"):
        export(str(long_ctx), tmp_path / "y", target="coreml", max_context=32768, progress=False, verify=False)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_palettized_build_matches_the_values_it_holds(tmp_path, checkpoints):
    """4-bit palettization: look-up tables in the package, and parity against transformers running the
    very values read back from the package."""
    from deltaship.compile import export

    m = export(
        str(checkpoints["base"]),
        tmp_path / "p",
        target="coreml",
        precision="fp16",
        max_context=64,
        prefill_chunk=8,
        progress=False,
        coreml_palettize=4,
        fidelity=False,
    )
    assert "palettization" in m["quantization"]["scheme"]
    prog = mil_eval.load_program(tmp_path / "p" / "model.mlpackage")
    luts = [op for op in prog.functions["decode"].operations if op.op_type == "constexpr_lut_to_dense"]
    names = " ".join(op.name for op in luts)
    assert len(luts) >= 8 and "embedding" in names and "mlp_gate_up" in names  # weights over 2048 elements
    v = m["verification"]
    assert v["status"] == "passed"  # parity against the values read back from the package
    assert v["kl_divergence"] > 1e-4  # and 4-bit tables do cost something against unrounded fp32
    with pytest.raises(DeltashipError, match="needs --precision fp16"):
        export(
            str(checkpoints["base"]),
            tmp_path / "q",
            target="coreml",
            precision="int4",
            max_context=64,
            progress=False,
            coreml_palettize=4,
        )
