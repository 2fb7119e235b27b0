"""`deltaship fleet run`: a matrix's exports and profiles on Ray (deltaship/fleet/, docs/fleet.md).

The embedded local cluster runs a tiny matrix (2 precisions x host) end to end: its rows carry the bytes `deltaship
export` writes and the non-timing fields `deltaship profile` records; a rerun is all `cached` and builds nothing.
Every Ray socket of the run is checked to be on loopback. Ray's state goes to temporary directories (HOME,
RAY_TMPDIR); nothing here runs `ray stop`: the embedded cluster is shut down by the run itself."""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path

import pytest
from fleet_sockets import assert_loopback, ray_sockets  # tests/fleet_sockets.py

from deltaship.cli import main
from deltaship.compile import export
from deltaship.errors import DeltashipError
from deltaship.fleet import fleet_run, parse_matrix
from deltaship.profiling.profile import profile

# one Ray at a time (these share a HOME and the machine's cores); a cluster that cannot start fails, never hangs
pytestmark = [pytest.mark.xdist_group("fleet"), pytest.mark.timeout(240)]

MATRIX = """
models = ["qwen3.5-tiny"]
targets = ["onnx"]
precisions = [{precisions}]
devices = [{devices}]
[export]
verify = false
fidelity = false
[profile]
prompt_lengths = [8]
gen = 4
contexts = [16]
reps = 1
warmups = 0
min_seconds = 0
breakdown = false
"""
WORKLOAD = dict(prompt_lengths=[8], gen=4, contexts=[16], reps=1, warmups=0, min_seconds=0, breakdown=False)


def matrix(tmp: Path, precisions=("fp32", "int4"), devices=("host",)) -> Path:
    p = tmp / "matrix.toml"
    quote = lambda xs: ", ".join(f'"{x}"' for x in xs)  # noqa: E731
    p.write_text(MATRIX.format(precisions=quote(precisions), devices=quote(devices)))
    return p


def test_the_socket_check_sees_a_socket_beyond_loopback():
    """The loopback assertion fails on a socket bound to every interface (it is not vacuous)."""
    anywhere = ipaddress.IPv6Address("::")
    with pytest.raises(AssertionError, match="not loopback"):
        assert_loopback([(1, "0A", ipaddress.IPv4Address("127.0.0.1"), anywhere), (2, "0A", anywhere, anywhere)])


# ---- the environment every Ray of this module runs in ----------------------------------------------------------
@pytest.fixture(scope="module")
def ray_home(tmp_path_factory):
    """HOME in a temporary directory: Ray writes its token under ~/.ray."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(home))
        mp.setenv("RAY_AUTH_MODE", "token")
        mp.delenv("RAY_ADDRESS", raising=False)
        yield home


# ---- the matrix, refused before any work ----------------------------------------------------------------------
BASE = 'models = ["qwen3.5-tiny"]\ntargets = ["onnx"]\nprecisions = ["fp32"]\ndevices = ["host"]\n'


def bad(extra: str = "", **axes: str) -> str:
    text = BASE + extra
    for key, value in axes.items():
        text = re.sub(rf"^{key} = .*$", f"{key} = {value}" if value else "", text, flags=re.M)
    return text


BAD = [
    (bad("model = 1"), "unknown key 'model'", "keys: models"),
    (bad(precisions='["fp8"]'), "precisions 'fp8' is unknown", "fp32"),
    (bad(targets='["tflite"]'), "targets 'tflite' is unknown", "onnx"),
    (bad(devices='["pixel"]'), "device 'pixel' is unknown", "adb:SERIAL"),
    (bad(devices='["adb:x; rm -rf /"]'), "device 'adb:x; rm -rf /' is unknown", "ssh://"),
    (bad(devices='["ssh://me@box/bin/sh"]'), "device 'ssh://me@box/bin/sh' is unknown", "ssh://user@host"),
    (bad("[export]\nverfy = false"), "unknown [export] key 'verfy'", "verify"),
    (bad("[export]\nforce = true"), "unknown [export] key 'force' (it is an axis", "verify"),
    (bad("[export]\nprompt_cache = '/etc/passwd'"), "unknown [export] key 'prompt_cache'", "max_context"),
    (bad('[export]\nblock_size = "32"'), "[export] block_size = '32'", "allowed: int"),
    (bad('[profile]\nrunner = "x"'), "unknown [profile] key 'runner'", "prompt_lengths"),
    (bad("[profile]\ngen = 1"), "[profile] gen must be >= 2", "set gen to 2 or more"),
    (bad(targets='["qnn"]'), "the cell qnn/fp32", "fp16"),
    (bad(models='["nope"]'), "model 'nope' is neither", "qwen3.5-tiny"),
    (bad(devices=""), "`devices` is missing", "devices"),
]


@pytest.mark.parametrize("text,what,allowed", BAD, ids=[b[1].split("'")[1] if "'" in b[1] else b[1][:20] for b in BAD])
def test_a_bad_matrix_is_refused_naming_the_key_and_the_allowed_values(text, what, allowed):
    with pytest.raises(DeltashipError) as e:
        parse_matrix(text)
    assert what in str(e.value) and allowed in str(e.value), str(e.value)


def test_the_cli_refuses_a_bad_matrix_before_any_work(tmp_path, capsys):
    p = tmp_path / "m.toml"
    p.write_text(BAD[1][0])
    assert main(["fleet", "run", str(p), "--out", str(tmp_path / "out")]) == 2
    assert "precisions 'fp8' is unknown" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing created, no cluster started


def test_a_good_matrix_is_typed():
    m = parse_matrix(matrix_text := MATRIX.format(precisions='"fp32", "int4"', devices='"host", "ssh://me@box:2222"'))
    assert m.precisions == ("fp32", "int4") and m.devices == ("host", "ssh://me@box:2222"), matrix_text
    assert m.export == {"verify": False, "fidelity": False} and m.profile["prompt_lengths"] == [8]


# ---- the embedded local cluster, end to end -------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_run(ray_home, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleet-local")
    seen: list = []

    def progress(line: str) -> None:
        if not seen:  # the first finished cell: the cluster is up and working
            seen.extend(ray_sockets())

    rows = fleet_run(matrix(tmp), out=tmp / "out", progress=progress)
    return {"rows": rows, "out": tmp / "out", "sockets": seen, "tmp": tmp}


def test_the_local_run_has_a_row_per_cell_and_stage(local_run):
    rows = local_run["rows"]
    assert sorted((r["stage"], r["cell"], r["status"]) for r in rows) == [
        ("export", "qwen3.5-tiny/onnx/fp32", "ok"),
        ("export", "qwen3.5-tiny/onnx/int4", "ok"),
        ("profile", "qwen3.5-tiny/onnx/fp32@host", "ok"),
        ("profile", "qwen3.5-tiny/onnx/int4@host", "ok"),
    ]
    written = [json.loads(line) for line in (local_run["out"] / "results.jsonl").read_text().splitlines()]
    assert written == rows
    exports = {r["cell"]: r for r in rows if r["stage"] == "export"}
    for r in rows:
        if r["stage"] == "profile":
            assert r["bundle_key"] == exports[r["bundle_cell"]]["bundle_key"]
            assert r["bundle_sha256"] == exports[r["bundle_cell"]]["bundle_sha256"]
            assert r["fingerprint"]["kind"] == "host" and r["error"] is None
    assert len({r["bundle_key"] for r in exports.values()}) == 2
    md = (local_run["out"] / "results.md").read_text()
    assert "## decode_latency_s (context 16) [s]" in md and "| qwen3.5-tiny/onnx/int4 |" in md


def test_its_sockets_are_on_loopback_only(local_run):
    assert_loopback(local_run["sockets"])


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_its_export_rows_carry_the_bytes_deltaship_export_writes(local_run, precision):
    row = next(r for r in local_run["rows"] if r["cell"] == f"qwen3.5-tiny/onnx/{precision}")
    manifest = export(
        "qwen3.5-tiny",
        local_run["tmp"] / f"by-hand-{precision}",
        precision=precision,
        verify=False,
        fidelity=False,
        progress=False,
    )
    assert row["files"] == {name: f["sha256"] for name, f in manifest["files"].items()}
    assert row["files"]["model.onnx"] == manifest["files"]["model.onnx"]["sha256"]


def _non_timing(doc: dict) -> dict:
    keys = ("metric", "unit", "prompt_length", "context", "from_context", "gen", "kv_dtype", "fill", "status")
    return {
        "bundle": doc["bundle"],
        "config": doc["config"],
        "threads": doc["threads"],
        "runtime": doc["runtime"],
        "emulation": doc["emulation"],
        "results": [{k: r.get(k) for k in keys} for r in doc["results"]],
    }


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_its_profile_rows_carry_what_deltaship_profile_records(local_run, precision):
    row = next(r for r in local_run["rows"] if r["cell"] == f"qwen3.5-tiny/onnx/{precision}@host")
    bundle = local_run["out"] / "store" / row["bundle_key"]
    doc = profile(bundle, **WORKLOAD)
    assert _non_timing(row["profile"]) == _non_timing(doc)
    assert {k: row["fingerprint"][k] for k in ("model", "cores", "os")} == {
        k: doc["device"][k] for k in ("model", "cores", "os")
    }


def test_a_rerun_is_cached_and_builds_nothing(local_run):
    out = local_run["out"]
    first = {r["cell"]: r for r in local_run["rows"]}
    records = {p.name: p.stat().st_mtime_ns for p in (out / "store").glob("*.json")}
    manifests = {p.parent.name: p.read_text() for p in (out / "store").glob("*/manifest.json")}
    rows = fleet_run(matrix(local_run["tmp"]), out=out, progress=lambda s: None)
    assert sorted((r["cell"], r["status"]) for r in rows) == sorted((c, "cached") for c in first)
    for r in rows:
        assert r["bundle_key"] == first[r["cell"]]["bundle_key"]
        assert r["bundle_sha256"] == first[r["cell"]]["bundle_sha256"]
        if r["stage"] == "profile":
            assert r["profile"] == first[r["cell"]]["profile"]
    assert {p.name: p.stat().st_mtime_ns for p in (out / "store").glob("*.json")} == records
    assert {p.parent.name: p.read_text() for p in (out / "store").glob("*/manifest.json")} == manifests
    assert len((out / "results.jsonl").read_text().splitlines()) == 2 * len(first)
