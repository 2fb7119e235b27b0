"""The trained built-in model and `deltaship eval`: quality that random weights could not fake."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from train_tiny import corpus_files, is_heldout  # noqa: E402  (the training script, outside the package)

from deltaship.check.evaluate import HELDOUT, evaluate
from deltaship.compile import export
from deltaship.models.source import load_source


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    return {
        p: (out / p, export("qwen3.5-tiny", out / p, precision=p, max_context=512, progress=False))
        for p in ("fp32", "int4")
    }


def test_preset_ships_trained_weights():
    src = load_source("qwen3.5-tiny")
    assert src.kind == "preset" and src.path is not None and (src.path / "model.safetensors").is_file()
    meta = json.loads((src.path / "training.json").read_text())
    assert meta["final_heldout_loss_nats_per_byte"] < 1.2  # random bytes would be ln(256) = 5.5
    assert src.spec.linear_num_value_heads > src.spec.linear_num_key_heads  # the Hv > Hk variant
    assert src.spec.layer_types.count("full_attention") * 3 == src.spec.layer_types.count("linear_attention")
    assert HELDOUT.is_file() and len(HELDOUT.read_bytes()) == 32768


def test_heldout_split_is_deterministic_and_disjoint():
    files = corpus_files()
    held = [f for f in files if is_heldout(f)]
    assert 0 < len(held) < 0.05 * len(files)
    assert held == [f for f in corpus_files() if is_heldout(f)]


def test_eval_contract_and_fp32_fidelity(tiny):
    path, manifest = tiny["fp32"]
    res = evaluate(path, tokens=256)
    assert {"perplexity", "reference_perplexity", "top1_agreement", "kl_divergence", "tokens"} <= set(res)
    assert res["tokens"] == 255 and "held-out" in res["text"]
    assert res["perplexity"] < 8  # a trained byte model on Python source; the random-weight one is ~270
    assert res["perplexity"] == pytest.approx(res["reference_perplexity"], rel=1e-4)
    assert res["top1_agreement"] == 1.0 and res["kl_divergence"] < 1e-6
    f = manifest["fidelity"]  # recorded at export
    assert f["perplexity"] == pytest.approx(res["perplexity"], rel=0.2) and f["tokens"] == 255


def test_int4_costs_something_but_not_much(tiny):
    res = evaluate(tiny["int4"][0], tokens=256)
    assert 0 < res["kl_divergence"] < 0.2
    assert res["perplexity"] < 1.3 * res["reference_perplexity"]
    assert res["top1_agreement"] > 0.8


def test_eval_refuses_a_different_model(tiny, checkpoints):
    from deltaship.errors import DeltashipError

    with pytest.raises(DeltashipError, match="not the model this bundle was exported from"):
        evaluate(tiny["fp32"][0], model=str(checkpoints["base"]))


def test_generate_def_prints_python_like_text(tiny):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "deltaship.cli",
            "generate",
            str(tiny["fp32"][0]),
            "--prompt",
            "def ",
            "--max-new-tokens",
            "48",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    text = json.loads(r.stdout)["text"]
    assert text.isascii() and ("_" in text or "(" in text)
    # sampled continuations look like code: indentation, calls, assignments, colons
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "deltaship.cli",
            "generate",
            str(tiny["fp32"][0]),
            "--prompt",
            "def read(self):\n",
            "--max-new-tokens",
            "160",
            "--temperature",
            "0.6",
            "--top-p",
            "0.9",
            "--seed",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    text = json.loads(r.stdout)["text"]
    assert sum(text.count(c) for c in "():=.") >= 5 and "    " in text
