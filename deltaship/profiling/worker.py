"""The measuring process: opens one bundle, runs the workload, prints one JSON document.

Run as a fresh process (`python -m deltaship.profiling.worker CONFIG_JSON`) so that its peak RSS is
the bundle's alone: it imports only numpy and the bundle's runtime. Phases follow PROFILING.md:
load_cold_s, load_warm_s, prefill_tok_s (per prompt length), ttft_s, tpot_s / decode_tok_s, and
decode latency at several context depths. Every phase: warmups, then at least `reps` repetitions
AND at least `min_seconds`; raw samples kept; monotonic nanosecond clocks.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

from deltaship.bundle.reader import read_manifest
from deltaship.profiling.longctx import fillable, sweep
from deltaship.stats import summarize
from deltaship.targets import get_target, open_bundle

SCHEMA_VERSION = 1


def now() -> float:
    return time.monotonic_ns() / 1e9


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def peak_rss_bytes() -> int:
    """Peak RSS of this process's own address space.

    On Linux this is VmHWM from /proc/self/status: getrusage's ru_maxrss survives execve, so a worker
    started from a large parent (a test runner, a notebook) would report the parent's peak instead.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def mapped_rss_bytes(fragment: str) -> int:
    """Resident bytes of this process's mappings of files whose path holds `fragment` (/proc/self/smaps; 0
    elsewhere)."""
    return _mapped_rss(lambda path: fragment in path)


def shared_object_rss_bytes() -> int:
    """Resident bytes of this process's mappings of shared objects (*.so, *.so.N): the interpreter's extension
    modules, numpy's and the runtime's libraries. Their resident file pages depend on the page cache, not on the
    bundle: the same wheels measured 9-21 MB more resident in a just-installed virtual environment than in one
    installed hours before (docs/results/memory.md), so `profile`'s plan counts them as measured here."""
    return _mapped_rss(lambda path: path.endswith(".so") or ".so." in path.rsplit("/", 1)[-1])


def _mapped_rss(match: Callable[[str], bool]) -> int:
    # /proc/self/smaps by hand: psutil's memory_maps() would do, but psutil is not a runtime dependency
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=5)
                if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                    inside = len(head) == 6 and match(head[5].rstrip("\n"))
                elif inside and head[0] == "Rss:":
                    total += int(head[1]) * 1024
    except OSError:
        return 0
    return total


def host_rss_bytes(manifest: dict[str, Any]) -> int | None:
    """The host driver's part of this process: RSS once the target's runtime is imported (ahead of the bundle),
    less the runtime's own shared objects, which an app maps too. None where the target loads nothing of the
    host's (ONNX Runtime: the interpreter and numpy are in its measured runtime term).

    Measured rather than taken from the plan's terms: most of it is torch's libraries, whose resident file pages
    vary with the page cache by tens of MB for the same files (77 against 131 MB seen on one machine, the same
    wheel in two virtual environments)."""
    fragment = get_target(manifest["target"]).load_runtime()
    return None if fragment is None else rss_bytes() - mapped_rss_bytes(fragment)


class RssTrace:
    """Samples RSS every `interval` seconds in a thread, labelled with the current phase."""

    def __init__(self, interval: float = 0.05):
        self.samples: list[list] = []
        self.phase = "start"
        self.t0 = now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.interval = interval

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append([round(now() - self.t0, 4), rss_bytes(), self.phase])
            self._stop.wait(self.interval)

    def __enter__(self) -> "RssTrace":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class GpuMemory:
    """Peak GPU memory of this process, sampled through NVML (pynvml) in a thread; source None without NVML.

    NVML's per-process accounting is empty on some virtual machines and containers (no process list, or
    other pid namespaces); then the peak is the device's used memory above what was used when sampling
    started (created before the session, so the CUDA context counts), and `source` says so."""

    def __init__(self, interval: float = 0.05):
        self.peak, self.device_peak, self.source, self._stop = 0, 0, None, threading.Event()
        try:
            import pynvml  # type: ignore  # lazy: NVIDIA GPUs only

            pynvml.nvmlInit()
            self._nv = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self._base = self._device_used()
            self.source = "NVML per-process used memory"
        except Exception:  # no pynvml or no driver: recorded as unmeasured, never as 0
            return
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _device_used(self) -> int:
        return sum(int(self._nv.nvmlDeviceGetMemoryInfo(h).used) for h in self._handles)

    def _run(self, interval: float) -> None:
        pid = os.getpid()
        while not self._stop.is_set():
            used = 0
            for h in self._handles:
                try:  # NotSupported on some vGPU/MIG setups: the device figure below still counts
                    procs = self._nv.nvmlDeviceGetComputeRunningProcesses(h)
                except Exception:
                    procs = []
                for p in procs:
                    if p.pid == pid and p.usedGpuMemory:
                        used += int(p.usedGpuMemory)
            self.peak = max(self.peak, used)
            self.device_peak = max(self.device_peak, self._device_used() - self._base)
            self._stop.wait(interval)

    def stop(self) -> None:
        self._stop.set()
        if self.source:
            self._thread.join()
            if self.peak == 0 and self.device_peak > 0:
                self.peak = self.device_peak
                self.source = (
                    "NVML device used memory above its level before the session (no per-process entry; "
                    "includes any other process's allocations meanwhile)"
                )
            elif self.peak == 0:
                self.source = None  # nothing seen at all: unmeasured, never 0


def repeat(fn: Callable[[], float], warmups: int, reps: int, min_seconds: float) -> list[float]:
    """Warm up, then keep sampling until both `reps` samples and `min_seconds` are reached."""
    for _ in range(warmups):
        fn()
    samples: list[float] = []
    start = now()
    while len(samples) < reps or now() - start < min_seconds:
        samples.append(fn())
        if len(samples) >= 50 * max(reps, 1):
            break
    return samples


def record(metric: str, unit: str, samples: list[float], **where: Any) -> dict[str, Any]:
    return {"metric": metric, "unit": unit, **where, "samples": samples, **summarize(samples)}


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    bundle, threads = cfg["bundle"], cfg.get("threads")
    warmups, reps, min_s = cfg.get("warmups", 2), cfg.get("reps", 5), cfg.get("min_seconds", 1.0)
    results: list[dict[str, Any]] = []
    manifest = read_manifest(bundle)
    rng = np.random.default_rng(0)
    vocab = manifest["model"]["vocab_size"]
    provider, runtime = cfg.get("provider", "cpu"), cfg.get("runtime")
    cache = cfg.get("prepack_cache")  # its entry built already (profile.build_prepack_cache)
    gpu = GpuMemory() if provider == "cuda" else None  # before the session: its CUDA context counts
    with RssTrace() as trace:
        trace.phase = "load"
        t = now()
        host = host_rss_bytes(manifest) if runtime is None and provider == "cpu" else None
        imported = now() - t  # the cold load counts the runtime's import, as in any fresh process
        t = now()
        session = open_bundle(
            bundle, threads=threads, check_hashes=False, provider=provider, runtime=runtime, prepack_cache=cache
        )
        results.append(record("load_cold_s", "s", [imported + now() - t]))
        if host is not None:
            results.append(
                dict(
                    record("host_rss_bytes", "bytes", [host]),
                    flags=[],
                    note="RSS once the runtime was imported, before the bundle opened, less the runtime's own "
                    "shared objects: deltaship's Python driver's part, which an app does not load",
                )
            )

        for p in cfg.get("prompt_lengths", [128]):
            if p + cfg.get("gen", 0) > session.max_context:
                results.append(
                    {
                        "metric": "prefill_tok_s",
                        "unit": "tok/s",
                        "prompt_length": p,
                        "samples": [],
                        "flags": ["skipped_over_max_context"],
                    }
                )
                continue
            trace.phase = f"prefill_{p}"
            ids = rng.integers(0, vocab, p).tolist()
            times, ttfts = [], []

            def prefill() -> float:
                session.reset()
                t0 = now()
                logits = session.prefill(ids)
                t1 = now()
                int(np.argmax(logits))
                ttfts.append(now() - t0)
                times.append(t1 - t0)
                return t1 - t0

            repeat(prefill, warmups, reps, min_s)
            times, ttfts = times[warmups:], ttfts[warmups:]
            results.append(record("prefill_tok_s", "tok/s", [p / x for x in times], prompt_length=p))
            results.append(record("ttft_s", "s", ttfts, prompt_length=p))

        gen = cfg.get("gen", 64)
        if gen >= 2:
            trace.phase = "decode"
            prompt = rng.integers(0, vocab, min(128, session.max_context - gen)).tolist()
            per_token: list[float] = []

            def decode() -> float:
                session.reset()
                logits = session.prefill(prompt)
                stamps = []
                for _ in range(gen):
                    tok = int(np.argmax(logits))
                    stamps.append(now())
                    logits = session.decode(tok)
                stamps.append(now())
                lat = np.diff(stamps).tolist()
                per_token.extend(lat)
                return (stamps[-1] - stamps[1]) / (gen - 1)  # tpot = (t_last - t_first) / (N - 1)

            tpots = repeat(decode, 1, max(3, reps // 2), min_s)[0:]
            # decode is measured after a fixed 128-token prompt whatever --prompt-lengths: `from_context` says so
            results.append(record("decode_tok_s", "tok/s", [1 / x for x in tpots], from_context=len(prompt), gen=gen))
            results.append(
                record(
                    "tpot_s",
                    "s",
                    per_token[gen:],
                    from_context=len(prompt),
                    gen=gen,
                    note="every per-token latency after the warmup run; p50 = median",
                )
            )

        if cfg.get("contexts") and not cfg.get("breakdown"):

            def phase(p: str) -> None:
                trace.phase = p

            if fillable(session):
                results += sweep(session, cfg["contexts"], repeat, warmups, reps, min_s / 2, rss_bytes, now, phase)
            else:  # e.g. onnxruntime-genai: its KV cache is out of reach; the rest of the profile stands
                results.append(
                    {
                        "metric": "decode_latency_s",
                        "unit": "s",
                        "samples": [],
                        "flags": ["not-measured"],
                        "note": f"context sweep not measured: the synthetic fill needs the KV buffers, which "
                        f"{session.runtime_name()} does not expose (profile depths in deltaship's own runtime)",
                    }
                )
        if cfg.get("breakdown") and hasattr(session, "profile_ops"):
            trace.phase = "breakdown"
            for c in cfg.get("contexts", []):
                if c < session.max_context:
                    for kind, secs in session.profile_ops(c, steps=max(3, reps)).items():
                        rec = record("decode_op_s", "s", secs, context=c, op_kind=kind)
                        if kind == "other":  # about a thousand small nodes, each timed by the profiler
                            rec["flags"] = rec["flags"] + ["profiler-inflated"]
                            rec["note"] = (
                                "under ONNX Runtime's profiler, which adds microseconds to every node: the "
                                "~1,000 small nodes of 'other' read several times their real cost"
                            )
                        results.append(rec)
        # The peak RSS is read here, before the warm loads: that of an app that opened the bundle once and ran it.
        # Sessions opened and closed again leave freed memory the allocator keeps (docs/results/memory.md), which no
        # app holding one session pays.
        peak = record(
            "peak_rss_bytes",
            "bytes",
            [peak_rss_bytes()],
            note="VmHWM (Linux) or getrusage maxrss of this process, which only opened the bundle once and ran it "
            "(read before the warm loads)",
        )
        peak["flags"] = []  # one number by definition, not a few samples
        libraries = dict(
            record("shared_object_rss_bytes", "bytes", [shared_object_rss_bytes()]),
            flags=[],
            note="resident bytes of the process's shared objects (*.so) beside the peak: page-cache dependent, "
            "so the memory plan takes them as measured",
        )
        # Warm loads open the bundle again with the first session closed, one session alive at a time.
        trace.phase = "load_warm"
        runtime_name = session.runtime_name()
        session = None  # closed: one session alive at a time
        gc.collect()

        def reopen() -> float:
            t0 = now()
            again = open_bundle(
                bundle, threads=threads, check_hashes=False, provider=provider, runtime=runtime, prepack_cache=cache
            )
            dt = now() - t0
            del again
            gc.collect()
            return dt

        results.append(record("load_warm_s", "s", repeat(reopen, 0, max(2, reps // 2), 0)))
        trace.phase = "end"
    results += [peak, libraries]
    if gpu is not None:
        gpu.stop()
        note = f"peak GPU memory, sampled every 50 ms: {gpu.source}"
        results.append(
            dict(record("gpu_peak_bytes", "bytes", [gpu.peak]), flags=[], note=note)
            if gpu.source
            else {
                "metric": "gpu_peak_bytes",
                "unit": "bytes",
                "samples": [],
                "flags": ["unmeasured"],
                "note": "pynvml is not installed, no NVIDIA driver answered, or NVML saw no memory in use: "
                "GPU memory was not measured",
            }
        )
    heavy = [m for m in ("torch", "transformers", "coremltools") if m in sys.modules]
    return {
        "results": results,
        "rss_trace": trace.samples,
        "runtime": runtime_name,
        "threads": threads,
        "imported_toolchains": heavy,
    }


def main() -> int:
    cfg = json.loads(sys.argv[1])
    out = run(cfg)
    sys.stdout.write(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
