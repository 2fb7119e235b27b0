"""Every reader of a bundle treats it as untrusted input: the reported cases, one test each.

A bundle is a closed world (deltaship/bundle/paths.py): paths inside it, listed in `files`, refused before any
file is opened; the manifest follows schema.json; the artifact agrees with the manifest; reads are bounded.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from deltaship.bundle import read_manifest, require_intact
from deltaship.check.inspect import inspect
from deltaship.commands import generate
from deltaship.errors import DeltashipError
from deltaship.runtimes.tokenizer import load_tokenizer
from deltaship.targets import open_bundle

ROOT = Path("/etc/passwd")


@pytest.fixture(scope="module")
def tiny(shared_export) -> Path:
    """The tiny preset (trained weights, a real tokenizer) as an fp32 ONNX bundle."""
    return shared_export("trust-tiny-onnx", "qwen3.5-tiny", target="onnx", precision="fp32", verify=False)


def copy(tiny: Path, tmp_path: Path, name: str = "b") -> Path:
    out = tmp_path / name
    shutil.copytree(tiny, out)
    return out


def edit(bundle: Path, change) -> dict:
    m = json.loads((bundle / "manifest.json").read_text())
    change(m)
    (bundle / "manifest.json").write_text(json.dumps(m))
    return m


def listing(path: Path) -> dict:
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def rehash(bundle: Path, name: str) -> None:
    edit(bundle, lambda m: m["files"].__setitem__(name, listing(bundle / name)))


class Opened:
    """Every path the process opens meanwhile (Python's `open` audit event: open(), Path.read_*, io.open)."""

    active: list[list[str]] = []
    hooked = False

    def __enter__(self) -> list[str]:
        if not Opened.hooked:
            sys.addaudithook(lambda event, args: Opened._seen(event, args))
            Opened.hooked = True
        self.paths: list[str] = []
        Opened.active.append(self.paths)
        return self.paths

    def __exit__(self, *exc) -> None:
        Opened.active.remove(self.paths)

    @staticmethod
    def _seen(event: str, args) -> None:
        if event == "open" and Opened.active and isinstance(args[0], (str, bytes, Path)):
            for paths in Opened.active:
                paths.append(str(Path(args[0] if not isinstance(args[0], bytes) else args[0].decode()).resolve()))


READERS = {
    "read_manifest": lambda b: read_manifest(b),
    "inspect": lambda b: inspect(b),
    "open_bundle": lambda b: open_bundle(b),
    "generate": lambda b: generate(b, input_ids=[1, 2], max_new_tokens=2),
}


def test_entry_left_out_of_files_is_refused(tiny, tmp_path):
    """Reported: a manifest whose files omit the entry skipped the hash check; a flipped model.onnx ran (exit 0)."""
    b = copy(tiny, tmp_path)
    edit(b, lambda m: m["files"].pop("model.onnx"))
    data = bytearray((b / "model.onnx").read_bytes())
    data[-1000] ^= 0xFF
    (b / "model.onnx").write_bytes(data)
    for name, read in READERS.items():
        with pytest.raises(DeltashipError, match=r"entry = 'model.onnx' is not listed in `files`"):
            read(b)


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda m: m["files"].__setitem__("../../../../../../etc/passwd", listing(ROOT)), "files"),
        (lambda m: m.__setitem__("entry", "../../../../../../etc/passwd"), "entry"),
        (lambda m: m["tokenizer"]["files"].append("../../../../../../etc/passwd"), r"tokenizer.files\[\d+\]"),
    ],
    ids=["files", "entry", "tokenizer"],
)
def test_traversal_is_refused_before_any_file_is_opened(tiny, tmp_path, change, field):
    """Reported: a files entry ../../etc/passwd with its hash was opened by inspect and generate (intact)."""
    b = copy(tiny, tmp_path)
    edit(b, change)
    for name, read in READERS.items():
        with Opened() as opened:
            with pytest.raises(DeltashipError, match=rf"{field} = '\.\./.*passwd' has a `\.\.` component") as e:
                read(b)
        assert str(ROOT) not in opened, name
        assert str((b / "model.onnx").resolve()) not in opened, name  # refused before any file but the manifest
        assert "export the bundle again" in e.value.fix


def test_entry_outside_the_bundle_is_refused(tiny, tmp_path):
    """Reported: an entry ../other/model.onnx or an absolute path ran a model outside the bundle."""
    other = copy(tiny, tmp_path, "other")
    b = copy(tiny, tmp_path)
    for entry, why in (("../other/model.onnx", r"`\.\.` component"), (str(other / "model.onnx"), "absolute path")):
        edit(b, lambda m: m.__setitem__("entry", entry))
        for name, read in READERS.items():
            with Opened() as opened:
                with pytest.raises(DeltashipError, match=rf"entry = '{entry}' (is an|has a) .*{why}"):
                    read(b)
            assert str((other / "model.onnx").resolve()) not in opened, name


def test_a_symlink_out_of_the_bundle_is_refused(tiny, tmp_path):
    """A file of the bundle that is a symlink to a file outside it (same bytes, so the hash matches) is refused,
    and so is an entry reached through a symlinked directory."""
    outside = copy(tiny, tmp_path, "outside")
    b = copy(tiny, tmp_path)
    (b / "tokenizer.json").unlink()
    (b / "tokenizer.json").symlink_to(outside / "tokenizer.json")
    for name, read in READERS.items():
        with pytest.raises(DeltashipError, match=r"files = 'tokenizer.json' resolves to .*outside the bundle"):
            read(b)
    b2 = copy(tiny, tmp_path, "b2")
    (b2 / "sub").symlink_to(outside)
    edit(b2, lambda m: (m.__setitem__("entry", "sub/model.onnx"), m["files"].__setitem__("sub/model.onnx", {})))
    with pytest.raises(DeltashipError, match=r"sub/model.onnx' resolves to .*outside the bundle"):
        open_bundle(b2)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda m: m.pop("states"), "'states' is a required property"),
        (lambda m: m["states"][0].__setitem__("dtype", "bfloat16"), r"\['states'\]\[0\]\['dtype'\]: 'bfloat16'"),
        (lambda m: m.__setitem__("prefill_chunk", 0), r"\['prefill_chunk'\]: 0 is less than the minimum of 1"),
        (lambda m: m.__setitem__("max_context", 10**30), r"\['max_context'\]: .* is greater than the maximum"),
        (lambda m: m["states"][0].__setitem__("shape", [1, -3, 256]), r"\['states'\]\[0\]\['shape'\]\[1\]"),
        # `profile`'s memory plan reads the block (devices/plan/memory.py planned_peak)
        (lambda m: m["quantization"].__setitem__("block_size", "32"), r"\['quantization'\]\['block_size'\]: '32'"),
    ],
    ids=["no-states", "bfloat16", "prefill-chunk-0", "huge-context", "negative-dim", "block-size-string"],
)
def test_manifest_values_are_validated_by_every_reader(tiny, tmp_path, change, match):
    """Reported: no states, dtype bfloat16, prefill_chunk 0 gave KeyError/ValueError tracebacks."""
    import deltaship

    b = copy(tiny, tmp_path)
    edit(b, change)
    for read in (read_manifest, open_bundle, deltaship.load, READERS["generate"]):
        with pytest.raises(DeltashipError, match=match) as e:
            read(b)
        assert "does not follow the bundle schema" in e.value.message
    info = inspect(b)
    assert not info["intact"] and any(p for p in info["problems"] if "manifest" in p)
    from deltaship.check.inspect import describe

    assert "FAILED" in describe(info)  # the human form of a broken manifest is a report, not a KeyError


def assert_state_shape_edit_refused(b: Path, then: str = "") -> None:
    """A second state's shape edited in b's manifest: opening the bundle is one DeltashipError naming the state and
    the manifest's shape (followed by `then`, a pattern), and inspect calls the bundle not intact."""
    m = edit(b, lambda m: m["states"][1].__setitem__("shape", [1, 4, 32, 31]))
    state = m["states"][1]["name"]
    with pytest.raises(DeltashipError, match=rf"states '{state}': shape \[1, 4, 32, 31\] in the manifest{then}"):
        open_bundle(b)
    info = inspect(b)
    assert not info["intact"] and any(state in p for p in info["problems"])


def test_an_edited_state_shape_is_refused_naming_the_state(tiny, tmp_path):
    """Reported: a state shape edited in the manifest gave onnxruntime's 'invalid dimensions' traceback, and
    inspect called the bundle intact."""
    b = copy(tiny, tmp_path)
    assert_state_shape_edit_refused(b)
    edit(b, lambda m: m["inputs"][0].__setitem__("dtype", "int32"))
    with pytest.raises(DeltashipError, match=r"inputs 'input_ids': dtype int32 in the manifest, int64 in model.onnx"):
        open_bundle(b)


# ExecuTorch: a .pte names no inputs, so the check compares the program's methods in order (counts, dtypes,
# static dims) and its mutable buffers by name (deltaship/runtimes/executorch_contract.py); tiny_pte marks it slow.
ET_EDITS = [  # (change, the error it gives)
    (lambda m: m["states"][0].__setitem__("dtype", "float16"), r"states 'past.0.conv': dtype float16 in the"),
    (lambda m: m["states"][2].__setitem__("buffer", "past_9_conv"), r"'past_9_conv' is not a mutable buffer"),
    (lambda m: m["states"].pop(), r"method 'forward' holds past_\d+_value, which the manifest does not name"),
    (lambda m: m["inputs"][0].__setitem__("dtype", "int32"), r"inputs 'tokens': dtype int32 in the manifest"),
    (lambda m: m["inputs"].pop(), r"inputs: 1 in the manifest, model.pte method 'forward' has 2"),
    (lambda m: m["outputs"][0].__setitem__("shape", [1, 999]), r"outputs 'logits': shape \[1, 999\] in the"),
    (lambda m: m.__setitem__("prefill_chunk", 64), r"prefill_chunk: 64 in the manifest, but .* at most 16 tokens"),
]


def test_an_edited_executorch_state_is_refused_naming_the_state(tiny_pte, tmp_path):
    """A state shape, dtype or buffer, an input or output edited in an ExecuTorch bundle's manifest is one
    DeltashipError naming the field before executorch loads the program, and inspect calls the bundle not intact."""
    b = copy(tiny_pte("fp32"), tmp_path)
    assert inspect(b)["intact"]  # the exported bundle agrees with its program
    m = edit(b, lambda m: m["states"][1].__setitem__("shape", [1, 4, 32, 31]))
    state = m["states"][1]["name"]
    with pytest.raises(
        DeltashipError, match=rf"states '{state}': shape \[1, 4, 32, 31\] in the manifest, \[1, 4, 32, 32\]"
    ):
        open_bundle(b)
    info = inspect(b)
    assert not info["intact"] and any(state in p for p in info["problems"])
    for change, match in ET_EDITS:
        b = copy(tiny_pte("fp32"), tmp_path, f"b{len(list(tmp_path.iterdir()))}")
        edit(b, change)
        with pytest.raises(DeltashipError, match=match):
            open_bundle(b)
        assert not inspect(b)["intact"]


def test_a_broken_executorch_program_is_one_error(tiny_pte, tmp_path):
    """A .pte whose flatbuffer is corrupted (its hash updated) is one DeltashipError or, where the bytes still
    parse, a list of problems: never an IndexError or a struct.error from the reader."""
    import random

    from deltaship.targets import get_target

    b = copy(tiny_pte("fp32"), tmp_path)
    pte = (b / "model.pte").read_bytes()
    program = int.from_bytes(pte[16:24], "little")  # the extended header's program size: the flatbuffer's bytes
    rng = random.Random(0)
    target = get_target("executorch")
    for _ in range(100):
        data = bytearray(pte[:program])
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(program)] = rng.randrange(256)
        (b / "model.pte").write_bytes(bytes(data))
        try:
            assert isinstance(target.artifact_problems(b, read_manifest(b)), list)
        except DeltashipError as e:
            assert "not a readable ExecuTorch program" in e.message
    (b / "model.pte").write_bytes(b"ET12 not a program")
    rehash(b, "model.pte")
    with pytest.raises(DeltashipError, match="not a readable ExecuTorch program"):
        open_bundle(b)


def set_state(mode: str, key: str, value):
    """An edit of the first state of this Core ML mode (`io` tensors or Core ML `state`s)."""
    return lambda m: next(s for s in m["states"] if s["mode"] == mode).__setitem__(key, value)


# Core ML: each package's model spec (its ModelDescription, read without coremltools) against the manifest, by
# name, for the functions the session calls (deltaship/runtimes/coreml_contract.py)
COREML_EDITS = [  # (change, the error it gives)
    (set_state("state", "dtype", "float32"), r"dtype float32 in the manifest, float16 in model.mlpackage"),
    (set_state("io", "coreml_input", "past_x"), r"model.mlpackage function 'prefill' has no 'past_x'"),
    (set_state("io", "coreml_output", "y"), r"states \(output\) '.*': model.mlpackage .* has no 'y'"),
    (lambda m: m["states"].pop(), r"model.mlpackage function 'prefill' (holds|takes) .*, which the manifest"),
    (lambda m: m["inputs"][0].__setitem__("dtype", "int64"), r"inputs 'input_ids': dtype int64 in the manifest"),
    (lambda m: m["outputs"][0].__setitem__("shape", [1, 999]), r"outputs 'logits': shape \[1, 999\] in the"),
    (lambda m: m.__setitem__("prefill_chunk", 16), r"inputs 'input_ids': shape \[1, 'T'\] in the manifest, \[1, 8\]"),
    (lambda m: m["lowering"]["parts"][0]["functions"].__setitem__("verify_9", []), r"model.mlpackage has no verify_9"),
]


@pytest.mark.slow  # a Core ML export (shared with test_coreml's package contract)
def test_an_edited_coreml_state_is_refused_naming_the_state(bundles, tmp_path):
    """A state shape or dtype, a state's Core ML name, an input or output edited in a Core ML bundle's manifest is
    one DeltashipError naming the field before the evaluator (or Core ML) loads the package, and inspect calls the
    bundle not intact."""
    built = bundles("grouped_values", "coreml", "fp16")  # io DeltaNet states, fp16 Core ML KV-cache states
    b = copy(built, tmp_path)
    assert inspect(b)["intact"]  # the exported bundle agrees with its package
    assert_state_shape_edit_refused(b, r", \[1, ")
    for change, match in COREML_EDITS:
        b = copy(built, tmp_path, f"b{len(list(tmp_path.iterdir()))}")
        edit(b, change)
        with pytest.raises(DeltashipError, match=match):
            open_bundle(b)
        assert not inspect(b)["intact"]
    # the package's own index and spec are untrusted too: a root model path out of the bundle, a spec that does
    # not parse (their hashes updated) are one error each
    b = copy(built, tmp_path, "index")
    index = b / "model.mlpackage" / "Manifest.json"
    info = json.loads(index.read_text())
    info["itemInfoEntries"][info["rootModelIdentifier"]]["path"] = "../../../manifest.json"
    index.write_text(json.dumps(info))
    rehash(b, "model.mlpackage/Manifest.json")
    with pytest.raises(DeltashipError, match=r"model.mlpackage/Manifest.json root model = .* refused before opening"):
        open_bundle(b)
    b = copy(built, tmp_path, "spec")
    (b / "model.mlpackage/Data/com.apple.CoreML/model.mlmodel").write_bytes(b"\x12\xff\xff\xff")
    rehash(b, "model.mlpackage/Data/com.apple.CoreML/model.mlmodel")
    with pytest.raises(DeltashipError, match="not a readable Core ML model spec"):
        open_bundle(b)


def test_a_broken_tokenizer_is_one_error(tiny, tmp_path):
    """Reported: a tokenizer.json that does not parse gave a traceback (its hash updated, so the check passes)."""
    b = copy(tiny, tmp_path)
    (b / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "nonsense"}}')
    rehash(b, "tokenizer.json")
    m = read_manifest(b)
    require_intact(b, m)
    with pytest.raises(DeltashipError, match="not a tokenizer the `tokenizers` library can read"):
        load_tokenizer(b, m)
    with pytest.raises(DeltashipError, match="not a tokenizer the `tokenizers` library can read"):
        generate(b, prompt="hi", max_new_tokens=1)


def test_oversized_tokenizer_and_manifest_are_refused_by_size(tiny, tmp_path):
    """A 65 MiB tokenizer.json (a sparse file) is refused, naming its size, before it is read."""
    b = copy(tiny, tmp_path)
    with open(b / "tokenizer.json", "r+b") as f:
        f.truncate(65 << 20)
    rehash(b, "tokenizer.json")
    m = read_manifest(b)
    with Opened() as opened, pytest.raises(DeltashipError, match=r"68,157,440 bytes, more than a tokenizer may hold"):
        load_tokenizer(b, m)
    assert str((b / "tokenizer.json").resolve()) not in opened
    with open(b / "manifest.json", "r+b") as f:
        f.truncate(65 << 20)
    with pytest.raises(DeltashipError, match=r"68,157,440 bytes, more than a bundle manifest may hold"):
        read_manifest(b)


def test_onnx_external_data_outside_the_bundle_is_refused(tiny, tmp_path):
    """onnxruntime opens the external-data files a graph names: each must be inside the bundle and listed."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    b = copy(tiny, tmp_path)
    (tmp_path / "secret.bin").write_bytes(np.zeros(4, np.float32).tobytes())
    w = numpy_helper.from_array(np.zeros(4, np.float32), "w")
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "../secret.bin"), ("offset", "0"), ("length", "16")):
        w.external_data.add(key=k, value=v)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    graph = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "g", [], [y], initializer=[w])
    onnx.save(helper.make_model(graph), str(b / "extra.onnx"))
    rehash(b, "extra.onnx")
    with pytest.raises(DeltashipError, match=r"extra.onnx \(external data of tensor 'w'\) = '\.\./secret.bin'"):
        open_bundle(b)
    info = inspect(b)
    assert not info["intact"] and "'../secret.bin' has a `..` component" in info["problems"][0]


def test_shell_lines_quote_manifest_values():
    """No manifest value reaches a shell unquoted: the adb runner line and the ssh profile line."""
    import shlex

    from deltaship.devices.android import runner_command
    from deltaship.profiling.remote import profile_command

    evil = "model; rm -rf /tmp/x $(reboot) `id`.pte"
    fields = {"model": f"/data/local/tmp/deltaship/b/{evil}", "threads": 4, "total": 8, "prompt_length": 4}
    cmd = runner_command("/data/local/tmp/deltaship/my bundle", "--model_path {model} --cpu_threads {threads}", fields)
    words = shlex.split(cmd.split(" && ", 1)[1].split(" & echo")[0])
    assert words == ["/data/local/tmp/deltaship/runner", "--model_path", fields["model"], "--cpu_threads", "4"]
    assert shlex.split(cmd.split(" && ")[0]) == ["cd", "/data/local/tmp/deltaship/my bundle"]
    cfg = {"prompt_lengths": [4], "gen": 2, "contexts": [8], "warmups": 0, "reps": 1, "min_seconds": 0.1}
    line = profile_command("deltaship", f"/tmp/d/{evil}", cfg, None, "phone; id")
    assert shlex.split(line)[2] == f"/tmp/d/{evil}" and shlex.split(line)[-1] == "phone; id"


def test_vision_parts_are_paths_where_the_block_names_no_program():
    """vision.graphs' vision/embedding/decoder are file names in a block without a program or package (ONNX: one
    graph each, checked as paths) and method or function names beside one (ExecuTorch, Core ML: not paths), read
    from the block itself, whatever the manifest's target says."""
    from deltaship.bundle.paths import named_paths

    parts = {"vision": "../vision.onnx", "embedding": "embedding.onnx", "decoder": "decoder_mm.onnx"}
    for target in ("onnx", "toy"):
        named = dict(named_paths({"target": target, "vision": {"graphs": parts}}))
        assert named["vision.graphs.vision"] == "../vision.onnx" and "vision.graphs.decoder" in named
    methods = {"program": "vision.pte", "vision": "vision_encoder", "decoder_program": "d.pte", "decoder": "text"}
    named = dict(named_paths({"target": "onnx", "vision": {"graphs": methods}}))
    assert named["vision.graphs.program"] == "vision.pte" and named["vision.graphs.decoder_program"] == "d.pte"
    assert "vision.graphs.vision" not in named and "vision.graphs.decoder" not in named
