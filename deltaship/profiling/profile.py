"""`deltaship profile`: run a bundle's workload on a device and collect versioned records.

host      a fresh worker process (its peak RSS is the bundle's alone), optionally under a tier's
          limits: thread count, and a memory cap through a cgroup when this host lets us make one.
ssh://    the bundle is streamed to the remote machine, profiled there by its own deltaship, the
          JSON pulled back.
adb:SERIAL  the bundle is pushed to /data/local/tmp and run by a user-supplied runner binary
          (see devices/android.py); PSS from dumpsys meminfo.
A run that dies (OOM kill, signal, disconnect) is recorded as such, never as a number.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from deltaship.bundle.destination import check_output_file, replace_file
from deltaship.bundle.reader import read_manifest, require_intact
from deltaship.devices.android import profile_adb
from deltaship.devices.catalog import get_tier
from deltaship.devices.discovery import check_device, default_threads, fingerprint
from deltaship.devices.plan import planned_peak
from deltaship.errors import DeltashipEnvironmentError, DeltashipError
from deltaship.files import read_json_object
from deltaship.options import threads as check_threads
from deltaship.profiling.launch import MemoryCap, run_worker
from deltaship.profiling.remote import profile_ssh
from deltaship.profiling.report import write_html
from deltaship.profiling.settings import ProfileSettings
from deltaship.profiling.speculative.workload import check as check_speculative
from deltaship.profiling.speculative.workload import profile_speculative
from deltaship.profiling.vision import check_sizes, profile_images
from deltaship.profiling.worker import SCHEMA_VERSION
from deltaship.progress import Progress, heartbeat
from deltaship.runtimes import PROVIDERS
from deltaship.runtimes.speculative import parse_speculative
from deltaship.stats import ratio_ci
from deltaship.targets import check_prepack_cache, get_target, open_bundle, require_artifact, text_runtime

DEFAULTS = dict(prompt_lengths=[128, 512], gen=64, contexts=[128, 1024, 4096], warmups=2, reps=5, min_seconds=2.0)


def bundle_summary(manifest: dict[str, Any], path: Path) -> dict[str, Any]:
    return {
        "name": path.name,
        "target": manifest["target"],
        "precision": manifest["precision"],
        "source": manifest["source"]["model"],
        "max_context": manifest["max_context"],
        "prefill_chunk": manifest["prefill_chunk"],
        "bundle_bytes": manifest.get("bundle_bytes"),
        "state_bytes": manifest.get("state_bytes"),
        "layers": manifest["model"]["num_layers"],
        "layer_types": manifest["model"]["layer_types"],
    }


def check_workload(manifest: dict[str, Any], prompt_lengths: list[int], gen: int, contexts: list[int]) -> None:
    mc = manifest["max_context"]
    deep = [str(c) for c in contexts if c >= mc]
    long = [str(p) for p in prompt_lengths if p + gen > mc]
    if deep or long:
        what = ([f"--contexts {','.join(deep)} (a depth must be below it)"] if deep else []) + (
            [f"--prompt-lengths {','.join(long)} with --gen {gen} (prompt + gen must fit)"] if long else []
        )
        raise DeltashipError(
            f"{' and '.join(what)}: past this bundle's max context of {mc}",
            f"use contexts below {mc} and prompt lengths up to {max(mc - gen, 1)} (or a smaller --gen), or export "
            "with a larger --max-context",
        )
    if any(p < 1 for p in prompt_lengths) or gen < 2 or any(c < 1 for c in contexts):
        raise DeltashipError(
            "prompt lengths and contexts must be positive and --gen at least 2",
            "e.g. --prompt-lengths 128,512 --gen 64 --contexts 128,1024",
        )


def profile(
    bundle: str | Path,
    settings: ProfileSettings | None = None,
    *,
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Profile a bundle on a device; return (and optionally write) the versioned JSON document.

    settings: a ProfileSettings (profiling/settings.py says what each field does), and/or its fields as keyword
    arguments (`profile(bundle, gen=16, threads=2)`; they replace the settings' values).
    speculative="mtp[:K]": profile speculative decoding with the bundle's MTP head instead of the plain workload
    (deltaship/profiling/speculative/); acceptance: the rate its projection assumes (default: the trained tiny
    head's measured one). image_sizes: for a bundle exported with --vision (host), the image sizes to profile
    encode latency, memory and image+question TTFT at (profiling/vision.py; default 224, 448, 896 and a document
    page; 'none': skip)."""
    s = dataclasses.replace(settings or ProfileSettings(), **options)
    threads = s.threads  # the tier's or the runtime's default when not given (recorded as what ran)

    check_threads(threads)  # as the CLI's --threads, before any work (a remote device gets it too)
    check_device(s.device)  # a host or serial that is an ssh/adb option is refused before any process starts
    if s.provider not in PROVIDERS:
        raise DeltashipError(f"unknown provider {s.provider!r}; providers: {', '.join(PROVIDERS)}", "use cpu or cuda")
    if s.provider != "cpu" and s.device != "host":
        raise DeltashipError(f"--provider {s.provider} is for --device host", "drop --provider, or profile on the host")
    if s.prepack_cache is not None and (s.device != "host" or s.speculative is not None):
        raise DeltashipError(
            "--prepack-cache is for the host's plain workload (an entry is built on the machine that runs it)",
            "drop --prepack-cache, or --speculative / --device",
        )
    say = progress or (lambda m: None)
    beat = (lambda m: progress(m, inline=True)) if isinstance(progress, Progress) else None  # a long step's detail
    path = Path(bundle)
    for option, out in (("--json", s.json_out), ("--report", s.report)):
        if out is not None and str(out) != "-":
            check_output_file(Path(out), (path,), option)  # before any work; a file inside the bundle breaks it
    manifest = read_manifest(path)
    require_intact(path, manifest, hashes=True)
    require_artifact(path, manifest)  # here, not in a worker whose failure reads as a run that died (exit 3)
    cfg = {
        k: v
        for k, v in dict(
            prompt_lengths=s.prompt_lengths,
            gen=s.gen,
            contexts=s.contexts,
            warmups=s.warmups,
            reps=s.reps,
            min_seconds=s.min_seconds,
        ).items()
        if v is not None
    }
    cfg = {**DEFAULTS, **cfg}
    if s.contexts is None:  # the default depths, the deepest clipped to what the bundle's KV cache holds
        mc = int(manifest["max_context"])
        cfg["contexts"] = sorted({min(c, mc - 1) for c in cfg["contexts"]})
    if s.speculative is not None:
        depth = parse_speculative(s.speculative)
        check_speculative(
            path,
            manifest,
            cfg,
            depth,
            device=s.device,
            runtime=s.runtime,
            provider=s.provider,
            tier=s.tier,
            acceptance=s.acceptance,
        )
        doc = {"schema_version": SCHEMA_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        doc.update(bundle=bundle_summary(manifest, path), config={**cfg, "speculative": s.speculative}, emulation=None)
        doc.update(profile_speculative(path, cfg, depth, threads, say, s.acceptance))
        return _finish(doc, None, s.json_out, s.report)
    check_workload(manifest, cfg["prompt_lengths"], cfg["gen"], cfg["contexts"])

    sizes = check_sizes(manifest, s.image_sizes, s.device, s.provider, s.runtime)
    t = get_tier(s.tier, s.tiers_file) if s.tier else None
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "bundle": bundle_summary(manifest, path),
        "config": cfg,
        "emulation": None,
    }
    if s.device.startswith("ssh://"):
        doc = profile_ssh(path, s.device, cfg, threads, s.tier, s.ssh_options, s.remote_deltaship, say)
    elif s.device.startswith("adb:"):
        doc.update(profile_adb(path, manifest, s.device[4:], cfg, s.runner, s.runner_args, say))
    elif s.device == "host":
        target = manifest["target"]
        if get_target(target).host_runtime is None:
            raise DeltashipError(
                f"this host has no runtime for {target} bundles that measures a device (Core ML runs only on Apple "
                "devices; QNN's HTP runs here only as a simulator, whose speed is not a phone's)",
                "profile a Core ML bundle on a Mac, or export for onnx/executorch (a --mtp Core ML bundle's "
                "`deltaship profile BUNDLE --speculative mtp` runs here, through coremltools' evaluator)",
            )

        text = text_runtime(path, s.runtime)
        if text is not None:  # a runtime that takes text (ExecuTorch's C++ LLM runner): its own stats
            module, spec = text
            doc["device"], doc["results"], doc["threads"] = fingerprint("host"), [], threads
            for p in cfg["prompt_lengths"]:
                say(f"profiling {path.name} in {s.runtime}: prompt {p} tokens, {cfg['gen']} new")
                out = getattr(module, spec.profile)(
                    path, prompt_length=p, gen=cfg["gen"], reps=cfg["reps"], warmups=cfg["warmups"]
                )
                doc["results"] += out["results"]
                doc["runtime"] = out["runtime"]
            return _finish(doc, t, s.json_out, s.report)
        if s.prepack_cache is not None:
            cfg["prepack_cache"] = str(Path(s.prepack_cache).expanduser().resolve())
            build_prepack_cache(path, manifest, cfg["prepack_cache"], s, say)
        if s.provider != "cpu" or s.runtime is not None:
            # fails here, clearly, if it cannot run
            open_bundle(path, provider=s.provider, runtime=s.runtime, check_hashes=False)
            cfg["provider"], cfg["runtime"] = s.provider, s.runtime
        doc["device"] = fingerprint("host")
        cap = None
        if t is not None:
            threads = min(t.threads, os.cpu_count() or t.threads)
            cap = MemoryCap(t.budget_bytes)
            doc["emulation"] = {
                "tier": t.name,
                "threads": threads,
                "memory_cap_bytes": t.budget_bytes,
                "memory_cap": cap.mechanism
                if cap.procs
                else "not enforceable on this host (no writable cgroup); peak RSS compared after the run",
                "emulated": True,
            }
        if threads is None and s.provider == "cpu":
            threads = default_threads()  # the runtime's own default, passed so that the record says what ran
        try:
            say(f"profiling {path.name} on the host ({threads or 'default'} threads)")
            with heartbeat(beat, f"warm-up and timed runs ({cfg['warmups']} warm-up, {cfg['reps']}+ timed per phase)"):
                out, died = run_worker({**cfg, "bundle": str(path), "threads": threads, "breakdown": False}, cap)
            if died:
                doc["results"] = [died]
            else:
                doc["results"], doc["rss_trace"], doc["runtime"] = out["results"], out["rss_trace"], out["runtime"]
                doc["imported_toolchains"] = out["imported_toolchains"]
                if s.breakdown and get_target(target).op_breakdown and cfg["contexts"]:
                    say(
                        "per-op breakdown at each context (separate process: the profiler's own session "
                        "would inflate the peak RSS)"
                    )
                    bcfg = {
                        **cfg,
                        "bundle": str(path),
                        "threads": threads,
                        "breakdown": True,
                        "prompt_lengths": [],
                        "gen": 0,
                    }
                    with heartbeat(beat, "per-op breakdown"):
                        bout, bdied = run_worker(bcfg, None)
                    doc["results"] += [r for r in bout["results"] if r["metric"] == "decode_op_s"] if bout else [bdied]
            if sizes:
                run = lambda c: run_worker(c, cap, module="deltaship.profiling.vision")  # noqa: E731
                doc["results"] += profile_images(path, sizes, cfg, threads, run, say)
        finally:
            if cap:
                cap.close()
        doc["threads"] = threads
    else:
        raise DeltashipError(f"unknown device {s.device!r}", "use host, ssh://user@host[:port] or adb:SERIAL")
    _memory_plan(doc, manifest)
    return _finish(doc, t, s.json_out, s.report)


def _finish(doc: dict[str, Any], t, json_out: str | Path | None, report: str | Path | None) -> dict[str, Any]:
    """The tier verdict, then the JSON and the HTML report where asked."""
    if t is not None:
        peak = next((r["median"] for r in doc["results"] if r["metric"] == "peak_rss_bytes"), None)
        doc["fit"] = {
            "tier": t.name,
            "budget_bytes": t.budget_bytes,
            "peak_rss_bytes": peak,
            "fits": peak is not None and peak <= t.budget_bytes,
        }
    if json_out is not None:
        text = json.dumps(doc, indent=1)
        if str(json_out) == "-":
            sys.stdout.write(text + "\n")
        else:
            _write(Path(json_out), text)
    if report is not None:
        write_html(doc, Path(report))
    return doc


def build_prepack_cache(path: Path, manifest: dict[str, Any], cache: str, s: ProfileSettings, say) -> None:
    """The bundle's --prepack-cache entry, built (when missing) before the workload, in a process of its own: what
    is measured is a later open, as an app's after its first; the build's own peak is the default session's."""
    check_prepack_cache(manifest["target"], s.runtime, s.provider)  # open_bundle's own refusal, before the build
    say(f"building the prepack cache entry in {cache} (first open only)")
    code = "import sys; from deltaship.targets import open_bundle; open_bundle(sys.argv[1], prepack_cache=sys.argv[2])"
    r = subprocess.run([sys.executable, "-c", code, str(path), cache], capture_output=True, text=True)
    if r.returncode:
        tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise DeltashipEnvironmentError(
            f"--prepack-cache {cache}: building its entry failed ({tail})",
            "run `deltaship generate BUNDLE --input-ids 1 --prepack-cache DIR` to see the whole error",
        )


def _memory_plan(doc: dict[str, Any], manifest: dict[str, Any]) -> None:
    """doc["memory_plan"]: what `deltaship plan` predicts for this bundle and workload, beside the measured peak."""
    peak = next((r["median"] for r in doc["results"] if r["metric"] == "peak_rss_bytes" and r.get("samples")), None)
    prompts = doc.get("config", {}).get("prompt_lengths") or []
    if peak is None or not prompts:
        return
    host = next((r["median"] for r in doc["results"] if r["metric"] == "host_rss_bytes"), None)
    libraries = next((r["median"] for r in doc["results"] if r["metric"] == "shared_object_rss_bytes"), None)
    prepacked = bool(doc.get("config", {}).get("prepack_cache"))
    plan = planned_peak(
        manifest,
        max(prompts),
        doc.get("threads"),
        None if host is None else int(host),
        prepacked,
        None if libraries is None else int(libraries),
    )
    if plan is not None:
        doc["memory_plan"] = {**plan, "peak_rss_bytes": peak, "plan_over_measured": plan["total_bytes"] / peak}


def _write(path: Path, text: str) -> None:
    replace_file(path, text, "--json")  # whole or not at all


def load_records(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    doc = read_json_object(p, "profile JSON", "pass files written by `deltaship profile --json`")  # bounded
    if doc.get("schema_version") != SCHEMA_VERSION or not isinstance(doc.get("results"), list):
        raise DeltashipError(
            f"{p}: not a deltaship profile (schema_version {doc.get('schema_version')!r:.40})",
            "pass files written by `deltaship profile --json`",
        )
    problem = _records_problem(doc["results"])
    if problem:
        raise DeltashipError(f"{p}: not a deltaship profile: {problem}", "pass files `deltaship profile --json` wrote")
    return doc


MAX_RECORDS, MAX_SAMPLES = 100_000, 1000  # compare's bootstrap draws 2000 x samples per record


def _records_problem(results: list) -> str | None:
    """What compare() would trip over in a profile's results (it reads metric, unit, samples, median and the
    keys), as data: None when every record it reads is well-formed."""
    if len(results) > MAX_RECORDS:
        return f"{len(results):,} results (at most {MAX_RECORDS:,})"
    for i, r in enumerate(results):
        if not isinstance(r, dict) or not isinstance(r.get("metric"), str):
            return f"results[{i}] is not a record with a metric name"
        for k in ("prompt_length", "context", "op_kind", "tokens", "positions"):
            if not isinstance(r.get(k), (str, int, type(None))):
                return f"results[{i}].{k} must be a number or a name"
        if not r.get("samples"):
            continue
        samples = r["samples"]
        if not isinstance(samples, list) or len(samples) > MAX_SAMPLES:
            return f"results[{i}].samples is not a list of at most {MAX_SAMPLES} numbers"
        if any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in [*samples, r.get("median")]):
            return f"results[{i}]: samples and median must be numbers"
        if not isinstance(r.get("unit"), str):
            return f"results[{i}].unit must be a string"
    return None


def compare(a: str | Path, b: str | Path) -> list[dict[str, Any]]:
    """B relative to A for every metric both have: ratio of medians with a bootstrap 95% interval."""
    da, db = load_records(a), load_records(b)

    def key(r: dict) -> tuple:  # speculative profiles: verify and draft calls apart by their length
        return (
            r["metric"],
            r.get("prompt_length"),
            r.get("context"),
            r.get("op_kind"),
            r.get("tokens", r.get("positions")),
        )

    ia = {key(r): r for r in da["results"] if r.get("samples")}
    rows = []
    for r in db["results"]:
        k = key(r)
        if k in ia and r.get("samples"):
            rc = ratio_ci(r["samples"], ia[k]["samples"])
            rows.append(
                {
                    "metric": k[0],
                    "prompt_length": k[1],
                    "context": k[2],
                    "op_kind": k[3],
                    "unit": r["unit"],
                    "a": ia[k]["median"],
                    "b": r["median"],
                    **rc,
                }
            )
    return rows


def shell_join(args: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in args)
