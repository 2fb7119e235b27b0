"""`deltaship plan` counts a prompt cache shipped in the bundle (export --prompt-cache): its bytes in the bundle and
its restore on the peak, from the same FILE export takes; `profile`'s plan counts a bundle's from its manifest.

One fp32 ONNX export of the trained tiny preset with a prompt cache (seconds), shared. The planned bytes are checked
against the bundle's real file and against the states' shapes the manifest lists (not the planner's formula).

Mutation-checked by hand (2026-11-27): leaving the restore out of estimate()'s total fails
test_plan_counts_the_files_bytes_and_its_restore; sizing the cache at the context instead of its tokens fails it
too; counting the tokens with a generation prompt fails test_the_file_is_counted_as_export_feeds_it; planned_peak
taking the spec's tensor bytes instead of the manifest's file bytes fails test_profiles_plan_reads_the_manifest;
restoring every state in one call fails test_a_restore_copies_one_state_at_a_time; dropping the table's
prompt-cache lines fails test_the_cli_prints_it; leaving the file's mapping or the KV copy out of the restore fails
test_plan_counts_the_files_bytes_and_its_restore or test_at_a_long_context_the_largest_copy_is_a_kv_cache.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from deltaship.cli import main
from deltaship.commands import plan
from deltaship.devices.plan import planned_peak
from deltaship.errors import DeltashipError

CONTEXT = 192
SYSTEM = "You write Python code."
ASK = dict(tier="phone-4gb", context=CONTEXT, targets=["onnx"], kv_dtypes=["fp32"])


@pytest.fixture(scope="module")
def system_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompt-cache") / "system.txt"
    path.write_text(SYSTEM + "\n")
    return path


@pytest.fixture(scope="module")
def cached(shared_export, system_file) -> Path:
    return shared_export(
        "prompt-cache-plan-tiny-onnx-fp32",
        "qwen3.5-tiny",
        target="onnx",
        precision="fp32",
        max_context=CONTEXT,
        verify=False,
        prompt_cache=system_file,
    )


def _manifest(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def _fp32_row(rows: list[dict]) -> dict:
    (row,) = [r for r in rows if r["precision"] == "fp32"]
    return row


def _grows_by_the_restore(cached: dict, plain: dict) -> bool:
    """The row's total is the plain one's with the restore added to the running part: the runtime plus the larger of
    loading and (the weights as loaded, the states, a prefill chunk's activations, the restore). True when the running
    part is the larger, so the total grew by exactly the restore; else the restore, which comes after loading, hides
    under its peak and the total is unchanged."""
    run = sum(plain[k] for k in ("runtime_bytes", "weights_loaded_bytes", "state_bytes", "activation_bytes"))
    assert cached["total_bytes"] == max(run + cached["prompt_cache_restore_bytes"], plain["total_bytes"])
    return cached["total_bytes"] - plain["total_bytes"] == cached["prompt_cache_restore_bytes"]


def _tensor_bytes(path: Path) -> int:
    """A safetensors file's bytes less its header (8 bytes of length, then the JSON header)."""
    data = path.read_bytes()
    return len(data) - 8 - struct.unpack("<Q", data[:8])[0]


def _states_from_manifest(manifest: dict, tokens: int) -> tuple[int, int]:
    """(the states at `tokens`, one KV cache at the context) from the manifest's own state shapes (float32 here):
    what the cache holds, and the whole-length copy its restore makes of one KV cache."""
    at, kv_whole = 0, 0
    for s in manifest["states"]:
        assert s["dtype"] == "float32", s
        shape = list(s["shape"])
        if s["kind"].startswith("kv_cache"):
            kv_whole = max(kv_whole, 4 * math.prod(shape))
            shape[shape.index(manifest["max_context"])] = tokens
        at += 4 * math.prod(shape)
    return at, kv_whole


def test_the_file_is_counted_as_export_feeds_it(cached, system_file, tmp_path):
    """plan --prompt-cache FILE counts the tokens export shipped for FILE, and a JSON file's template settings too."""
    from deltaship.chat import Chat

    tokens = _manifest(cached)["chat"]["prompt_cache"]["tokens"]
    assert _fp32_row(plan("qwen3.5-tiny", prompt_cache=system_file, **ASK))["prompt_cache_tokens"] == tokens > 0
    spec = {"system": "Answer briefly.", "template_kwargs": {"enable_thinking": False}}
    (tmp_path / "c.json").write_text(json.dumps(spec))
    chat = Chat(cached, system=spec["system"], template_kwargs=spec["template_kwargs"], threads=1, prompt_cache=False)
    want = len(chat.render_ids(chat.history, add_generation_prompt=False))
    assert _fp32_row(plan("qwen3.5-tiny", prompt_cache=tmp_path / "c.json", **ASK))["prompt_cache_tokens"] == want


def test_plan_counts_the_files_bytes_and_its_restore(cached, system_file):
    m = _manifest(cached)
    tokens = m["chat"]["prompt_cache"]["tokens"]
    rows = plan("qwen3.5-tiny", prompt_cache=system_file, **ASK)  # every ONNX precision, each with an fp32 KV cache
    plains = plan("qwen3.5-tiny", **ASK)
    at, kv_whole = _states_from_manifest(m, tokens)
    grew = {}
    for row, plain in zip(rows, plains, strict=True):
        if row["precision"] in ("fp32", "int8", "int4"):  # fp32 activations: the states of this bundle's file
            # in the bundle: exactly the file's tensors, which are the states at the cache's length
            assert row["prompt_cache_bytes"] == _tensor_bytes(cached / "prompt_cache.safetensors") == at
            # on the peak: the file's tensors, plus the file mapped while it is read (here larger than one KV cache)
            assert row["prompt_cache_restore_bytes"] == at + max(at, kv_whole) == 2 * at
        for part in ("weights_bytes", "kv_bytes", "deltanet_bytes", "activation_bytes", "runtime_bytes"):
            assert row[part] == plain[part], part
        assert plain["prompt_cache_tokens"] is None and plain["prompt_cache_restore_bytes"] == 0
        grew[row["precision"]] = _grows_by_the_restore(row, plain)
    # fp32 ONNX loads with originals and prepacked copies at once, a peak the restore (after loading) stays under at
    # this context; int4's peak is the prefill's, so its total grows by exactly the restore
    assert grew["int4"] and not grew["fp32"], grew


def test_profiles_plan_reads_the_manifest(cached):
    """profile's plan of a bundle that ships a cache: its tokens and file bytes as the manifest records them, and
    the total of a chat that starts from it; its own total (a profile never restores the cache) unchanged."""
    m = _manifest(cached)
    path = cached / "prompt_cache.safetensors"
    p = planned_peak(m, 64)
    c = p["prompt_cache"]
    assert c["tokens"] == m["chat"]["prompt_cache"]["tokens"]
    assert c["file_bytes"] == m["files"]["prompt_cache.safetensors"]["bytes"] == path.stat().st_size
    _, kv_whole = _states_from_manifest(m, c["tokens"])
    assert c["restore_bytes"] == path.stat().st_size + max(path.stat().st_size, kv_whole)
    run = sum(p[k] for k in ("runtime_bytes", "weights_loaded_bytes", "state_bytes", "activation_bytes"))
    assert c["chat_total_bytes"] == max(run + c["restore_bytes"], p["total_bytes"])
    without = {k: v for k, v in m.items() if k != "chat"}
    assert "prompt_cache" not in planned_peak(without, 64)
    assert planned_peak(without, 64)["total_bytes"] == p["total_bytes"]


def test_profile_says_it(cached):
    from deltaship.profiling.profile import profile
    from deltaship.profiling.report import format_results

    doc = profile(cached, threads=1, prompt_lengths=[16], gen=2, contexts=[], warmups=0, reps=1, min_seconds=0,
                  breakdown=False)  # fmt: skip
    c = doc["memory_plan"]["prompt_cache"]
    assert (
        f"prompt cache {c['tokens']:,} tokens: {c['file_bytes'] / 2**20:.2f} MiB in the bundle; a chat starting from "
        f"it: plan {c['chat_total_bytes'] / 2**30:.3f} GiB (+{c['restore_bytes'] / 2**20:.2f} MiB while it restores"
    ) in format_results(doc)


def test_a_restore_copies_one_state_at_a_time(cached, monkeypatch):
    """The restore the plan counts: each state read (its layout checked) and written on its own, so at most one
    whole-length KV copy at a time beside the file's arrays."""
    from deltaship.chat import Chat
    from deltaship.runtimes.onnx import OnnxSession

    reads, writes = [], []
    read, write = OnnxSession._read_states, OnnxSession._write_states
    monkeypatch.setattr(OnnxSession, "_read_states", lambda self, names: reads.append(list(names)) or read(self, names))
    monkeypatch.setattr(OnnxSession, "_write_states", lambda self, a: writes.append(list(a)) or write(self, a))
    chat = Chat(cached, system=SYSTEM, threads=1)
    assert chat.session.position == _manifest(cached)["chat"]["prompt_cache"]["tokens"]  # it restored
    states = [s["name"] for s in chat.session.manifest["states"]]
    assert writes == [[n] for n in states]
    assert reads and all(len(names) == 1 for names in reads), reads


def test_the_cli_prints_it(cached, system_file, capsys):
    from deltaship.devices.plan.text import _gib

    tokens = _manifest(cached)["chat"]["prompt_cache"]["tokens"]
    size = _tensor_bytes(cached / "prompt_cache.safetensors")
    args = ["plan", "--model", "qwen3.5-tiny", "--tier", "phone-4gb", "--context", str(CONTEXT), "--targets", "onnx"]
    assert main(args + ["--prompt-cache", str(system_file)]) == 0
    out = capsys.readouterr().out
    assert " pcache " in out.splitlines()[1]
    assert f"prompt cache {tokens:,} tokens in the bundle: {_gib(size)} (onnx fp32 (fp32 KV)" in out
    assert main(args + ["--prompt-cache-tokens", str(tokens), "--json"]) == 0  # the count given directly: same rows
    rows = json.loads(capsys.readouterr().out)
    fp32 = next(r for r in rows if r["precision"] == "fp32" and r["kv_dtype"] == "fp32")
    assert fp32["prompt_cache_bytes"] == size and fp32["prompt_cache_tokens"] == tokens
    assert main(args) == 0  # no cache asked: no column, no line
    assert "pcache" not in capsys.readouterr().out
    with pytest.raises(SystemExit):  # one says the cache's length
        main(args + ["--prompt-cache", str(system_file), "--prompt-cache-tokens", "3"])


def test_a_model_without_a_tokenizer_takes_a_token_count(system_file):
    with pytest.raises(DeltashipError, match="no tokenizer") as e:
        plan("qwen3.5-0.8b", tier="phone-8gb", prompt_cache=system_file)
    assert "--prompt-cache-tokens" in e.value.fix
    # at 16,384 tokens the running part of an int4 row (its KV cache) is larger than loading's peak, which would
    # otherwise hide the restore
    rows = plan("qwen3.5-0.8b", tier="phone-8gb", targets=["onnx"], prompt_cache_tokens=1024, context=16384)
    plain = plan("qwen3.5-0.8b", tier="phone-8gb", targets=["onnx"], context=16384)
    grew = {}
    for r, p in zip(rows, plain, strict=True):
        assert r["prompt_cache_tokens"] == 1024
        assert r["prompt_cache_restore_bytes"] > r["prompt_cache_bytes"] > 1024 * r["kv_bytes"] // r["context"]
        grew[r["precision"]] = _grows_by_the_restore(r, p) or grew.get(r["precision"], False)  # any KV dtype
    assert grew["int4"], grew


def test_a_context_that_cannot_hold_the_cache_does_not_fit():
    from deltaship.devices.plan import verdicts

    rows = plan("qwen3.5-tiny", prompt_cache_tokens=CONTEXT, **ASK)
    assert not any(r["fits"] for r in rows if r["context"] <= CONTEXT)
    assert "leave no room in a context of 192" in " ".join(verdicts(rows))
    longest = plan("qwen3.5-tiny", tier="phone-4gb", context="max", targets=["onnx"], prompt_cache_tokens=CONTEXT)
    assert all(r["context"] > CONTEXT and r["fits"] for r in longest)
    with pytest.raises(DeltashipError, match="longest context"):
        plan("qwen3.5-tiny", tier="phone-4gb", prompt_cache_tokens=4096)


def test_at_a_long_context_the_largest_copy_is_a_kv_cache(cached):
    """The restore's second term is the larger of the file (mapped while read) and one KV cache at the context (the
    whole-length copy a KV cache is written through): at the tiny's 4096 tokens, one KV cache (2 KV heads x 64 dims
    x 4096 tokens fp32, 2 MiB) is larger than the cache's file."""
    tokens = _manifest(cached)["chat"]["prompt_cache"]["tokens"]
    ask = {**ASK, "context": 4096}
    row = _fp32_row(plan("qwen3.5-tiny", prompt_cache_tokens=tokens, **ask))
    assert row["prompt_cache_bytes"] == _tensor_bytes(cached / "prompt_cache.safetensors")  # whatever the context
    assert row["prompt_cache_restore_bytes"] == row["prompt_cache_bytes"] + 2 * 64 * 4096 * 4
    assert _grows_by_the_restore(row, _fp32_row(plan("qwen3.5-tiny", **ask)))


def test_export_for_a_device_plans_with_the_cache(cached, system_file, tmp_path):
    """export --device TIER --prompt-cache FILE: the tier's plan counts the cache export will ship; on a budget
    between the plain plan and the plan with the cache, the cache costs a narrower KV cache or a smaller chunk."""
    from deltaship.compile.steps import device_prompt_cache_tokens, plan_device
    from deltaship.devices.plan import choose_for_tier
    from deltaship.models.source import load_source

    source = load_source("qwen3.5-tiny")
    tokens = device_prompt_cache_tokens(source, system_file)
    assert tokens == _manifest(cached)["chat"]["prompt_cache"]["tokens"]
    assert device_prompt_cache_tokens(source, None) is None
    fixed = dict(target="onnx", precision="int4", context=CONTEXT)
    plain = choose_for_tier(source.spec, "phone-4gb", **fixed)
    with_cache = choose_for_tier(source.spec, "phone-4gb", **fixed, prompt_cache_tokens=tokens)
    assert with_cache.total_bytes - plain.total_bytes == with_cache.prompt_cache_restore_bytes > 0
    budget = (plain.total_bytes + with_cache.total_bytes) / 2 / 2**30
    (tmp_path / "t.toml").write_text(
        f'[tiers.tight]\nkind = "phone"\nram_gib = 1\nbudget_gib = {budget!r}\ntargets = ["onnx"]\n'
        f'precisions = ["int4"]\ncontext = {CONTEXT}\nthreads = 4\n'
    )
    args = (source.spec, "tight", str(tmp_path / "t.toml"), "onnx", "int4", CONTEXT)
    own = plan_device(*args, None, None)
    assert (own.kv_cache, own.prefill_chunk) == (None, None)  # the target's own KV cache and chunk fit
    cut = plan_device(*args, None, None, tokens)  # with the cache, only a narrower KV cache or a smaller chunk fits
    assert cut.kv_cache is not None or cut.prefill_chunk is not None, cut
    with pytest.raises(DeltashipError, match="nothing fits tier tight"):  # or nothing, the two fixed
        plan_device(*args, "fp32", CONTEXT, tokens)


def test_export_passes_the_caches_tokens_to_the_tiers_plan(cached, system_file, tmp_path, monkeypatch):
    from deltaship.compile import export, steps

    class Stop(Exception):
        pass

    seen = []

    def spy(*args):
        seen.append(args[8])
        raise Stop  # the plan is all this test needs: no export

    monkeypatch.setattr(steps, "plan_device", spy)
    with pytest.raises(Stop):
        export("qwen3.5-tiny", tmp_path / "o", device="phone-4gb", prompt_cache=system_file, progress=False)
    assert seen == [_manifest(cached)["chat"]["prompt_cache"]["tokens"]]
    assert not (tmp_path / "o").exists()
