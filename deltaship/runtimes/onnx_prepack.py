"""ONNX Runtime's prepacked weights kept on disk, so that a CPU session maps them instead of packing them at each load.

When a session loads, ONNX Runtime repacks every MatMulNBits weight into its CPU kernels' layout (1.2x the stored
int4 bytes). While it packs, the stored weights and their packed copies are resident together: that is the load
peak (0.865 GiB for the 0.8B int4 bundle, 0.66 once loaded; docs/results/memory.md). Asked to
(`session.save_external_prepacked_constant_initializers`), ONNX Runtime saves the optimized graph with the packed
weights in its external data. A session of that graph maps them: no packing, no heap copy, and clean file pages
that the OS can drop and read again.

The packed layout belongs to this CPU and this ONNX Runtime (MLAS picks its kernels by instruction set; ORT warns
that such a graph "should only be used in the same environment the model was optimized in"). So the cache is built
on the machine that runs it, never shipped in a bundle. Its entry's name is a key over the bundle's files, the ONNX
Runtime version and the CPU's features, so any change builds a new entry instead of reusing a stale one.

An entry is a directory, `<cache>/<key>/`, holding exactly model.onnx, model.onnx.data and entry.json. It is built
in a temporary directory beside it and renamed into place, so a reader sees a whole entry or none. A directory of
that name that is not an intact entry is refused, not replaced: deltaship overwrites nothing it did not write.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import platform
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deltaship.bundle.node_order import order_for_runtime
from deltaship.bundle.paths import bundle_path
from deltaship.errors import DeltashipEnvironmentError, DeltashipError, DeltashipUnavailable
from deltaship.files import read_json_object, sha256_file
from deltaship.runtimes.onnx_contract import external_locations

# entry.json's format and the saved graph's layout (2: nodes in the runtime's walk order; 3: the data file's sha256
# recorded); a new one builds new entries
FORMAT = 3
MODEL, DATA, META = "model.onnx", "model.onnx.data", "entry.json"
# ONNX Runtime's session config keys (onnxruntime_session_options_config_keys.h)
_SAVE_PREPACKED = "session.save_external_prepacked_constant_initializers"
_DATA_NAME = "session.optimized_model_external_initializers_file_name"
_DATA_MIN = "session.optimized_model_external_initializers_min_size_in_bytes"


def cpu_features() -> str:
    """What selects ONNX Runtime's CPU kernels: the machine, and the instruction-set flags the kernel reports
    (Linux: /proc/cpuinfo's `flags` on x86, `Features` on Arm). Elsewhere the processor's name only."""
    seen: list[str] = [platform.machine(), platform.processor()]
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                seen.append(" ".join(sorted(value.split())))
                break
    except OSError:
        pass
    return "|".join(seen)


def cache_key(bundle: Path, manifest: dict[str, Any], ort_version: str) -> str:
    """The entry's name: the bundle's graph and weight files (name, size, sha256 from the manifest, and the size and
    modification time on disk, so a file replaced under a session opened with check_hashes=False misses the
    cache), the ONNX Runtime version and the CPU's features."""
    entry = manifest["entry"]
    parts: dict[str, Any] = {"format": FORMAT, "onnxruntime": ort_version, "cpu": cpu_features(), "files": []}
    for name in (entry, f"{entry}.data"):
        if name not in manifest["files"]:
            continue
        st = bundle_path(bundle, manifest, name, "files").stat()
        parts["files"].append([name, manifest["files"][name], st.st_size, st.st_mtime_ns])
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def cached_model(
    cache: str | Path,
    bundle: Path,
    manifest: dict[str, Any],
    ort: Any,
    options: Callable[[], Any],
) -> Path:
    """The prepacked graph of the bundle's entry in the cache directory `cache`, built first if the cache has none
    for this bundle, ONNX Runtime and CPU. options: the session's SessionOptions (a new object per call); the graph
    is optimized with them, as the session that opens it will be."""
    root = Path(cache).expanduser()
    key = cache_key(bundle, manifest, ort.__version__)
    entry = root / key
    if entry.exists() or entry.is_symlink():
        return _checked(entry, key)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
    except OSError as e:
        raise DeltashipEnvironmentError(
            f"--prepack-cache {root}: cannot create a directory there ({e.strerror or e})",
            "pass a directory you can write to, or drop --prepack-cache",
        ) from None
    try:
        _build(tmp, bundle, manifest, ort, options, key)
        try:
            tmp.rename(entry)  # atomic: a reader sees the whole entry or none
        except OSError:
            if not (entry.exists() or entry.is_symlink()):
                raise
            # another process built the same entry first: use theirs (checked like any entry), drop ours
    except OSError as e:
        raise DeltashipEnvironmentError(
            f"--prepack-cache {root}: could not write the prepacked model ({e.strerror or e}; it takes about twice "
            "the bundle's weights)",
            "free disk space there or pass another directory, or drop --prepack-cache",
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _checked(entry, key)


def _build(tmp: Path, bundle: Path, manifest: dict[str, Any], ort: Any, options, key: str) -> None:
    opts = options()
    opts.optimized_model_filepath = str(tmp / MODEL)
    opts.add_session_config_entry(_SAVE_PREPACKED, "1")
    opts.add_session_config_entry(_DATA_NAME, DATA)
    opts.add_session_config_entry(_DATA_MIN, "1024")  # small tensors stay inside model.onnx
    source = bundle_path(bundle, manifest, manifest["entry"], "entry")
    try:
        ort.InferenceSession(str(source), sess_options=opts, providers=["CPUExecutionProvider"])  # saved, dropped
    except Exception as e:  # ORT raises its own exception types; a full disk surfaces here as a failed save
        raise DeltashipEnvironmentError(
            f"{source}: ONNX Runtime {ort.__version__} could not save its prepacked model ({e})",
            "free disk space in the --prepack-cache directory, or drop --prepack-cache",
        ) from None
    finally:
        _trim_heap()
    if not (tmp / DATA).is_file():  # nothing was large enough to go to external data: an empty data file
        (tmp / DATA).write_bytes(b"")
    _order_for_runtime(tmp / MODEL)
    meta = {
        "format": FORMAT,
        "key": key,
        "onnxruntime": ort.__version__,
        "bundle": str(bundle.resolve()),
        "files": {n: {"bytes": (tmp / n).stat().st_size} for n in (MODEL, DATA)},
        "model_sha256": sha256_file(tmp / MODEL),
        "data_sha256": sha256_file(tmp / DATA),
    }
    (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")


def _order_for_runtime(model: Path) -> None:
    """Rewrite the saved graph's node order so that the session that opens it runs it layer by layer. ONNX Runtime
    saves the nodes in the order it ran them, and runs a file in its walk of the file's order, which for a layer-by-
    layer order is the late one (each layer's state writes after the LM head: at 0.8B int4 the cache's peak was 1.166
    GiB against 0.866 without it, docs/results/memory.md). One more walk, as the export does (bundle/node_order.py)."""
    try:
        import onnx  # lazy: the onnx extra, installed with onnxruntime by `pip install "deltaship[onnx]"`
    except ImportError:
        raise DeltashipUnavailable(
            "--prepack-cache rewrites the graph ONNX Runtime saves, which needs the onnx package",
            'pip install "deltaship[onnx]"',
        ) from None
    proto = onnx.load(str(model), load_external_data=False)
    nodes = order_for_runtime(list(proto.graph.node))
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    onnx.save(proto, str(model))


def _trim_heap() -> None:
    """Give the freed heap back to the OS (glibc's malloc_trim; nothing elsewhere). The session that built the entry
    packed its weights in the heap; glibc keeps freed pages for reuse, so without this they stay resident beside the
    mapped ones the next session reads (0.38 GiB at the 0.8B int4: docs/results/memory.md)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _checked(entry: Path, key: str) -> Path:
    """entry/model.onnx, after checking that the entry is one this module wrote and that nothing changed it: exactly
    its three plain files, entry.json naming this key, the sizes it recorded, the sha256 of model.onnx and of
    model.onnx.data (a data file rewritten at the same size is caught; hashing reads it once, sequentially, into the
    page cache the session then maps, and adds no resident memory), and every external data location in model.onnx
    being model.onnx.data beside it (ONNX Runtime opens those itself)."""
    fix = f"remove {entry} (deltaship builds it again on the next open), or pass another --prepack-cache"
    if entry.is_symlink() or not entry.is_dir():
        raise DeltashipError(f"{entry}: not a directory deltaship wrote (a prepack cache entry)", fix)
    names = sorted(p.name for p in entry.iterdir())
    if names != sorted((MODEL, DATA, META)) or any((entry / n).is_symlink() for n in names):
        held = ", ".join(names) or "nothing"
        raise DeltashipError(f"{entry}: not an intact prepack cache entry (it holds {held})", fix)
    meta = read_json_object(entry / META, "prepack cache entry's record", fix)  # bounded, like any untrusted JSON
    try:
        ok = meta["format"] == FORMAT and meta["key"] == key
        ok = ok and all((entry / n).stat().st_size == int(meta["files"][n]["bytes"]) for n in (MODEL, DATA))
        ok = ok and sha256_file(entry / MODEL) == meta["model_sha256"]
        ok = ok and sha256_file(entry / DATA) == meta["data_sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise DeltashipError(f"{entry}: a prepack cache entry changed after deltaship wrote it", fix)
    bad = sorted({loc or "(none)" for _, loc in external_locations(entry / MODEL) if loc != DATA})
    if bad:
        raise DeltashipError(f"{entry / MODEL}: names external data outside its entry ({', '.join(bad)})", fix)
    return entry / MODEL
