"""Profiling harness, device tiers and discovery: real processes, a real sshd, a real browser, a real adb."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from deltaship.devices.catalog import load_catalog
from deltaship.devices.plan import plan, weight_bytes
from deltaship.errors import DeltashipError
from deltaship.models.presets import PRESETS
from deltaship.stats import ratio_ci, summarize

FAST = dict(prompt_lengths=[16, 40], gen=6, contexts=[8, 48], reps=3, warmups=1, min_seconds=0.1)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    from deltaship.compile import export

    out = tmp_path_factory.mktemp("prof") / "tiny"
    export("qwen3.5-tiny", out, max_context=64, prefill_chunk=32, progress=False, verify=False)
    return out


# ---- statistics -------------------------------------------------------------------------------
def test_summary_statistics():
    s = summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s["median"] == 3.0 and s["n"] == 5 and "noisy" in s["flags"]
    assert s["ci95"][0] <= 3.0 <= s["ci95"][1] and s["p90"] > 4.0
    calm = summarize([1.0, 1.01, 0.99, 1.0, 1.0, 1.02])
    assert calm["flags"] == [] and calm["cv"] < 0.02
    r = ratio_ci([2.0, 2.1, 1.9, 2.0, 2.05], [1.0, 1.05, 0.95, 1.0, 1.02])
    assert 1.9 < r["ratio"] < 2.1 and r["significant"]
    assert not ratio_ci([1.0, 1.2, 0.8, 1.1, 0.9], [1.0, 1.1, 0.9, 1.2, 0.8])["significant"]


# ---- tiers and the planner ----------------------------------------------------------------------
def test_catalog_and_user_tiers(tmp_path):
    tiers, models = load_catalog()
    assert {"phone-4gb", "phone-8gb", "phone-12gb", "laptop-16gb", "gpu-8gb", "gpu-24gb", "gpu-80gb"} <= set(tiers)
    assert "phone-8gb" in models["qwen3.5-0.8b"] and "gpu-24gb" in models["qwen3.5-9b"]
    extra = tmp_path / "mine.toml"
    extra.write_text(
        '[tiers.watch-1gb]\nkind = "watch"\nram_gib = 1\nbudget_gib = 0.25\n'
        'targets = ["executorch"]\nprecisions = ["int4"]\ncontext = 512\n'
    )
    tiers, _ = load_catalog(extra)
    assert tiers["watch-1gb"].budget_bytes == 2**28
    extra.write_text('[tiers.bad]\nkind = "x"\n')
    with pytest.raises(DeltashipError, match="tier 'bad': ram_gib is missing"):
        load_catalog(extra)


def test_plan_arithmetic_and_fit():
    spec = PRESETS["qwen3.5-0.8b"].spec()
    # int4 ONNX: 4 bits + a 4-byte scale per 32 weights, the tied table stored once for gather and head
    p = spec.parameter_count()
    assert weight_bytes(spec, "onnx", "int4") == int(p["total"] * (0.5 + 4 / 32))
    # ExecuTorch stores a tied head twice (4-bit embedding kernel + 8da4w linear)
    assert weight_bytes(spec, "executorch", "int4") == int((p["total"] + p["embedding"]) * (0.5 + 4 / 32))
    assert weight_bytes(spec, "onnx", "fp32") == p["total"] * 4
    rows = plan("qwen3.5-9b", tier="phone-4gb")
    assert rows and not any(r["fits"] for r in rows) and not any(r["recommended"] for r in rows)
    rows = plan("qwen3.5-0.8b", tier="phone-8gb")
    rec = [r for r in rows if r["recommended"]]
    assert len(rec) == 1 and rec[0]["fits"]
    for r in rows:
        assert r["total_bytes"] == r["weights_bytes"] + r["state_bytes"] + r["overhead_bytes"]
        assert r["fits"] == (r["total_bytes"] <= r["budget_bytes"])
    with pytest.raises(DeltashipError, match="unknown tier 'phone-2gb'"):
        plan("qwen3.5-0.8b", tier="phone-2gb")


def test_plan_weights_match_a_real_bundle(bundle, tmp_path):
    """The planner's weight bytes for ONNX fp32 and int4 equal the bundle's model file to within its graph."""
    from deltaship.compile import export

    m = json.loads((bundle / "manifest.json").read_text())
    planned = weight_bytes(PRESETS["qwen3.5-tiny"].spec(), "onnx", "fp32")
    assert abs(m["files"]["model.onnx"]["bytes"] - planned) / planned < 0.05
    m4 = export("qwen3.5-tiny", tmp_path / "int4", precision="int4", max_context=64, progress=False, verify=False)
    planned = weight_bytes(PRESETS["qwen3.5-tiny"].spec(), "onnx", "int4")
    assert abs(m4["files"]["model.onnx"]["bytes"] - planned) / planned < 0.05, (m4["files"]["model.onnx"], planned)


# ---- profiling on the host ---------------------------------------------------------------------
def test_profile_host_records_and_contract(bundle, tmp_path):
    from deltaship.profiling.profile import profile

    ballast = np.ones(1 << 27)  # 1 GiB resident in this process: the worker's peak must not include it
    doc = profile(bundle, **FAST, json_out=tmp_path / "p.json", threads=1)
    del ballast
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved["schema_version"] == 1 and saved["device"]["device"] == "host"
    assert {"device", "bundle", "results"} <= set(saved)
    metrics = {(r["metric"], r.get("prompt_length"), r.get("context")) for r in doc["results"]}
    for m in [
        ("load_cold_s", None, None),
        ("load_warm_s", None, None),
        ("prefill_tok_s", 16, None),
        ("prefill_tok_s", 40, None),
        ("ttft_s", 40, None),
        ("decode_latency_s", None, 8),
        ("decode_latency_s", None, 48),
        ("peak_rss_bytes", None, None),
    ]:
        assert m in metrics, m
    for r in doc["results"]:
        assert {"metric", "unit", "samples", "median", "p90", "cv", "ci95", "flags"} <= set(r), r["metric"]
        if r["metric"] in ("prefill_tok_s", "decode_latency_s"):
            assert len(r["samples"]) >= 3 and r["ci95"][0] <= r["median"] <= r["ci95"][1]
    kinds = {r["op_kind"] for r in doc["results"] if r["metric"] == "decode_op_s"}
    assert {"deltanet", "attention", "matmul"} <= kinds
    peak = next(r["median"] for r in doc["results"] if r["metric"] == "peak_rss_bytes")
    assert 20 << 20 < peak < 1 << 30
    assert doc["imported_toolchains"] == []  # the measured process held only the ONNX runtime


def test_profile_compare(bundle, tmp_path):
    from deltaship.profiling.profile import compare, profile

    profile(bundle, **FAST, json_out=tmp_path / "a.json", threads=1, breakdown=False)
    profile(bundle, **FAST, json_out=tmp_path / "b.json", threads=1, breakdown=False)
    rows = compare(tmp_path / "a.json", tmp_path / "b.json")
    assert {r["metric"] for r in rows} >= {"prefill_tok_s", "decode_latency_s"}
    for r in rows:
        assert r["ci95"][0] <= r["ratio"] <= r["ci95"][1] or r["metric"] in ("load_cold_s", "peak_rss_bytes")


def test_profile_tier_emulation_and_fit(bundle):
    from deltaship.profiling.profile import profile

    doc = profile(bundle, **FAST, tier="phone-4gb", breakdown=False)
    e = doc["emulation"]
    assert e["tier"] == "phone-4gb" and e["threads"] == min(4, os.cpu_count()) and e["emulated"]
    assert doc["fit"]["fits"] and doc["fit"]["budget_bytes"] == int(1.2 * 2**30)


def test_a_run_that_dies_is_recorded_not_a_number(bundle, tmp_path):
    """A tier whose budget is far below the bundle's needs: under a cgroup cap the worker is killed.

    10 MiB is below what the worker needs just to import numpy and onnxruntime (about 22 MiB anonymous
    memory), so the kill is certain. The earlier 64 MiB cap sat close to the worker's real need with the
    tiny bundle, and the test failed once with it (the failure's output was not kept).
    """
    from deltaship.profiling.launch import MemoryCap
    from deltaship.profiling.profile import profile

    cap = MemoryCap(10 << 20)
    enforceable = cap.procs is not None
    cap.close()
    if not enforceable:
        pytest.skip("this host offers no writable cgroup to cap memory (the cap is reported as not enforced)")
    tiny = tmp_path / "tiers.toml"
    tiny.write_text(
        '[tiers.tiny-ram]\nkind = "phone"\nram_gib = 1\nbudget_gib = 0.01\n'
        'targets = ["onnx"]\nprecisions = ["fp32"]\ncontext = 64\nthreads = 1\n'
    )
    doc = profile(bundle, **FAST, tier="tiny-ram", tiers_file=str(tiny), breakdown=False)
    died = [r for r in doc["results"] if r.get("status") == "died"]
    assert died and died[0]["samples"] == [] and "died" in died[0]["flags"], doc["results"]
    assert "out of memory" in died[0]["reason"], died[0]  # the cap killed it, not a crash
    assert not any(r.get("median") for r in doc["results"])
    assert doc["fit"]["fits"] is False


def test_worker_holds_one_session_at_a_time(bundle, monkeypatch):
    """Peak RSS is that of an app with one session: warm loads must not overlap the cold-loaded one."""
    import gc
    import weakref

    from deltaship.profiling import worker

    real, alive, most = worker.open_bundle, set(), [0]

    def counting(*args, **kwargs):
        gc.collect()
        session = real(*args, **kwargs)
        key = id(session)
        alive.add(key)
        weakref.finalize(session, alive.discard, key)
        most[0] = max(most[0], len(alive))
        return session

    monkeypatch.setattr(worker, "open_bundle", counting)
    doc = worker.run(dict(bundle=str(bundle), threads=1, **dict(FAST, contexts=[8])))
    assert most[0] == 1
    warm = next(r for r in doc["results"] if r["metric"] == "load_warm_s")
    assert len(warm["samples"]) >= 2
    assert any(r["metric"] == "decode_tok_s" and r["median"] > 0 for r in doc["results"])


def test_default_contexts_clip_to_the_bundle(bundle):
    """Without --contexts the default depths are clipped to what the bundle's KV cache holds, rather
    than refused (a 4096-context bundle is profiled at 4095, not failed for 4096)."""
    from deltaship.profiling.profile import profile

    fast = {k: v for k, v in FAST.items() if k != "contexts"}
    doc = profile(bundle, **fast, breakdown=False)
    assert doc["config"]["contexts"] == [63]
    from deltaship.devices.discovery import default_threads

    assert doc["threads"] == default_threads() >= 1  # no --threads: the count the runtime was given, not None
    depths = [r["context"] for r in doc["results"] if r["metric"] == "decode_latency_s"]
    assert depths == [63]


def _rec(metric: str, unit: str, median: float, **where) -> dict:
    return {
        "metric": metric,
        "unit": unit,
        **where,
        "samples": [median] * 3,
        "median": median,
        "p90": median,
        "ci95": [median, median],
        "cv": 0.0,
        "n": 3,
        "flags": [],
    }


def test_results_table_says_its_units_threads_and_prompt():
    """The terminal table: the real thread count, names in the shown unit (ttft_ms, not ttft_s over ms figures),
    the prompt a decode figure ran after, and columns aligned whatever the `where` text."""
    from deltaship.profiling.report import format_compare, format_results

    doc = {
        "device": {"device": "host", "model": "cpu", "cores": 2},
        "bundle": {"name": "tiny", "target": "onnx", "precision": "fp32"},
        "runtime": "onnxruntime 1.31.0",
        "threads": 2,
        "results": [
            _rec("ttft_s", "s", 0.0123, prompt_length=8),
            _rec("decode_tok_s", "tok/s", 250.0, from_context=128, gen=4),
            _rec("decode_latency_s", "s", 0.004, context=16),
            _rec("decode_op_s", "s", 0.001, context=4096, op_kind="deltanet"),
            _rec("peak_rss_bytes", "bytes", 300 * 2**20),
        ],
    }
    text = format_results(doc)
    lines = text.splitlines()
    assert "2 threads" in lines[0] and "None" not in lines[0]
    assert "threads: the runtime's default" in format_results({**doc, "threads": None}).splitlines()[0]
    assert "ttft_ms " in text and "ttft_s" not in text and "decode_latency_ms" in text and "peak_rss_mib" in text
    assert "decode_tok_s " in text  # tokens per second keeps its name
    row = next(ln for ln in lines if ln.startswith("ttft_ms"))
    assert " ms " in row and "12.30" in row
    assert "after P=128" in text and "decode after a random prompt of 128 tokens" in text
    rows = [
        ln
        for ln in lines[1:]
        if ln.split()[0] in {"metric", "ttft_ms", "decode_tok_s", "decode_latency_ms", "decode_op_ms", "peak_rss_mib"}
    ]
    assert len(rows) == 6
    assert len({len(ln.rstrip()) for ln in rows[1:]}) == 1, "\n".join(rows)  # every column lines up
    cmp = [
        {**r, "a": r["median"], "b": r["median"], "ratio": 1.0, "ci95": [1.0, 1.0], "significant": False}
        for r in doc["results"]
    ]
    assert len({len(ln) for ln in format_compare(cmp, "A", "B").splitlines()[3:]}) == 1


def test_html_device_table_formats_bytes(tmp_path):
    from deltaship.profiling.report import write_html

    doc = {
        "device": {
            "device": "host",
            "cores": 2,
            "ram_bytes": 25276510208,
            "gpus": [{"name": "H100", "memory_bytes": 80 * 2**30}],
        },
        "bundle": {"name": "tiny", "target": "onnx", "precision": "fp32"},
        "results": [],
    }
    page = write_html(doc, tmp_path / "r.html").read_text()
    assert "<th>ram_bytes</th><td>23.54 GiB</td>" in page and "25276510208" not in page
    assert "memory_bytes 80.00 GiB" in page


def test_profile_bad_input(bundle):
    from deltaship.profiling.profile import profile

    with pytest.raises(
        DeltashipError, match="--contexts 128 .a depth must be below it.: past this bundle's max context of 64"
    ):
        profile(bundle, contexts=[128], prompt_lengths=[16], gen=4)
    with pytest.raises(DeltashipError, match="unknown tier"):
        profile(bundle, **FAST, tier="phone-1gb")
    with pytest.raises(DeltashipError, match="unknown device"):
        profile(bundle, **FAST, device="bluetooth:phone")


# ---- the HTML report in a real browser ---------------------------------------------------------
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is installed by .ci/run; not on this machine")
def test_html_report_renders_in_headless_chromium(bundle, tmp_path):
    from deltaship.profiling.profile import profile

    report = tmp_path / "report.html"
    profile(bundle, **FAST, report=report, threads=1)
    html = report.read_text()
    assert "src='data:image/png;base64," in html and "http" not in html.split("<body>")[1].split("<script>")[0]
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'chrome'}",
        "--virtual-time-budget=5000",
        "--dump-dom",
        report.as_uri(),
    ]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    import re

    summary = re.search(r'<table id="summary">(.*?)</table>', dom, re.S).group(1)
    assert "decode_tok_s (after P=" in summary and "prefill_tok_s (P=" in summary and "tok/s" in summary
    assert "ttft_ms (P=" in summary and "ttft_s" not in summary
    device = re.search(r'<table id="device">(.*?)</table>', dom, re.S).group(1)
    assert "<th>cores</th>" in device and "{" not in device  # a table, not the raw JSON
    m = re.search(r'<span id="check" data-expected="(\d+)">(\d+)/(\d+)</span>', dom)
    assert m, dom[-2000:]
    expected, loaded, total = map(int, m.groups())
    assert expected == total == loaded >= 4  # every plot decoded by the browser
    shot = tmp_path / "shot.png"
    subprocess.run(
        cmd[:-2] + [f"--screenshot={shot}", "--window-size=1100,1600", report.as_uri()],
        capture_output=True,
        timeout=120,
    )
    from PIL import Image

    px = np.asarray(Image.open(shot).convert("L"))
    assert px.std() > 10  # not a blank page


# ---- ssh against a real sshd on loopback -------------------------------------------------------
def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    if SSHD is None:
        pytest.skip("openssh-server is installed by .ci/run; not on this machine")
    d = tmp_path_factory.mktemp("sshd")
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
    os.chmod(d / "authorized_keys", 0o600)
    port = _free_port()
    venv_bin = str(Path(sys.executable).parent)
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPubkeyAuthentication yes\nUsePAM no\n"
        f"StrictModes no\nPermitRootLogin yes\nPidFile {d / 'sshd.pid'}\nSetEnv PATH={venv_bin}:/usr/bin:/bin\n"
        "PermitUserEnvironment yes\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config")], stderr=subprocess.PIPE)
    for _ in range(50):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    opts = [
        "-i",
        str(d / "client_key"),
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "LogLevel=ERROR",
    ]
    user = os.environ.get("USER") or subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
    yield {
        "url": f"ssh://{user}@127.0.0.1:{port}",
        "options": opts,
        "port": port,
        "deltaship": str(Path(sys.executable).parent / "deltaship"),
    }
    proc.terminate()
    proc.wait(timeout=10)


def test_ssh_fingerprint_and_profile_over_loopback(sshd, bundle, tmp_path):
    from deltaship.devices.discovery import ssh_fingerprint
    from deltaship.profiling.profile import profile

    fp = ssh_fingerprint(sshd["url"], sshd["options"], sshd["deltaship"])
    assert fp["kind"] == "ssh" and fp["cores"] >= 1 and fp["ram_bytes"] > 0
    doc = profile(
        bundle,
        device=sshd["url"],
        **FAST,
        ssh_options=sshd["options"],
        remote_deltaship=sshd["deltaship"],
        json_out=tmp_path / "remote.json",
    )
    assert doc["device"]["kind"] == "ssh" and doc["device"]["device"] == sshd["url"]
    assert any(r["metric"] == "prefill_tok_s" and r["samples"] for r in doc["results"])
    assert json.loads((tmp_path / "remote.json").read_text())["bundle"]["name"] == "tiny"


def test_unreachable_ssh_host_is_a_clear_error(bundle):
    from deltaship.profiling.profile import profile

    port = _free_port()  # nothing listens there
    with pytest.raises(DeltashipError, match=f"ssh://127.0.0.1:{port} is unreachable"):
        profile(bundle, device=f"ssh://127.0.0.1:{port}", **FAST, ssh_options=["-o", "ConnectTimeout=3"])


# ---- Android: a real adb server, no phone ------------------------------------------------------
@pytest.mark.skipif(shutil.which("adb") is None, reason="adb is installed by .ci/run; not on this machine")
def test_adb_with_no_device():
    from deltaship.devices.discovery import adb_devices, adb_fingerprint

    subprocess.run(["adb", "start-server"], capture_output=True, timeout=60)
    assert adb_devices() == []
    with pytest.raises(DeltashipError, match="'emulator-5554' is not attached"):
        adb_fingerprint("emulator-5554")


def test_android_runner_output_parsing():
    from deltaship.devices.android import parse_pss, parse_runner_output

    et = (
        'I 00:00:01 PyTorchObserver {"prompt_tokens":128,"generated_tokens":33,"model_load_start_ms":1000,'
        '"model_load_end_ms":1500,"inference_start_ms":2000,"prompt_eval_end_ms":2400,"first_token_ms":2410,'
        '"inference_end_ms":3010,"SCALING_FACTOR_UNITS_PER_SECOND":1000}'
    )
    got = parse_runner_output(et)
    assert got == pytest.approx({"load_cold_s": 0.5, "prefill_tok_s": 320.0, "ttft_s": 0.41, "decode_tok_s": 32 / 0.6})
    assert parse_runner_output("Average inference time cost: 12.5 ms")["inference_s"] == pytest.approx(0.0125)
    assert parse_pss("  TOTAL PSS:   123456   TOTAL RSS: 200000") == 123456 * 1024


# ---- the CLI -----------------------------------------------------------------------------------
def test_cli_devices_plan_profile(bundle, tmp_path):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "deltaship.cli", *a],
        capture_output=True,
        text=True,  # noqa: E731
        env=env,
        timeout=600,
    )
    r = run("devices", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)[0]["device"] == "host"
    r = run("plan", "--model", "qwen3.5-9b", "--json")
    rows = json.loads(r.stdout)
    assert {
        "tier",
        "target",
        "precision",
        "context",
        "weights_bytes",
        "state_bytes",
        "overhead_bytes",
        "total_bytes",
        "budget_bytes",
        "fits",
    } <= set(rows[0])
    r = run("plan", "--model", "qwen3.5-9b", "--tier", "phone-4gb")
    assert r.returncode == 0 and "no" in r.stdout
    r = run("plan", "--model", "qwen3.5-9b", "--tier", "nope")
    assert r.returncode == 2 and "unknown tier 'nope'" in r.stderr
    r = run(
        "profile",
        str(bundle),
        "--prompt-lengths",
        "16",
        "--gen",
        "4",
        "--contexts",
        "8",
        "--reps",
        "3",
        "--min-seconds",
        "0.1",
        "--json",
        str(tmp_path / "c.json"),
        "--no-breakdown",
    )
    assert r.returncode == 0 and "prefill_tok_s" in r.stdout
    r = run("profile", "--compare", str(tmp_path / "c.json"), str(tmp_path / "c.json"))
    assert r.returncode == 0 and "B/A" in r.stdout and "1.000" in r.stdout


def _fake_nvml(monkeypatch, per_process: int | None, device_used: list[int]):
    """A pynvml stand-in: one GPU whose used memory follows `device_used`, listing this process with
    `per_process` bytes (0: no per-process entry, as on some virtual machines; None: the query raises,
    as NotSupported does on some vGPU setups)."""
    import types

    used = iter(device_used + [device_used[-1]] * 10_000)
    proc = types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=per_process)

    def processes(h):
        if per_process is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return [proc] if per_process else []

    nv = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=next(used)),
        nvmlDeviceGetComputeRunningProcesses=processes,
    )
    monkeypatch.setitem(sys.modules, "pynvml", nv)


@pytest.mark.parametrize(
    "per_process,expect,source",
    [
        (3 << 30, 3 << 30, "per-process"),
        (0, 2 << 30, "device used memory above"),
        (None, 2 << 30, "device used memory above"),
    ],
)
def test_gpu_memory_per_process_or_device_delta(monkeypatch, per_process, expect, source):
    from deltaship.profiling.worker import GpuMemory

    _fake_nvml(monkeypatch, per_process, [5 << 30, 6 << 30, 7 << 30, 6 << 30])
    g = GpuMemory(interval=0.001)
    time.sleep(0.05)
    g.stop()
    assert g.peak == expect and source in g.source


def test_gpu_memory_without_nvml_is_unmeasured(monkeypatch):
    from deltaship.profiling.worker import GpuMemory

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    g = GpuMemory()
    g.stop()
    assert g.source is None and g.peak == 0
    _fake_nvml(monkeypatch, None, [5 << 30])  # NVML answers but never sees any memory in use
    g = GpuMemory(interval=0.001)
    time.sleep(0.02)
    g.stop()
    assert g.source is None
