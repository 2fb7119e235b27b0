"""Names are names: a name a manifest carries (graph inputs and outputs, states, methods and functions, files) is
only what a graph I/O name or a relative path needs, so no manifest value becomes source code in a generated kit,
and every reader refuses a bundle with another before any work (issue 45, item 1). Numbers are JSON integers and
every listed file carries its sha256 (item 2)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import deltaship
from deltaship.bundle import read_manifest, schema_problems
from deltaship.check.inspect import inspect
from deltaship.cli import main
from deltaship.commands import generate
from deltaship.errors import DeltashipError
from deltaship.targets import open_bundle

# what an attacker would put in a name that a kit pastes into a Kotlin/Swift string literal, a JS file or a page
HOSTILE = {
    "kotlin-template": 'past.0.conv${Runtime.getRuntime().exec("id")}',
    "quote": 'past.0.conv"',
    "backslash": "past.0.conv\\",
    "newline": "past.0.conv\n",
    "comment-end": "past.0.conv*/",
    "script-end": "past.0.conv</script>",
    "unicode-escape": "past.0.conv\\u0022",
    "non-ascii": "past.0.conv\u00e9",
    "space": "past.0 conv",
    "10KB": "p" * 10240,
}


@pytest.fixture(scope="module")
def tiny(shared_export) -> Path:
    """The tiny preset as an fp32 ONNX bundle (shared with test_trust_reader)."""
    return shared_export("trust-tiny-onnx", "qwen3.5-tiny", target="onnx", precision="fp32", verify=False)


@pytest.fixture(scope="module")
def hostile(tiny, tmp_path_factory) -> Path:
    """One copy of the bundle whose manifest each case rewrites."""
    out = tmp_path_factory.mktemp("names") / "b"
    shutil.copytree(tiny, out)
    return out


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    got = capsys.readouterr()
    return code, got.out + got.err  # inspect reports on stdout


@pytest.mark.parametrize("value", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_state_name_is_refused_by_every_reader(tiny, hostile, tmp_path, capsys, value):
    """Reported: a state named `past.0.conv${Runtime.getRuntime().exec("id")}` became code in KitSpec.kt. Every
    reader refuses the bundle (DeltashipError; the CLI exits 2 with the fix) naming the field, and `app` writes
    nothing, for each platform."""
    m = json.loads((tiny / "manifest.json").read_text())
    m["states"][0]["name"] = value
    (hostile / "manifest.json").write_text(json.dumps(m))
    where = r"manifest\['states'\]\[0\]\['name'\]"
    for read in (
        read_manifest,
        open_bundle,
        deltaship.load,
        lambda b: generate(b, input_ids=[1, 2], max_new_tokens=2),
    ):
        with pytest.raises(DeltashipError, match=where) as e:
            read(hostile)
        assert "does not follow the bundle schema" in e.value.message and "export the bundle again" in e.value.fix
    info = inspect(hostile)
    assert not info["intact"] and any("['states'][0]['name']" in p for p in info["problems"])
    before = sorted(os.listdir(tmp_path))
    for argv in (
        ["inspect", str(hostile)],
        ["generate", str(hostile), "--prompt", "hi", "--max-new-tokens", "2"],
        ["eval", str(hostile), "--tokens", "16"],
        ["profile", str(hostile), "--gen", "1", "--reps", "1", "--warmups", "0"],
        *(["app", str(hostile), "--platform", p, "--out", str(tmp_path / p)] for p in ("android", "ios", "web")),
    ):
        code, err = _cli(argv, capsys)
        assert code == 2, (argv[0], err)
        assert "['states'][0]['name']" in err and "Traceback" not in err, (argv[0], err)
        assert "fix:" in err or argv[0] == "inspect", (argv[0], err)
    assert sorted(os.listdir(tmp_path)) == before  # no kit, no staging directory, no lock left


def _set(path: str, value):
    """A change that puts `value` at `path` (dots and [i]) of a manifest, creating dicts on the way."""

    def change(m: dict) -> None:
        keys = [int(k) if k.isdigit() else k for k in path.replace("[", ".").replace("]", "").split(".")]
        at = m
        for k in keys[:-1]:
            at = at[k] if isinstance(k, int) or k in at else at.setdefault(k, {})
        at[keys[-1]] = value

    return change


EVIL = 'x${Runtime.getRuntime().exec("id")}'
# every name field of the schema an app or a kit reads, with the evil value (the ONNX bundle's manifest as the base)
FIELDS = [
    "inputs[0].name",
    "inputs[0].kind",
    "outputs[0].name",
    "states[0].output",
    "states[0].coreml_input",
    "states[0].in_place",
    "inputs[0].shape[1]",  # a symbolic dim: a name too
    "source.model",
    "tokens.bad key",
    "lowering.parts",
    "lowering.functions",
    "vision.graphs",
    "speculative.draft.function",
    "speculative.draft.program_method",
    "speculative.verify.functions",
    "speculative.rollback.deltanet_outputs",
    "speculative.duplicated_tensors",
    "speculative.shared_tensors",
]
VALUES = {
    "states[0].in_place": [EVIL],
    "tokens.bad key": 1,
    "lowering.parts": [{"package": "model.mlpackage", "input": EVIL, "output": "logits", "states": ["a"]}],
    "lowering.functions": {EVIL: {"tokens": 1}},
    "vision.graphs": {"vision": EVIL, "embedding": "e", "decoder": "d"},
    "speculative.verify.functions": {"1": EVIL},
    "speculative.rollback.deltanet_outputs": {"past.0.conv": EVIL},
    "speculative.duplicated_tensors": [EVIL],
    "speculative.shared_tensors": {EVIL: 1},
}


@pytest.mark.parametrize("field", FIELDS)
def test_every_name_field_is_a_name(tiny, field):
    """Each name field of the schema refuses the evil value (the ONNX manifest with it set is refused there)."""
    m = json.loads((tiny / "manifest.json").read_text())
    assert not schema_problems(m)
    _set(field, VALUES.get(field, EVIL))(m)
    top = field.split(".")[0].split("[")[0]
    problems = schema_problems(m)  # a block the base lacks misses required fields too: the pattern must refuse
    refused = ("does not match", "not valid under any")  # a pattern, or a dim's oneOf
    assert any(p.startswith(f"manifest['{top}']") and any(r in p for r in refused) for p in problems), problems


@pytest.mark.parametrize(
    "field, value",
    [
        ("source.model", "my models/qwen3.5 0.8B"),  # a checkpoint path with spaces is still a label
        ("inputs[0].name", "past_key_values.0:key/x-1"),
        ("speculative.verify.functions", {"12": "verify_12"}),
    ],
)
def test_plain_names_pass(tiny, field, value):
    m = json.loads((tiny / "manifest.json").read_text())
    _set(field, value)(m)
    last = field.split(".")[-1].split("[")[0]
    assert not [p for p in schema_problems(m) if f"['{last}']" in p], schema_problems(m)


def test_file_names_are_bounded_and_plain(tiny, tmp_path):
    """A files key, entry or tokenizer file of 10 KB, with a newline or a `$`, is refused by path before any file
    is opened (bundle/paths.py), and by the schema."""
    b = tmp_path / "b"
    shutil.copytree(tiny, b)
    m = json.loads((b / "manifest.json").read_text())
    for name, why in (("m" * 10240 + ".onnx", "10245 characters long"), ("model.onnx\n", "holds characters")):
        bad = dict(m, files={**m["files"], name: m["files"]["model.onnx"]})
        (b / "manifest.json").write_text(json.dumps(bad))
        with pytest.raises(DeltashipError, match=why) as e:
            read_manifest(b)
        assert len(e.value.message) < 400  # the name is cut in the message
        with pytest.raises(DeltashipError, match=why):
            inspect(b)
    long = dict(m, entry="m" * 300)
    assert any("['entry']" in p for p in schema_problems(long))


@pytest.mark.parametrize(
    "change, match",
    [
        (_set("states[0].shape", [1, 3.0, 256]), r"\['states'\]\[0\]\['shape'\]\[1\]: 3.0 is not of type 'integer'"),
        (_set("max_context", 64.0), r"\['max_context'\]: 64.0 is not of type 'integer'"),
        (_set("tokens.eos", [True]), r"\['tokens'\]\['eos'\]\[0\]: True is not of type 'integer'"),
    ],
    ids=["shape-float", "context-float", "eos-bool"],
)
def test_integers_are_integers(tiny, tmp_path, change, match):
    """Reported: [1, 3.0, 256] passed the schema as a shape (JSON Schema's integer takes a zero fraction)."""
    b = tmp_path / "b"
    shutil.copytree(tiny, b)
    m = json.loads((b / "manifest.json").read_text())
    change(m)
    (b / "manifest.json").write_text(json.dumps(m))
    for read in (read_manifest, open_bundle, deltaship.load):
        with pytest.raises(DeltashipError, match=match):
            read(b)
    assert not inspect(b)["intact"]


def test_a_file_without_its_sha256_is_refused(tiny, tmp_path, capsys):
    """Reported: a `files` entry without its sha256 was a KeyError (exit 1) in inspect."""
    b = tmp_path / "b"
    shutil.copytree(tiny, b)
    m = json.loads((b / "manifest.json").read_text())
    del m["files"]["tokenizer.json"]["sha256"]
    (b / "manifest.json").write_text(json.dumps(m))
    for read in (read_manifest, open_bundle):
        with pytest.raises(DeltashipError, match=r"\['files'\]\['tokenizer.json'\]: 'sha256' is a required property"):
            read(b)
    info = inspect(b)
    assert not info["intact"] and any("'tokenizer.json': not a plain file name with its size and sha256" in p
                                      for p in info["problems"])  # fmt: skip
    code, err = _cli(["inspect", str(b)], capsys)
    assert code == 2 and "Traceback" not in err, err
