"""The memory plan is measured, not hoped: `plan`'s total against the peak RSS `profile` measures, and the
session's release of mapped weight pages (docs/results/memory.md)."""

from __future__ import annotations

import mmap
import statistics
import sys

import pytest

from deltaship.devices.plan import memory_terms, planned_peak
from deltaship.profiling.profile import profile
from deltaship.profiling.report import format_results

# the workload the terms were fitted on (bench/memory/memory_split.py --fit): a 512-token prefill at the
# preset's context
WORKLOAD = dict(prompt_lengths=[512], gen=8, contexts=[], warmups=1, reps=2, min_seconds=0, breakdown=False)


def profiled_plans(bundle, runs: int = 3, **options) -> tuple[list[dict], float]:
    """`runs` profiles of `bundle` (fresh processes): their documents and the median of their plan/measured ratios.
    A tiny process's peak moves by several percent from run to run (qwen3.5-tiny fp16: 135-154 MiB in six runs,
    freed prefill memory given back to the system or not), so one run would test the noise as much as the plan."""
    docs = [profile(bundle, threads=2, **WORKLOAD, **options) for _ in range(runs)]
    return docs, statistics.median(d["memory_plan"]["plan_over_measured"] for d in docs)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8", "int4"])
def test_plan_is_within_ten_percent_of_the_measured_peak_rss(shared_export, precision):
    bundle = shared_export(
        f"memory-plan-tiny-onnx-{precision}", "qwen3.5-tiny", target="onnx", precision=precision, verify=False
    )
    docs, ratio = profiled_plans(bundle)
    m = docs[0]["memory_plan"]
    assert m["terms"].startswith("measured"), m["terms"]
    # the shared objects' resident pages are the process's own (page-cache dependent: 45 vs 55 MiB for the same
    # wheels in two virtual environments), swapped in for those the terms were fitted with
    assert m["libraries"] == "measured in the profiled process" and 20 << 20 < m["libraries_bytes"] < 200 << 20, m
    assert abs(ratio - 1) <= 0.10, [d["memory_plan"] for d in docs]
    text = format_results(docs[0])  # `profile` prints both, side by side
    assert f"measured {m['peak_rss_bytes'] / 2**30:.3f} GiB, plan {m['total_bytes'] / 2**30:.3f} GiB" in text


def test_a_prepacked_sessions_plan_is_within_ten_percent_of_its_measured_peak_rss(shared_export, tmp_path):
    """A session that maps a --prepack-cache entry has terms of its own (memory_terms.toml's onnx.int4.prepacked):
    its weights become resident as it runs, and it holds no packed copy beside the originals while loading."""
    bundle = shared_export("memory-plan-tiny-onnx-int4", "qwen3.5-tiny", target="onnx", precision="int4", verify=False)
    docs, ratio = profiled_plans(bundle, prepack_cache=tmp_path / "cache")
    m = docs[0]["memory_plan"]
    assert m["prepacked"] and "prepacked: memory-prepacked" in m["terms"], m["terms"]
    assert abs(ratio - 1) <= 0.10, [d["memory_plan"] for d in docs]
    assert len(list((tmp_path / "cache").iterdir())) == 1  # built before the first run, then mapped by every one


def test_the_plan_swaps_the_terms_shared_objects_for_the_measured_ones():
    """The runtime term holds the shared objects' resident bytes of the process it was fitted on: `profile`'s plan
    replaces them with its own process's, byte for byte; a tier's plan (an app's process) keeps the terms'."""
    manifest = {"source": {"model": "qwen3.5-0.8b"}, "target": "onnx", "precision": "int4", "max_context": 1024}
    terms = memory_terms("onnx", "int4")
    assert terms.libraries_bytes > 0
    base = planned_peak(manifest, 512)
    more = planned_peak(manifest, 512, libraries_bytes=terms.libraries_bytes + (10 << 20))
    assert base["libraries"] == "terms" and more["libraries"] == "measured in the profiled process"
    assert more["total_bytes"] - base["total_bytes"] == 10 << 20 == more["runtime_bytes"] - base["runtime_bytes"]


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_executorch_plan_is_within_ten_percent_of_the_measured_peak_rss(tiny_pte, precision):
    """The ExecuTorch rows, on the tiny preset's programs the ExecuTorch tests share (context 128, prefill chunk 16,
    the MTP head beside `forward`): `profile`'s process is deltaship's Python driver, torch included."""
    doc = profile(tiny_pte(precision), threads=2, **dict(WORKLOAD, prompt_lengths=[64]))
    m = doc["memory_plan"]
    assert m["terms"].startswith("measured"), m["terms"]
    # the driver's part (torch's libraries, whose resident pages vary with the page cache by tens of MB) is the
    # profiled process's own: the plan predicts the rest
    assert m["host"].startswith("measured") and 100 << 20 < m["host_bytes"] < m["peak_rss_bytes"], m
    assert abs(m["plan_over_measured"] - 1) <= 0.10, m


def test_unmeasured_terms_say_they_are_estimates():
    for target in ("onnx", "executorch"):
        for precision in ("fp32", "fp16", "int8", "int4"):
            assert memory_terms(target, precision).source.startswith("measured"), (target, precision)
    terms = memory_terms("coreml", "int4")  # Core ML runs here only in a Linux evaluator: nothing a phone would see
    assert terms.source.startswith("estimate") and terms.weights_factor == 1.0


def test_a_device_tiers_plan_leaves_out_the_python_drivers_bytes():
    """ExecuTorch's measured runtime term holds torch (deltaship's Python driver loads it through the pybindings; an
    app links the C++ runtime alone): `profile`'s plan (the host process) counts it, a tier's plan does not."""
    from deltaship.devices.catalog import get_tier
    from deltaship.devices.plan import estimate
    from deltaship.models.source import load_source

    spec, tier = load_source("qwen3.5-0.8b").spec, get_tier("phone-4gb")
    terms = memory_terms("executorch", "int4")
    assert terms.host_bytes > 100 << 20  # torch's libraries, resident once imported
    app = estimate(spec, tier, "executorch", "int4", 1024)
    driver = estimate(spec, tier, "executorch", "int4", 1024, host_driver=True)
    assert driver.total_bytes - app.total_bytes == terms.host_bytes == driver.runtime_bytes - app.runtime_bytes
    # `profile` measures the driver's part in its own process and plans with that in place of the terms'
    measured = estimate(spec, tier, "executorch", "int4", 1024, host_driver=True, host_bytes=300 << 20)
    assert measured.total_bytes - app.total_bytes == 300 << 20
    assert estimate(spec, tier, "executorch", "int4", 1024, host_bytes=300 << 20).total_bytes == app.total_bytes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_release_mapped_pages_forgets_clean_pages_and_keeps_written_ones(tmp_path):
    from deltaship.runtimes.onnx import release_mapped_pages

    path = tmp_path / "model.onnx.data"
    page = mmap.PAGESIZE
    path.write_bytes(bytes(range(256)) * (64 * page // 256))

    def resident(m: mmap.mmap) -> int:
        target, rss, cur = str(path.resolve()), 0, False
        for line in open("/proc/self/smaps"):
            f = line.split()
            if "-" in f[0] and not f[0].endswith(":"):
                cur = len(f) == 6 and f[5] == target
            elif cur and f[0] == "Rss:":
                rss += int(f[1]) * 1024
        return rss

    with open(path, "rb") as fh:
        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)  # private and writable, as ONNX Runtime maps it
        assert sum(m[i] for i in range(0, len(m), page)) == 0  # touch every page
        assert resident(m) >= 32 * page
        assert release_mapped_pages(path) == len(m)
        assert resident(m) < 8 * page
        assert m[:256] == bytes(range(256)) and m[-1] == 255  # read back from the file
        m[5] = 7  # a written page lives only in this process: the mapping is left alone
        assert release_mapped_pages(path) == 0
        assert m[5] == 7
        m.close()


def test_profile_reads_the_peak_before_the_warm_loads(shared_export, monkeypatch):
    """The peak is an app's that opened the bundle once: sessions opened and closed again for load_warm_s leave freed
    memory behind in the allocator, which must not count."""
    from deltaship.profiling import worker

    bundle = shared_export("memory-plan-tiny-onnx-int4", "qwen3.5-tiny", target="onnx", precision="int4", verify=False)
    real, opened = worker.open_bundle, []

    def counting(*args, **kwargs):
        opened.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(worker, "open_bundle", counting)
    monkeypatch.setattr(worker, "peak_rss_bytes", lambda: len(opened))  # "peak" = sessions opened when it is read
    doc = worker.run(dict(bundle=str(bundle), threads=1, prompt_lengths=[8], gen=2, contexts=[], reps=2, warmups=0))
    peak = next(r for r in doc["results"] if r["metric"] == "peak_rss_bytes")
    assert peak["samples"] == [1] and len(opened) >= 3  # read after the one cold load, before the warm ones
    assert next(r for r in doc["results"] if r["metric"] == "load_warm_s")["n"] >= 2


def test_cpu_prefill_gives_the_arena_back_and_decode_does_not(shared_export):
    """A multi-token call on the CPU runs with arena shrinkage (a second prefill of the same length must not hold the
    first one's chunks and ORT's planned block at once); a decode step runs with none (it keeps the memory pattern)."""
    from deltaship.targets import open_bundle

    bundle = shared_export("memory-plan-tiny-onnx-int4", "qwen3.5-tiny", target="onnx", precision="int4", verify=False)
    s = open_bundle(bundle, threads=1)
    seen = []
    real = s.sess.run_with_iobinding
    s.sess.run_with_iobinding = lambda io, opts=None: (seen.append(opts), real(io, opts))[1]
    s.prefill([1, 2, 3, 4])
    s.decode(5)
    assert seen[0] is not None and seen[0].get_run_config_entry("memory.enable_memory_arena_shrinkage") == "cpu:0"
    assert seen[1] is None


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_tied_quantized_embedding_gathers_from_the_lm_heads_own_table(shared_export, tmp_path, precision):
    """No second resident copy of a tied, quantized LM head: after ONNX Runtime's graph optimizations (constant
    folding included) the embedding's GatherBlockQuantized reads the very initializer the LM head's MatMulNBits
    packs (a Reshape of it in between was folded into a copy: 0.12 GiB at 0.8B int4)."""
    import onnx
    import onnxruntime as ort

    from deltaship.runtimes.onnx_io import session_options

    bundle = shared_export(
        f"memory-plan-tiny-onnx-{precision}", "qwen3.5-tiny", target="onnx", precision=precision, verify=False
    )
    opts = session_options(ort, 1, None)
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(bundle / "model.onnx"), opts, providers=["CPUExecutionProvider"])
    graph = onnx.load(str(tmp_path / "optimized.onnx"), load_external_data=False).graph
    gathers = [n for n in graph.node if n.op_type == "GatherBlockQuantized"]
    packed_heads = {n.input[1] for n in graph.node if n.op_type == "MatMulNBits"}
    assert len(gathers) == 1 and gathers[0].input[0] in packed_heads, [list(n.input) for n in gathers]


def test_the_plans_weights_follow_the_bundles_quantization_block(shared_export):
    """A bundle exported with --block-size 128 stores a quarter of block 32's scales: `profile`'s plan reads the block
    from the manifest, and its stored weights shrink by what the bundle's files shrank."""
    from deltaship.bundle.reader import read_manifest

    b32 = shared_export("memory-plan-tiny-onnx-int4", "qwen3.5-tiny", target="onnx", precision="int4", verify=False)
    b128 = shared_export(
        "memory-plan-tiny-onnx-int4-block128", "qwen3.5-tiny", target="onnx", precision="int4", verify=False,
        block_size=128,
    )  # fmt: skip
    m32, m128 = read_manifest(b32), read_manifest(b128)
    assert (m32["quantization"]["block_size"], m128["quantization"]["block_size"]) == (32, 128)
    files = {k: sum(f["bytes"] for f in m["files"].values()) for k, m in (("32", m32), ("128", m128))}
    p32, p128 = planned_peak(m32, 64), planned_peak(m128, 64)
    w = {k: p["weights_loaded_bytes"] / memory_terms("onnx", "int4", block_size=b).weights_factor
         for k, p, b in (("32", p32, 32), ("128", p128, 128))}  # fmt: skip
    saved, planned = files["32"] - files["128"], w["32"] - w["128"]
    assert saved > 0 and abs(planned / saved - 1) < 0.05, (saved, planned)


def test_a_block_table_names_the_factors_and_the_row_the_runtime():
    """memory_terms.toml's onnx.int4.block128 (and its prepacked table) replace the factors, never the runtime terms;
    a block without a table keeps the default block's factors and says so."""
    import tomllib

    from deltaship.devices.plan.memory import MEMORY_TERMS

    row = tomllib.loads(MEMORY_TERMS.read_text())["onnx"]["int4"]
    default, prepacked = memory_terms("onnx", "int4"), memory_terms("onnx", "int4", prepacked=True)
    b128, b128p = memory_terms("onnx", "int4", block_size=128), memory_terms("onnx", "int4", True, 128)
    assert (b128.weights_factor, b128.load_factor) == (
        row["block128"]["weights_factor"],
        row["block128"]["load_factor"],
    )
    assert b128p.weights_factor == row["block128"]["prepacked"]["weights_factor"] != b128.weights_factor
    assert b128.runtime_bytes == default.runtime_bytes and b128p.runtime_bytes == prepacked.runtime_bytes
    assert b128p.libraries_bytes == prepacked.libraries_bytes
    assert "block 128:" in b128.source and "block 128, prepacked:" in b128p.source
    b64 = memory_terms("onnx", "int4", block_size=64)
    assert b64.weights_factor == default.weights_factor and "block 64: not measured" in b64.source
    assert memory_terms("onnx", "fp32", block_size=128) == memory_terms("onnx", "fp32")  # no blocks at fp32
