"""The README is the first thing a newcomer runs: its commands must work as written, and its links resolve.

Shell blocks fenced as ```bash runnable are run in order, in one temporary directory (later blocks use
the bundle the main job writes), with this interpreter's bin directory first on PATH so that `deltaship`
is this environment's. The install and test commands are not run here; they must be the ones CI runs.
docs/ship.md's Python API example runs after them, on the main job's bundle. Every one of them must keep stderr to
deltaship's own lines (progress and notices).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# Pages the README and docs link to that are written in a parallel change; each is checked like any other
# file as soon as it exists. Drop a name from here once its page has landed.
PENDING: set[str] = set()


def fenced(text: str) -> list[tuple[list[str], str]]:
    """(info-string words, body) of every fenced block, in order."""
    return [(info.split(), body) for info, body in FENCE.findall(text)]


def commands(body: str) -> list[str]:
    return [ln.strip() for ln in body.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def section(text: str, heading: str) -> str:
    """The text directly under `heading`, up to the next heading of any level."""
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    nxt = re.search(r"^#+ ", text[start:], re.M)
    return text[start : start + nxt.start()] if nxt else text[start:]


def normalized(line: str) -> list[str]:
    # -q only quiets pip/pytest; it changes neither what is installed nor what is tested
    return [t for t in shlex.split(line) if t != "-q"]


def test_readme_is_short():
    size = README.stat().st_size
    assert size < 10 * 1024, f"README.md is {size} bytes; keep it under 10 KB and move detail to docs/"


def test_the_tour_says_model_takes_a_hub_id_and_allow_download():
    """`--model` in the five-minute tour: a Hub id shaped as deltaship parses one, and `--allow-download`, one of
    export()'s options (the CLI's flags are its arguments); otherwise both appear only in `--help`."""
    from deltaship.compile.settings import EXPORT_OPTIONS
    from deltaship.models.hub import parse_hub_id

    text = README.read_text()
    tour = text[text.index("\n## A five-minute tour\n") : text.index("\n## Targets and precisions\n")]
    assert "`--allow-download`" in tour and "allow_download" in EXPORT_OPTIONS
    ids = [t for t in re.findall(r"`([^`\s]+/[^`\s]+)`", tour) if parse_hub_id(t) and not (ROOT / t).exists()]
    assert ids, "the tour names no Hugging Face id for --model"


def test_install_and_test_commands_are_what_ci_runs():
    text = README.read_text()
    quick = [
        cmd
        for info, body in fenced(section(text, "## Quick start"))
        if info[:1] == ["bash"] and "runnable" not in info
        for cmd in commands(body)
    ]
    install = [c for c in quick if c.startswith("pip install")]
    tests = [c for c in quick if c.startswith("python -m pytest")]
    # a user install (the main job's extra) first, then the contributor install the test command needs
    assert len(install) == 2 and len(tests) == 1, f"expected two installs and one test command in Quick start: {quick}"
    user, contributor = install
    assert user == 'pip install "torch==2.13.0" -e ".[onnx]"', f"the user install is the main job's (onnx): {user!r}"
    ci = [
        normalized(ln)
        for ln in (ROOT / ".ci" / "run").read_text().splitlines()
        if ln.strip() and not ln.lstrip().startswith("#")
    ]
    for cmd in [contributor, *tests]:
        assert normalized(cmd) in ci, f"README command {cmd!r} is not a line of .ci/run"
    # the CPU-only recipe ends with one of those install commands
    cpu = [cmd for info, body in fenced(section(text, "### CPU-only torch")) for cmd in commands(body)]
    assert cpu and cpu[-1] in install, f"the CPU-only torch recipe must end with one of {install}: {cpu}"


def test_the_extras_the_readme_names_exist():
    """Every extra the Quick start names (`onnx`, `executorch`, ...) is one of pyproject.toml's, and each target's
    toolchain extra and the contributor's are named."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    quick = section(README.read_text(), "## Quick start")
    named = set(re.findall(r'\.\[(\w+)\]"', quick)) | set(re.findall(r"`(\w+)` for", quick))
    named |= set(re.findall(r"`(\w+)`[,;]", quick))
    assert named <= set(extras), f"the README names extras pyproject.toml does not have: {named - set(extras)}"
    assert {"onnx", "executorch", "coreml", "qnn", "genai", "video", "dev"} <= named, named


def test_the_sample_log_says_when_where_and_how_long():
    """The sample log's timings are a measurement: the sentence above it names the date, the host and the whole
    command's median time."""
    lines = README.read_text().splitlines()
    at = next(i for i, ln in enumerate(lines) if ln == "```text" and lines[i + 1].startswith("[   0.0s] loading"))
    intro = " ".join(lines[at - 3 : at])
    assert re.search(r"\d{4}-\d{2}-\d{2}", intro) and "2-core" in intro, intro
    assert re.search(r"median\s+\d+(\.\d+)? s \(\d+ runs", intro), intro


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_resolve():
    pages = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    assert len(pages) > 3, "docs/ is missing"
    broken = []
    for page in pages:
        text = FENCE.sub("", page.read_text())
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
            if not dest.exists():
                if rel not in PENDING:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no {rel})")
                continue
            if anchor and dest.suffix == ".md":
                heads = {slug(h) for h in re.findall(r"^#+ (.+)$", FENCE.sub("", dest.read_text()), re.M)}
                if anchor not in heads:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor} in {rel})")
    assert not broken, "broken links:\n" + "\n".join(broken)


SHIP = ROOT / "docs" / "ship.md"
# deltaship's own lines on stderr: a progress line ("[  12.3s] verify: ..."), a notice or error of a command
# ("deltaship generate: ...", "deltaship: error: ..." from argparse) and the fix line under an error ("  fix: ...").
OWN = re.compile(r"^(\[\s*\d+\.\ds\] |deltaship( [a-z-]+)?: |  fix: )")


def foreign(stderr: str) -> list[str]:
    """The stderr lines deltaship did not write itself (a toolchain's notice, a warning, a stray print)."""
    return [ln for ln in stderr.splitlines() if ln.strip() and not OWN.match(ln)]


def test_own_lines_are_told_apart():
    own = "[   0.0s] loading qwen3.5-tiny\n[ 102.4s] verification passed\ndeltaship eval: note\n  fix: x\n"
    assert not foreign(own)
    for line in (
        "Failed to load /x/torchao/_C_mxfp8.so: Could not load this library",
        "W1127 02:05:48.872000 6912 torch/utils/_pytree.py:630] <enum 'KernelPreference'> is an Enum subclass",
        "[transformers] `causal_conv1d_fn` is falling back to its reference PyTorch implementation",
        "E 00:00:00.000 executorch:cpuinfo_utils.cpp:71] Failed to open midr file",
        "lm_head.weight",
        "[W:onnxruntime:, graph.cc:1234 Graph] Initializer logit_rows appears in graph inputs",
    ):
        assert foreign(line) == [line]


def python_example() -> str:
    """docs/ship.md's Python API example (the block that calls deltaship.load)."""
    blocks = [body for info, body in fenced(SHIP.read_text()) if info[:1] == ["python"] and "deltaship.load" in body]
    assert len(blocks) == 1, "docs/ship.md should have one Python example calling deltaship.load"
    return blocks[0]


@pytest.mark.slow  # exports and profiles: the README's other checks (links, length, commands) take milliseconds
def test_runnable_blocks_run(tmp_path):
    runnable = [body for info, body in fenced(README.read_text()) if info[:1] == ["bash"] and "runnable" in info]
    assert len(runnable) >= 5, "the README's runnable blocks (```bash runnable) are missing"
    main = runnable[0]
    assert "deltaship export" in main and "deltaship generate" in main, "the first runnable block must be the main job"
    env = dict(
        os.environ,
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    example = python_example()
    # the README's blocks, then docs/ship.md's Python example on the bundle the main job wrote
    for body in [*runnable, example]:
        r = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", body] if body is not example else [sys.executable, "-c", body],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if r.returncode:
            pytest.fail(
                f"README block failed (exit {r.returncode}):\n{body}\n--- stdout\n{r.stdout[-3000:]}"
                f"\n--- stderr\n{r.stderr[-3000:]}"
            )
        # quiet by default: a newcomer sees deltaship's progress and notices, no toolchain's chatter
        assert not foreign(r.stderr), f"stderr lines that are not deltaship's own, from:\n{body}\n" + "\n".join(
            foreign(r.stderr)
        )
        if body is main:
            prompt = shlex.split(main.split("deltaship generate", 1)[1])
            prompt = prompt[prompt.index("--prompt") + 1]
            last = [ln for ln in r.stdout.splitlines() if ln.strip()][-1]
            assert last.startswith(prompt) and len(last) > len(prompt) + 8, (
                f"the main job printed no generated text after the prompt {prompt!r}: {last!r}"
            )
