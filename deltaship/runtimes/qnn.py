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
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deltaship.bundle.qnn_context import read_context_model, soc_refusal, version_refusal
from deltaship.errors import DeltashipEnvironmentError, DeltashipError

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
) -> QnnOpen:
    """A session on the QNN HTP backend with CPU fallback disabled.

    Raises DeltashipError naming each op QNN refused (with QNN's reason) when a node cannot run on
    the HTP. `model` is the serialized ONNX model or its path.
    """
    return _open(model, soc_model=soc_model, htp_arch=htp_arch, fp16=fp16)


def open_context(model: str | Path, *, soc_model: str = DEFAULT_SOC_MODEL, htp_arch: str = DEFAULT_HTP_ARCH) -> QnnOpen:
    """A session on the HTP over a compiled context (an EPContext `*_ctx.onnx` and the `*_qnn.bin` beside it, from
    deltaship.lowering.qnn.context.compile_context), CPU fallback disabled.

    Before ONNX Runtime sees it, the context model is read (bundle/qnn_context.py) and refused with a
    DeltashipError when it was compiled for another SoC than `soc_model` / `htp_arch`, with a newer QNN than
    onnxruntime-qnn's, or names a binary that is not a file beside it: ONNX Runtime skips that check on x86-64,
    where the simulator opens any context with any SoC options, and on a phone QNN refuses a context for a newer
    HTP with a bare error code.
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


def _open(model: bytes | str | Path, *, soc_model: str, htp_arch: str, fp16: bool) -> QnnOpen:
    ort, qnn = _qnn()
    devices = [d for d in ort.get_ep_devices() if d.ep_name == qnn.get_ep_name()]
    if not devices:
        raise DeltashipEnvironmentError(
            f"onnxruntime {ort.__version__} lists no {qnn.get_ep_name()} device after registering the plugin",
            "reinstall onnxruntime-qnn 2.7.0 beside onnxruntime >= 1.24.2",
        )
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    opts.log_severity_level = 0  # verbose: QNN's per-node validation lines are the evidence
    opts.add_provider_for_devices(
        devices,
        {
            "backend_path": qnn.get_qnn_htp_path(),
            "enable_htp_fp16_precision": "1" if fp16 else "0",
            "soc_model": soc_model,
            "htp_arch": htp_arch,
        },
    )
    source = model if isinstance(model, bytes) else str(model)
    # ONNX Runtime logs from C++ to file descriptor 2: read it back for the validation lines.
    with tempfile.TemporaryFile(mode="w+b") as log_file:
        saved = os.dup(2)
        os.dup2(log_file.fileno(), 2)
        error = None
        try:
            session = ort.InferenceSession(source, sess_options=opts)
        except Exception as e:  # ORT raises its own Fail/InvalidArgument types
            error = e
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log_file.seek(0)
        log = log_file.read().decode("utf-8", "replace")
    checks = parse_validation(log)
    refused = [c for c in checks if not c.passed]
    if error is not None or refused:
        named = "; ".join(dict.fromkeys(_refusal(c) for c in refused)) or str(error).strip()
        raise DeltashipError(
            f"QNN HTP (soc {soc_model}) cannot run every node of this graph: {named}",
            "lower the refused ops to forms the HTP accepts (docs/npu.md lists them)",
        )
    return QnnOpen(session=session, checks=checks)


_ORT_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(int64)": "int64"}


class QnnDecoder:
    """Greedy decoding with QNN graphs: decode (input_ids [1, 1], position [1], past.* -> logits, present.*) and,
    optionally, prefill (the same with input_ids [1, C]: C tokens a call).

    The states live here as numpy arrays, zeroed at reset(); each call feeds its tokens from the current
    position and keeps the graph's present.* outputs as the next call's past.* inputs. A prompt is fed in
    whole prefill chunks, the rest (and every prompt without a prefill graph) one token a step."""

    def __init__(self, model: str | Path, prefill: str | Path | None = None, **htp_options: str):
        self._np = np
        self.opened = open_htp(model, **htp_options)
        self.prefill_opened = open_htp(prefill, **htp_options) if prefill is not None else None
        self.chunk = self.prefill_opened.session.get_inputs()[0].shape[1] if self.prefill_opened else 0
        sess = self.opened.session
        self.state_inputs = [i for i in sess.get_inputs() if i.name not in ("input_ids", "position")]
        self.state_outputs = [o.name for o in sess.get_outputs()][1:]
        if len(self.state_inputs) != len(self.state_outputs):
            raise DeltashipError(
                f"{model}: {len(self.state_inputs)} state inputs but {len(self.state_outputs)} state outputs",
                "re-export the qnn decode graph",
            )
        keys = [i.shape[2] for i in self.state_inputs if i.name.endswith(".key")]
        self.max_context = min(keys) if keys else None  # the static KV buffers' rows
        self._quiet = self._ort_run_options()
        self.reset()

    @staticmethod
    def _ort_run_options():
        import onnxruntime as ort  # lazy: onnxruntime; the session above imported it

        quiet = ort.RunOptions()
        quiet.log_severity_level = 3  # the session logs verbosely (for the validation lines); runs need not
        return quiet

    def reset(self) -> None:
        np = self._np
        self.states = [np.zeros(i.shape, dtype=_ORT_DTYPES[i.type]) for i in self.state_inputs]
        self.position = 0

    def _call(self, session, tokens: list[int]):
        np = self._np
        if self.max_context is not None and self.position + len(tokens) > self.max_context:
            raise DeltashipError(
                f"the sequence would reach position {self.position + len(tokens)}, past the graph's static KV "
                f"buffers of {self.max_context} positions",
                "export with a larger --max-context, or start a new sequence (reset)",
            )
        feed = {"input_ids": np.array([tokens], np.int64), "position": np.array([self.position], np.int64)}
        feed.update({i.name: s for i, s in zip(self.state_inputs, self.states)})
        out = session.run(None, feed, self._quiet)
        self.states = out[1:]
        self.position += len(tokens)
        return out[0].reshape(-1).astype(np.float32)

    def step(self, token: int):
        """Logits [V] (fp32) after `token` at the next position."""
        return self._call(self.opened.session, [token])

    def prefill(self, prompt: list[int]):
        """Logits [V] (fp32) after the last token of `prompt`, fed from the current position."""
        if not prompt:
            raise DeltashipError("an empty prompt: there are no logits to continue from", "pass at least one token")
        whole = len(prompt) - len(prompt) % self.chunk if self.chunk else 0
        for i in range(0, whole, self.chunk):
            logits = self._call(self.prefill_opened.session, prompt[i : i + self.chunk])
        for t in prompt[whole:]:
            logits = self.step(t)
        return logits

    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        """The argmax continuation of `prompt` (from a fresh state), `new_tokens` tokens."""
        self.reset()
        logits = self.prefill(prompt)
        out = []
        for _ in range(new_tokens):
            out.append(int(logits.argmax()))
            logits = self.step(out[-1])
        return out
