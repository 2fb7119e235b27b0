"""The prepack cache (deltaship/runtimes/onnx_prepack.py): a CPU session that maps ONNX Runtime's packed weights from
a graph saved on this machine gives the same logits as one that packs them at load; an entry is built once, keyed
by the bundle, and one that changed after deltaship wrote it is refused, never used or replaced."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from deltaship.errors import DeltashipError
from deltaship.targets import open_bundle

PROMPTS = ([5], [3, 17, 9, 41, 2, 8, 30], list(range(2, 22)))  # 1, 7 and more than the 8-token prefill chunk


@pytest.fixture(scope="module")
def int4(shared_export):
    return shared_export("memory-plan-tiny-onnx-int4", "qwen3.5-tiny", target="onnx", precision="int4", verify=False)


def _logits(session, ids):
    session.reset()
    first = np.array(session.prefill(ids), dtype=np.float32).reshape(-1)
    steps = [first]
    for _ in range(4):  # greedy decode: the packed weights are read on every step
        steps.append(np.array(session.decode(int(np.argmax(steps[-1]))), dtype=np.float32).reshape(-1))
    return np.stack(steps)


def _entries(cache):
    return sorted(p for p in cache.iterdir() if not p.name.startswith("."))


def test_a_cached_session_gives_the_logits_of_one_that_packs_at_load(int4, tmp_path):
    cache = tmp_path / "cache"
    plain = open_bundle(int4, threads=1)
    cached = open_bundle(int4, threads=1, prepack_cache=cache)
    for ids in PROMPTS:
        a, b = _logits(plain, ids), _logits(cached, ids)
        assert a.shape == b.shape and np.abs(a).max() > 0
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-4)
        assert (np.argmax(a, -1) == np.argmax(b, -1)).all()
    (entry,) = _entries(cache)
    assert sorted(p.name for p in entry.iterdir()) == ["entry.json", "model.onnx", "model.onnx.data"]
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temporary directory left behind
    # the packed weights are saved beside the originals: more bytes than the bundle's graph and weights
    saved = sum(p.stat().st_size for p in (entry / "model.onnx", entry / "model.onnx.data"))
    assert saved > sum(p.stat().st_size for p in int4.glob("model.onnx*"))


def test_an_entry_is_built_once_and_reused(int4, tmp_path):
    cache = tmp_path / "cache"
    open_bundle(int4, threads=1, prepack_cache=cache)
    (entry,) = _entries(cache)
    stamp = (entry / "model.onnx.data").stat().st_mtime_ns
    open_bundle(int4, threads=1, prepack_cache=cache)
    assert _entries(cache) == [entry] and (entry / "model.onnx.data").stat().st_mtime_ns == stamp


def test_another_bundle_or_a_rewritten_weight_file_gets_its_own_entry(int4, tmp_path):
    cache = tmp_path / "cache"
    open_bundle(int4, threads=1, prepack_cache=cache)
    copy = tmp_path / "copy"
    shutil.copytree(int4, copy, copy_function=shutil.copy)  # same bytes, new modification times
    open_bundle(copy, threads=1, prepack_cache=cache)
    assert len(_entries(cache)) == 2


@pytest.mark.parametrize(
    "tamper",
    ["data-size", "data-bytes", "model-bytes", "extra-file", "symlink", "meta-key", "outside-location"],
)
def test_an_entry_changed_after_it_was_written_is_refused_and_kept(int4, tmp_path, tamper):
    cache = tmp_path / "cache"
    open_bundle(int4, threads=1, prepack_cache=cache)
    (entry,) = _entries(cache)
    model, data, meta = entry / "model.onnx", entry / "model.onnx.data", entry / "entry.json"
    if tamper == "data-size":
        with open(data, "ab") as f:
            f.write(b"\0")
    elif tamper == "data-bytes":  # rewritten at the same size: only its hash tells
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 1
        data.write_bytes(bytes(raw))
    elif tamper == "model-bytes":
        raw = bytearray(model.read_bytes())
        raw[-1] ^= 1
        model.write_bytes(bytes(raw))
    elif tamper == "extra-file":
        (entry / "notes.txt").write_text("x")
    elif tamper == "symlink":
        data.unlink()
        data.symlink_to(int4 / "model.onnx")
    elif tamper == "meta-key":
        m = json.loads(meta.read_text())
        m["key"] = "0" * 32
        meta.write_text(json.dumps(m))
    else:  # a graph whose external data points out of the entry, with entry.json rewritten to match it
        raw = model.read_bytes()
        assert raw.count(b"model.onnx.data") > 0
        evil = raw.replace(b"model.onnx.data", b"../../../x.data")  # same length: the protobuf stays valid
        model.write_bytes(evil)
        m = json.loads(meta.read_text())
        from deltaship.files import sha256_file

        m["model_sha256"] = sha256_file(model)
        meta.write_text(json.dumps(m))
    before = sorted((p.name, p.stat().st_size) for p in entry.iterdir())
    with pytest.raises(DeltashipError) as e:
        open_bundle(int4, threads=1, prepack_cache=cache)
    assert str(entry) in str(e.value) and "remove" in e.value.fix
    assert sorted((p.name, p.stat().st_size) for p in entry.iterdir()) == before  # nothing replaced


def test_the_cache_is_for_the_cpu_provider(int4, tmp_path):
    with pytest.raises(DeltashipError, match="CPU"):
        open_bundle(int4, provider="cuda", prepack_cache=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_an_unwritable_cache_directory_is_an_environment_error(int4, tmp_path):
    from deltaship.errors import DeltashipEnvironmentError

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(DeltashipEnvironmentError, match="prepack-cache"):
        open_bundle(int4, threads=1, prepack_cache=blocker / "cache")


def test_generate_and_chat_take_the_cache_and_give_the_same_tokens(int4, tmp_path):
    import subprocess
    import sys

    def run(*args):
        r = subprocess.run(
            [sys.executable, "-m", "deltaship", *args], capture_output=True, text=True, timeout=300, cwd=tmp_path
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    gen = ("generate", str(int4), "--input-ids", "5,9,2,7", "--max-new-tokens", "6", "--json")
    plain = json.loads(run(*gen))["output_ids"]
    cache = tmp_path / "cache"
    assert json.loads(run(*gen, "--prepack-cache", str(cache)))["output_ids"] == plain
    assert len(_entries(cache)) == 1
    r = subprocess.run(
        [sys.executable, "-m", "deltaship", "chat", str(int4), "--json", "--max-new-tokens", "3"]
        + ["--prepack-cache", str(cache)],
        input="hello\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["reply_ids"] and len(_entries(cache)) == 1  # reused, not rebuilt


def test_an_empty_cache_path_is_refused_not_taken_as_the_current_directory(int4, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DeltashipError, match="empty path"):
        open_bundle(int4, threads=1, prepack_cache="")
    assert not list(tmp_path.iterdir())


def test_runtimes_that_cannot_map_the_cache_refuse_it(int4, tmp_path):
    with pytest.raises(DeltashipError, match="--runtime genai") as e:
        open_bundle(int4, runtime="genai", prepack_cache=tmp_path / "cache")
    assert e.value.fix == "drop --prepack-cache" and not (tmp_path / "cache").exists()
