"""The house rules that keep a target one thing: a toy target registered in one place shows up in the
CLI, export, the runtime, the planner and inspect; constants live once; passes ask the family."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from deltaship.errors import DeltashipError
from deltaship.targets import (
    PRECISIONS,
    StorageFormat,
    Target,
    TargetOptions,
    get_target,
    option,
    register,
    table,
    unregister,
)
from deltaship.targets.tolerances import Tolerance

PACKAGE = Path(__file__).resolve().parents[1] / "deltaship"


@dataclass(frozen=True)
class ToyOptions(TargetOptions):
    toy_knob: int = field(default=3, metadata=option("a toy option", choices=(3, 5)))


class ToyTarget(Target):
    """ONNX's artifact under another name: everything a target declares, in one class."""

    name = "toy"
    description = "a test target (ONNX's lowering and session)"
    lowering_module = "deltaship.lowering.onnx.model"
    Options = ToyOptions
    tool_packages = ("onnx", "onnxruntime")
    usage = ("toy usage",)
    pass_options = {"accuracy_level": 4, "onnx_deltanet_ops": "standard"}  # what ONNX's lowering reads
    tolerances = {p: Tolerance(1e-3, 1.0, 1e-3, True) for p in PRECISIONS}
    formats = {p: StorageFormat(bits=8, scale=0, block=1, head_copy=False, act=1) for p in PRECISIONS}
    runtime_base_bytes = 1 << 20

    def pipeline(self):
        return get_target("onnx").pipeline()

    def io_inputs(self, ctx):
        return get_target("onnx").io_inputs(ctx)

    def open_session(self, bundle, manifest, **kw):
        return get_target("onnx").open_session(bundle, manifest, **kw)


@pytest.fixture
def toy():
    register(ToyTarget)
    yield get_target("toy")
    unregister("toy")


def test_a_registered_target_is_everywhere(toy, tmp_path, capsys):
    from deltaship.bundle import schema_problems
    from deltaship.check.inspect import describe, inspect
    from deltaship.cli import build_parser
    from deltaship.compile import export
    from deltaship.devices.plan import plan
    from deltaship.targets import open_bundle

    with pytest.raises(SystemExit):
        build_parser().parse_args(["export", "--help"])
    help_text = capsys.readouterr().out
    assert "toy" in help_text.split("--target")[1].split("\n")[0] and "--toy-knob {3,5}" in help_text
    assert ("toy", "int4") in table()

    m = export("qwen3.5-tiny", tmp_path / "toy", target="toy", toy_knob=5, max_context=64, verify=False, progress=False)
    assert m["target"] == "toy" and m["usage"] == ["toy usage"] and not schema_problems(m)
    info = inspect(tmp_path / "toy")
    assert info["intact"] and "toy / fp32" in describe(info)
    ref = export("qwen3.5-tiny", tmp_path / "onnx", target="onnx", max_context=64, verify=False, progress=False)
    ids = [100, 101, 102]
    assert (
        open_bundle(tmp_path / "toy").generate(ids, 8).output_ids
        == open_bundle(tmp_path / "onnx").generate(ids, 8).output_ids
    )
    assert ref["files"]["model.onnx"] == m["files"]["model.onnx"]

    rows = plan("qwen3.5-tiny", tier="phone-8gb", targets=["toy"])
    assert {r["target"] for r in rows} == {"toy"}
    params = sum(v for k, v in m["model"]["parameters"].items() if k != "total")
    assert all(abs(r["weights_bytes"] - params) <= params * 0.05 for r in rows)  # 8 bits a weight


def test_target_options_are_typed_and_owned(toy, tmp_path):
    from deltaship.compile import export

    with pytest.raises(DeltashipError, match="--toy-knob must be 3 or 5, got 4"):
        export("qwen3.5-tiny", tmp_path / "a", target="toy", toy_knob=4, progress=False)
    with pytest.raises(DeltashipError, match="--toy-knob applies to --target toy, not onnx"):
        export("qwen3.5-tiny", tmp_path / "b", target="onnx", toy_knob=3, progress=False)
    assert not any(tmp_path.iterdir())


def test_every_family_module_has_the_interface():
    import importlib

    from deltaship.models.families import ARCHITECTURES, FAMILIES, INTERFACE

    assert set(ARCHITECTURES.values()) <= set(FAMILIES)
    for model_type, module in FAMILIES.items():
        missing = [n for n in INTERFACE if not hasattr(importlib.import_module(module), n)]
        assert not missing, f"family {model_type} ({module}) lacks {missing}"


def _sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text() for p in PACKAGE.rglob("*.py")}


def test_constants_are_defined_once_and_targets_are_not_compared_by_name():
    src = _sources()
    for const in ("PRECISIONS", "DEFAULT_PREFILL_CHUNK"):
        where = [f for f, text in src.items() if re.search(rf"^{const}\s*=", text, re.M)]
        assert where == ["targets/base.py"], (const, where)
    assert not [f for f, text in src.items() if re.search(r"^TARGETS\s*=", text, re.M)]  # the registry is the list
    compared = [
        f"{f}: {m.group(0)}"
        for f, text in src.items()
        if not f.startswith("targets/")
        for m in re.finditer(r"""target\s*[!=]=\s*["'][a-z]+["']""", text)
    ]
    assert not compared, compared
    duck = [f for f, text in src.items() if re.search(r"(getattr|hasattr)\(tmod", text)]
    assert not duck, duck
    assert not [f for f, text in src.items() if "import qwen3_5" in text and f.startswith("export/passes")]


def test_every_deltaship_import_names_an_existing_module():
    """A module moved in a reshape leaves no import behind (imports inside functions included)."""
    import importlib.util

    root = PACKAGE.parent
    missing = []
    for path in [*PACKAGE.rglob("*.py"), *(root / "tests").rglob("*.py"), *(root / "bench").rglob("*.py")]:
        for m in re.finditer(r"^\s*(?:from|import)\s+(deltaship(?:\.\w+)*)", path.read_text(), re.M):
            try:
                found = importlib.util.find_spec(m.group(1)) is not None
            except ModuleNotFoundError:
                found = False
            if not found:
                missing.append(f"{path.relative_to(root)}: {m.group(1)}")
    assert not missing, missing


def test_a_missing_toolchain_names_the_extra(tmp_path, monkeypatch):
    import importlib.util

    from deltaship.compile import export
    from deltaship.targets import open_bundle

    bundle = tmp_path / "b"
    export("qwen3.5-tiny", bundle, max_context=32, verify=False, progress=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    with pytest.raises(DeltashipError, match="needs onnxruntime") as e:
        open_bundle(bundle)
    assert e.value.fix == 'pip install "deltaship[onnx]"'
    with pytest.raises(DeltashipError, match="needs onnxruntime"):
        export("qwen3.5-tiny", tmp_path / "c", max_context=32, verify=False, progress=False)
    assert not (tmp_path / "c").exists()
