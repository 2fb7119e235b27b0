"""Open an ONNX graph on Qualcomm's QNN HTP backend (onnxruntime-qnn), every node on the HTP.

onnxruntime-qnn is a plugin execution provider: its library is registered with ONNX Runtime once per
process, then a session asks for its device with CPU fallback disabled, so a node QNN refuses makes
the session fail instead of running silently on the CPU. On x86-64 Linux the HTP backend is a
simulator; on a device the same options pick the real NPU. A refusal is turned into one error that
names the refused nodes and QNN's reasons, read from ONNX Runtime's verbose log of QNN's validation.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from deltaship.bundle.paths import bundle_path
from deltaship.bundle.qnn_context import read_context_model, soc_refusal, version_refusal
from deltaship.errors import DeltashipEnvironmentError, DeltashipError
from deltaship.runtimes.base import Session

# The Snapdragon 8 Elite (SM8750): the default SoC the HTP simulator models.
DEFAULT_SOC_MODEL = "69"
DEFAULT_HTP_ARCH = "79"

# "Validation FAILED for 1 nodes in OrtNodeUnit (MatMul) :" then, for a refusal, tab-indented lines
# "Operator type: MatMul Node name: n Node index: 0" and "REASON : Cannot get shape".
_VALIDATION = re.compile(
    r"LogNodeSupport\] Validation (PASSED|FAILED) for \d+ nodes in \w+ \((\w+)\) :[^\n]*"
    r"(?:\n\t[^\n]*?Node name: ?([^\n]*?) Node index[^\n]*)?(?:\n\tREASON : ([^\n]*))?"
)
_REGISTERED = False


@dataclass(frozen=True)
class NodeCheck:
    """One line of QNN's validation: an ONNX op (or a fused unit) and whether the HTP accepted it."""

    op: str
    passed: bool
    node: str
    reason: str


@dataclass(frozen=True)
class QnnOpen:
    """A session with every node on the HTP, and QNN's validation lines that accepted them."""

    session: object  # onnxruntime.InferenceSession
    checks: tuple[NodeCheck, ...]


def _qnn():
    """Import onnxruntime with the QNN plugin registered (lazily: the plugin is optional)."""
    global _REGISTERED
    try:
        import onnxruntime as ort  # lazy: onnxruntime; toolchain import, kept lazy: runtimes/ loads without it
        import onnxruntime_qnn
    except ImportError as e:
        raise DeltashipEnvironmentError(
            f"the QNN HTP backend needs onnxruntime-qnn ({e})",
            "pip install onnxruntime-qnn==2.7.0 --no-deps (it sits beside onnxruntime 1.31)",
        ) from None
    name = onnxruntime_qnn.get_ep_name()
    # once per process, whoever registers it first (the lowering's compile_context registers it too)
    if not _REGISTERED and not any(d.ep_name == name for d in ort.get_ep_devices()):
        ort.register_execution_provider_library(name, onnxruntime_qnn.get_library_path())
    _REGISTERED = True
    return ort, onnxruntime_qnn


def parse_validation(log: str) -> tuple[NodeCheck, ...]:
    """QNN's per-node validation lines from ONNX Runtime's verbose log."""
    checks = []
    for m in _VALIDATION.finditer(log):
        passed, op, node, reason = m.group(1) == "PASSED", m.group(2), m.group(3) or "", m.group(4) or ""
        checks.append(NodeCheck(op=op, passed=passed, node=node.strip(), reason=reason.strip()))
    return tuple(checks)


def _refusal(c: NodeCheck) -> str:
    return f"{c.op}{f' node {c.node!r}' if c.node else ''} ({c.reason or 'refused'})"


def open_htp(
    model: bytes | str | Path,
    *,
    soc_model: str = DEFAULT_SOC_MODEL,
    htp_arch: str = DEFAULT_HTP_ARCH,
    fp16: bool = True,
    evidence: bool = False,
) -> QnnOpen:
    """A session on the QNN HTP backend with CPU fallback disabled: it opens only when every node runs on the HTP.

    Raises DeltashipError naming each op QNN refused (with QNN's reason) when a node cannot run on
    the HTP. `model` is the serialized ONNX model or its path. evidence: open with ONNX Runtime's verbose log to
    keep QNN's per-node validation lines (QnnOpen.checks); the session then logs verbosely at every run too, so by
    default it opens quietly (no checks) and only a refused graph is opened again verbosely, for the error."""
    return _open(model, soc_model=soc_model, htp_arch=htp_arch, fp16=fp16, evidence=evidence)


def open_context(model: str | Path, *, soc_model: str = DEFAULT_SOC_MODEL, htp_arch: str = DEFAULT_HTP_ARCH) -> QnnOpen:
    """A session on the HTP over a compiled context (an EPContext `*_ctx.onnx` and the `*_qnn.bin` beside it, from
    deltaship.lowering.qnn.context.compile_context), CPU fallback disabled.

    Before ONNX Runtime sees it, the context model is read (bundle/qnn_context.py) and refused with a
    DeltashipError when it was compiled for another SoC than `soc_model` / `htp_arch`, with a newer QNN than
    onnxruntime-qnn's, or names a binary that is not a file beside it. onnxruntime-qnn skips its own check on
    x86-64, where the simulator opens any context with any SoC options; on a phone that check rates a context for a
    newer HTP unsupported and one for an older HTP "prefer recompilation" (bundle/qnn_context.py).
    """
    _, qnn = _qnn()
    path = Path(model)
    if not path.is_file():
        raise DeltashipError(f"no QNN context model at {path}", "compile one (deltaship.lowering.qnn.context)")
    read = read_context_model(path)
    compat = read.compat
    runtime_qnn = qnn.build_and_package_info.qnn_version
    why = soc_refusal(compat, int(soc_model), int(htp_arch)) or version_refusal(compat, runtime_qnn)
    if why:
        raise DeltashipError(
            f"{path.name}: {why}",
            f"open it with the SoC it was compiled for (soc_model {compat.soc_models[0]}, htp_arch "
            f"{compat.htp_archs[0]}) on QNN >= {compat.qnn_sdk}, or compile the graph again for this SoC",
        )
    for name in read.binaries:
        if not path.with_name(name).is_file():
            raise DeltashipError(
                f"{path.name} names the context binary {name}, which is not beside it",
                "ship the *_qnn.bin with its *_ctx.onnx (or compile the graph again)",
            )
    return _open(path, soc_model=soc_model, htp_arch=htp_arch, fp16=True)


def _open(model: bytes | str | Path, *, soc_model: str, htp_arch: str, fp16: bool, evidence: bool = False) -> QnnOpen:
    ort, qnn = _qnn()
    devices = [d for d in ort.get_ep_devices() if d.ep_name == qnn.get_ep_name()]
    if not devices:
        raise DeltashipEnvironmentError(
            f"onnxruntime {ort.__version__} lists no {qnn.get_ep_name()} device after registering the plugin",
            "reinstall onnxruntime-qnn 2.7.0 beside onnxruntime >= 1.24.2",
        )
    provider = {
        "backend_path": qnn.get_qnn_htp_path(),
        "enable_htp_fp16_precision": "1" if fp16 else "0",
        "soc_model": soc_model,
        "htp_arch": htp_arch,
    }
    source = model if isinstance(model, bytes) else str(model)
    session, error, log = _create(ort, source, devices, provider, verbose=evidence)
    if error is not None and not evidence:  # QNN's validation lines name the refused nodes: open again to read them
        session, error, log = _create(ort, source, devices, provider, verbose=True)
    checks = parse_validation(log)
    refused = [c for c in checks if not c.passed]
    if error is not None or refused:
        named = "; ".join(dict.fromkeys(_refusal(c) for c in refused)) or str(error).strip()
        raise DeltashipError(
            f"QNN HTP (soc {soc_model}) cannot run every node of this graph: {named}",
            "lower the refused ops to forms the HTP accepts (docs/npu.md lists them)",
        )
    return QnnOpen(session=session, checks=checks)


def _create(ort, source, devices, provider: dict[str, str], verbose: bool):
    """(session or None, the error or None, what ONNX Runtime and QNN logged while opening it)."""
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    opts.log_severity_level = 0 if verbose else 3  # verbose: QNN's per-node validation lines
    opts.add_provider_for_devices(devices, provider)
    # ONNX Runtime logs from C++ to file descriptor 2 (read back: the validation lines) and QNN writes a note of its
    # own to file descriptor 1 (which would corrupt `generate --json`): both go to the log while the session opens.
    with tempfile.TemporaryFile(mode="w+b") as log_file:
        sys.stdout.flush()
        saved = {fd: os.dup(fd) for fd in (1, 2)}
        for fd in saved:
            os.dup2(log_file.fileno(), fd)
        session = error = None
        try:
            session = ort.InferenceSession(source, sess_options=opts)
        except Exception as e:  # ORT raises its own Fail/InvalidArgument types
            error = e
        finally:
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
        log_file.seek(0)
        log = log_file.read().decode("utf-8", "replace")
    return session, error, log


_ORT_DTYPES = {"float32": np.float32, "float16": np.float16}


class QnnSession(Session):
    """A qnn bundle on the QNN HTP backend: decode.onnx (1 token a call) and prefill.onnx (prefill_chunk tokens a
    call), each opened with the bundle's SoC and CPU fallback disabled (a node the HTP refuses fails the open,
    named). The states live here as numpy arrays (the manifest's shapes and dtypes), zeroed at reset; each call
    feeds its tokens from the current position and keeps the graph's present.* outputs as the next past.*. A
    prompt goes in whole prefill chunks, the rest one token a call (base Session chunks it; _forward picks)."""

    latency_note = (
        "onnxruntime-qnn's HTP backend on x86-64 is QNN's simulator: these latencies are the simulator's on this "
        "host, not a Snapdragon NPU's"
    )

    def __init__(self, bundle: Path, manifest: dict[str, Any], prefill_chunk: int | None = None):
        low = manifest.get("lowering") or {}
        graphs, soc, opts = low.get("graphs"), low.get("soc"), low.get("provider_options") or {}
        if not isinstance(graphs, dict) or "decode" not in graphs or not isinstance(soc, dict):
            raise DeltashipError(
                f"{bundle}: the manifest names no QNN graphs (lowering.graphs.decode) or SoC (lowering.soc)",
                "export the bundle again with --target qnn",
            )
        chunk = int(manifest["prefill_chunk"])
        if prefill_chunk is not None and prefill_chunk != chunk:
            raise DeltashipError(
                f"--prefill-chunk {prefill_chunk}: this qnn bundle's prefill graph takes exactly {chunk} tokens a call "
                "(static shapes)",
                f"drop --prefill-chunk, or export with --prefill-chunk {prefill_chunk}",
            )
        super().__init__(bundle, manifest, prefill_chunk=chunk)
        htp = {
            "soc_model": str(soc["soc_model"]),
            "htp_arch": str(soc["htp_arch"]),
            "fp16": str(opts.get("enable_htp_fp16_precision", "1")) == "1",
        }

        compiled = low.get("context") or {}

        def open_graph(key: str) -> QnnOpen:
            if key in compiled:  # the EPContext model compiled for the SoC (export --qnn-context), as an app opens it
                made = compiled[key]
                for i, f in enumerate(made["files"]):  # the context model and its binaries: inside, listed
                    bundle_path(bundle, manifest, f["path"], f"lowering.context.{key}.files[{i}].path")
                path = bundle_path(bundle, manifest, made["model"], f"lowering.context.{key}.model")
                return open_context(path, soc_model=htp["soc_model"], htp_arch=htp["htp_arch"])
            return open_htp(bundle_path(bundle, manifest, graphs[key]["file"], f"lowering.graphs.{key}.file"), **htp)

        self.soc = soc
        self.compiled = sorted(compiled)  # the graphs opened from their compiled contexts
        self.decode_graph = open_graph("decode")
        self.prefill_graph = open_graph("prefill") if "prefill" in graphs else None
        self.graph_chunk = int(graphs["prefill"]["tokens"]) if self.prefill_graph else 1
        self._states = {s["name"]: s for s in manifest["states"]}
        self._outputs = [s["output"] for s in manifest["states"]]
        self._quiet = _quiet_run_options()
        self._reset_states()

    def runtime_name(self) -> str:
        return (
            f"onnxruntime-qnn {metadata.version('onnxruntime-qnn')} (QNN HTP, {self.soc.get('chip')} soc "
            f"{self.soc['soc_model']} / v{self.soc['htp_arch']}, CPU fallback disabled"
            + (f"; EPContext: {', '.join(self.compiled)})" if self.compiled else ")")
        )

    def _reset_states(self) -> None:
        self.states = {n: np.zeros(s["shape"], _ORT_DTYPES[s["dtype"]]) for n, s in self._states.items()}

    def _read_states(self, names) -> dict[str, np.ndarray]:
        return {n: self.states[n].copy() for n in names}

    def _write_states(self, arrays: dict[str, np.ndarray]) -> None:
        for n, a in arrays.items():
            want = self.states[n]
            if a.shape != want.shape or a.dtype != want.dtype:
                raise DeltashipError(
                    f"state {n}: {a.dtype}{list(a.shape)} given, {want.dtype}{list(want.shape)} expected",
                    "restore a state this bundle saved",
                )
            self.states[n] = np.array(a, copy=True)

    def _call(self, opened: QnnOpen, ids: np.ndarray, position: int) -> np.ndarray:
        feed = {"input_ids": ids.reshape(1, -1).astype(np.int64), "position": np.array([position], np.int64)}
        feed.update(self.states)
        out = opened.session.run(None, feed, self._quiet)
        self.states = dict(zip(self._states, out[1:]))
        return out[0].reshape(-1).astype(np.float32)

    def _forward(self, ids: np.ndarray) -> np.ndarray:
        if self.prefill_graph is not None and ids.size == self.graph_chunk:
            return self._call(self.prefill_graph, ids, self.position)
        for i, token in enumerate(ids):  # fewer tokens than a chunk: one decode call each
            logits = self._call(self.decode_graph, np.array([token]), self.position + i)
        return logits


def _quiet_run_options():
    import onnxruntime as ort  # lazy: onnxruntime; open_htp imported it

    quiet = ort.RunOptions()
    quiet.log_severity_level = 3  # the session logs verbosely (for the validation lines); runs need not
    return quiet
