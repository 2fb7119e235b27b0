"""The file the runtime opens is the file that was hashed (issue 45, item 2).

Every graph file a bundle's runtime opens (whatever its name), every external-data file, model file or context
binary such a file names (resolved as its runtime resolves it: beside that file), and every file inside a package
directory is inside the bundle, listed and hashed; `entry` names what the target's runtime opens. A bundle that
swaps in another file is refused by `inspect` and by every reader, naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest

import deltaship
from deltaship.check.inspect import inspect
from deltaship.cli import main
from deltaship.commands import generate
from deltaship.errors import DeltashipError
from deltaship.targets import open_bundle


@pytest.fixture(scope="module")
def tiny(shared_export) -> Path:
    """The tiny preset as an fp32 ONNX bundle (shared with test_trust_reader)."""
    return shared_export("trust-tiny-onnx", "qwen3.5-tiny", target="onnx", precision="fp32", verify=False)


def _listing(path: Path) -> dict:
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _manifest(b: Path) -> dict:
    return json.loads((b / "manifest.json").read_text())


def _write(b: Path, m: dict) -> None:
    (b / "manifest.json").write_text(json.dumps(m))


def _external(b: Path, graph: str, out: str, location: str) -> None:
    """b/graph saved again as b/out with its weights in the external-data file `location` (beside b/out)."""
    import onnx

    model = onnx.load(str(b / graph))
    (b / out).parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(b / out), save_as_external_data=True, location=location, size_threshold=4096)


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    got = capsys.readouterr()
    return code, got.out + got.err


def assert_refused_everywhere(b: Path, match: str, tmp_path: Path, capsys) -> None:
    """inspect calls the bundle not intact, naming the file (never "all file hashes match"); every reader raises
    a DeltashipError naming it with the fix; the CLI exits 2 and `app` writes nothing."""
    info = inspect(b)
    assert not info["intact"] and any(re.search(match, p) for p in info["problems"]), info["problems"]
    for read in (open_bundle, deltaship.load, lambda x: generate(x, input_ids=[1, 2], max_new_tokens=2)):
        with pytest.raises(DeltashipError, match=match) as e:
            read(b)
        assert "export the bundle again" in e.value.fix
    before = sorted(os.listdir(tmp_path))
    for argv in (
        ["inspect", str(b)],
        ["generate", str(b), "--prompt", "hi", "--max-new-tokens", "2"],
        ["eval", str(b), "--tokens", "16"],
        *(["app", str(b), "--platform", p, "--out", str(tmp_path / f"kit-{p}")] for p in ("android", "web")),
    ):
        code, out = _cli(argv, capsys)
        assert code == 2 and "Traceback" not in out, (argv[0], out)
        assert "all file hashes match" not in out, (argv[0], out)
        assert re.search(match, out.replace("\n", " ")), (argv[0], out)
    assert sorted(os.listdir(tmp_path)) == before


def test_a_renamed_entry_with_unlisted_external_data_is_refused(tiny, tmp_path, capsys):
    """Reported: an entry renamed model.bin whose initializers point to an unlisted hidden.bin ran in generate,
    eval and app while inspect said all hashes match (only *.onnx files were read for external data)."""
    b = tmp_path / "b"
    shutil.copytree(tiny, b)
    _external(b, "model.onnx", "model.bin", "hidden.bin")
    (b / "model.onnx").unlink()
    m = _manifest(b)
    m["files"].pop("model.onnx")
    m["files"]["model.bin"] = _listing(b / "model.bin")
    m["entry"] = "model.bin"
    _write(b, m)
    assert_refused_everywhere(
        b, r"entry = 'model.bin' is not an ONNX graph \(a file named \*\.onnx\)", tmp_path, capsys
    )
    # named .onnx again, the graph's unlisted data is what is refused
    os.rename(b / "model.bin", b / "model.onnx")
    m["files"]["model.onnx"] = m["files"].pop("model.bin")
    m["entry"] = "model.onnx"
    _write(b, m)
    assert_refused_everywhere(
        b, r"model.onnx \(external data of tensor '[^']+'\) = 'hidden.bin' is not listed in `files`", tmp_path, capsys
    )


def test_external_data_resolves_beside_a_graph_in_a_subdirectory(tiny, tmp_path, capsys):
    """Reported: with the entry in sub/, deltaship hashed model.onnx.data at the bundle's root while ONNX Runtime
    read sub/model.onnx.data (unlisted) beside the graph."""
    b = tmp_path / "b"
    shutil.copytree(tiny, b)
    _external(b, "model.onnx", "sub/model.onnx", "model.onnx.data")
    shutil.copyfile(b / "sub" / "model.onnx.data", b / "model.onnx.data")  # the decoy deltaship used to hash
    (b / "model.onnx").unlink()
    config = json.loads((b / "genai_config.json").read_text())
    config["model"]["decoder"]["filename"] = "sub/model.onnx"  # genai reads it beside its config
    (b / "genai_config.json").write_text(json.dumps(config))
    m = _manifest(b)
    m["files"]["genai_config.json"] = _listing(b / "genai_config.json")
    m["files"].pop("model.onnx")
    m["files"]["sub/model.onnx"] = _listing(b / "sub" / "model.onnx")
    m["files"]["model.onnx.data"] = _listing(b / "model.onnx.data")
    m["entry"] = "sub/model.onnx"
    _write(b, m)
    assert_refused_everywhere(
        b, r"sub/model.onnx \(external data of tensor '[^']+'\) = 'sub/model.onnx.data' is not listed", tmp_path, capsys
    )
    # listed where ONNX Runtime reads it, the bundle opens and runs
    m["files"]["sub/model.onnx.data"] = m["files"].pop("model.onnx.data")
    (b / "model.onnx.data").unlink()
    _write(b, m)
    assert inspect(b)["intact"]
    assert len(generate(b, input_ids=[1, 2], max_new_tokens=2)["output_ids"]) == 2


def test_a_genai_model_file_is_a_listed_graph(tiny, tmp_path):
    """onnxruntime-genai opens the decoder its genai_config.json names: that file is checked as a graph of the
    bundle (listed, hashed, its external data beside it), not only the manifest's entry."""
    b = tmp_path / "b"
    shutil.copytree(tiny, b)
    shutil.copyfile(b / "model.onnx", b / "ghost.onnx.bak")  # an unlisted graph
    os.rename(b / "ghost.onnx.bak", b / "ghost")
    config = json.loads((b / "genai_config.json").read_text())
    config["model"]["decoder"]["filename"] = "ghost"
    (b / "genai_config.json").write_text(json.dumps(config))
    m = _manifest(b)
    m["files"]["genai_config.json"] = _listing(b / "genai_config.json")
    _write(b, m)
    match = r"genai_config.json model.decoder.filename = 'ghost' is not listed in `files`"
    assert any(match.replace("\\", "") in p for p in inspect(b)["problems"])
    for read in (open_bundle, lambda x: open_bundle(x, runtime="genai")):
        with pytest.raises(DeltashipError, match=match):
            read(b)
    m["lowering"].pop("genai")  # genai reads genai_config.json from the bundle's directory, named or not
    _write(b, m)
    assert any(match.replace("\\", "") in p for p in inspect(b)["problems"])


@pytest.mark.parametrize(
    "target, kind", [("executorch", "an ExecuTorch program"), ("coreml", "a Core ML package")], ids=["pte", "coreml"]
)
def test_entry_names_what_the_targets_runtime_opens(tiny, tmp_path, target, kind):
    """An ExecuTorch bundle's entry is a *.pte file, a Core ML bundle's a *.mlpackage directory: the ONNX graph
    relabelled as either is refused by inspect and the readers, naming the entry."""
    b = tmp_path / "b"
    shutil.copytree(tiny, b)
    m = _manifest(b)
    m["target"] = target
    if target == "coreml":
        m["lowering"] = {"parts": [], "functions": {}}
    _write(b, m)
    match = rf"entry = 'model.onnx' is not {kind}"
    assert any(match in p for p in inspect(b)["problems"])
    with pytest.raises(DeltashipError, match=match):
        open_bundle(b)
    if target == "coreml":  # a package is a directory: a file of that name is refused, the directory passes the rule
        (b / "model.mlpackage").write_text("{}")
        m["entry"], m["files"]["model.mlpackage"] = "model.mlpackage", _listing(b / "model.mlpackage")
        _write(b, m)
        with pytest.raises(DeltashipError, match=r"entry = 'model.mlpackage' is not a Core ML package \(a directory"):
            open_bundle(b)
        (b / "model.mlpackage").unlink()
        (b / "model.mlpackage").mkdir()
        (b / "model.mlpackage" / "Manifest.json").write_text("{}")
        m["files"].pop("model.mlpackage")
        m["files"]["model.mlpackage/Manifest.json"] = _listing(b / "model.mlpackage" / "Manifest.json")
        m["lowering"]["parts"] = [
            {"package": "model.mlpackage", "input": "input_ids", "output": "logits", "states": []}
        ]
        _write(b, m)
        with pytest.raises(DeltashipError, match=r"Manifest.json: names no root model"):  # past the entry rule
            open_bundle(b)


def test_every_file_inside_a_package_directory_is_listed(tiny, tmp_path, capsys):
    """A Core ML package is opened whole by its runtime: a file under it the manifest does not list (so no hash
    covers it), or a symlink under it, is refused by the integrity check every reader runs."""
    b = tmp_path / "b"
    shutil.copytree(tiny, b)
    pkg = b / "model.mlpackage"
    (pkg / "Data").mkdir(parents=True)
    (pkg / "Manifest.json").write_text("{}")
    (pkg / "Data" / "weight.bin").write_bytes(b"w" * 64)
    m = _manifest(b)
    m["lowering"]["parts"] = [{"package": "model.mlpackage", "input": "input_ids", "output": "logits", "states": []}]
    m["files"]["model.mlpackage/Manifest.json"] = _listing(pkg / "Manifest.json")
    _write(b, m)
    info = inspect(b)
    want = "model.mlpackage/Data/weight.bin: inside model.mlpackage (lowering.parts[0].package) but not listed"
    assert not info["intact"] and any(want in p for p in info["problems"]), info["problems"]
    with pytest.raises(DeltashipError, match=r"model.mlpackage/Data/weight.bin: inside model.mlpackage"):
        open_bundle(b)
    code, out = _cli(["inspect", str(b)], capsys)
    assert code == 2 and "weight.bin" in out
    m["files"]["model.mlpackage/Data/weight.bin"] = _listing(pkg / "Data" / "weight.bin")
    _write(b, m)
    assert inspect(b)["intact"]  # listed, the package is part of the closed world
    (pkg / "Data" / "link.bin").symlink_to(b / "tokenizer.json")
    with pytest.raises(DeltashipError, match=r"model.mlpackage/Data/link.bin: a symlink inside model.mlpackage"):
        open_bundle(b)


def _context_model(path: Path, binary: str) -> None:
    from onnx import TensorProto, helper

    node = helper.make_node("EPContext", ["x"], ["y"], domain="com.microsoft", main_context=1,
                            ep_cache_context=binary, embed_mode=0, source="QNNExecutionProvider")  # fmt: skip
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT16, [1, 8]) for n in ("x", "y")]
    g = helper.make_graph([node], "ctx", io[:1], io[1:])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    helper.set_model_props(model, {"ep_compatibility_info.QNNExecutionProvider": "v2:6:2.51.0:5.51.0:79:69:0:0"})
    path.write_bytes(model.SerializeToString())


def test_a_qnn_context_binary_is_listed_where_onnxruntime_qnn_reads_it(shared_export, tmp_path):
    """An EPContext model names its context binary, which onnxruntime-qnn opens beside it: a binary the manifest
    does not list (while it lists a decoy) is refused by inspect and open_bundle before any runtime loads."""
    qnn = shared_export("trust-qnn-fp16", "qwen3.5-tiny", target="qnn", precision="fp16", max_context=64, verify=False)
    b = tmp_path / "b"
    shutil.copytree(qnn, b)
    _context_model(b / "decode_ctx.onnx", "hidden_qnn.bin")
    for name in ("hidden_qnn.bin", "decode_ctx_qnn.bin"):
        (b / name).write_bytes(b"\0" * 64)
    m = _manifest(b)
    files = [{"path": n, **_listing(b / n)} for n in ("decode_ctx.onnx", "decode_ctx_qnn.bin")]
    m["lowering"]["context"] = {
        "decode": {"graph": "decode.onnx", "model": "decode_ctx.onnx", "files": files, "soc_model": 69,
                   "htp_arch": 79, "qnn_sdk": "2.51.0", "compatibility": "v2:6:2.51.0:5.51.0:79:69:0:0"}
    }  # fmt: skip
    for f in files:
        m["files"][f["path"]] = {"bytes": f["bytes"], "sha256": f["sha256"]}
    _write(b, m)
    match = r"decode_ctx.onnx \(its EPContext binary\) = 'hidden_qnn.bin' is not listed in `files`"
    info = inspect(b)
    assert not info["intact"] and any(match.replace("\\", "") in p for p in info["problems"]), info["problems"]
    with pytest.raises(DeltashipError, match=match):
        open_bundle(b)
