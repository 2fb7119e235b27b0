"""The Hugging Face way in: Hub ids from the local cache, the transformers-style model class, optimum-cli."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import write_checkpoint

from deltaship.errors import DeltashipError

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    return write_checkpoint("base", tmp_path_factory.mktemp("hub-src") / "ckpt", seed=3)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache of our own: HF_HOME and HF_HUB_CACHE point into tmp_path."""
    cache = tmp_path / "hf-home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(cache.parent))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    return cache


def put_in_cache(cache: Path, repo_id: str, ckpt: Path, commit: str = COMMIT, ref: str | None = "main") -> Path:
    """Lay a checkpoint out as huggingface_hub does: models--org--name/snapshots/<commit>/, refs/<ref> = commit."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    shutil.copytree(ckpt, snapshot)
    if ref is not None:
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot


def export_tiny(model: str, out: Path) -> dict:
    from deltaship.export import export
    return export(model, out, target="onnx", precision="fp32", max_context=64, prefill_chunk=8, verify=False,
                  progress=False)


def test_hub_id_exports_from_the_cache_with_repo_and_commit(hf_cache, tiny_ckpt, tmp_path):
    put_in_cache(hf_cache, "acme/tiny-qwen", tiny_ckpt)
    manifest = export_tiny("acme/tiny-qwen", tmp_path / "b")
    assert manifest["model_card"]["source_repo"] == "acme/tiny-qwen"
    assert manifest["model_card"]["revision"] == COMMIT
    assert manifest["source"]["model"] == f"acme/tiny-qwen@{COMMIT}"  # loadable again, pinned to the commit
    on_disk = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert on_disk["model_card"]["revision"] == COMMIT


def test_hub_id_at_a_commit_picks_that_snapshot(hf_cache, tiny_ckpt, tmp_path):
    put_in_cache(hf_cache, "acme/tiny-qwen", tiny_ckpt, commit=COMMIT)
    other = write_checkpoint("base", tmp_path / "other", seed=11)
    put_in_cache(hf_cache, "acme/tiny-qwen", other, commit=OTHER_COMMIT, ref=None)  # not main
    from deltaship.models.source import load_source
    pinned, main = load_source(f"acme/tiny-qwen@{OTHER_COMMIT}"), load_source("acme/tiny-qwen")
    assert pinned.model_card()["revision"] == OTHER_COMMIT and main.model_card()["revision"] == COMMIT
    assert pinned.fingerprint() != main.fingerprint()  # different weights, not the same snapshot twice
    manifest = export_tiny(f"acme/tiny-qwen@{OTHER_COMMIT}", tmp_path / "b")
    assert (manifest["model_card"]["source_repo"], manifest["model_card"]["revision"]) == ("acme/tiny-qwen",
                                                                                           OTHER_COMMIT)


def test_hub_id_at_a_branch_resolves_to_its_commit(hf_cache, tiny_ckpt):
    put_in_cache(hf_cache, "acme/tiny-qwen", tiny_ckpt, commit=OTHER_COMMIT, ref="dev")
    from deltaship.models.source import load_source
    assert load_source("acme/tiny-qwen@dev").model_card()["revision"] == OTHER_COMMIT


def test_unknown_hub_id_offline_names_cache_and_command(hf_cache, tmp_path):
    with pytest.raises(DeltashipError) as e:
        export_tiny("acme/not-there", tmp_path / "b")
    assert "acme/not-there" in e.value.message and str(hf_cache) in e.value.message
    assert "download acme/not-there" in e.value.fix and "--allow-download" in e.value.fix
    assert not (tmp_path / "b").exists()


def test_absent_revision_lists_the_cached_ones(hf_cache, tiny_ckpt, tmp_path):
    put_in_cache(hf_cache, "acme/tiny-qwen", tiny_ckpt)
    with pytest.raises(DeltashipError) as e:
        export_tiny("acme/tiny-qwen@v9", tmp_path / "b")
    assert "'v9'" in e.value.message and COMMIT in e.value.message and "main" in e.value.message
    assert "download acme/tiny-qwen --revision v9" in e.value.fix


def test_hub_checkpoint_of_another_architecture_is_refused(hf_cache, tmp_path):
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                   "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100}))
    put_in_cache(hf_cache, "acme/tiny-llama", llama)
    with pytest.raises(DeltashipError) as e:
        export_tiny("acme/tiny-llama", tmp_path / "b")
    assert "acme/tiny-llama" in e.value.message and "'llama'" in e.value.message and "qwen3_5" in e.value.message
    assert "Qwen3.5" in e.value.fix


def test_download_is_refused_when_hf_hub_offline_is_set(hf_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from deltaship.models.source import load_source
    with pytest.raises(DeltashipError) as e:
        load_source("acme/not-there", allow_download=True)
    assert "HF_HUB_OFFLINE" in e.value.message and "download acme/not-there" in e.value.fix


def test_a_local_directory_wins_over_a_hub_id_and_nonsense_is_named(tmp_path, monkeypatch, tiny_ckpt):
    from deltaship.models.source import load_source
    monkeypatch.chdir(tiny_ckpt.parent.parent)
    src = load_source(f"{tiny_ckpt.parent.name}/{tiny_ckpt.name}")  # relative path shaped like org/name
    assert src.kind == "checkpoint" and src.model_card()["source_repo"] is None
    with pytest.raises(DeltashipError) as e:
        load_source("not a/model id!")
    assert "Hub id" in e.value.message
