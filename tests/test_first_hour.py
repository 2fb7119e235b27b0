"""What a new user trips over in the first hour (issue 52): typos, help groups, quiet plan footnotes, generate's
timings, the app command's wording and listing, the README's fast checks."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import stub_bundle

from deltaship.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def usage_error(capsys, argv: list[str]) -> list[str]:
    """The stderr lines of a command argparse refuses (exit 2)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.splitlines()


def subparser(name: str):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[name]


def option(parser, flag: str):
    return next(a for a in parser._actions if flag in a.option_strings)


@pytest.mark.parametrize(
    "argv, what, fix",
    [
        (
            ["export", "--model", "qwen3.5-tiny", "--out", "x", "--precison", "int4"],
            "deltaship export: error: unknown option --precison; did you mean --precision?",
            "  fix: pass --precision instead of --precison",
        ),
        (
            ["export", "--model", "qwen3.5-tiny", "--out", "x", "--precision", "int5"],
            "deltaship export: error: --precision int5 is not one of fp32, fp16, int8, int4; did you mean int8?",
            "  fix: pass --precision int8",
        ),
        (
            ["generate", "b", "--prompt", "x", "--temprature=0.5"],
            "deltaship generate: error: unknown option --temprature; did you mean --temperature?",
            "  fix: pass --temperature instead of --temprature",
        ),
        (
            ["exprot", "--model", "qwen3.5-tiny"],
            "deltaship: error: unknown command 'exprot'; did you mean 'export'?",
            "  fix: use deltaship export (deltaship --help lists the commands)",
        ),
        (
            ["plan", "--model", "qwen3.5-0.8b", "--zzz"],
            "deltaship plan: error: unknown option --zzz",
            "  fix: `deltaship plan --help` lists its options",
        ),
    ],
)
def test_a_typo_is_one_line_with_the_suggestion_and_a_fix(capsys, argv, what, fix):
    """No usage block: the subcommand, the bad word and the nearest option or choice, then the fix line."""
    assert usage_error(capsys, argv) == [what, fix]


def test_every_usage_error_is_what_and_fix(capsys):
    """argparse's other refusals (a missing option, a value its check refuses) take the same two lines."""
    assert usage_error(capsys, ["export", "--out", "x"]) == [
        "deltaship export: error: the following arguments are required: --model",
        "  fix: `deltaship export --help` shows what each option takes",
    ]
    lines = usage_error(capsys, ["generate", "b", "--prompt", "x", "--max-new-tokens", "0"])
    assert lines == ["deltaship generate: error: argument --max-new-tokens: must be >= 1, got 0", "  fix: " + (
        "pass --max-new-tokens 1 or more")]  # fmt: skip


def test_shared_target_options_sit_in_a_group_that_says_where_they_apply():
    export = subparser("export")
    group = next(g for g in export._action_groups if any("--mtp" in a.option_strings for a in g._group_actions))
    takers = [t for t in ("coreml", "executorch", "onnx", "qnn") if f"{t}" in group.title]
    assert takers == ["coreml", "executorch", "onnx"], group.title  # qnn has no MTP head
    assert {"--mtp", "--mtp-draft-vocab"} <= {s for a in group._group_actions for s in a.option_strings}
    own = next(g for g in export._action_groups if g.title == "coreml options")
    assert "--mtp" not in {s for a in own._group_actions for s in a.option_strings}


def test_device_and_tier_help_list_the_catalog_tiers():
    from deltaship.devices.catalog import load_catalog

    tiers = list(load_catalog()[0])
    assert len(tiers) > 3
    for command, flag in (("export", "--device"), ("plan", "--tier"), ("profile", "--tier")):
        text = option(subparser(command), flag).help
        assert ", ".join(tiers) in text, (command, flag, text)


def test_plan_footnotes_only_with_verbose(capsys):
    assert main(["plan", "--model", "qwen3.5-0.8b", "--tier", "phone-8gb"]) == 0
    quiet = capsys.readouterr().out
    assert "measured 20" not in quiet and "estimate (not measured)" not in quiet
    hint = [ln for ln in quiet.splitlines() if "deltaship plan --verbose" in ln]
    assert len(hint) == 1, quiet
    assert main(["plan", "--model", "qwen3.5-0.8b", "--tier", "phone-8gb", "--verbose"]) == 0
    loud = capsys.readouterr().out
    notes = [ln for ln in loud.splitlines() if ln.startswith("  ") and ("measured" in ln or "estimate" in ln)]
    assert len(notes) >= 8 and "deltaship plan --verbose" not in loud
    assert f"({len(notes)} notes)" in hint[0]
    # the table and verdicts themselves are the same
    assert [ln for ln in loud.splitlines() if ln not in notes] == [ln for ln in quiet.splitlines() if ln not in hint]


def test_generate_json_reports_ttft_and_decode_rate(bundles, capsys):
    bundle = bundles("base")
    argv = ["generate", str(bundle), "--input-ids", "1,2,3", "--max-new-tokens", "6", "--no-stop-at-eos", "--json"]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert len(res["output_ids"]) == 6
    assert 0 < res["ttft_s"] <= res["seconds"] and res["decode_tok_s"] > 0
    # 5 tokens after the first, decoded in at most the time after the first token
    assert res["decode_tok_s"] >= 5 / (res["seconds"] - res["ttft_s"]) * 0.99


def test_force_refusal_names_force(tmp_path):
    from deltaship.bundle.destination import check_destination
    from deltaship.errors import DeltashipError

    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    with pytest.raises(DeltashipError) as e:
        check_destination(out, True, (), "--out", replaces=("bundle",))
    assert "; --force replaces only a deltaship bundle or an empty directory; nothing was written" in e.value.message
    assert "--force this" not in e.value.message


def test_app_lists_kit_json_among_what_it_wrote(tmp_path, monkeypatch, capsys):
    import types

    import deltaship.apps as apps

    def fake_write_kit(bundle: Path, out: Path, platform: str) -> list[Path]:
        (out / "README.md").write_text("# kit")
        return [out / "README.md"]

    monkeypatch.setitem(sys.modules, "fake_web_kit", types.SimpleNamespace(write_kit=fake_write_kit))
    monkeypatch.setitem(apps._KITS, "web", "fake_web_kit")
    monkeypatch.chdir(tmp_path)
    stub_bundle(Path("b"), "onnx")
    assert main(["app", "b", "--platform", "web", "--out", "kit"]) == 0
    wrote = capsys.readouterr().out.splitlines()[0]
    assert wrote == "wrote the web kit to kit: kit/README.md, kit/kit.json" and Path("kit/kit.json").is_file()


def test_readme_checks_are_in_the_fast_tier():
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow", "-p", "no:cacheprovider",
         "tests/test_readme.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "test_relative_links_resolve" in r.stdout and "test_readme_is_short" in r.stdout
    assert "test_runnable_blocks_run" not in r.stdout  # it exports: slow


@pytest.fixture
def quick_beats(monkeypatch):
    """heartbeat() reports every millisecond (1 s by default): a test's short steps get their detail lines."""
    from deltaship.progress import heartbeat

    monkeypatch.setattr(heartbeat.__wrapped__, "__defaults__", (0.001,))


def progress_lines():
    import io

    from deltaship.progress import Progress

    buf = io.StringIO()
    return Progress(stream=buf, every=0), buf


def test_eval_reports_its_steps_on_stderr_and_quiet_silences_them(bundles, capsys):
    bundle = str(bundles("base"))
    assert main(["eval", bundle, "--tokens", "16", "--json"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith(f"] eval: {bundle} against the checkpoint it was exported from"), err
    assert any(ln.endswith("] eval: 16 tokens of seeded random token ids (no tokenizer)") for ln in err), err
    assert main(["eval", bundle, "--tokens", "16", "--json", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def slow_sessions(monkeypatch, module) -> None:
    """`module`'s open_bundle gives sessions that decode in 10 ms a token, as a slow runtime does (Core ML's op-by-op
    evaluator on Linux): long enough for a step's detail lines."""
    import time

    opened = module.open_bundle

    def slow(*args, **kwargs):
        session = opened(*args, **kwargs)
        decode = session.decode
        session.decode = lambda tok: (time.sleep(0.01), decode(tok))[1]
        return session

    monkeypatch.setattr(module, "open_bundle", slow)


def test_eval_steps_report_their_detail(bundles, monkeypatch, quick_beats):
    import deltaship.check.evaluate as ev

    slow_sessions(monkeypatch, ev)
    evaluate = ev.evaluate
    say, buf = progress_lines()
    evaluate(bundles("base"), tokens=16, progress=say)
    said = buf.getvalue()
    assert re.search(r"\] eval: the bundle, \d+ s: \d+ of 15 tokens\n", said), said
    assert re.search(r"\] eval: the transformers fp32 reference, \d+ s\n", said), said


def test_generate_reports_a_long_generation_and_nothing_for_a_short_one(bundles, capsys, monkeypatch, quick_beats):
    from deltaship.commands import generate

    bundle = bundles("base")
    say, buf = progress_lines()
    with monkeypatch.context() as m:
        slow_sessions(m, sys.modules["deltaship.commands.generate"])  # the module, not the function of its name
        generate(bundle, input_ids=[1, 2, 3], max_new_tokens=6, stop_at_eos=False, progress=say)
    said = buf.getvalue()
    assert re.search(r"\] generate: 3 prompt tokens, then decoding, \d+ s: \d of 6 new tokens\n", said), said
    assert "] generate: opening the bundle, " in said
    # by default, a log gets a line only once a step has been silent for 10 s: none for this one
    argv = ["generate", str(bundle), "--input-ids", "1,2,3", "--max-new-tokens", "2"]
    assert main(argv) == 0 and capsys.readouterr().err == ""
    assert main([*argv, "--quiet"]) == 0 and capsys.readouterr().err == ""


def test_profile_reports_its_warm_up_and_timed_runs(bundles, monkeypatch, quick_beats):
    import time

    import deltaship.profiling.profile as prof

    def slow_worker(cfg, cap=None, **kw):  # the worker process: its warm-ups and timed runs
        time.sleep(0.05)
        return None, {"metric": "run", "status": "died", "reason": "test", "samples": [], "flags": ["died"]}

    monkeypatch.setattr(prof, "run_worker", slow_worker)
    say, buf = progress_lines()
    prof.profile(bundles("base"), progress=say, contexts=[16], prompt_lengths=[8], gen=2, reps=1, warmups=1)
    assert re.search(r"\] warm-up and timed runs \(1 warm-up, 1\+ timed per phase\), \d+ s\n", buf.getvalue())


@pytest.fixture
def tiny_onnx(shared_export) -> Path:
    """The trained tiny preset as an ONNX int4 bundle (it has a tokenizer and a chat template), shared with
    test_memory_plan and test_onnx_order."""
    return shared_export("memory-plan-tiny-onnx-int4", "qwen3.5-tiny", target="onnx", precision="int4", verify=False)


def refused(capsys, argv: list[str]) -> list[str]:
    """The error and fix lines of a command deltaship refuses as bad input (exit 2)."""
    assert main(argv) == 2
    return [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("[")]  # less the progress


def test_eval_text_scores_the_users_file(tiny_onnx, tmp_path, capsys):
    own = tmp_path / "mine.py"
    own.write_text((ROOT / "deltaship" / "progress.py").read_text(encoding="utf-8"), encoding="utf-8")
    assert main(["eval", str(tiny_onnx), "--text", str(own), "--tokens", "24", "--json", "--quiet"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["text"] == str(own) and res["tokens"] == 23 and res["perplexity"] > 1


def test_eval_text_refuses_short_non_utf8_large_and_tokenizerless(tiny_onnx, bundles, tmp_path, capsys, monkeypatch):
    from deltaship.check import evaluate as ev
    from deltaship.runtimes.tokenizer import load_tokenizer

    short = tmp_path / "short.txt"
    short.write_text("def f(x):\n    return x\n")
    tokenizer = load_tokenizer(tiny_onnx, json.loads((tiny_onnx / "manifest.json").read_text()))
    n = len(tokenizer.encode(short.read_text()))
    what, fix = refused(capsys, ["eval", str(tiny_onnx), "--text", str(short), "--tokens", "100"])
    assert what == (
        f"deltaship eval: error: --text {short}: {n} tokens with the bundle's tokenizer; the eval needs 100 "
        "(--tokens, at most the bundle's max context)"
    )
    assert fix == f"  fix: pass a longer text, or --tokens {n}"
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"def f():\n    return '\xff'\n" * 20)
    what, fix = refused(capsys, ["eval", str(tiny_onnx), "--text", str(bad), "--tokens", "8"])
    assert "not UTF-8 text" in what and "position 21" in what and fix == "  fix: pass a UTF-8 text file under 16 MiB"
    monkeypatch.setattr(ev, "MAX_TEXT_BYTES", 64)
    what, _ = refused(capsys, ["eval", str(tiny_onnx), "--text", str(bad), "--tokens", "8"])
    assert f"{bad}: {bad.stat().st_size:,} bytes, more than a --text file may hold (64 bytes)" in what
    what, _ = refused(capsys, ["eval", str(bundles("base")), "--text", str(short), "--tokens", "8"])
    assert what.startswith("deltaship eval: error: --text needs the bundle's tokenizer")


def test_generate_chat_is_the_first_turn_of_a_chat(tiny_onnx, capsys):
    from deltaship.chat import Chat
    from deltaship.targets import open_bundle

    prompt = "Write a function that adds two numbers."
    argv = ["generate", str(tiny_onnx), "--prompt", prompt, "--chat", "--max-new-tokens", "12"]
    assert main([*argv, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    chat = Chat(open_bundle(tiny_onnx))
    turn = [{"role": "user", "content": prompt}]
    assert res["input_ids"] == chat.render_ids(turn, add_generation_prompt=True)  # rendered as chat renders it
    reply = chat.send(prompt, max_new_tokens=12)
    assert res["output_ids"] == reply.ids and res["text"] == reply.text  # greedy: chat's own reply
    assert main(argv) == 0
    assert capsys.readouterr().out == reply.text + "\n"  # the reply alone, without the prompt


def test_generate_chat_needs_a_text_prompt(tiny_onnx, capsys):
    what, fix = refused(capsys, ["generate", str(tiny_onnx), "--input-ids", "1,2", "--chat"])
    assert what == (
        "deltaship generate: error: --chat renders a text --prompt as a user turn; it cannot take --input-ids"
    )
    assert fix == "  fix: pass --prompt TEXT"


def test_generate_chat_stops_at_the_end_of_the_turn(tiny_onnx, monkeypatch):
    """The trained tiny never ends a turn by itself: a session whose third token is <|im_end|> stands in."""
    from deltaship.commands import generate

    module = sys.modules["deltaship.commands.generate"]
    end = json.loads((tiny_onnx / "manifest.json").read_text())["tokens"]["im_end"]
    opened = module.open_bundle

    def ending(*args, **kwargs):
        session = opened(*args, **kwargs)
        decode, calls = session.decode, []

        def decode_to_end(tok):
            logits = decode(tok).copy()
            calls.append(tok)
            if len(calls) == 2:
                logits[end] = logits.max() + 10
            return logits

        session.decode = decode_to_end
        return session

    monkeypatch.setattr(module, "open_bundle", ending)
    res = generate(tiny_onnx, prompt="Hi", chat=True, max_new_tokens=8, progress=False)
    assert res["stopped"] == "eos" and len(res["output_ids"]) == 3 and res["output_ids"][-1] == end
    assert "<|im_end|>" not in res["text"] and len(res["text"]) >= 1
    plain = generate(tiny_onnx, prompt="Hi", max_new_tokens=8, progress=False)  # without --chat: no turn to end
    assert plain["stopped"] == "length" and len(plain["output_ids"]) == 8
