"""Ahead-of-time compilation of a static QNN graph for one Snapdragon SoC: an EPContext model.

An EPContext model is what an app ships so the phone does not compile the graph at first launch: a small
`<name>_ctx.onnx` whose one `com.microsoft::EPContext` node names the QNN context binary beside it
(`<name>_ctx_qnn.bin`, the graph compiled and scheduled for one HTP). It is made with ONNX Runtime's compile API
(`onnxruntime.ModelCompiler`, the session options' `ep.context_*` settings under another name) and onnxruntime-qnn's
HTP backend with the SoC's `soc_model` and `htp_arch`. The x86-64 wheel ships QNN's HTP preparer
(libHtpPrepare.so): compiling here is QNN's own offline preparation for that SoC; only running it is simulated.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from deltaship.bundle.qnn_context import ContextModel, read_context_model
from deltaship.errors import DeltashipEnvironmentError, DeltashipError
from deltaship.lowering.qnn.soc import QnnSoc

CONTEXT_SUFFIX = "_ctx.onnx"  # ONNX Runtime names the binary <model stem>_qnn.bin beside it


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _qnn_compiler():
    """onnxruntime with the QNN plugin registered (once per process, whoever registered it first)."""
    try:
        import onnxruntime as ort  # lazy: onnxruntime; the QNN compile is optional (the `qnn` extra)
        import onnxruntime_qnn
    except ImportError as e:
        raise DeltashipEnvironmentError(
            f"compiling a QNN context needs onnxruntime-qnn ({e})",
            "pip install onnxruntime-qnn==2.7.0 --no-deps (it sits beside onnxruntime 1.31)",
        ) from None
    name = onnxruntime_qnn.get_ep_name()
    if not any(d.ep_name == name for d in ort.get_ep_devices()):
        ort.register_execution_provider_library(name, onnxruntime_qnn.get_library_path())
    devices = [d for d in ort.get_ep_devices() if d.ep_name == name]
    if not devices:
        raise DeltashipEnvironmentError(
            f"onnxruntime {ort.__version__} lists no {name} device after registering the plugin",
            "reinstall onnxruntime-qnn 2.7.0 beside onnxruntime >= 1.24.2",
        )
    return ort, onnxruntime_qnn, devices


def compile_context(graph: Path, soc: QnnSoc, out_dir: Path, *, name: str | None = None, fp16: bool = True) -> dict:
    """Compile the static graph `graph` (a lowering/qnn decode.onnx or prefill.onnx) for `soc` into out_dir.

    Writes `<name>_ctx.onnx` (the EPContext model, a few KB) and the context binary `<name>_ctx_qnn.bin` beside
    it (ep.context_embed_mode 0); `name` defaults to `<graph stem>_<soc.name>`. Every node must compile for the
    HTP: a node QNN leaves to the CPU fails the compile, naming it, and nothing is left in out_dir. Existing files
    are never overwritten. Returns what a manifest records:

        {"graph": "decode.onnx", "soc": "8gen3", "chip": "SM8650", "soc_model": 57, "htp_arch": 75,
         "model": "decode_8gen3_ctx.onnx",
         "files": [{"path": ..., "bytes": ..., "sha256": ...}, ...],    # the ctx model, then its binaries
         "qnn_sdk": "2.51.0", "qnn_build": "v2.51.0.260929181845", "htp_backend_api": "5.51.0",
         "compatibility": "v2:6:2.51.0:5.51.0:75:57:0:0", "onnxruntime": "1.31.1", "onnxruntime_qnn": "2.7.0",
         "compile_seconds": 1.2}

    The QNN version is read back from what was written: `qnn_sdk` and `htp_backend_api` from the context model's
    compatibility record (bundle/qnn_context.py: a runtime needs QNN `qnn_sdk` or newer), `qnn_build` from the
    EPContext node's `ep_sdk_version` (the full QAIRT build the binary was made with). Two compiles of one graph
    give binaries of the same size whose bytes differ in a few hundred places, so a binary's sha256 identifies
    one compile, not the graph.
    """
    ort, qnn, devices = _qnn_compiler()
    graph, out_dir = Path(graph), Path(out_dir)
    model = out_dir / f"{name or f'{graph.stem}_{soc.name}'}{CONTEXT_SUFFIX}"
    if not graph.is_file():
        raise DeltashipError(f"no QNN graph at {graph}", "lower it first (deltaship.lowering.qnn.model)")
    if model.exists() or model.with_name(f"{model.stem}_qnn.bin").exists():
        raise DeltashipError(f"{model} (or its _qnn.bin) already exists", "compile into an empty directory")
    opts = ort.SessionOptions()
    opts.add_provider_for_devices(
        devices,
        {
            "backend_path": qnn.get_qnn_htp_path(),
            "enable_htp_fp16_precision": "1" if fp16 else "0",
            "soc_model": str(soc.soc_model),
            "htp_arch": str(soc.htp_arch),
            "enable_htp_prepare_only": "1",  # compile only: the simulator need not load the result
        },
    )
    opts.log_severity_level = 3
    # CPU fallback stays allowed here so that a node the HTP refuses is left in the written model, where it can be
    # named; any such node then fails the compile below (the runtime opens contexts with the fallback disabled).
    compiler = ort.ModelCompiler(
        opts,
        str(graph),
        embed_compiled_data_into_model=False,
        flags=ort.OrtCompileApiFlags.ERROR_IF_NO_NODES_COMPILED | ort.OrtCompileApiFlags.ERROR_IF_OUTPUT_FILE_EXISTS,
    )
    start = time.perf_counter()
    try:
        compiler.compile_to_file(str(model))
    except Exception as e:  # ORT raises its own Fail/InvalidArgument types
        _remove_outputs(model)
        raise DeltashipError(
            f"QNN could not compile {graph.name} for {soc.marketing} ({soc.chip}, HTP v{soc.htp_arch}): "
            f"{str(e).strip()[:400]}",
            "open the graph with deltaship.runtimes.qnn.open_htp to see QNN's reason for each refused node",
        ) from None
    seconds = time.perf_counter() - start
    try:
        read = _checked(model, graph, soc)
    except DeltashipError:
        _remove_outputs(model)
        raise
    compat = read.compat
    files = [model, *(model.with_name(b) for b in read.binaries)]
    return {
        "graph": graph.name,
        "soc": soc.name,
        "chip": soc.chip,
        "soc_model": soc.soc_model,
        "htp_arch": soc.htp_arch,
        "model": model.name,
        "files": [{"path": f.name, "bytes": f.stat().st_size, "sha256": _sha256(f)} for f in files],
        "qnn_sdk": compat.qnn_sdk,
        "qnn_build": ",".join(read.qnn_builds),
        "htp_backend_api": compat.htp_backend_api,
        "compatibility": compat.record,
        "onnxruntime": ort.__version__,
        "onnxruntime_qnn": qnn.__version__,
        "compile_seconds": round(seconds, 3),
    }


def _checked(model: Path, graph: Path, soc: QnnSoc) -> ContextModel:
    """The context model just written, checked: every node compiled, for the SoC asked, its binaries beside it."""
    read = read_context_model(model)
    if read.other_ops:
        left = read.other_ops
        named = ", ".join(left[:8]) + (f" and {len(left) - 8} more" if len(left) > 8 else "")
        raise DeltashipError(
            f"QNN HTP ({soc.chip}, v{soc.htp_arch}) did not compile {len(left)} node(s) of {graph.name}: {named}",
            "lower the refused ops to forms the HTP accepts (docs/npu.md lists them); "
            "deltaship.runtimes.qnn.open_htp names QNN's reason for each",
        )
    compat = read.compat
    if (soc.soc_model, soc.htp_arch) not in zip(compat.soc_models, compat.htp_archs):
        raise DeltashipError(
            f"asked QNN for {soc.chip} (SoC {soc.soc_model}, HTP v{soc.htp_arch}) but {model.name} records "
            f"SoCs {compat.soc_models}, archs {compat.htp_archs}",
            "report this with the onnxruntime-qnn version; the SoC options were not applied",
        )
    for name in read.binaries:
        if not model.with_name(name).is_file():
            raise DeltashipError(
                f"{model.name} names the context binary {name!r}, which was not written", "compile again"
            )
    return read


def _remove_outputs(model: Path) -> None:
    for path in (model, model.with_name(f"{model.stem}_qnn.bin")):
        path.unlink(missing_ok=True)
