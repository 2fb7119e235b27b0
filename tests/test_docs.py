"""The docs as a whole: every page is reachable from docs/index.md, and lists that restate data (the tier
catalog) say what the data says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from deltaship.devices import catalog
from deltaship.errors import DeltashipError

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```[^\n]*\n.*?^```[ \t]*$", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _links(page: Path) -> set[Path]:
    """The local files a markdown page links to (anchors and web addresses dropped)."""
    out = set()
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue
        path = target.partition("#")[0]
        if path:
            out.add((page.parent / path).resolve())
    return out


def reachable(start: Path) -> set[Path]:
    seen, todo = {start.resolve()}, [start.resolve()]
    while todo:
        page = todo.pop()
        for dest in _links(page):
            if dest.suffix == ".md" and dest.is_file() and dest not in seen:
                seen.add(dest)
                todo.append(dest)
    return seen


def test_every_page_is_reachable_from_the_index():
    pages = {p.resolve() for p in DOCS.rglob("*.md")}
    assert len(pages) > 10
    lost = sorted(p.relative_to(ROOT).as_posix() for p in pages - reachable(DOCS / "index.md"))
    assert not lost, f"pages no link path from docs/index.md reaches (link them from index.md): {lost}"


def test_reachability_sees_a_page_nothing_links(tmp_path):
    (tmp_path / "index.md").write_text("[a](a.md)\n")
    (tmp_path / "a.md").write_text("[b](sub/b.md#top)\n```\n[c](c.md)\n```\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("[index](../index.md) [web](https://example.com/x.md)\n")
    (tmp_path / "c.md").write_text("only linked from a code block\n")
    got = {p.relative_to(tmp_path.resolve()).as_posix() for p in reachable(tmp_path / "index.md")}
    assert got == {"index.md", "a.md", "sub/b.md"}


def _tier_tables() -> dict[str, str]:
    """Each page (docs/ and the README) with the tier markers: the text between them."""
    begin, end = catalog.DOC_MARKERS
    pages = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]
    return {
        str(p.relative_to(ROOT)): text.split(begin, 1)[1].split(end, 1)[0].removeprefix("\n")
        for p in pages
        if begin in (text := p.read_text())
    }


def test_the_docs_tier_tables_are_the_catalogs():
    """The docs' tier lists are generated from deltaship/devices/tiers.toml: a tier added, changed or removed there
    fails this test until the docs are regenerated."""
    tables = _tier_tables()
    assert "docs/profiling.md" in tables, f"docs/profiling.md lost its {catalog.DOC_MARKERS} markers"
    want = catalog.tier_table_markdown()
    for page, table in tables.items():
        assert table == want, (
            f"{page}'s tier table differs from deltaship/devices/tiers.toml: run {catalog.REGENERATE} {page}"
        )


def test_a_new_tier_changes_the_generated_table(tmp_path, monkeypatch):
    """What the test above compares against follows the catalog: a new tier is a new row, and --write puts it
    between the markers (and only there)."""
    extra = tmp_path / "tiers.toml"
    extra.write_text(
        catalog.CATALOG.read_text()
        + '\n[tiers.watch-1gb]\nkind = "watch"\nram_gib = 1\nbudget_gib = 0.25\ntargets = ["onnx"]\n'
        'precisions = ["int4"]\ncontext = 512\n'
    )
    before = catalog.tier_table_markdown()
    monkeypatch.setattr(catalog, "CATALOG", extra)
    after = catalog.tier_table_markdown()
    assert after.startswith(before) and after[len(before) :].startswith("| watch-1gb | watch | 1 GiB | 0.25 GiB |")
    doc = tmp_path / "page.md"
    doc.write_text(f"intro\n{catalog.DOC_MARKERS[0]}\nold rows\n{catalog.DOC_MARKERS[1]}\noutro\n")
    assert catalog.main(["--write", str(doc)]) == 0
    assert doc.read_text() == f"intro\n{catalog.DOC_MARKERS[0]}\n{after}{catalog.DOC_MARKERS[1]}\noutro\n"
    doc.write_text("no markers\n")
    with pytest.raises(DeltashipError, match="needs one"):
        catalog.main(["--write", str(doc)])


def reliability_references(text: str) -> list[tuple[str, str]]:
    """(test file, test name) for every test docs/reliability.md names: `tests/<file>.py::name`, and `::name` for
    another test of the file named last before it."""
    refs, current = [], None
    for file, name in re.findall(r"`(tests/[\w/]+\.py)?::(\w+)`", text):
        current = file or current
        assert current is not None, f"::{name} names no file before it"
        refs.append((current, name))
    return refs


def test_reliability_names_only_tests_that_exist():
    """Each promise of docs/reliability.md names the test that keeps it: the test must exist, so a renamed or
    dropped test cannot leave a promise that nothing checks."""
    refs = reliability_references((DOCS / "reliability.md").read_text())
    assert len(refs) >= 40, refs
    missing = [
        f"{file}::{name}"
        for file, name in refs
        if not re.search(rf"^\s*(async )?def {name}\(", (ROOT / file).read_text(), re.M)
    ]
    assert not missing, f"docs/reliability.md names tests that do not exist: {missing}"
    assert reliability_references("`tests/a.py::x`, `::y`") == [("tests/a.py", "x"), ("tests/a.py", "y")]


# `822ab80:bench/x.py` names a removed script at the commit that had it (git show REV:PATH), not a file here
BENCH_SCRIPT = re.compile(r"(?<![:\w/])bench/[\w/]+\.(?:py|sh)\b")


def test_the_docs_and_code_name_only_bench_scripts_that_exist():
    """A moved or renamed benchmark script leaves no command behind: every `bench/....py|sh` named in the docs, the
    READMEs, the bench scripts' own usage lines and the package's comments is a file. Raw JSON under bench/results/
    is left out: its recorded commands say where a script was when it ran."""
    texts = [*DOCS.rglob("*.md"), ROOT / "README.md", *(ROOT / "bench").rglob("*.md")]
    texts += [*(ROOT / "bench").rglob("*.py"), *(ROOT / "bench").rglob("*.sh"), *(ROOT / "tests").rglob("*.py")]
    texts += [*(ROOT / "deltaship").rglob("*.py"), *(ROOT / "deltaship").rglob("*.toml")]
    named = {(str(p.relative_to(ROOT)), s) for p in texts for s in BENCH_SCRIPT.findall(p.read_text())}
    assert len(named) > 100, "the pattern no longer finds the commands"
    missing = sorted(f"{where}: {script}" for where, script in named if not (ROOT / script).is_file())
    assert not missing, missing


def test_bench_readme_lists_every_script():
    """bench/README.md is the index of bench/: each script in a group folder has its line there."""
    index = (ROOT / "bench" / "README.md").read_text()
    scripts = [p for p in (ROOT / "bench").glob("*/*") if p.suffix in (".py", ".sh")]
    assert len(scripts) > 20
    assert not [str(p.relative_to(ROOT)) for p in scripts if f"`{p.name}`" not in index]
    assert not [p.name for p in (ROOT / "bench").glob("*.py")], "a script directly under bench/: put it in a group"


def _web_kit_install() -> str:
    """The install command of the web kit's own README.md (one line under its "## Install")."""
    from deltaship.apps.web import _readme

    m = {"entry": "model.onnx", "precision": "int4", "prefill_chunk": 16, "max_context": 64, "states": []}
    body = _readme(m, "web", ["model.onnx"]).split("## Install", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    (line,) = [ln for ln in body.splitlines() if ln.strip() and not ln.startswith("#")]
    return line


def test_the_docs_install_the_web_kit_as_its_readme_says():
    """The README's and docs/ship.md's `cd dist/web` line installs the web kit the way the kit's README does: no
    step of the desktop kit's (onnxruntime-node's CUDA download skipped), which the web kit does not install."""
    install = _web_kit_install()
    assert install == "npm install"
    for page in (ROOT / "README.md", DOCS / "ship.md"):
        lines = [ln for ln in page.read_text().splitlines() if ln.startswith("cd dist/web ")]
        assert lines == [f"cd dist/web && {install} && python3 -m http.server 8000"], (page.name, lines)


def _ship_table_rows() -> list[tuple[str, str, str]]:
    """(platform, target, kit platform) of docs/ship.md's table: the `--target` and `--platform` it pairs."""
    rows = []
    for line in (DOCS / "ship.md").read_text().splitlines():
        target, kit = re.search(r"`--target (\w+)`", line), re.search(r"`--platform (\w+)`", line)
        if line.startswith("|") and target and kit:
            rows.append((line.split("|")[1].strip(), target.group(1), kit.group(1)))
    return rows


def _readme_ship_pairs() -> list[tuple[str, str]]:
    """(target, kit platform) of each `deltaship app` command in the README: the target its bundle was exported to."""
    exported, pairs = {}, []
    for line in (ROOT / "README.md").read_text().splitlines():
        if m := re.match(r"deltaship export .*--target (\w+) .*--out (\S+)", line):
            exported[m.group(2)] = m.group(1)
        elif m := re.match(r"deltaship app (\S+) --platform (\w+)", line):
            pairs.append((exported[m.group(1)], m.group(2)))
    return pairs


def test_the_docs_promise_only_kits_that_take_the_bundle():
    """Each bundle-and-kit pair docs/ship.md's table and the README's Ship-it commands promise is one the kit takes
    (the target's app_platforms, which `deltaship app` asks): an iOS row for ExecuTorch bundles, say, would be a
    promise `deltaship app --platform ios` refuses."""
    from deltaship.targets import get_target

    rows = _ship_table_rows()
    assert len(rows) >= 5 and ("iOS, macOS", "coreml", "ios") in rows, rows
    pairs = _readme_ship_pairs()
    assert ("executorch", "android") in pairs and ("coreml", "ios") in pairs, pairs
    refused = [(t, k) for _, t, k in rows if k not in get_target(t).app_platforms]
    refused += [(t, k) for t, k in pairs if k not in get_target(t).app_platforms]
    assert not refused, f"the docs pair bundles with kits that refuse them (target, platform): {refused}"


# A repository path (`deltaship/runtimes/onnx.py`, `bench/gpu/run.sh`, `docs/results/memory.md`, `tests/...py`), or
# one under the package without its prefix (`runtimes/onnx.py`). `822ab80:bench/...` names a file at a commit (git
# show REV:PATH) and `/tmp/deltaship/...` is not in the repository: the look-behind leaves both out, and a glob or a
# brace list (`memory-profile-*.json`) never ends in `\w.ext`, so it is not read as a path.
_EXT = r"\.(?:py|md|sh|toml|json|mjs)\b"
_TOP_PATH = re.compile(r"(?<![\w/.:~$-])((?:deltaship|bench|docs|tests|tools)/[\w./-]*\w" + _EXT + ")")
_PKG_DIRS = sorted(p.name for p in (ROOT / "deltaship").iterdir() if p.is_dir() and not p.name.startswith("_"))
_PKG_PATH = re.compile(r"(?<![\w/.:~$-])((?:" + "|".join(_PKG_DIRS) + r")/[\w./-]*\w\.py\b)")


def _prose(path: Path) -> str:
    """What a file says to a reader: a page whole; a Python file's docstrings and comments (its code's strings are
    data, such as a test's made-up module names); a shell script's or TOML file's comment lines."""
    text = path.read_text()
    if path.suffix == ".md":
        return text
    if path.suffix != ".py":
        return "\n".join(ln.partition("#")[2] for ln in text.splitlines())
    import ast
    import io
    import tokenize

    parts = [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            parts.append(ast.get_docstring(node, clean=False) or "")
    return "\n".join(parts)


def missing_paths(path: Path, text: str) -> list[str]:
    """The repository paths `text` (read from `path`) names that are not there: a top-level path from the root, a
    package-relative one under deltaship/ (or, in bench/, under bench/)."""
    out = [p for p in _TOP_PATH.findall(text) if not (ROOT / p).exists()]
    bases = [ROOT / "deltaship", ROOT / path.relative_to(ROOT).parts[0]]
    out += [p for p in _PKG_PATH.findall(text) if not any((b / p).exists() for b in bases) and not (ROOT / p).exists()]
    return out


def test_every_path_the_docs_and_comments_name_exists():
    """A moved or deleted file leaves no pointer behind: every repository path a docs page, a README, a docstring or a
    comment (package, tests, bench scripts, pyproject.toml) names is there. Raw JSON under bench/results/ is left out:
    its recorded commands say where things were when it ran."""
    files = [*DOCS.rglob("*.md"), ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "pyproject.toml"]
    files += (ROOT / "bench").glob("**/*.md")
    for top in ("deltaship", "tests", "bench", "tools"):
        files += [p for ext in ("py", "sh", "toml") for p in (ROOT / top).rglob(f"*.{ext}")]
    files = [p for p in files if p.relative_to(ROOT).parts[:2] != ("bench", "results") and "__pycache__" not in p.parts]
    assert len(files) > 250, len(files)
    missing = sorted(f"{p.relative_to(ROOT)}: {name}" for p in files for name in missing_paths(p, _prose(p)))
    assert not missing, missing


def test_the_path_check_catches_a_made_up_path():
    page = DOCS / "index.md"
    assert missing_paths(page, "see deltaship/runtimes/onnx.py and docs/index.md") == []
    assert missing_paths(page, "see deltaship/runtimes/onnx_gone.py") == ["deltaship/runtimes/onnx_gone.py"]
    assert missing_paths(page, "as `runtimes/gone.py` does") == ["runtimes/gone.py"]
    assert missing_paths(page, "`bench/tools/nope.mjs`, tests/test_nope.py") == [
        "bench/tools/nope.mjs",
        "tests/test_nope.py",
    ]
    # a file at a commit, a path outside the repository, a glob: not read as paths here
    assert missing_paths(page, "822ab80:bench/x/y.py, /tmp/deltaship/a.py, bench/results/memory-*.json") == []
    assert _prose(ROOT / "tests" / "test_architecture.py").count("apps/x.py") == 0  # a code string, not prose
