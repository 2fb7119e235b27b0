"""ONNX Runtime session for deltaship ONNX bundles (no torch import).

States live in preallocated buffers bound with IOBinding. A state whose manifest entry lists the
session's execution provider under "in_place" has one buffer that is both past and present: the KV
cache (GroupQueryAttention writes the new positions into the buffer it reads) and, on the CPU, the
DeltaNet recurrent state (LinearAttention copies past into present, then updates present). The other
states alternate between two buffers, so nothing is copied per token.

cuda_graph=True (CUDA provider only; the default there for bundles exported with --onnx-cuda-graph, which
cuda_graph=False turns off) asks ONNX Runtime's CUDA EP to capture decode (T=1) as CUDA graphs and
replay them, which needs every buffer a run touches at a fixed device address: the states are, input_ids and
the position inputs live in preallocated device buffers written in place (DecodeInputs), logits in a fixed
device buffer. Each set of addresses a call binds gets its own `gpu_graph_id` (_graph_options): the alternating
state buffers give two sets in a decode loop; an --mtp bundle's verify and draft calls (onnx_speculative.py) add
theirs, and a rollback, which swaps buffers, a few more. Prefill runs with `gpu_graph_id` -1 (not captured: its
length varies). ORT refuses the session
when the graph needs Memcpy nodes (CPU-placed nodes feeding GPU ones), so only bundles exported with
--onnx-cuda-graph (deltaship/lowering/onnx/graph_capture.py) are opened this way; see docs/results/gpu.md.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from deltaship.bundle.paths import bundle_path
from deltaship.errors import DeltashipError
from deltaship.runtimes.base import Session
from deltaship.runtimes.onnx_io import (
    KEEP_ROWS,
    DecodeInputs,
    counts_positions,
    keeps_rows,
    position_feeds,
    session_options,
)
from deltaship.runtimes.onnx_prepack import cached_model
from deltaship.runtimes.onnx_speculative import OnnxSpeculation

_NP = {"float32": np.float32, "float16": np.float16, "int8": np.int8, "uint8": np.uint8}
MAX_GRAPHS = 64  # captured graphs per session (each its own gpu_graph_id)


# Run options of a multi-token call on the CPU: give the arena's free regions back when the call ends. ORT plans one
# block per input shape from the second run of that shape (the memory pattern) and takes it from the arena beside the
# chunks the first run left there, so without this a second prefill of the same length held both; a decode step
# keeps the pattern and the arena as they are (docs/results/memory.md).
PREFILL_RUN_CONFIG = {"memory.enable_memory_arena_shrinkage": "cpu:0"}


def release_mapped_pages(data_file: Path) -> int:
    """Drop this process's resident pages of the bundle's external data file; return the bytes of mappings advised.

    ONNX Runtime maps external initializers copy-on-write and keeps the mappings of those it still uses after
    prepacking (the embedding's rows, the LM head's scales): their pages, touched while loading and prepacking, stay
    resident though decode reads a few rows of them. MADV_DONTNEED on a mapping none of whose pages were written
    (no anonymous pages in /proc/self/smaps) only forgets clean pages: a later read faults them in again from the
    file (docs/results/memory.md). Linux only; 0 elsewhere.
    """
    advice = getattr(mmap, "MADV_DONTNEED", None)
    try:
        smaps = Path("/proc/self/smaps").read_text().splitlines()
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return 0
    target, spans, cur = str(data_file.resolve()), [], None
    for line in smaps:
        fields = line.split(maxsplit=5)
        if fields and "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
            cur = None
            if len(fields) == 6 and fields[5] == target:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                cur = [lo, hi, True]
                spans.append(cur)
        elif cur is not None and fields[:1] == ["Anonymous:"] and int(fields[1]) != 0:
            cur[2] = False  # a page of it was written: its copy lives only here
    done = 0
    for lo, hi, clean in spans:
        if advice is not None and clean and libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), advice) == 0:
            done += hi - lo
    return done


def _fp16_activations(manifest: dict[str, Any]) -> bool:
    """Whether GroupQueryAttention runs in fp16 (on the CUDA provider, where fp32 attention falls back to the CPU)."""
    return manifest["precision"] == "fp16" or manifest.get("quantization", {}).get("activations") == "float16"


def cuda_provider_options(cuda_graph: bool) -> dict[str, str]:
    """The CUDA EP's options for a deltaship session."""
    return {"enable_cuda_graph": "1"} if cuda_graph else {}


class OnnxSession(OnnxSpeculation, Session):
    def __init__(
        self,
        bundle: Path,
        manifest: dict[str, Any],
        threads: int | None = None,
        providers: list[str] | None = None,
        prefill_chunk: int | None = None,
        in_place: bool = True,
        profiling: bool = False,
        provider: str = "cpu",
        cuda_graph: bool | None = None,
        prepack_cache: str | Path | None = None,
    ):
        super().__init__(bundle, manifest, prefill_chunk)
        if prepack_cache is not None and (provider != "cpu" or (providers and providers[0] != "CPUExecutionProvider")):
            raise DeltashipError(
                "prepack_cache keeps ONNX Runtime's CPU weight layout; this session runs on "
                f"{providers[0] if providers else provider}",
                "drop --prepack-cache (it is for the CPU provider)",
            )
        capturable = "cuda_graph" in manifest.get("lowering", {})  # exported with --onnx-cuda-graph
        if cuda_graph is None:  # such a bundle is captured on the CUDA provider
            cuda_graph = provider == "cuda" and in_place and capturable
        if cuda_graph and (provider != "cuda" or (providers and providers[0] != "CUDAExecutionProvider")):
            raise DeltashipError(
                f"cuda_graph=True needs the CUDA execution provider; this session was asked for "
                f"{providers[0] if providers else provider}",
                "open the bundle with provider='cuda' (onnxruntime-gpu on an NVIDIA GPU), or drop cuda_graph",
            )
        if cuda_graph and not capturable:
            raise DeltashipError(
                f"{bundle}: this bundle's decoder cannot be captured as a CUDA graph (its position arithmetic runs on "
                "the CPU and feeds the GPU through Memcpy nodes, which ONNX Runtime refuses to capture)",
                "export it with --onnx-cuda-graph (and --precision fp16 or --onnx-activations fp16), or drop "
                "--cuda-graph",
            )
        if cuda_graph and not in_place:
            raise DeltashipError(
                "cuda_graph=True needs in_place=True (the KV cache must stay in one buffer)", "drop in_place=False"
            )
        import onnxruntime as ort  # lazy: onnxruntime: the runtime this session loads

        if providers is None and provider == "cuda":
            have = ort.get_available_providers()
            if "CUDAExecutionProvider" not in have:
                raise DeltashipError(
                    f"this onnxruntime {ort.__version__} has no CUDA execution provider (it has {', '.join(have)})",
                    "on a machine with an NVIDIA GPU: pip uninstall onnxruntime && pip install onnxruntime-gpu==1.31.*",
                )
            providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
        self.cuda_graph = cuda_graph
        self._ort = ort
        prefix = None
        if profiling:
            prefix = str(Path(tempfile.mkdtemp(prefix="deltaship-ortprof-")) / "ort")
        self.threads = threads
        self.providers = providers or ["CPUExecutionProvider"]
        # ORT takes provider options as (name, options) pairs; self.providers keeps the plain names
        ep_list = [
            (p, cuda_provider_options(cuda_graph)) if p == "CUDAExecutionProvider" else p for p in self.providers
        ]
        model_path = bundle_path(self.bundle, manifest, manifest["entry"], "entry")
        turn_taking = "speculative" in manifest  # an --mtp bundle's decoder takes turns with its draft head
        if prepack_cache is not None:  # the graph with ORT's packed weights, mapped (runtimes/onnx_prepack.py)
            model_path = cached_model(
                prepack_cache,
                self.bundle,
                manifest,
                ort,
                lambda: session_options(ort, threads, None, turn_taking=turn_taking),
            )
        self.cpu_fallback = False
        try:
            if self.providers[0] != "CPUExecutionProvider":
                # Every node on the accelerator, or say that some are not: ORT would otherwise run them on the
                # CPU without a word.
                accel = [p for p in ep_list if p != "CPUExecutionProvider"]
                try:  # ORT refuses a CPU provider in the list when CPU fallback is disabled
                    self.sess = ort.InferenceSession(
                        str(model_path),
                        providers=accel,
                        sess_options=session_options(ort, threads, prefix, strict=True, turn_taking=turn_taking),
                    )
                except Exception as e:
                    if "fallback to CPU EP has been explicitly disabled" not in str(e):
                        raise  # not a placement question (no device, out of memory, ...): say so below
                    # ORT keeps a few int64 position nodes on the CPU in every deltaship graph (GQA's sequence
                    # lengths); with fp32 activations attention itself runs there (see runtime_name).
                    self.cpu_fallback = True
            if not hasattr(self, "sess"):
                opts = session_options(ort, threads, prefix, turn_taking=turn_taking)
                self.sess = ort.InferenceSession(str(model_path), sess_options=opts, providers=ep_list)
        except Exception as e:  # ORT raises its own exception types
            if cuda_graph and "graph capture" in str(e):
                raise DeltashipError(
                    f"{model_path}: ONNX Runtime {ort.__version__} refused CUDA graph capture for this bundle: {e}",
                    "open it without cuda_graph, and see docs/results/gpu.md, 'CUDA graphs' (bench/gpu/placement.py "
                    "lists the nodes ORT would keep on the CPU)",
                ) from None
            raise DeltashipError(
                f"{model_path}: ONNX Runtime {ort.__version__} could not load the model: {e}",
                "export the bundle again with this version of deltaship",
            ) from None
        got = self.sess.get_providers()[0]
        if got != self.providers[0]:  # ORT fell back to another provider without failing
            raise DeltashipError(
                f"{model_path}: ONNX Runtime opened the session on {got}, not {self.providers[0]}",
                "check the GPU driver and CUDA libraries (onnxruntime-gpu 1.31 needs CUDA 13)",
            )
        self.device = "cuda" if got.startswith("CUDA") else "cpu"
        data = f"{manifest['entry']}.data"  # the external data beside the entry, listed and hashed when there is one
        if prepack_cache is not None:  # the packed weights map back in as decode reads them
            release_mapped_pages(model_path.with_name(f"{model_path.name}.data"))
        elif self.device == "cpu" and data in manifest["files"]:
            release_mapped_pages(bundle_path(self.bundle, manifest, data, "files"))
        if self.device == "cuda" and _fp16_activations(manifest) and not capturable:
            raise DeltashipError(
                f"{bundle}: this bundle's graph copies GroupQueryAttention's total_sequence_length from the GPU to "
                f"the host (a Memcpy node), and on it ONNX Runtime {ort.__version__}'s CUDA provider gave wrong, "
                "NaN logits (H200, 2026-11-26: docs/results/gpu.md)",
                "export it again with --onnx-cuda-graph, which computes the sequence lengths on the device (the "
                "same tokens on the CPU and in onnxruntime-genai), or run it on the CPU",
            )
        self.in_place = in_place
        self.states = manifest["states"]
        self._plan_states(self.providers[0])
        self._logits = np.zeros((1, 1, self.vocab_size), dtype=np.float32)
        self._logits_val = ort.OrtValue.ortvalue_from_numpy(self._logits)
        # one-token calls reuse one IOBinding per parity of the alternating states (made on first use): a decode
        # step writes two numbers and runs, instead of binding every state again
        self._decode_io: dict[tuple[int, ...], tuple[Any, Any]] = {}
        self.counted = counts_positions(manifest)
        # host buffers (ORT copies them where the graph reads them), as prefill's bind_cpu_input; cuda_graph=True
        # puts them on the device (_graph_buffers): a captured graph reads only device addresses
        self.keep_rows = keeps_rows(manifest)
        self._decode_in = DecodeInputs(ort, "cpu", self.counted, self.keep_rows)
        self._run_opts: dict[str, Any] = {}
        if self.device == "cpu" and PREFILL_RUN_CONFIG:
            prefill_opts = ort.RunOptions()
            for key, value in PREFILL_RUN_CONFIG.items():
                prefill_opts.add_run_config_entry(key, value)
            self._run_opts["-1"] = prefill_opts  # multi-token calls (_graph_id -1)
        if cuda_graph:
            self._graph_buffers("cuda")
        # the multimodal decoder's position_ids (runtimes/vision.py): a slice (a view, no copy) of one row
        self._positions = np.arange(self.max_context, dtype=np.int64).reshape(1, -1)

    def _plan_states(self, provider: str) -> None:
        """A buffer per state that shares past and present on `provider`, two for the others (zeroed)."""
        self._bufs: dict[str, list[np.ndarray]] = {}
        self._vals: dict[str, list] = {}
        self._cur: dict[str, int] = {}
        for s in self.states:
            n = 1 if self._shares_buffer(s, provider) else 2
            arrs = [np.zeros(s["shape"], dtype=_NP[s["dtype"]]) for _ in range(n)]
            self._bufs[s["name"]] = arrs
            self._vals[s["name"]] = [self._ortvalue(a) for a in arrs]
            self._cur[s["name"]] = 0
        self._alternating = [s["name"] for s in self.states if len(self._vals[s["name"]]) == 2]
        self._spare = self._rollback = None  # the speculative calls' extra buffers, made again on first use

    def _graph_buffers(self, device: str, plan_for: str | None = None) -> None:
        """Fixed-address decode inputs and logits, and the run options of uncaptured calls (cuda_graph=True).
        plan_for: plan the state buffers as that execution provider shares them (a rehearsal on the CPU of the
        CUDA provider's buffers: tests/test_cuda_graph.py)."""
        ort = self._ort
        if plan_for is not None:
            self._plan_states(plan_for)
        # a captured graph writes its output to the address it was captured with, on the device
        args = ("cuda", 0) if device == "cuda" else ()
        self._logits_val = ort.OrtValue.ortvalue_from_numpy(self._logits, *args)
        self._decode_in = DecodeInputs(ort, device, self.counted, self.keep_rows)
        self._decode_io.clear()
        ro = ort.RunOptions()
        ro.add_run_config_entry("gpu_graph_id", "-1")  # not captured: prefill, and calls of other shapes
        self._run_opts = {"-1": ro}
        self._graphs: dict[tuple, Any] = {}

    def _graph_options(self, kind: str, shape: tuple, values) -> Any:
        """The run options of a captured call: one gpu_graph_id per kind of call, shape and set of buffer addresses
        it binds, so that each captured graph replays on the addresses it was captured with. A plain decode loop
        alternates two sets (the states' parity); a speculative rollback swaps a state's buffers, which makes a
        new set (a few permutations of three buffers, so a bounded number of graphs)."""
        key = (kind, shape, tuple(v.data_ptr() for v in values))
        hit = self._graphs.get(key)
        if hit is None:
            if len(self._graphs) >= MAX_GRAPHS:
                raise DeltashipError(
                    f"{self.bundle}: more than {MAX_GRAPHS} captured CUDA graphs in one session (buffer sets "
                    "should repeat)",
                    "open the session with cuda_graph=False, and report it",
                )
            hit = self._ort.RunOptions()
            hit.add_run_config_entry("gpu_graph_id", str(len(self._graphs) + 1))
            self._graphs[key] = hit
        return hit

    def _shares_buffer(self, state: dict[str, Any], provider: str) -> bool:
        """Past and present in one buffer: where the manifest says the kernel allows it on this provider."""
        if not self.in_place:
            return False
        if "in_place" not in state:  # bundles from before deltaship recorded it: the KV cache only
            return state["kind"].startswith("kv_cache")
        return provider in state["in_place"]

    def runtime_name(self) -> str:
        fallback = ", some nodes on the CPU" if self.cpu_fallback else ""
        if self.device == "cuda" and not _fp16_activations(self.manifest):
            fallback += (
                ", fp32 activations: attention runs on the CPU (export with --onnx-activations fp16 "
                "or --precision fp16 for the GPU)"
            )
        graph = ", decode captured as CUDA graphs" if self.cuda_graph else ""
        return f"onnxruntime {self._ort.__version__} ({self.providers[0]}{graph}{fallback})"

    def _ortvalue(self, arr: np.ndarray):
        if self.device == "cuda":
            return self._ort.OrtValue.ortvalue_from_numpy(arr, "cuda", 0)
        return self._ort.OrtValue.ortvalue_from_numpy(arr)

    def _reset_states(self) -> None:
        for name, arrs in self._bufs.items():
            for a, v in zip(arrs, self._vals[name]):
                if self.device == "cuda":
                    v.update_inplace(np.zeros_like(a))
                else:
                    a[...] = 0
            self._cur[name] = 0

    def _bind_states(self, io) -> list:
        """Bind every state, the logits and (--mtp) the rollback outputs; return the OrtValues bound."""
        bound = []
        for s in self.states:
            vals, cur = self._vals[s["name"]], self._cur[s["name"]]
            io.bind_ortvalue_input(s["name"], vals[cur])
            io.bind_ortvalue_output(s["output"], vals[(cur + 1) % len(vals)])
            bound += [vals[cur], vals[(cur + 1) % len(vals)]]
        io.bind_ortvalue_output("logits", self._logits_val)
        bound.append(self._logits_val)
        if "speculative" in self.manifest:
            bound += self._bind_rollback(io, verify=False)
        return bound

    def _decode_binding(self) -> tuple[Any, Any]:
        """The IOBinding of a one-token call at the states' current parity, and its run options: made once per
        parity (the alternating states flip every call, so two in a plain decode loop) and kept, since every
        buffer it binds stays where it is. Forgotten (`_decode_io.clear()`) when a state's buffer is replaced."""
        key = tuple(self._cur[n] for n in self._alternating)
        hit = self._decode_io.get(key)
        if hit is None:
            io = self.sess.io_binding()
            for name, value in self._decode_in.values.items():
                io.bind_ortvalue_input(name, value)
            bound = list(self._decode_in.values.values()) + self._bind_states(io)
            opts = self._graph_options("decode", (1,), bound) if self.cuda_graph else None
            hit = self._decode_io[key] = (io, opts)
        return hit

    def _forward(self, ids: np.ndarray) -> np.ndarray:
        # A kept decode binding reads its inputs where they are when they live where the graph reads them: host
        # arrays on the CPU provider, device buffers in a captured session. A host array bound for a device is
        # copied at bind time (IOBinding), so an uncaptured CUDA session binds every call afresh: reusing the
        # binding there fed the first call's position to every later one (wrong tokens from the first, measured
        # on an H200, docs/results/gpu.md).
        if ids.size == 1 and (self.device == "cpu" or self.cuda_graph):
            io, opts = self._decode_binding()
            self._decode_in.set(int(ids[0]), self.position)
        else:
            io, opts = self.sess.io_binding(), self._run_opts.get("-1")
            io.bind_cpu_input("input_ids", ids.reshape(1, -1))
            for name, arr in position_feeds(self.counted, self.position, ids.size).items():
                io.bind_cpu_input(name, arr)
            if self.keep_rows:
                io.bind_cpu_input(KEEP_ROWS, np.zeros(1, np.int64))
            self._bind_states(io)
        if opts is None:
            self.sess.run_with_iobinding(io)
        else:
            self.sess.run_with_iobinding(io, opts)
        for n in self._alternating:
            self._cur[n] ^= 1
        if self.device == "cuda" or self.cuda_graph:
            return self._logits_val.numpy().reshape(-1).copy()
        return self._logits.reshape(-1).copy()

    def _read_states(self, names) -> dict[str, np.ndarray]:
        return {n: self._vals[n][self._cur[n]].numpy().copy() for n in names}

    def _write_states(self, arrays: dict[str, np.ndarray]) -> None:
        # into the current buffer of each state (on the CPU the OrtValue wraps that very array), so every kept
        # IOBinding and captured graph still reads it where it is
        for name, value in arrays.items():
            cur = self._cur[name]
            if self.device == "cuda":
                self._vals[name][cur].update_inplace(np.ascontiguousarray(value))
            else:
                self._bufs[name][cur][...] = value
        self._after_verify = None  # a speculative snapshot or rollback cannot span a restore
        self._keep_past = False

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Current value of every state (copies), by input name."""
        out = {}
        for name, vals in self._vals.items():
            out[name] = vals[self._cur[name]].numpy().copy()
        return out

    # Op kinds of the per-op breakdown: DeltaNet's own ops, attention, and the matmuls around them.
    OP_KINDS = {
        "LinearAttention": "deltanet",
        "CausalConvWithState": "deltanet",
        "GatedRMSNorm": "deltanet",
        "GroupQueryAttention": "attention",
        "MatMul": "matmul",
        "MatMulNBits": "matmul",
        "Gemm": "matmul",
    }

    def profile_ops(self, context: int, steps: int = 5) -> dict[str, list[float]]:
        """Seconds per decode step spent in each op kind at a context depth (ONNX Runtime's profiler)."""
        prof = OnnxSession(self.bundle, self.manifest, threads=self.threads, providers=self.providers, profiling=True)
        for _ in range(steps + 1):
            prof.reset()
            prof.seek(context)
            prof.decode(1)
        trace_file = Path(prof.sess.end_profiling())
        trace = json.loads(trace_file.read_text())
        shutil.rmtree(trace_file.parent, ignore_errors=True)  # the profiler's private temp dir (MBs per run)
        runs = [e for e in trace if e.get("name") == "model_run"][1:]  # the first run is a warmup
        out: dict[str, list[float]] = {}
        for run in runs:
            lo, hi = run["ts"], run["ts"] + run["dur"]
            per: dict[str, float] = {}
            for e in trace:
                if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and lo <= e["ts"] <= hi:
                    kind = self.OP_KINDS.get(e.get("args", {}).get("op_name", ""), "other")
                    per[kind] = per.get(kind, 0.0) + e["dur"] / 1e6
            for kind, secs in per.items():
                out.setdefault(kind, []).append(secs)
        return out
