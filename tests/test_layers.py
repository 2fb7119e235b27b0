"""The layers of the package (docs/architecture.md): the import-linter contracts in pyproject.toml hold, the
package has no import cycle, and a function imports something itself only to load a toolchain lazily.

Every rule here is fed a synthetic breach too, so a check that stopped looking would fail."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "deltaship"

# What a function may import itself, and why: the toolchains (heavy to import, or optional extras).
TOOLCHAINS = {
    "torch": "heavy (seconds to import)",
    "torchao": "ExecuTorch's quantizer",
    "transformers": "heavy; the reference and the HF face only",
    "coremltools": "the coreml extra",
    "executorch": "the executorch extra",
    "onnx": "the onnx extra's graph library",
    "onnxruntime": "the runtime an ONNX session loads",
    "onnxruntime_genai": "the genai extra",
    "onnxruntime_qnn": "the qnn extra",
    "PIL": "images only",
    "av": "the video extra",
    "matplotlib": "plots only",
    "tokenizers": "the tokenizer library, only where text is encoded",
    "huggingface_hub": "Hub ids only",
    "safetensors": "checkpoint and session files only",
    "jinja2": "chat templates only",
    "jsonschema": "schema checks only",
    "pynvml": "NVIDIA GPUs only",
    "rich": "the progress display only",
    "readline": "interactive chat only (it changes the terminal's line editing)",
    "starlette": "the serve extra's HTTP framework",
    "uvicorn": "the serve extra's HTTP server",
    "pydantic": "the serve extra's request checks",
    "ray": "the fleet extra (deltaship fleet run)",
}
LAZY = re.compile(r"#\s*lazy:\s*(\S.*)")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(tree: ast.Module) -> set[str]:
    """Modules a module imports when it is imported (not in functions or classes, not under TYPE_CHECKING)."""
    out: set[str] = set()

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                out.add(child.module)
                out.update(f"{child.module}.{a.name}" for a in child.names)
            walk(child)

    walk(tree)
    return out


class ImportMap:
    """The package's import-time graph, from the source (nothing is imported)."""

    def __init__(self, sources: dict[str, str]):
        self.trees = {name: ast.parse(src) for name, src in sources.items()}
        self.sources = sources
        self.graph = {name: _top_level_imports(tree) for name, tree in self.trees.items()}
        self._toolchain: dict[str, str | None] = {}

    def toolchain(self, module: str) -> str | None:
        """The toolchain importing `module` loads (itself, or through the package's modules), or None."""
        top = module.split(".")[0]
        if top != "deltaship":
            return top if top in TOOLCHAINS else None
        if module not in self.graph:
            return None  # a name in a module
        if module not in self._toolchain:
            self._toolchain[module] = None  # a cycle reads as "none yet"
            parents = [".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)]
            found = (self.toolchain(d) for d in [*sorted(self.graph[module]), *parents] if d != module)
            self._toolchain[module] = next((t for t in found if t), None)
        return self._toolchain[module]

    def local_imports(self):
        """(module, line, what it imports, the toolchain that loads, the reason written) per import in a function."""
        for name, tree in self.trees.items():
            lines = self.sources[name].splitlines()
            own = {self.toolchain(d) for d in self.graph[name]} - {None}

            def walk(node: ast.AST, inside: bool):
                for child in ast.iter_child_nodes(node):
                    deeper = inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    if inside and isinstance(child, (ast.Import, ast.ImportFrom)):
                        what = child.module if isinstance(child, ast.ImportFrom) else child.names[0].name
                        targets = [what]
                        if isinstance(child, ast.ImportFrom):
                            targets += [f"{what}.{a.name}" for a in child.names]
                        tool = next((t for t in map(self.toolchain, targets) if t), None)
                        reason = LAZY.search(lines[child.lineno - 1]) or _reason_above(lines, child.lineno - 2)
                        yield name, child.lineno, what, (None if tool in own else tool), reason
                    yield from walk(child, deeper)

            yield from walk(tree, False)


def _reason_above(lines: list[str], k: int):
    """The reason of a run of imports: a `# lazy:` on an import line above in the run, or a comment line above it."""
    while k >= 0 and lines[k].lstrip().startswith(("from ", "import ")):
        if LAZY.search(lines[k]):
            return LAZY.search(lines[k])
        k -= 1
    return LAZY.search(lines[k]) if k >= 0 and lines[k].lstrip().startswith("#") else None


def _package_sources() -> dict[str, str]:
    return {_module_name(p): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def local_import_problems(imports: ImportMap) -> list[str]:
    problems = []
    for module, line, what, tool, reason in imports.local_imports():
        where = f"{module} l.{line}: import of {what} inside a function"
        if module == "deltaship" and reason:  # the package's face: `import deltaship` stays thin (PEP 562 names)
            continue
        if tool is None:
            problems.append(f"{where} loads no toolchain the module does not load already: import it at the top")
        elif reason is None:
            problems.append(f"{where} (it loads {tool}) has no `# lazy: <reason>` comment")
    return problems


def test_the_contracts_hold():
    """lint-imports (import-linter) with the contracts of pyproject.toml: the layers, lowering and runtimes apart,
    the target packages of the lowering apart."""
    run = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    g = nx.DiGraph()
    for module in graph.modules:
        g.add_edges_from((module, m) for m in graph.find_modules_directly_imported_by(module))
    return [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]


def test_no_import_cycle():
    """No two modules import each other, directly or round a loop (imports inside functions count)."""
    assert _cycles(grimp.build_graph("deltaship")) == []


def test_the_cycle_check_sees_a_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / "knot"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from knot import b  # a function-local import still ties the knot\n")
    (pkg / "b.py").write_text("from knot import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _cycles(grimp.build_graph("knot", cache_dir=None)) == [["knot.a", "knot.b"]]


def test_function_local_imports_only_load_toolchains():
    """An import inside a function is there to load a toolchain lazily, and says so (`# lazy: <reason>`);
    everything else is imported at the top of the module, where a reader sees it."""
    problems = local_import_problems(ImportMap(_package_sources()))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import json\n\ndef f():\n    import torch  # lazy: heavy\n    return torch, json\n", None),
        ("def f():\n    import torch\n    return torch\n", "has no `# lazy: <reason>` comment"),
        ("def f():\n    import json  # lazy: no\n    return json\n", "loads no toolchain"),
        ("def f():\n    from deltaship.light import x  # lazy: no\n    return x\n", "loads no toolchain"),
        ("def f():\n    from deltaship.heavy import x  # lazy: torch\n    return x\n", None),
        ("import torch\n\ndef f():\n    import torch  # lazy: torch\n    return torch\n", "loads no toolchain"),
        ("class C:\n    def m(self):\n        import onnx\n        return onnx\n", "has no `# lazy"),
        ("def f():\n    # lazy: onnx\n    import json\n    import onnx\n    return onnx, json\n", "loads no toolchain"),
        ("def f():\n    # lazy: onnx\n    import onnx\n    import onnx.helper\n    return onnx\n", None),
        ("def f():\n    # lazy: onnx\n    x = 1\n    import onnx\n    return onnx, x\n", "has no `# lazy"),
    ],
)
def test_the_local_import_rule_catches(source, expected):
    imports = ImportMap(
        {
            "deltaship.probe": source,
            "deltaship.light": "import json\nx = 1\n",
            "deltaship.heavy": "import torch\nx = 1\n",
            "deltaship": "",
        }
    )
    problems = [p for p in local_import_problems(imports) if p.startswith("deltaship.probe")]
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and expected in problems[0], problems


def test_the_architecture_page_draws_the_contracted_layers():
    """docs/architecture.md's layer table lists the layers of pyproject.toml's contract, top to bottom."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    expected = [sorted(re.split(r"\s*[|:]\s*", layer)) for layer in layers]
    doc = (ROOT / "docs" / "architecture.md").read_text()
    table = doc.split("<!-- layers -->")[1].split("<!-- /layers -->")[0]
    rows = [line for line in table.splitlines() if line.startswith("| L")]
    drawn = [sorted(re.findall(r"`([\w.]+)`", re.split(r"(?<!\\)\|", row)[2])) for row in rows]
    assert drawn == expected, "docs/architecture.md's layer table and pyproject.toml's contract differ"


def test_the_package_face_stays_thin():
    """`import deltaship.<anything>` runs deltaship/__init__.py first: it loads only the logging set-up, so a small
    process (the ONNX Runtime worker, a kit's tooling) needs none of deltaship's dependencies beyond what it uses."""
    code = "import sys, deltaship; print(sorted(m for m in sys.modules if m.startswith('deltaship')))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0 and run.stdout.split() == ["['deltaship',", "'deltaship.logs']"], run.stdout + run.stderr
