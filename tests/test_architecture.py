"""The house rules that keep a target one thing: a toy target registered in one place shows up in the
CLI, export, the runtime, the planner and inspect; constants live once; passes ask the family."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from deltaship.errors import DeltashipError
from deltaship.targets import (
    PRECISIONS,
    StorageFormat,
    Target,
    get_target,
    option,
    register,
    table,
    unregister,
)
from deltaship.targets.onnx import OnnxOptions
from deltaship.targets.tolerances import Tolerance

PACKAGE = Path(__file__).resolve().parents[1] / "deltaship"


@dataclass(frozen=True)
class ToyOptions(OnnxOptions):  # ONNX's lowering reads ONNX's options, typed
    toy_knob: int = field(default=3, metadata=option("a toy option", choices=(3, 5)))


class ToyTarget(Target):
    """ONNX's artifact under another name: everything a target declares, in one class."""

    name = "toy"
    description = "a test target (ONNX's lowering and session)"
    lowering_module = "deltaship.lowering.onnx.model"
    Options = ToyOptions
    tool_packages = ("onnx", "onnxruntime")
    usage = ("toy usage",)
    tolerances = {p: Tolerance(1e-3, 1.0, 1e-3, True) for p in PRECISIONS}
    formats = {p: StorageFormat(bits=8, scale=0, block=1, head_copy=False, act=1) for p in PRECISIONS}
    runtime_base_bytes = 1 << 20
    app_platforms = {"web": "onnxruntime-web"}  # ONNX's graph: the web kit runs it

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

    # the app kits and the image side ask the target: its platforms take it, the others and images refuse it
    from deltaship.apps import write_kit
    from deltaship.targets import a_bundle, open_multimodal

    assert write_kit(tmp_path / "toy", tmp_path / "kit", "web")["target"] == "toy"
    with pytest.raises(DeltashipError, match="is a toy bundle; the android kit runs ExecuTorch, ONNX or QNN bundles"):
        write_kit(tmp_path / "toy", tmp_path / "kit2", "android")
    assert a_bundle("toy") == "a toy bundle" and a_bundle("onnx") == "an ONNX bundle"
    with pytest.raises(DeltashipError, match="toy bundles take no images"):
        open_multimodal(open_bundle(tmp_path / "toy"))

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


def test_app_platforms_name_runtimes_the_target_records():
    """A target's app platforms name runtimes its manifests' `app_runtimes` describe (what was checked, and how)."""
    from deltaship.targets import all_targets

    for t in all_targets():
        assert set(t.app_platforms.values()) <= set(t.app_runtimes), (t.name, t.app_platforms)
    assert {p for t in all_targets() for p in t.app_platforms} == {"android", "ios", "web", "desktop"}


def test_every_family_module_has_the_interface():
    import importlib

    from deltaship.models.families import ARCHITECTURES, FAMILIES, INTERFACE

    assert set(ARCHITECTURES.values()) <= set(FAMILIES)
    for model_type, module in FAMILIES.items():
        missing = [n for n in INTERFACE if not hasattr(importlib.import_module(module), n)]
        assert not missing, f"family {model_type} ({module}) lacks {missing}"


def _sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text() for p in PACKAGE.rglob("*.py")}


def test_constants_are_defined_once():
    src = _sources()
    for const in ("PRECISIONS", "DEFAULT_PREFILL_CHUNK"):
        where = [f for f, text in src.items() if re.search(rf"^{const}\s*=", text, re.M)]
        assert where == ["targets/base.py"], (const, where)
    assert not [f for f, text in src.items() if re.search(r"^TARGETS\s*=", text, re.M)]  # the registry is the list
    duck = [f for f, text in src.items() if re.search(r"(getattr|hasattr)\(tmod", text)]
    assert not duck, duck
    assert not [f for f, text in src.items() if "import qwen3_5" in text and f.startswith("lowering/passes")]


# ---- no target knowledge outside deltaship/targets/ -----------------------------------------------------------
_COMPARISONS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)
# Strings equal to a target name that do not name the target, each with why: (file, the line, stripped) -> reason
NOT_A_TARGET = {
    (
        "devices/discovery.py",
        'RUNTIME_PACKAGES = ("onnxruntime", "onnxruntime-gpu", "executorch", "coremltools", "torch")',
    ): "pip distributions whose versions the device report lists (ExecuTorch's runtime package)",
    (
        "logs.py",
        'NOISY = ("torchao", "torch.utils._pytree", "transformers", "coremltools", "executorch", "torch._export")',
    ): "Python logger names of the toolchains",
    (
        "logs.py",
        'for module in ("coremltools", "executorch", "torchao", "torch.utils._pytree", "torch.export", "copyreg"):',
    ): "Python module names whose warnings are quieted",
    (
        "lowering/executorch/requirements.py",
        '"executorch_prim": {"python": None, "cpp_link": ["executorch"], "ios": "executorch"},',
    ): "ExecuTorch's C++ library and iOS framework names",
    (
        "lowering/executorch/requirements.py",
        'WHOLE_ARCHIVE = ("executorch", "custom_ops", "quantized_ops_lib", "optimized_native_cpu_ops_lib", '
        '"xnnpack_backend")',
    ): "ExecuTorch's C++ library names (linked whole-archive)",
    (
        "lowering/executorch/requirements.py",
        '"ios": ["executorch", "executorch_llm", "threadpool"],',
    ): "ExecuTorch's iOS framework names",
}


def _named(node: ast.AST, names: set[str]) -> list[str]:
    """The target names a literal spells: a string, or the strings of a tuple, list or set literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [n for e in node.elts for n in _named(e, names)]
    return []


def target_name_uses(source: str, names: set[str]) -> list[tuple[int, str, str]]:
    """(line, name, the line's text) of every literal that spells a target name where code decides by it: an operand
    of ==, !=, in, not in, is, is not; a match case's value or mapping key; a dict key; an element of a tuple, list or
    set literal (a table of targets)."""
    lines = source.splitlines()
    hits = set()
    for node in ast.walk(ast.parse(source)):
        found: list[str] = []
        if isinstance(node, ast.Compare) and any(isinstance(op, _COMPARISONS) for op in node.ops):
            found = [n for x in (node.left, *node.comparators) for n in _named(x, names)]
        elif isinstance(node, ast.Dict):
            found = [n for k in node.keys if k is not None for n in _named(k, names)]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            found = _named(node, names)
        elif isinstance(node, ast.MatchValue):
            found = _named(node.value, names)
        elif isinstance(node, ast.MatchMapping):
            found = [n for k in node.keys for n in _named(k, names)]
        hits.update((node.lineno, n, lines[node.lineno - 1].strip()) for n in found)
    return sorted(hits)


def _target_knowledge_outside_targets(sources: dict[str, str], names: set[str]) -> list[str]:
    return [
        f"{f}:{line}: {name!r} in `{text}`"
        for f, text_ in sorted(sources.items())
        if not f.startswith("targets/")
        for line, name, text in target_name_uses(text_, names)
        if (f, text) not in NOT_A_TARGET
    ]


def test_no_target_name_is_compared_or_tabled_outside_targets():
    """Code outside deltaship/targets/ asks the target (an attribute of its Target class), never compares a target
    name or keeps a table keyed by one: every spelling of a registered name in a comparison, a match case, a dict
    key or a tuple/list/set literal is found (the AST, not a regex over one spelling)."""
    from deltaship.targets import target_names

    names = set(target_names())
    assert {"onnx", "executorch", "coreml"} <= names
    found = _target_knowledge_outside_targets(_sources(), names)
    assert not found, "target knowledge outside deltaship/targets/ (ask the Target instead):\n" + "\n".join(found)
    src = _sources()
    stale = [key for key in NOT_A_TARGET if key[1] not in [ln.strip() for ln in src.get(key[0], "").splitlines()]]
    assert not stale, f"allow-list entries that match no line any more (remove them): {stale}"


@pytest.mark.parametrize(
    "code",
    [
        'if manifest.get("target") != "onnx":\n    pass\n',
        'ok = target == "coreml"\n',
        'ok = "executorch" == manifest["target"]\n',
        'ok = target in ("onnx", "executorch")\n',
        'ok = target not in {"coreml"}\n',
        'ok = target in ["onnx"]\n',
        'ok = target is "onnx"\n',
        'match target:\n    case "onnx":\n        pass\n',
        'match target:\n    case "coreml" | "executorch":\n        pass\n',
        'match m:\n    case {"onnx": x}:\n        pass\n',
        'KITS = {"onnx": 1, "executorch": 2}\n',
        'KITS = dict(a=1, **{"coreml": 3})\n',
        'RUNS = ("onnx",)\n',
        'RUNS = {"executorch"}\n',
        'f(["coreml", "x"])\n',
        'ok = (target, x) == ("onnx", 1)\n',
        'def f(manifest):\n    return manifest.get("target") == "onnx" and 1\n',
    ],
)
def test_the_target_name_check_catches_every_spelling(code):
    """The check above, fed each spelling in a module outside targets/ (and the same module inside it, allowed)."""
    names = {"onnx", "executorch", "coreml"}
    assert _target_knowledge_outside_targets({"apps/x.py": code}, names), code
    assert not _target_knowledge_outside_targets({"targets/x.py": code}, names)


@pytest.mark.parametrize(
    "code",
    [
        'print("export with --target onnx")\n',  # a message naming a flag
        'path.suffix == ".onnx"\n',  # a file extension
        'node.domain == "ai.onnx"\n',  # an opset domain
        'import_module("onnx")\n',  # a module name passed, not compared
        'def export(target: str = "onnx"): ...\n',  # a default argument
        "x = t.name == name\n",  # names compared as values
    ],
)
def test_the_target_name_check_leaves_other_strings_alone(code):
    assert not _target_knowledge_outside_targets({"apps/x.py": code}, {"onnx", "executorch", "coreml"}), code


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


def test_one_generic_aten_table_serves_both_graph_lowerers():
    """The aten ops lowered the same way by ONNX and Core ML are one function each (deltaship/lowering/aten.py),
    over primitives both lowerers implement; a lowerer that registered its own copy would fail at import."""
    from deltaship.lowering.aten import GENERIC, GraphOps
    from deltaship.lowering.coreml.lowering import MIL_LOWERINGS, MILLowerer
    from deltaship.lowering.onnx.lowering import LOWERINGS, Lowerer

    assert len(GENERIC) >= 19
    for op in GENERIC:
        assert LOWERINGS.get(op) is GENERIC.get(op) is MIL_LOWERINGS.get(op), op
    primitives = [n for n in vars(GraphOps) if not n.startswith("_")]
    assert {"value", "elementwise", "cast", "expand_dims", "concat", "split"} <= set(primitives)
    for cls in (Lowerer, MILLowerer):
        assert not [n for n in primitives if not callable(getattr(cls, n, None))], cls


# ---- nothing is set on an export's context or settings after they are built ----------------------------------
# The names an export's context and settings go by (ExportContext, ExportSettings, LoweringSettings), and the
# classes: a parameter annotated with one of them counts whatever its name.
CONTEXT_NAMES = {"ctx", "ctx2", "context", "settings", "lowering"}
CONTEXT_CLASSES = {"ExportContext", "ExportSettings", "LoweringSettings", "CheckSettings", "KvCachePlan"}


def _held(node: ast.AST) -> ast.AST:
    """The object an assignment target writes into: `a.b[c][d]` -> `a.b` (the attribute holding the container)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return node


def context_writes(source: str) -> list[tuple[int, str]]:
    """(line, code) of every write into an export context's or settings' attribute: `ctx.x = ...`, `ctx.x += ...`,
    `ctx.x[k] = ...`, `del ctx.x`, `setattr(ctx, ...)`, `object.__setattr__(ctx, ...)`. Rebinding the name
    (`ctx = replace(ctx, ...)`) makes a new object and is not a write; nor is `ctx.model.flag = ...` (the module
    tree is the passes' product, rewritten by them)."""
    tree = ast.parse(source)
    found: list[tuple[int, str]] = []
    for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module))]:
        names = set(CONTEXT_NAMES)
        if not isinstance(fn, ast.Module):
            for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs:
                if a.annotation is not None and set(re.findall(r"\w+", ast.unparse(a.annotation))) & CONTEXT_CLASSES:
                    names.add(a.arg)

        def is_context(node: ast.AST) -> bool:
            return isinstance(node, ast.Name) and node.id in names

        for node in ast.walk(fn):
            targets: list[ast.AST] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            elif isinstance(node, ast.Call) and node.args:
                f = ast.unparse(node.func)
                if f in ("setattr", "object.__setattr__", "delattr") and is_context(node.args[0]):
                    found.append((node.lineno, ast.unparse(node)))
            for t in targets:
                for leaf in t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]:
                    held = _held(leaf)
                    if isinstance(held, ast.Attribute) and is_context(held.value):
                        found.append((node.lineno, ast.unparse(node).splitlines()[0]))
    return sorted(set(found))


def test_nothing_is_set_on_an_export_context_or_its_settings():
    """The export path's context and settings are built once: the passes return their products (passes.Made), a
    lowering returns its own in its `Lowered`; no module writes into one after it is built (docs/architecture.md)."""
    from deltaship.lowering.passes import ExportContext

    writes = [f"{f}:{line}: {code}" for f, text in _sources().items() for line, code in context_writes(text)]
    assert not writes, writes
    with pytest.raises(AttributeError):  # and at run time: the context is frozen, products included
        ExportContext(None).states = []


@pytest.mark.parametrize(
    "code",
    [
        "def f(ctx):\n    ctx.states = []",
        "def f(ctx):\n    ctx.rounded: dict = {}",
        "def f(ctx):\n    ctx.quant['linear']['w'] = 1",
        "def f(ctx):\n    ctx.programs['mtp'] = (1, 2)",
        "def f(ctx2):\n    ctx2.report += [1]",
        "def f(ctx):\n    ctx.model, x = None, 1",
        "def f(ctx):\n    del ctx.model",
        "def f(ctx):\n    setattr(ctx, 'states', [])",
        "def f(ctx):\n    object.__setattr__(ctx, 'states', [])",
        "def f(settings):\n    settings.kv = None",
        "def f(c: ExportContext):\n    c.parts = []",
        "def f(c: 'LoweringSettings | None'):\n    c.prefill_chunk = 8",
    ],
)
def test_the_context_write_check_catches_every_spelling(code):
    assert context_writes(code), code


@pytest.mark.parametrize(
    "code",
    [
        "def f(ctx):\n    ctx = replace(ctx, states=[])",
        "def f(ctx):\n    ctx.model.last_token_only = True",
        "def f(ctx):\n    ctx.plan.add_source('a', 'a', (1,))",
        "def f(ctx):\n    states = [dict(s) for s in ctx.states]\n    states[0]['layout'] = 'x'",
        "def f(model):\n    model.states = []",
    ],
)
def test_the_context_write_check_leaves_other_writes_alone(code):
    assert not context_writes(code), code
