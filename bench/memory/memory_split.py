"""Where a deltaship ONNX session's memory goes, step by step, measured in fresh processes.
Regenerates: docs/results/memory.md's split tables, and deltaship/devices/memory_terms.toml (--fit).

    python bench/memory/memory_split.py BUNDLE [BUNDLE ...] [--variants default,no-prepack,...] [--rounds 2]
        [--prompt 512] [--gen 32] [--threads 2] [--json OUT.json]

Each (bundle, variant) runs in its own process (`--worker`), which records after every step its VmRSS,
VmHWM (the peak so far), /proc/self/smaps_rollup (Rss, Pss, Anonymous, Pss_File, Pss_Anon) and, from
/proc/self/smaps, the resident bytes of the bundle's external data file (weights mapped from disk) and
of the ONNX Runtime library. Steps: bare Python, `import numpy`, `import onnxruntime`, the deltaship
runtime's imports, the ONNX Runtime session (weights as loaded, prepacked copies), deltaship's session
around it (state buffers, IOBinding), a warmup prefill, a `--prompt`-token prefill (arena growth:
attention scores, MLP activations), `--gen` decode steps. A variant is a set of ONNX Runtime session
options added on top of deltaship's own (`deltaship.runtimes.onnx_io.session_options`); rounds alternate the
variants, and prefill/decode times are kept so that each variant's speed is compared with the default's
in the same run (ratios, not absolute numbers: the machine may be shared).
ONNX Runtime's Python API has no allocator statistics (the C API's AllocatorGetStats is not exposed), so
the arena is seen through RSS.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# name -> ONNX Runtime session settings on top of deltaship's: ("config", key, value) entries or
# ("attr", SessionOptions attribute, value)
VARIANTS: dict[str, list[tuple[str, str, object]]] = {
    "default": [],
    # ONNX Runtime's packed weights saved once (deltaship/runtimes/onnx_prepack.py) and mapped by the session
    "prepacked": [("deltaship", "prepack_cache", True)],
    "no-prepack": [("config", "session.disable_prepacking", "1")],
    "no-arena": [("attr", "enable_cpu_mem_arena", False)],
    "no-mem-pattern": [("attr", "enable_mem_pattern", False)],
    # deltaship's session as it was before: prefill calls without arena shrinkage, mapped pages kept
    "no-shrink": [("deltaship", "prefill_run_config", False)],
    "main": [("deltaship", "prefill_run_config", False), ("deltaship", "release_mapped_pages", False)],
    "no-arena-no-pattern": [("attr", "enable_cpu_mem_arena", False), ("attr", "enable_mem_pattern", False)],
    "env-allocators": [("config", "session.use_env_allocators", "1")],
    "no-folding": [("config", "optimization.disable_specified_optimizers", "ConstantFolding")],
    # deltaship's session as it was before it released the mapped weight pages after loading
    "keep-mapped": [("deltaship", "release_mapped_pages", False)],
    "no-folding-keep-mapped": [
        ("config", "optimization.disable_specified_optimizers", "ConstantFolding"),
        ("deltaship", "release_mapped_pages", False),
    ],
    # an arena registered in the environment that grows by what is asked, not by doubling (kSameAsRequested)
    "arena-same-as-requested": [
        ("env_arena", "arena_extend_strategy", 1),
        ("config", "session.use_env_allocators", "1"),
    ],
    "device-init": [("config", "session.use_device_allocator_for_initializers", "1")],
    "device-init-no-pattern": [
        ("config", "session.use_device_allocator_for_initializers", "1"),
        ("attr", "enable_mem_pattern", False),
    ],
    "device-init-no-arena": [
        ("config", "session.use_device_allocator_for_initializers", "1"),
        ("attr", "enable_cpu_mem_arena", False),
    ],
}


def status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out


def rollup() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("Rss", "Pss", "Pss_Anon", "Pss_File", "Anonymous"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def mapped_rss(names: dict[str, str]) -> dict[str, int]:
    """Resident bytes of the mappings whose path contains each needle (label -> needle)."""
    out = dict.fromkeys(names, 0)
    cur = None
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=5)
            if len(first) >= 5 and "-" in first[0] and not line.startswith(("Rss", "Pss")):
                path = first[5].strip() if len(first) > 5 else ""
                cur = next((label for label, needle in names.items() if needle and needle in path), None)
            elif cur and line.startswith("Rss:"):
                out[cur] += int(line.split()[1]) * 1024
    return out


def worker(a) -> int:
    import numpy as np  # noqa: F401  (step 2; imported here so that step 1 is bare Python)

    steps: list[dict] = []
    # runtime_library: the runtime's own shared objects (an app links them too); the rest of the process up to the
    # runtime's import is the host's (the interpreter, numpy, torch for ExecuTorch): --fit's host_bytes
    needles: dict[str, str] = {"weights_file": "", "runtime_library": "/onnxruntime/capi/"}

    peak = [0]  # the process's peak so far, across the resets of reset_peak

    def step(name: str, **extra) -> None:
        st = status()
        peak[0] = max(peak[0], st["VmHWM"])
        steps.append({"step": name, **st, "VmHWM": peak[0], **rollup(), **mapped_rss(needles), **extra})

    def reset_peak() -> int:
        """Start a new peak (Linux >= 4.0: 5 > /proc/self/clear_refs resets VmHWM to the RSS now); return the RSS."""
        st = status()
        peak[0] = max(peak[0], st["VmHWM"])
        Path("/proc/self/clear_refs").write_text("5")
        return st["VmRSS"]

    step.steps, step.needles, step.reset_peak = steps, needles, reset_peak

    # bare Python was recorded by the caller's argv handling below; numpy is already in
    step("import numpy")
    bundle = Path(a.bundle)
    entry = json.loads((bundle / "manifest.json").read_text()).get("entry", "")
    if entry.endswith(".pte"):  # an ExecuTorch program: its runtime (torch, the pybindings, the kernel libraries)
        return executorch_worker(a, bundle, entry, step)
    import onnxruntime  # noqa: F401

    step("import onnxruntime")
    import deltaship.runtimes.onnx as onnx_rt
    from deltaship.bundle.reader import read_manifest
    from deltaship.targets import open_bundle

    step("import deltaship runtime")
    manifest = read_manifest(bundle)
    data = sorted(f.name for f in bundle.iterdir() if f.suffix == ".data")  # the external data file, if any
    needles["weights_file"] = str(bundle.resolve() / data[0]) if data else ""
    settings = VARIANTS[a.variant]

    base_options = onnx_rt.session_options

    def options(ort, *args, **kw):
        opts = base_options(ort, *args, **kw)
        for kind, key, value in settings:
            if kind in ("env_arena", "deltaship"):
                continue
            if kind == "config":
                opts.add_session_config_entry(key, str(value))
            else:
                setattr(opts, key, value)
        return opts

    onnx_rt.session_options = options  # the name OnnxSession calls
    for kind, key, value in settings:
        if kind == "deltaship" and key == "release_mapped_pages" and not value:
            onnx_rt.release_mapped_pages = lambda data_file: 0
        if kind == "deltaship" and key == "prefill_run_config" and not value:
            onnx_rt.PREFILL_RUN_CONFIG = {}
        if kind == "env_arena":  # max_mem 0 (no cap), strategy, default initial chunk, default dead bytes
            info = onnxruntime.OrtMemoryInfo(
                "Cpu", onnxruntime.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, onnxruntime.OrtMemType.DEFAULT
            )
            onnxruntime.create_and_register_allocator(info, onnxruntime.OrtArenaCfg(0, int(value), -1, -1))
    ort_session = onnxruntime.InferenceSession

    class Recorded(ort_session):  # the ONNX Runtime session alone, before deltaship's buffers
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            step("onnxruntime session")

    onnxruntime.InferenceSession = Recorded
    return run_session(a, bundle, manifest, open_bundle, step, steps)


def executorch_worker(a, bundle: Path, entry: str, step) -> int:
    """The same steps for an ExecuTorch bundle: its runtime's import (torch, the pybindings and the kernel libraries
    the programs call), deltaship's session (the program loaded, XNNPACK's packed weights, the method's planned
    buffers and states), then the prefills and decode steps."""
    from deltaship.runtimes import executorch as et_rt

    step.needles.update(weights_file=str((bundle / entry).resolve()), runtime_library="/executorch/")
    et_rt.runtime()
    step("import executorch runtime")
    from deltaship.bundle.reader import read_manifest
    from deltaship.targets import open_bundle

    step("import deltaship runtime")
    return run_session(a, bundle, read_manifest(bundle), open_bundle, step, step.steps)


def run_session(a, bundle: Path, manifest: dict, open_bundle, step, steps: list[dict]) -> int:
    import numpy as np

    t0 = time.monotonic()
    cache = a.prepack_cache if ("deltaship", "prepack_cache", True) in VARIANTS[a.variant] else None
    s = open_bundle(bundle, threads=a.threads, check_hashes=False, prefill_chunk=a.prefill_chunk, prepack_cache=cache)
    load_s = time.monotonic() - t0
    state_bytes = sum(int(np.prod(st["shape"])) * np.dtype(st["dtype"]).itemsize for st in manifest["states"])
    step("deltaship session (states, IOBinding)", load_s=load_s, state_bytes_one_copy=state_bytes)
    rng = np.random.default_rng(0)
    # token ids: the first 1000 of the vocabulary (the runs recorded before --ids) or the whole of it, as text spread
    # over it reads: the quantized embedding is gathered from the mapped file, so spread ids make its pages resident
    top = s.vocab_size if a.ids == "whole-vocab" else min(1000, s.vocab_size)
    s.reset()
    s.prefill(rng.integers(0, top, 16).tolist())
    step("warmup prefill 16")
    ids = rng.integers(0, top, a.prompt).tolist()
    s.reset()
    before = step.reset_peak()  # the prefill's own peak, which the load's may hide in VmHWM
    t0 = time.monotonic()
    logits = s.prefill(ids)
    prefill_s = time.monotonic() - t0
    step(f"prefill {a.prompt}", prefill_s=prefill_s, own_peak=status()["VmHWM"], rss_before=before)
    s.reset()  # a second prompt of the same length, as every chat's next turn: what the first left must be reused
    t0 = time.monotonic()
    logits = s.prefill(ids)
    step(f"prefill {a.prompt} again", prefill_again_s=time.monotonic() - t0)
    tok = int(np.argmax(logits))
    stamps = []
    for _ in range(a.gen):
        stamps.append(time.monotonic())
        tok = int(np.argmax(s.decode(tok)))
    stamps.append(time.monotonic())
    tpot = (stamps[-1] - stamps[1]) / (a.gen - 1)
    step(f"decode {a.gen}", tpot_s=tpot)
    print(json.dumps({"steps": a.first + steps, "prefill_s": prefill_s, "tpot_s": tpot, "load_s": load_s}))
    return 0


def run_worker(bundle: str, variant: str, a, chunk: int | None = None) -> dict:
    cmd = [sys.executable, __file__, "--worker", bundle, "--variant", variant, "--threads", str(a.threads)]
    cmd += ["--prompt", str(a.prompt), "--gen", str(a.gen), "--prepack-cache", str(a.prepack_cache), "--ids", a.ids]
    if chunk:
        cmd += ["--prefill-chunk", str(chunk)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{bundle} {variant}: worker died ({out.returncode}): {out.stderr[-800:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


GIB = 1 << 30


def table(bundle: str, variant: str, res: dict) -> str:
    lines = [
        f"\n{bundle} [{variant}]",
        f"{'step':40s} {'RSS':>7s} {'peak':>7s} {'anon':>7s} {'weights':>8s} {'PSS':>7s}",
    ]
    prev = 0
    for st in res["steps"]:
        rss = st["VmRSS"]
        lines.append(
            f"{st['step']:40s} {rss / GIB:7.3f} {st['VmHWM'] / GIB:7.3f} {st.get('RssAnon', 0) / GIB:7.3f} "
            f"{st.get('weights_file', 0) / GIB:8.3f} {st.get('Pss', 0) / GIB:7.3f}  (+{(rss - prev) / GIB:.3f})"
        )
        prev = rss
    return "\n".join(lines)


def _sizes(source: str, target: str, precision: str, context: int, chunk: int, block: int | None = None) -> dict:
    """The plan's stored weights, activation formula and states for a bundle's model and workload (block: the
    bundle's quantization block, its manifest's quantization.block_size)."""
    from deltaship.devices.plan import activation_bytes, state_bytes, weight_bytes
    from deltaship.models.source import load_source

    spec = load_source(source).spec
    return {
        "w": weight_bytes(spec, target, precision, block),
        "act": activation_bytes(spec, target, precision, context, chunk, all_layers=True),
        "act_one_layer": activation_bytes(spec, target, precision, context, chunk),  # the plan's unmeasured formula
        "states": state_bytes(spec, target, precision, context),
    }


def prepacked_terms(split: Path, profiles: list[Path] = ()) -> str:
    """The `prepacked` table of memory_terms.toml for each (target, precision) of a split run's `prepacked`
    variant (rounds after the build): a session that maps its packed weights touches them as it runs, not as it
    loads, so the weights factor is read from the end of the run (RSS less the process before the bundle, the
    states and what the last prefill left), the activation factor from the run's peak over its end, and the load
    factor from the peak while the session opened. The median over rounds and chunks. profiles: `deltaship profile
    --prepack-cache --json` documents of a small model, whose peak less the other terms gives runtime_bytes (the
    prepacked session's fixed costs; the median over the documents), as fit_terms does for the default session."""
    from statistics import median

    from deltaship.bundle.reader import read_manifest

    by: dict[tuple[str, str, int | None], dict[str, list[float]]] = {}
    for run in json.loads(split.read_text())["runs"]:
        if run["variant"] != "prepacked" or run["round"] == "build":
            continue
        m = read_manifest(run["bundle"])
        steps = {st["step"]: st for st in run["steps"]}
        pre = steps["import deltaship runtime"]["VmRSS"]
        sess = steps["deltaship session (states, IOBinding)"]
        chunk = min(run.get("prompt", 512), run.get("prefill_chunk") or m["prefill_chunk"])
        z = _sizes(m["source"]["model"], m["target"], m["precision"], m["max_context"], chunk, _block(m))
        end, peak = run["steps"][-1]["VmRSS"], run["steps"][-1]["VmHWM"]
        f = by.setdefault((m["target"], m["precision"], _block(m)), {"wf": [], "af": [], "lf": []})
        f["wf"].append((end - pre - z["states"]) / z["w"])
        f["af"].append(max(0, peak - end) / z["act"])
        f["lf"].append((sess["VmHWM"] - pre) / z["w"])
    # each profile: (stored weights, peak less the weights and states, the activation formula); a small and a
    # large model's profiles fix the runtime term and the activation factor together (the plan meets both peaks)
    seen: dict[tuple[str, str, int | None], list[tuple[float, float, float]]] = {}
    for p in profiles:
        doc = json.loads(p.read_text())
        b = doc["bundle"]
        key = (b["target"], b["precision"], None)  # the default block's: a block table takes the row's runtime
        if not doc["config"].get("prepack_cache") or key not in by:
            continue
        peak = next(r["median"] for r in doc["results"] if r["metric"] == "peak_rss_bytes")
        chunk = min(max(doc["config"]["prompt_lengths"]), b["prefill_chunk"])
        z = _sizes(b["source"], b["target"], b["precision"], b["max_context"], chunk)
        seen.setdefault(key, []).append((z["w"], peak - median(by[key]["wf"]) * z["w"] - z["states"], z["act"]))
    runtime: dict[tuple[str, str, int | None], float] = {}
    for key, rows in seen.items():
        small = [r for r in rows if r[0] < SMALL]
        large = [r for r in rows if r[0] >= SMALL]
        if small and large:  # rest = runtime + af * act at both sizes
            (_, rs, as_), (_, rl, al) = (median(c) for c in zip(*small)), (median(c) for c in zip(*large))
            af = max(0.0, (rl - rs) / (al - as_))
            by[key]["af"] = [af]
            runtime[key] = rs - af * as_
        elif small:
            runtime[key] = median(r[1] - median(by[key]["af"]) * r[2] for r in small)
    out = []
    for (target, precision, block), f in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0)):
        out += [
            f"[{target}.{precision}{f'.block{block}' if block else ''}.prepacked]",
            *(
                [f"runtime_bytes = {int(runtime[(target, precision, block)])}"]
                if (target, precision, block) in runtime
                else []
            ),
            f"weights_factor = {median(f['wf']):.4f}",
            f"activation_factor = {median(f['af']):.4f}",
            f"load_factor = {median(f['lf']):.4f}",
            f'from = "{split.name}, the prepacked variant, {len(f["wf"])} runs'
            + (
                f"; runtime and activations: {len(seen.get((target, precision, block), []))} profiles"
                if profiles
                else ""
            )
            + '"',
            "",
        ]
    return "\n".join(out)


def _libraries(doc: dict) -> int | None:
    """The profiled process's shared objects' resident bytes (profile's shared_object_rss_bytes), if recorded."""
    return next((int(r["median"]) for r in doc["results"] if r["metric"] == "shared_object_rss_bytes"), None)


def runtime_terms(profiles: list[Path]) -> str:
    """runtime_bytes and libraries_bytes of memory_terms.toml's rows, refitted from `deltaship profile --json`
    documents of a small model (several runs of each bundle), the other terms as the table has them: each run's peak
    less the rest of its plan (weights, states, activations: total_bytes less runtime_bytes) less its shared objects'
    resident bytes is the runtime's own part; runtime_bytes is the median of those plus the median of the shared
    objects, which libraries_bytes records so that `profile` can swap them for its own process's."""
    from statistics import median

    runs: dict[str, list[tuple[int, int]]] = {}
    for p in profiles:
        doc = json.loads(p.read_text())
        b, plan, libs = doc["bundle"], doc.get("memory_plan"), _libraries(doc)
        if plan is None or libs is None:
            raise SystemExit(f"{p}: no memory plan or no shared_object_rss_bytes (a profile by this version)")
        peak = next(r["median"] for r in doc["results"] if r["metric"] == "peak_rss_bytes")
        rest = plan["total_bytes"] - plan["runtime_bytes"]
        if plan["host"] != "terms":  # ExecuTorch: the host is measured in the process; --fit reads its terms
            raise SystemExit(f"{p}: the host's bytes were measured in this process: refit its row with --fit")
        own = peak - rest - libs
        key = f"{b['target']}.{b['precision']}" + (".prepacked" if plan.get("prepacked") else "")
        runs.setdefault(key, []).append((own, libs))
    out = []
    for key, rows in sorted(runs.items()):
        libs = int(median(r[1] for r in rows))
        out += [f"[{key}]", f"runtime_bytes = {int(median(r[0] for r in rows)) + libs}", f"libraries_bytes = {libs}"]
        out += [f"# {len(rows)} profiles", ""]
    return "\n".join(out)


RUNTIME_IMPORTS = ("import onnxruntime", "import executorch runtime")
SMALL = 64 << 20  # stored weights under this: a prefill's growth is too small to read a factor from


def _block(manifest: dict) -> int | None:
    """The bundle's quantization block where it is not its target's default (export --block-size), else None."""
    from deltaship.targets import get_target

    block = (manifest.get("quantization") or {}).get("block_size")
    default = get_target(manifest["target"]).storage_format(manifest["precision"]).block
    return block if block is not None and default > 1 and block != default else None


def _run_factors(run: dict, m: dict) -> tuple[float, float, float | None, float, float]:
    """A split run's (stored weights, weights factor, activation factor or None, load factor, host bytes or -1)."""
    steps = {st["step"]: st for st in run["steps"]}
    pre = steps["import deltaship runtime"]["VmRSS"]
    sess = steps["deltaship session (states, IOBinding)"]["VmRSS"]
    chunk = min(run.get("prompt", 512), run.get("prefill_chunk") or m["prefill_chunk"])
    z = _sizes(m["source"]["model"], m["target"], m["precision"], m["max_context"], chunk, _block(m))
    imported = next((steps[k] for k in RUNTIME_IMPORTS if k in steps), None)
    host = imported["VmRSS"] - imported["runtime_library"] if imported and "runtime_library" in imported else -1
    wf = (sess - pre) / z["w"]
    lf = (steps["deltaship session (states, IOBinding)"]["VmHWM"] - pre) / z["w"]
    # the prefill's growth: the peak after the session less the session, where the peak came after loading
    # (the arena gives its regions back after each prefill, so RSS afterwards does not show it)
    peak, at_load = run["steps"][-1]["VmHWM"], steps["deltaship session (states, IOBinding)"]["VmHWM"]
    af = max(0.0, peak - sess - z["states"]) / z["act"] if peak > at_load and z["w"] >= SMALL else None
    own = next((st for st in run["steps"] if "own_peak" in st), None)
    if own is not None and z["w"] >= SMALL:  # the prefill's own peak, measured even where the load's hides it
        af = max(0, own["own_peak"] - own["rss_before"]) / z["act"]
    return z["w"], wf, af, lf, host


def block_terms(splits: list[Path]) -> str:
    """The `blockN` tables of memory_terms.toml: the factors of bundles exported with a quantization block other
    than the target's default (a runtime's packed layout adds its own bytes per block, so the factors per stored
    byte differ), each the median over the split runs' default variant of such bundles."""
    from statistics import median

    from deltaship.bundle.reader import read_manifest

    by: dict[tuple[str, str, int], list[tuple]] = {}
    for p in splits:
        for run in json.loads(p.read_text())["runs"]:
            m = read_manifest(run["bundle"])
            if run["variant"] == "default" and _block(m) is not None:
                by.setdefault((m["target"], m["precision"], _block(m)), []).append(_run_factors(run, m))
    out = []
    for (target, precision, block), rows in sorted(by.items()):
        afs = [r[2] for r in rows if r[2] is not None]
        out += [
            f"[{target}.{precision}.block{block}]",
            f"weights_factor = {median(r[1] for r in rows):.4f}",
            *([f"activation_factor = {median(afs):.4f}"] if afs else []),
            f"load_factor = {median(r[3] for r in rows):.4f}",
            f'from = "{", ".join(sorted({p.name for p in splits}))}: {len(rows)} runs at block {block}"',
            "",
        ]
    return "\n".join(out)


def fit_terms(splits: list[Path], profiles: list[Path], out: Path, machine: str, skip: tuple[str, ...] = ()) -> str:
    """deltaship/devices/memory_terms.toml. Per (target, precision): the weights factor (resident bytes per stored
    byte once the session is open) and the activation factor (a prefill chunk's growth over the plan's
    activation_bytes, states apart) from the split run of the largest model (`skip`: bundles left out, e.g. a
    "before" bundle); the host's bytes (the process up to the runtime's import, less the runtime's own shared
    objects) per target; then the runtime term from `deltaship profile --json` documents of the small model (its
    measured peak less the other terms), so that the plan meets the measured peak at both sizes. A precision
    measured only small takes the factors of the target's nearest precision measured large (fp16 -> fp32, int8 ->
    int4), and the activation factor, which a small model cannot show, that of another precision of the target; a
    (target, precision) measured only small counts its weights as stored (its fixed session costs would read as a
    large factor per weight byte) and leaves those costs to the runtime term."""
    from deltaship.bundle.reader import read_manifest

    factors: dict[tuple[str, str], tuple] = {}
    host: dict[str, int] = {}
    for p in splits:
        for run in json.loads(p.read_text())["runs"]:
            if run["variant"] != "default" or run["bundle"] in skip:
                continue
            m = read_manifest(run["bundle"])
            if _block(m) is not None:  # another quantization block: block_terms' tables
                continue
            w, wf, af, lf, host_bytes = _run_factors(run, m)
            if host_bytes >= 0:
                host[m["target"]] = host_bytes
            key = (m["target"], m["precision"])
            if key not in factors or w >= factors[key][0]:
                factors[key] = (w, wf, af, lf, f"{m['source']['model']} {m['precision']}")
    lines = [
        "# Memory terms of `deltaship plan`, measured: bench/memory/memory_split.py --fit (docs/results/memory.md).",
        "# runtime_bytes: the process before any weight; weights_factor: resident bytes per stored weight byte once",
        "# loaded; activation_factor: a prefill chunk's measured growth over the plan's activation formula;",
        "# load_factor: the peak while loading per stored weight byte (originals and prepacked copies at once);",
        "# host_bytes: the part of runtime_bytes that deltaship's Python driver loads and an app does not.",
        "[machine]",
        f'name = "{machine}"',
        f'date = "{time.strftime("%Y-%m-%d", time.gmtime())}"',
        "",
    ]
    for p in profiles:
        doc = json.loads(p.read_text())
        b = doc["bundle"]
        key = (b["target"], b["precision"])
        near = (b["target"], {"fp16": "fp32", "int8": "int4"}.get(b["precision"], b["precision"]))
        cand = factors.get(key)
        if cand is None or (cand[0] < SMALL and factors.get(near, (0,))[0] >= SMALL):
            cand = factors[near]  # a small model's fixed session costs would read as a large factor per weight byte
        w_measured, wf, af, lf, src = cand
        if w_measured < SMALL:  # only a small model: its fixed costs go to the runtime term, weights count as stored
            wf, af, lf, src = 1.0, None, 1.0, f"weights as stored ({src} only)"
        if af is None:  # the load peak hid the prefill's: the activation factor of another precision of the target
            af = next((f[2] for (t, _), f in sorted(factors.items()) if t == b["target"] and f[2] is not None), None)
        if af is None:  # no prefill growth measured at a size that shows it: the estimate's formula (one layer)
            src = f"{src}, activations as estimated"
        peak = next(r["median"] for r in doc["results"] if r["metric"] == "peak_rss_bytes")
        chunk = min(max(doc["config"]["prompt_lengths"]), b["prefill_chunk"])
        z = _sizes(b["source"], b["target"], b["precision"], b["max_context"], chunk)
        act = af * z["act"] if af is not None else z["act_one_layer"]
        runtime = peak - max(wf * z["w"] + z["states"] + act, lf * z["w"])
        lines += [
            f"[{b['target']}.{b['precision']}]",
            f"runtime_bytes = {int(runtime)}",
            f"weights_factor = {wf:.4f}",
            *([f"activation_factor = {af:.4f}"] if af is not None else []),
            f"load_factor = {lf:.4f}",
            f"host_bytes = {host.get(b['target'], 0)}",
            *([f"libraries_bytes = {_libraries(doc)}"] if _libraries(doc) is not None else []),
            f'from = "factors: {src}; runtime: {b["source"]} {b["precision"]} profile peak"',
            "",
        ]
    lines.append(block_terms(splits))
    for p in splits:  # the --prepack-cache sessions' tables, from splits that ran the prepacked variant
        if any(r["variant"] == "prepacked" for r in json.loads(p.read_text())["runs"]):
            lines.append(prepacked_terms(p))
    text = "\n".join(lines)
    out.write_text(text)
    return text


def main() -> int:
    if "--fit" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--fit", nargs="+", type=Path, help="split runs (--json outputs)")
        ap.add_argument("--profiles", nargs="+", type=Path, required=True, help="deltaship profile --json documents")
        ap.add_argument(
            "--write-terms", type=Path, default=Path(__file__).parents[2] / "deltaship/devices/memory_terms.toml"
        )
        ap.add_argument("--machine", required=True)
        ap.add_argument("--skip", nargs="*", default=[], help="bundles of the split runs to leave out")
        a = ap.parse_args()
        print(fit_terms(a.fit, a.profiles, a.write_terms, a.machine, tuple(a.skip)))
        return 0
    if "--runtime-terms" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--runtime-terms", nargs="+", type=Path, required=True, help="profile --json documents")
        print(runtime_terms(ap.parse_args().runtime_terms))
        return 0
    if "--block-terms" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--block-terms", nargs="+", type=Path, required=True, help="split runs (--json outputs)")
        print(block_terms(ap.parse_args().block_terms))
        return 0
    if "--prepacked-terms" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--prepacked-terms", type=Path, required=True, help="a split run (--json) with 'prepacked'")
        ap.add_argument("--profiles", nargs="*", type=Path, default=[], help="profile --prepack-cache --json documents")
        a = ap.parse_args()
        print(prepacked_terms(a.prepacked_terms, a.profiles))
        return 0
    if "--worker" in sys.argv:  # record bare Python before anything else is imported
        first = [{"step": "python", **status(), **rollup()}]
        ap = argparse.ArgumentParser()
        ap.add_argument("--worker", dest="bundle")
        ap.add_argument("--variant", default="default")
        ap.add_argument("--threads", type=int, default=2)
        ap.add_argument("--prompt", type=int, default=512)
        ap.add_argument("--gen", type=int, default=32)
        ap.add_argument("--prefill-chunk", type=int)
        ap.add_argument("--prepack-cache")
        ap.add_argument("--ids", default="first-1000")
        a = ap.parse_args()
        a.first = first
        return worker(a)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--variants", default="default")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument(
        "--prefill-chunk",
        help="tokens per prefill call (default: the bundle's); a comma-separated list alternates them in each round",
    )
    ap.add_argument(
        "--prepack-cache",
        type=Path,
        help="the prepacked variant's cache directory (default: a temporary one, removed at the end); each bundle's "
        "entry is built by a first, recorded run ('build') before the rounds",
    )
    ap.add_argument(
        "--ids",
        choices=("first-1000", "whole-vocab"),
        default="first-1000",
        help="prompt token ids drawn from the vocabulary's first 1000 (default, as the recorded runs) or the whole of "
        "it (as `deltaship profile` draws them, and as text spread over the vocabulary reads the embedding)",
    )
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    variants = a.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    runs = []
    chunks = [int(c) for c in a.prefill_chunk.split(",")] if a.prefill_chunk else [None]
    scratch = None
    if a.prepack_cache is None:
        scratch = tempfile.TemporaryDirectory(prefix="deltaship-prepack-")
        a.prepack_cache = Path(scratch.name)
    if "prepacked" in variants:  # the first open builds the entry: its own run, recorded, before the rounds
        for b in a.bundles:
            res = run_worker(b, "prepacked", a, chunks[0])
            runs.append(
                {
                    "round": "build",
                    "bundle": b,
                    "variant": "prepacked",
                    "prompt": a.prompt,
                    "gen": a.gen,
                    "ids": a.ids,
                    **res,
                }
            )
            print(table(b, "prepacked, first open: builds the cache entry", res), flush=True)
    for r in range(a.rounds):
        for b in a.bundles:
            for v in variants:
                for c in chunks:
                    res = run_worker(b, v, a, c)
                    runs.append(
                        {"round": r, "bundle": b, "variant": v, "prompt": a.prompt, "gen": a.gen, "ids": a.ids, **res}
                        | ({"prefill_chunk": c} if c else {})
                    )
                    print(table(b, v if c is None else f"{v}, chunk {c}", res), flush=True)
                    print(
                        f"  prefill {a.prompt}: {res['prefill_s']:.2f} s, decode {1 / res['tpot_s']:.1f} tok/s",
                        flush=True,
                    )
    if a.json:
        doc = {
            "command": "python " + " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "variants": {v: VARIANTS[v] for v in variants},
            "runs": runs,
        }
        a.json.write_text(json.dumps(doc, indent=1))
    if scratch is not None:
        scratch.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
