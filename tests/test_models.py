"""Model spec, weights and presets: reading config.json and safetensors, and every way they can be wrong."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers import set_json, text_config

from deltaship.errors import DeltashipError
from deltaship.models.presets import PRESETS
from deltaship.models.safetensors_io import SafetensorsFile, write_safetensors
from deltaship.models.source import load_source
from deltaship.models.spec import ModelSpec
from deltaship.models.weights import RandomWeights, expected_tensors


def _copy(checkpoints, name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(checkpoints[name], dst)
    return dst


def test_text_and_multimodal_specs_agree(checkpoints):
    text = load_source(str(checkpoints["base"])).spec
    mm = load_source(str(checkpoints["multimodal"]))
    assert mm.spec.architecture == "Qwen3_5ForConditionalGeneration"
    for field in ("hidden_size", "layer_types", "linear_num_value_heads", "vocab_size", "head_dim"):
        assert getattr(mm.spec, field) == getattr(text, field)
    assert mm.ignored["vision encoder"] > 0 and mm.ignored["multi-token-prediction head"] == 2
    assert any("vision" in n for n in mm.notes()) and any("multi-token" in n for n in mm.notes())


def test_layer_types_are_read_not_assumed(checkpoints):
    spec = load_source(str(checkpoints["odd_heads"])).spec
    assert spec.layer_types[0] == "full_attention" and spec.attention_layers == (0,)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_presets_match_published_sizes(preset):
    spec = PRESETS[preset].spec()
    published = {
        "qwen3.5-0.8b": (1024, 24, 18, 6, 16, True),
        "qwen3.5-2b": (2048, 24, 18, 6, 16, True),
        "qwen3.5-4b": (2560, 32, 24, 8, 32, True),
        "qwen3.5-9b": (4096, 32, 24, 8, 32, False),
    }
    if preset in published:
        h, n, dn, at, hv, tied = published[preset]
        assert (
            spec.hidden_size,
            spec.num_layers,
            len(spec.deltanet_layers),
            len(spec.attention_layers),
            spec.linear_num_value_heads,
            spec.tie_word_embeddings,
        ) == (h, n, dn, at, hv, tied)
        assert spec.vocab_size == 248320 and spec.head_dim == 256 and spec.rotary_dim == 64
    st = spec.state_bytes(4096, kv_bytes_per_elem=2)
    if preset in ("qwen3.5-0.8b", "qwen3.5-2b"):
        assert st["deltanet_recurrent"] == 18 * 16 * 128 * 128 * 4  # 18 MiB, as QWEN35.md says
        assert st["kv_cache"] // 4096 == 12 * 1024  # 12 KiB per token at 16 bits


@pytest.mark.parametrize("preset", list(PRESETS))
def test_parameter_count_equals_transformers(preset):
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from deltaship.models.qwen3_5 import hf_config

    spec = PRESETS[preset].spec()
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**hf_config(spec)))
    assert spec.parameter_count()["total"] == sum(p.numel() for p in model.parameters())  # tied counted once


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda c: c.pop("hidden_size"), "'hidden_size' is missing"),
        (lambda c: c.update(model_type="llama"), "model_type 'llama' is not supported"),
        (lambda c: c.update(layer_types=["linear_attention"]), "layer_types has 1 entries"),
        (lambda c: c.update(num_attention_heads=3), "3 query heads are not a multiple"),
        (lambda c: c.update(linear_num_value_heads=3), "not a multiple of its 2 key heads"),
        (lambda c: c.update(hidden_size="64"), "'hidden_size' must be a positive integer"),
        (
            lambda c: c.update(layer_types=["linear_attention", "mamba", "linear_attention", "full_attention"]),
            "unknown layer kind",
        ),
    ],
)
def test_bad_configs_name_the_problem(mutate, message):
    cfg = dict(text_config("base"), model_type="qwen3_5_text")
    mutate(cfg)
    with pytest.raises(DeltashipError, match=message):
        ModelSpec.from_config(cfg)


def test_malformed_and_missing_config(checkpoints, tmp_path):
    d = _copy(checkpoints, "base", tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(DeltashipError, match="not valid JSON"):
        load_source(str(d))
    (d / "config.json").unlink()
    with pytest.raises(DeltashipError, match="no config.json"):
        load_source(str(d))


def test_unknown_model_or_preset():
    with pytest.raises(DeltashipError, match="neither a preset, an existing directory nor a Hub id"):
        load_source("qwen3.5-7b")


def _rewrite(path, edit):
    sf = SafetensorsFile(path)
    tensors = {n: sf.read(n) for n in sf.entries}
    del sf
    edit(tensors)
    write_safetensors(path, list(tensors.items()))


def test_missing_extra_and_misshapen_tensors_are_named(checkpoints, tmp_path):
    d = _copy(checkpoints, "base", tmp_path)
    path = d / "model.safetensors"

    def edit(t):
        del t["model.layers.1.linear_attn.A_log"]
        t["model.layers.0.mlp.extra.weight"] = np.zeros(3, np.float32)
        t["model.layers.3.self_attn.k_proj.weight"] = np.zeros((5, 64), np.float32)

    _rewrite(path, edit)
    with pytest.raises(DeltashipError) as e:
        load_source(str(d))
    msg = str(e.value)
    assert "model.layers.1.linear_attn.A_log" in msg and "missing 1" in msg
    assert "model.layers.0.mlp.extra.weight" in msg
    assert "model.layers.3.self_attn.k_proj.weight: [5, 64] (expected [32, 64])" in msg


def test_truncated_safetensors_is_refused(checkpoints, tmp_path):
    d = _copy(checkpoints, "base", tmp_path)
    path = d / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(DeltashipError, match="truncated safetensors file"):
        load_source(str(d))
    path.write_bytes(data[:5])
    with pytest.raises(DeltashipError, match="truncated"):
        load_source(str(d))


def test_pickled_checkpoints_are_never_loaded(checkpoints, tmp_path):
    d = _copy(checkpoints, "base", tmp_path)
    (d / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    # a real pickle that would create `marker` if anything unpickled it
    import pickle

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (d / "pytorch_model.bin").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(DeltashipError, match="never loads pickles"):
        load_source(str(d))
    assert not marker.exists()


def test_sharded_checkpoint_with_index(checkpoints, tmp_path):
    d = _copy(checkpoints, "grouped_values", tmp_path)
    sf = SafetensorsFile(d / "model.safetensors")
    names = sorted(sf.entries)
    tensors = {n: sf.read(n) for n in names}
    del sf
    (d / "model.safetensors").unlink()
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, part in shards.items():
        write_safetensors(d / fname, [(n, tensors[n]) for n in part], dtype="BF16")
    index = {"weight_map": {n: f for f, part in shards.items() for n in part}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    src = load_source(str(d))
    name = "model.layers.0.linear_attn.in_proj_qkv.weight"
    w = src.weights.read(name)
    # BF16 storage: equal to the original up to bf16 rounding
    np.testing.assert_allclose(w, tensors[name], rtol=2**-8, atol=0)
    np.testing.assert_array_equal(src.weights.read(name, slice(3, 9)), w[3:9])
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(DeltashipError, match="shard\\(s\\) that are missing: model-00002-of-00002"):
        load_source(str(d))


def test_random_weights_are_deterministic_and_row_streamable():
    spec = PRESETS["qwen3.5-tiny"].spec()
    a, b = RandomWeights(spec, seed=3), RandomWeights(spec, seed=3)
    a.ROW_BLOCK = b.ROW_BLOCK = 64  # exercise block boundaries on a small tensor
    name = "model.embed_tokens.weight"
    full = a.read(name)
    assert full.shape == expected_tensors(spec)[name]
    np.testing.assert_array_equal(full, b.read(name))
    np.testing.assert_array_equal(a.read(name, slice(50, 140)), full[50:140])
    assert not np.array_equal(full, RandomWeights(spec, seed=4).read(name))


def test_unsupported_rope_and_activation(tmp_path, checkpoints):
    d = _copy(checkpoints, "base", tmp_path)
    set_json(d / "config.json", "hidden_act", "gelu")
    with pytest.raises(DeltashipError, match="hidden_act 'gelu' is not supported"):
        load_source(str(d))
