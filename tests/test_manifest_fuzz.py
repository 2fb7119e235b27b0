"""Property: whatever a manifest says, every bundle reader either loads the bundle or raises one DeltashipError.

Mutations of a real tiny ONNX bundle's manifest (hypothesis, derandomized, no example database): keys deleted,
renamed, retyped; paths with `..`, absolute, through a symlink out of the bundle; huge, negative and zero
numbers; wrong shapes and dtypes. Readers: read_manifest (schema and paths), inspect (and its human form),
require_intact, the artifact check, the tokenizer, open_bundle and two generated tokens.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltaship.bundle import read_manifest, require_intact
from deltaship.check.inspect import describe, inspect
from deltaship.errors import DeltashipError
from deltaship.runtimes.tokenizer import load_tokenizer
from deltaship.targets import open_bundle, require_artifact

TOKENIZER = Path(__file__).parents[1] / "deltaship" / "models" / "data" / "qwen3.5-tiny" / "tokenizer.json"
PATHS = [
    "../model.onnx",
    "/etc/passwd",
    "..",
    ".",
    "",
    "a/../model.onnx",
    "./model.onnx",
    "model.onnx/",
    "evil/model.onnx",  # evil -> a directory outside the bundle
    "evil",
    "C:\\model.onnx",
    "model.onnx\x00",
    "model.onnx",
    "tokenizer.json",
    "missing.onnx",
]
FIELDS = [  # the fields readers act on, drawn more often than a random walk would reach them
    ("entry",),
    ("files",),
    ("files", "model.onnx"),
    ("files", "model.onnx", "bytes"),
    ("tokenizer", "files", 0),
    ("states",),
    ("states", 0, "shape"),
    ("states", 0, "shape", 1),
    ("states", 0, "dtype"),
    ("states", 0, "name"),
    ("states", 0, "output"),
    ("inputs", 0, "shape"),
    ("inputs", 0, "dtype"),
    ("inputs", 0, "kind"),
    ("outputs", 0, "shape", 2),
    ("prefill_chunk",),
    ("max_context",),
    ("model", "vocab_size"),
    ("tokens", "eos"),
    ("target",),
    ("lowering", "genai", "config"),
    ("model", "parameters", "total"),
    ("schema_version",),
    ("source",),
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(PATHS),
    st.sampled_from(["bfloat16", "float64", "int4", "float16", "uint8"]),
)
values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def fuzz_bundle(bundles, tmp_path_factory) -> tuple[Path, dict]:
    """A copy of the tiny ONNX bundle with a real tokenizer, and a symlink `evil` to a directory outside it."""
    root = tmp_path_factory.mktemp("fuzz")
    b = root / "bundle"
    shutil.copytree(bundles("base"), b)
    shutil.copy(TOKENIZER, b / "tokenizer.json")
    (root / "outside").mkdir()
    os.link(b / "model.onnx", root / "outside" / "model.onnx")
    (b / "evil").symlink_to(root / "outside")
    m = json.loads((b / "manifest.json").read_text())
    data = (b / "tokenizer.json").read_bytes()
    import hashlib

    m["files"]["tokenizer.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    m["tokenizer"]["files"] = ["tokenizer.json"]
    (b / "manifest.json").write_text(json.dumps(m))
    read_manifest(b)  # the unmutated bundle is valid
    return b, m


def _mutate(data, m: dict) -> None:
    if data.draw(st.booleans(), label="known field"):
        path = list(data.draw(st.sampled_from(FIELDS), label="field"))
    else:  # a random walk from the root
        path, node = [], m
        while isinstance(node, (dict, list)) and node and data.draw(st.integers(0, 3), label="deeper") > 0:
            key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
            path.append(key)
            node = node[key]
    parent = m
    for key in path[:-1]:
        try:
            parent = parent[key]
        except (KeyError, IndexError, TypeError):
            return
    if not path or not isinstance(parent, (dict, list)):
        return
    key = path[-1]
    if isinstance(parent, dict) or (isinstance(key, int) and key < len(parent)):
        op = data.draw(st.sampled_from(["delete", "replace", "replace", "rename", "path"]), label="op")
        if op == "delete":
            parent.pop(key, None) if isinstance(parent, dict) else parent.pop(key)
        elif op == "rename" and isinstance(parent, dict) and key in parent:
            parent[data.draw(st.sampled_from(PATHS + ["x", key.upper()]))] = parent.pop(key)
        elif op == "path":
            parent[key] = data.draw(st.sampled_from(PATHS))
        else:
            parent[key] = data.draw(values, label="value")


def _read_all(b: Path) -> str:
    """Every reader on the bundle; returns how far it got. Only DeltashipError may escape a reader."""
    try:
        describe(inspect(b, check_hashes=False))
    except DeltashipError:
        pass
    try:
        m = read_manifest(b)
        require_intact(b, m, hashes=False)
        require_artifact(b, m)
    except DeltashipError:
        return "refused"
    try:
        load_tokenizer(b, m).encode("hi")
    except DeltashipError:
        pass
    try:
        open_bundle(b, check_hashes=False).generate([1, 2], 2)
    except DeltashipError:
        return "refused at open"
    # what ran is the bundle's own entry, listed and inside it (not evil/model.onnx, the same bytes outside)
    assert m["entry"] in m["files"] and b.resolve() in (b / m["entry"]).resolve().parents
    return "ran"


def test_every_reader_loads_or_refuses_a_mutated_manifest(fuzz_bundle):
    b, manifest = fuzz_bundle
    outcomes: dict[str, int] = {}

    @settings(
        max_examples=500,
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def check(data):
        m = copy.deepcopy(manifest)
        for _ in range(data.draw(st.integers(1, 3), label="mutations")):
            _mutate(data, m)
        (b / "manifest.json").write_text(json.dumps(m))
        outcome = _read_all(b)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    try:
        check()
    finally:
        (b / "manifest.json").write_text(json.dumps(manifest))
    # the property held on each example; and the run reached every reader, valid bundles included
    if os.environ.get("DELTASHIP_FUZZ_OUTCOMES"):  # how the examples split (docs/reliability.md quotes it)
        print(outcomes)
    assert outcomes.get("refused", 0) > 100 and outcomes.get("ran", 0) > 20, outcomes
