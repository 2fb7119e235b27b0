"""Writing an output directory: what --force may replace, one writer per --out, crash recovery, the machine's
errors (disk full, names too long, memory) as one line and exit 3. docs/reliability.md lists the promises."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from filelock import FileLock

from deltaship.bundle import read_manifest
from deltaship.bundle.destination import NAME_MAX, check_output_file, lock_path, recover, siblings, stem, what_is
from deltaship.cli import main
from deltaship.devices import limits

ENV = dict(os.environ, TOKENIZERS_PARALLELISM="false")
FAST = ["--no-verify", "--max-context", "128", "--quiet"]
DEAD = 999_999_999  # no such pid


def tree_digest(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if the export gets as far as loading the model."""
    import deltaship.models.source as source

    def load_source(*a, **k):
        raise AssertionError("the model was loaded before the destination was checked")

    monkeypatch.setattr(source, "load_source", load_source)


@pytest.fixture
def bundle(bundles, tmp_path) -> Path:
    """A copy of a tiny bundle at tmp_path/b, to be replaced."""
    out = tmp_path / "b"
    shutil.copytree(bundles("base"), out)
    return out


def export(capsys, model: str, out: Path, *extra: str) -> tuple[int, str]:
    rc = main(["export", "--model", model, "--out", str(out), *FAST, *extra])
    return rc, capsys.readouterr().err


# ---- what --force may replace ---------------------------------------------------------------------------
def test_force_never_touches_the_input_checkpoint_or_unrelated_files(tmp_path, checkpoints, capsys, no_loading):
    par = tmp_path / "par"
    shutil.copytree(checkpoints["base"], par / "ck")
    (par / "notes.txt").write_text("mine\n")
    before = tree_digest(par)
    rc, err = export(capsys, str(par / "ck"), par, "--force")
    assert rc == 2 and "holds the input" in err and "nothing was written" in err
    rc, err = export(capsys, str(par / "ck"), par / "ck", "--force")
    assert rc == 2 and "is the input" in err
    rc, err = export(capsys, str(par / "ck"), par / "ck" / "inside", "--force")
    assert rc == 2 and "lies inside the input" in err
    rc, err = export(capsys, "qwen3.5-tiny", par, "--force")  # not the input, but not deltaship's either
    assert rc == 2 and "did not write (ck/, notes.txt)" in err and "move" in err
    assert tree_digest(par) == before and sorted(p.name for p in par.iterdir()) == ["ck", "notes.txt"]


def test_out_that_is_or_holds_the_current_directory_is_refused_before_work(tmp_path, monkeypatch, capsys, no_loading):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    t0 = time.monotonic()
    rc, err = export(capsys, "qwen3.5-tiny", Path("."), "--force")
    assert rc == 2 and "is the current directory" in err
    rc, err = export(capsys, "qwen3.5-tiny", Path(".."), "--force")
    assert rc == 2 and "holds the current directory" in err
    assert time.monotonic() - t0 < 5 and sorted(os.listdir(work)) == []  # no_loading: nothing was loaded


def test_force_replaces_a_bundle_a_kit_an_empty_dir_only(tmp_path):
    (tmp_path / "kit").mkdir()
    (tmp_path / "kit" / "kit.json").write_text(json.dumps({"kit": "deltaship.app", "platform": "web"}))
    (tmp_path / "empty").mkdir()
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "manifest.json").write_text(json.dumps({"schema": "someone-else/1"}))
    (tmp_path / "f").write_text("x")
    assert [what_is(tmp_path / n) for n in ("kit", "empty", "fake", "f", "none")] == [
        "kit",
        "empty",
        "other",
        "file",
        "missing",
    ]


def test_app_kit_force_refuses_a_foreign_directory(bundles, tmp_path):
    from deltaship.apps import write_kit
    from deltaship.errors import DeltashipError

    out = tmp_path / "app"
    out.mkdir()
    (out / "main.swift").write_text("// mine\n")
    with pytest.raises(DeltashipError, match="did not write"):
        write_kit(bundles("base"), out, "web", force=True)
    with pytest.raises(DeltashipError, match="lies inside the input"):
        write_kit(bundles("base"), bundles("base") / "kit", "web", force=True)
    assert (out / "main.swift").read_text() == "// mine\n"


def test_profile_outputs_inside_the_bundle_are_refused(tmp_path):
    from deltaship.errors import DeltashipError

    b = tmp_path / "b"
    b.mkdir()
    with pytest.raises(DeltashipError, match="lies inside the input"):
        check_output_file(b / "report.html", (b,), "--report")
    with pytest.raises(DeltashipError, match="is a directory"):
        check_output_file(b, (), "--report")
    check_output_file(tmp_path / "report.html", (b,), "--report")


# ---- one writer at a time ---------------------------------------------------------------------------------
def test_second_writer_fails_at_once_naming_the_holder(tmp_path, capsys, no_loading):
    out = tmp_path / "b"
    with FileLock(str(lock_path(out)), timeout=0):
        t0 = time.monotonic()
        rc, err = export(capsys, "qwen3.5-tiny", out)
        assert time.monotonic() - t0 < 5
    assert rc == 3 and f"being written by process {os.getpid()}" in err and "wait for it" in err
    assert not out.exists()


def test_lock_file_is_removed_after_the_write(bundle, capsys):
    rc, err = export(capsys, "qwen3.5-tiny", bundle, "--force")
    assert rc == 0, err
    assert sorted(p.name for p in bundle.parent.iterdir()) == ["b"]


# ---- names ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["a" * 240, "é" * 127, "b" * NAME_MAX, "x[1]*"])
def test_sibling_names_fit_name_max_and_are_found_again(tmp_path, name):
    out = tmp_path / name
    s = stem(out)
    longest = f".{s}.partial-{'9' * 10}-{'f' * 8}"
    assert len(longest.encode()) <= NAME_MAX and len(lock_path(out).name.encode()) <= NAME_MAX
    (tmp_path / f".{s}.partial-{DEAD}-abcd1234").mkdir()
    assert [pid for _, pid in siblings(out, "partial")] == [DEAD]
    assert stem(tmp_path / ("b" * 240)) != stem(tmp_path / ("b" * 241))


def test_a_240_character_out_name_works(tmp_path, capsys):
    out = tmp_path / ("a" * 240)
    rc, err = export(capsys, "qwen3.5-tiny", out)
    assert rc == 0, err
    assert read_manifest(out)["target"] == "onnx" and [p.name for p in tmp_path.iterdir()] == [out.name]


# ---- crash recovery ---------------------------------------------------------------------------------------
def test_a_backup_whose_out_is_missing_is_put_back_and_a_dead_partial_removed(bundle, capsys):
    before = tree_digest(bundle)
    old, partial = bundle.parent / f".b.old-{DEAD}", bundle.parent / f".b.partial-{DEAD}-abcd1234"
    bundle.rename(old)
    partial.mkdir()
    (partial / "model.onnx").write_bytes(b"half")
    said = recover(bundle)
    err = capsys.readouterr().err
    assert len(said) == 2 and err.count("\n") == 2
    assert "did not finish" in err and "put the previous" in err
    assert tree_digest(bundle) == before and not old.exists() and not partial.exists()
    # a backup beside a complete output is the leftover of a finished replace: removed
    shutil.copytree(bundle, old)
    recover(bundle)
    assert not old.exists() and "finished but left its backup" in capsys.readouterr().err


def test_a_live_writers_partial_is_left_alone(tmp_path):
    out = tmp_path / "b"
    live = tmp_path / f".b.partial-{os.getppid()}-abcd1234"
    live.mkdir()
    assert recover(out) == [] and live.exists()


KILL_AT = {
    # stage -> code run before main() in the child: kill itself there with SIGKILL
    "staging": "import deltaship.bundle.writer as w; f = w.write_manifest\n"
    "w.write_manifest = lambda *a: os.kill(os.getpid(), 9)",
    "between-renames": "import pathlib; r = pathlib.Path.rename\n"
    "def rename(self, t):\n    r(self, t)\n    if '.old-' in str(t): os.kill(os.getpid(), 9)\n"
    "pathlib.Path.rename = rename",
    "after-rename": "import deltaship.bundle.destination as d; rm = d.shutil.rmtree\n"
    "d.shutil.rmtree = lambda p, **k: os.kill(os.getpid(), 9) if '.old-' in str(p) else rm(p, **k)",
}
NOTICE = {
    "staging": ["did not finish"],
    "between-renames": ["did not finish", "put the previous"],
    "after-rename": ["finished but left its backup"],
}


@pytest.mark.parametrize("stage", list(KILL_AT))
def test_sigkill_at_each_write_stage_is_recovered_by_the_next_run(bundle, capsys, stage):
    before = tree_digest(bundle)
    code = "import os, sys\n" + KILL_AT[stage] + "\nfrom deltaship.cli import main\nsys.exit(main(sys.argv[1:]))"
    args = ["export", "--model", "qwen3.5-tiny", "--out", str(bundle), "--force", *FAST]
    r = subprocess.run([sys.executable, "-c", code, *args], env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr
    left = sorted(p.name for p in bundle.parent.iterdir())
    if stage == "between-renames":
        assert "b" not in left and any(n.startswith(".b.old-") for n in left)
    elif stage == "staging":
        assert tree_digest(bundle) == before
    rc, err = export(capsys, "qwen3.5-tiny", bundle, "--force")
    assert rc == 0, err
    for line in NOTICE[stage]:
        assert line in err
    assert sorted(p.name for p in bundle.parent.iterdir()) == ["b"] and read_manifest(bundle)["max_context"] == 128


# ---- the machine's errors ---------------------------------------------------------------------------------
def test_disk_full_is_one_line_exit_3_and_the_old_bundle_stays(bundle, capsys, monkeypatch):
    from deltaship.compile import steps

    before = tree_digest(bundle)

    def full(src, dst, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))

    monkeypatch.setattr(steps.shutil, "copy", full)  # the tokenizer copy
    rc, err = export(capsys, "qwen3.5-tiny", bundle, "--force")
    monkeypatch.undo()
    assert rc == 3 and "No space left on device" in err and "free space on" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 2  # error + fix
    assert tree_digest(bundle) == before and sorted(p.name for p in bundle.parent.iterdir()) == ["b"]


def test_memory_error_while_writing_is_exit_3(tmp_path, capsys, monkeypatch):
    import deltaship.bundle.writer as w

    def oom(*a, **k):
        raise MemoryError

    monkeypatch.setattr(w, "write_manifest", oom)
    rc, err = export(capsys, "qwen3.5-tiny", tmp_path / "b")
    assert rc == 3 and "out of memory" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


# ---- memory, before the work --------------------------------------------------------------------------------
def test_export_whose_plan_passes_the_memory_limit_is_refused_before_work(tmp_path, capsys, monkeypatch):
    fake = [limits.Limit("cgroup memory.max (fake)", 600 << 20, 500 << 20)]  # leaves 100 MiB
    monkeypatch.setattr(limits, "memory_limits", lambda: fake)
    import deltaship.lowering.passes as passes

    monkeypatch.setattr(passes, "run_pipeline", lambda *a, **k: pytest.fail("the export started"))
    rc = main(["export", "--model", "qwen3.5-tiny", "--out", str(tmp_path / "b"), "--max-context", "128"])
    err = capsys.readouterr().err
    assert rc == 3 and "needs about 0.6" in err and "cgroup memory.max (fake) leaves it 0.10 GiB (0.59 GiB" in err
    assert "--no-verify" in err and limits.IGNORE_ENV in err
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(limits.IGNORE_ENV, "1")
    with pytest.raises(BaseException, match="the export started"):
        main(["export", "--model", "qwen3.5-tiny", "--out", str(tmp_path / "b"), "--max-context", "128"])


def test_a_real_address_space_limit_is_refused_with_both_numbers(tmp_path):
    import resource

    cap = 1400 << 20

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    args = ["export", "--model", "qwen3.5-tiny", "--out", str(tmp_path / "b"), "--max-context", "128"]
    r = subprocess.run(
        [sys.executable, "-m", "deltaship.cli", *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit,
    )
    assert r.returncode == 3, r.stderr[-2000:]
    assert "of address space" in r.stderr and "RLIMIT_AS (ulimit -v) leaves it" in r.stderr and "(1.37 GiB" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_plots_replace_only_plots_and_file_outputs_are_whole_or_nothing(bundles, tmp_path, monkeypatch):
    from deltaship.bundle.destination import check_destination, replace_file
    from deltaship.errors import DeltashipError

    with pytest.raises(DeltashipError, match="--plots .* is a deltaship bundle; --plots replaces only profile plots"):
        check_destination(bundles("base"), True, (), "--plots", replaces=("plots",))
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "plots.json").write_text(json.dumps({"kind": "deltaship.plots", "files": []}))
    check_destination(plots, True, (), "--plots", replaces=("plots",))
    report = tmp_path / "r.html"
    replace_file(report, "old")

    def full(*a):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(DeltashipError, match="No space left") as e:
        replace_file(report, "new")
    assert e.value.exit_code == 3
    monkeypatch.undo()
    assert report.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["plots", "r.html"]
