"""Saved chat sessions: one safetensors file, arrays plus JSON metadata inside it (no pickle).

Layout (docs/bundle-format.md, "Saved chat sessions"; the metadata's JSON Schema: session.schema.json):
- tensors `state/<state>`: every state of the session in its runtime's layout, the DeltaNet states whole, each KV
  cache up to the position; `checkpoint/<i>/<state>`: the DeltaNet states of the last exchange's checkpoints;
- `__metadata__["deltaship_chat"]`: the JSON metadata (format, version, the bundle's identity, position, token
  ids, messages, checkpoints, each tensor's dtype, shape and sha256); `__metadata__["deltaship_chat_sha256"]`:
  the sha256 of that JSON text.
Loading checks all of it before touching the session; saving writes a temp file beside the target, fsyncs it and
renames it over the target.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from deltaship.bundle.destination import OutputLock, recover, replace_file
from deltaship.bundle.paths import bundle_path
from deltaship.errors import DeltashipEnvironmentError, DeltashipError
from deltaship.files import parse_json

FORMAT = "deltaship-chat-session"
VERSION = 1
META_KEY = "deltaship_chat"
META_SHA_KEY = "deltaship_chat_sha256"
MAX_FILE_BYTES = 64 << 30


def bundle_identity(bundle: Path) -> str:
    """sha256 of the bundle's manifest.json (which hashes every file of the bundle)."""
    h = hashlib.sha256()
    with open(Path(bundle) / "manifest.json", "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


PROMPT_CACHE_FILE = "prompt_cache.safetensors"


def files_identity(manifest: dict[str, Any]) -> str:
    """sha256 over the bundle's files and their sha256, the prompt cache left out: the identity of the bundle a
    shipped prompt cache belongs to (it cannot name the manifest that lists it)."""
    rows = sorted((path, f["sha256"]) for path, f in manifest.get("files", {}).items() if path != PROMPT_CACHE_FILE)
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def save_chat(chat, path: Path, shipped: bool = False) -> Path:
    """shipped: a prompt cache inside the bundle, which names the bundle by its files (files_identity)."""
    from safetensors.numpy import save  # lazy: safetensors: session files only

    s = chat.session
    tensors: dict[str, np.ndarray] = {f"state/{n}": a for n, a in s.state_file_arrays().items()}
    checkpoints, last = [], None
    if chat.turns:
        t = chat.turns[-1]
        names = {}
        for key, cp in (("before", t.before), ("before_reply", t.before_reply)):
            if cp is None or not s.can_restore(cp):
                names[key] = None
                continue
            i = len(checkpoints)
            checkpoints.append({"position": cp.position})
            tensors.update({f"checkpoint/{i}/{n}": np.asarray(a) for n, a in cp.states.items()})
            names[key] = i
        last = {"messages_before": t.messages_before, "ids_before_reply": t.ids_before_reply, **names}
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "bundle": {
            ("files_sha256" if shipped else "manifest_sha256"): (
                files_identity(s.manifest) if shipped else bundle_identity(s.bundle)
            ),
            "target": s.manifest["target"],
        },
        "position": s.position,
        "ids": [int(i) for i in chat.ids],
        "system": chat.system,
        "template_kwargs": chat.template_kwargs,
        "messages": chat.history,
        "checkpoints": checkpoints,
        "last_turn": last,
        "tensors": {k: {"dtype": str(a.dtype), "shape": list(a.shape), "sha256": _sha(a)} for k, a in tensors.items()},
    }
    text = json.dumps(meta, sort_keys=True, separators=(",", ":"))
    blob = save(
        {k: np.ascontiguousarray(a) for k, a in tensors.items()},
        metadata={META_KEY: text, META_SHA_KEY: hashlib.sha256(text.encode()).hexdigest()},
    )
    path = Path(path)
    try:  # whole or not at all, private to the user (a conversation)
        replace_file(path, blob, "--session", mode=0o600)
    except DeltashipEnvironmentError:
        raise
    except OSError as e:
        raise DeltashipEnvironmentError(f"{path}: could not save the chat session: {e}", "check the disk") from None
    return path


# ---- where a session may be saved ---------------------------------------------------------------------------

_HELD: dict[str, OutputLock] = {}  # session files this process holds the lock of (a chat's --session)


@contextmanager
def claimed(path: Path, option: str = "--session") -> Iterator[None]:
    """This process's exclusive claim on a session file (the lock `.NAME.lock` beside it, removed when let go),
    after which the partial copies that killed writers left beside it are removed (as --out's staging is).
    Re-entrant within the process: a chat saving to its own --session holds it already."""
    key = str(Path(path).absolute())
    if key in _HELD:
        yield
        return

    def busy(who: str, lock: Path) -> tuple[str, str]:
        return (
            f"{option} {path} is in use by another deltaship chat ({who}, lock {lock})",
            f"close that chat, or use another {option}",
        )

    lock = OutputLock(Path(path), option, busy=busy)
    _HELD[key] = lock
    try:
        recover(Path(path))
        yield
    finally:
        del _HELD[key]
        lock.release()


def check_save_target(path: Path, session) -> None:
    """A chat saves only where a session of its bundle belongs: never inside a bundle (this one, or any directory
    above `path` holding a manifest.json), never over a file that is not a session of this bundle."""
    path = Path(path)
    fix = "save to a new file outside any bundle, or to a session file of this bundle"
    real = path.resolve()
    inside = [d for d in real.parents if (d / "manifest.json").is_file()]
    bundle = Path(session.bundle).resolve()
    if real == bundle or bundle in real.parents or inside:
        where = bundle if (real == bundle or bundle in real.parents) else inside[0]
        raise DeltashipError(f"{path}: inside the bundle {where}; a chat writes nothing into a bundle", fix)
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise DeltashipError(f"{path}: not a plain file; a chat saves only to a file of its own", fix)
    if path.exists() and not session_file_of(path, session):
        raise DeltashipError(f"{path}: exists and is not a saved chat session of this bundle; nothing was written", fix)


_REFUSE_FIX = "load a session saved by deltaship chat for this bundle"


def _refuse(path: Path, what: str, fix: str = _REFUSE_FIX) -> None:
    raise DeltashipError(f"{path}: {what}; nothing was loaded", fix)


# safetensors' dtype names, as numpy names them (the ones a session's states can have)
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64", "I32": "int32", "I16": "int16",
           "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool"}  # fmt: skip
MAX_HEADER_BYTES = 64 << 20  # the header holds the metadata: token ids and messages of at most a whole context


def read_header(path: Path) -> tuple[dict[str, Any], dict[str, tuple[str, list[int], int, int]], int]:
    """The checked metadata of a session file and its tensor table {name: (dtype, shape, start, end)} (offsets in
    the file), read from the safetensors header alone: every dtype known, every shape's bytes equal to its offsets,
    the tensors packed back to back exactly up to the file's end, the metadata's sha256, schema and version. No tensor
    byte is read. Returns (meta, table, file size)."""
    path = Path(path)
    if not path.is_file():
        _refuse(path, "no such session file", "pass a file written by chat.save / --session")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        _refuse(path, f"{size} bytes, more than a chat session may have here")
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or n > MAX_HEADER_BYTES or 8 + n > size:
                _refuse(path, "not a readable session file (truncated or not a safetensors file: bad header length)")
            raw = f.read(n)
    except OSError as e:
        _refuse(path, f"cannot be read ({e.strerror or e})", "check the file")
    try:
        header = parse_json(raw.decode("utf-8"), str(path), "session file's safetensors header", _REFUSE_FIX)
    except (UnicodeDecodeError, DeltashipError):
        _refuse(path, "not a readable session file (truncated or not a safetensors file: its header is not JSON)")
    if not isinstance(header, dict):
        _refuse(path, "not a readable session file (its safetensors header is not an object)")
    extra = header.pop("__metadata__", None) or {}
    table: dict[str, tuple[str, list[int], int, int]] = {}
    base, spans = 8 + n, []
    for name, entry in header.items():
        ok = isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and entry["dtype"] in _DTYPES
        ok = ok and isinstance(entry.get("shape"), list)
        shape, offs = (entry.get("shape"), entry.get("data_offsets")) if ok else (None, None)
        ok = ok and all(type(d) is int and 0 <= d < 1 << 40 for d in shape) and len(shape) <= 8
        ok = ok and isinstance(offs, list) and len(offs) == 2 and all(type(o) is int and o >= 0 for o in offs)
        if not ok:
            _refuse(path, f"not a readable session file (tensor {str(name)[:80]!r} has no valid dtype/shape/offsets)")
        count = int(np.prod(shape, dtype=object)) if shape else 1
        if offs[1] - offs[0] != count * np.dtype(_DTYPES[entry["dtype"]]).itemsize:
            _refuse(path, f"not a readable session file (tensor {name[:80]!r}: its offsets disagree with its shape)")
        table[name] = (_DTYPES[entry["dtype"]], list(shape), base + offs[0], base + offs[1])
        spans.append((offs[0], offs[1]))
    at = 0
    for lo, hi in sorted(spans):  # back to back from the header on, nothing between, nothing after
        if lo != at:
            _refuse(path, "not a readable session file (its tensors overlap or leave gaps)")
        at = hi
    if base + at != size:
        _refuse(path, f"not a readable session file (truncated: its header describes {base + at} bytes, it has {size})")
    if not isinstance(extra, dict):
        _refuse(path, "a safetensors file without deltaship chat metadata")
    text, sha = extra.get(META_KEY), extra.get(META_SHA_KEY)
    if not isinstance(text, str):
        _refuse(path, "a safetensors file without deltaship chat metadata")
    if hashlib.sha256(text.encode()).hexdigest() != sha:
        _refuse(path, "its metadata does not match its sha256 (the file was altered)")
    meta = parse_json(text, f"{path} (its deltaship metadata)", "session's metadata", _REFUSE_FIX)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        _refuse(path, f"not a {FORMAT} file")
    version = meta.get("version")
    if not isinstance(version, int) or version > VERSION:
        _refuse(
            path,
            f"format version {version!r}, newer than this deltaship reads ({VERSION})",
            "upgrade deltaship to load it",
        )
    import jsonschema  # lazy: jsonschema: the schema check only

    schema = json.loads(resources.files("deltaship.chat").joinpath("session.schema.json").read_text())
    try:
        jsonschema.validate(meta, schema)
    except jsonschema.ValidationError as e:
        where = "/".join(map(str, e.absolute_path)) or "(top)"
        _refuse(path, f"metadata invalid at {where}: {e.message}")
    if set(meta["tensors"]) != set(table):
        _refuse(path, f"tensors {sorted(set(meta['tensors']) ^ set(table))[:4]} do not match its metadata")
    for name, entry in meta["tensors"].items():
        if entry["dtype"] != table[name][0] or entry["shape"] != table[name][1]:
            _refuse(path, f"tensor {name} does not match its dtype or shape (the file was altered)")
    return meta, table, size


def expected_tensors(path: Path, meta: dict[str, Any], session) -> dict[str, tuple[str, list[int]]]:
    """{tensor: (dtype, shape)} a session file of `meta`'s position and checkpoints holds for this session's bundle:
    every state (a KV cache up to the position), and each checkpoint's DeltaNet states."""
    p = meta["position"]
    layout = session.state_layout()
    want: dict[str, tuple[str, list[int]]] = {}
    for name, (shape, dtype, axis) in layout.items():
        full = list(shape)
        if axis is not None:
            full[axis] = p
        want[f"state/{name}"] = (dtype, full)
    for i, c in enumerate(meta["checkpoints"]):
        if c["position"] > p:
            _refuse(path, f"checkpoint {i} is incomplete or out of range")
        for s in session.deltanet_states():
            shape, dtype, _ = layout[s["name"]]
            want[f"checkpoint/{i}/{s['name']}"] = (dtype, list(shape))
    return want


def read_session_file(path: Path, session=None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The metadata and tensors of a saved session, every check done (hashes, schema, version). The header is checked
    before any tensor is read; with `session`, also the bundle's identity, the position and that the file holds
    exactly the states of the session's bundle in their shapes, so no tensor is read that the bundle cannot use.
    Tensors are then read one at a time, each checked against its sha256, within the bytes the header allows."""
    path = Path(path)
    meta, table, size = read_header(path)
    if session is not None:
        check_identity(path, meta, session)
        p = meta["position"]
        if len(meta["ids"]) != p or p > session.max_context:
            _refuse(path, f"{len(meta['ids'])} token ids for position {p} (max context {session.max_context})")
        want = expected_tensors(path, meta, session)
        for name in sorted(set(want) | set(table)):
            if name not in want or name not in table or (table[name][0], table[name][1]) != want[name]:
                got = f"{table[name][0]} {table[name][1]}" if name in table else "missing"
                need = f"{want[name][0]} {want[name][1]}" if name in want else "not a state of this bundle"
                _refuse(path, f"tensor {name[:80]} is {got}; this bundle's is {need}")
    budget = size  # with a session: exactly the bytes of the bundle's states at that position (checked above)
    tensors: dict[str, np.ndarray] = {}
    try:
        with open(path, "rb") as f:
            for name, (dtype, shape, lo, hi) in sorted(table.items(), key=lambda kv: kv[1][2]):
                budget -= hi - lo
                if budget < 0:
                    _refuse(path, "its tensors are larger than the file")
                f.seek(lo)
                data = bytearray(hi - lo)  # writable, read in place: one copy of the tensor
                if f.readinto(data) != hi - lo:
                    _refuse(path, "not a readable session file (truncated while reading)")
                a = np.frombuffer(data, dtype=dtype).reshape(shape)
                if _sha(a) != meta["tensors"][name]["sha256"]:
                    _refuse(path, f"tensor {name} does not match its sha256, dtype or shape (the file was altered)")
                tensors[name] = a
    except OSError as e:
        _refuse(path, f"cannot be read ({e.strerror or e})", "check the file")
    return meta, tensors


def session_file_of(path: Path, session) -> bool:
    """Whether `path` is a readable session file saved with this session's bundle (its header alone is read)."""
    try:
        meta, _, _ = read_header(path)
        check_identity(path, meta, session)
    except DeltashipError:
        return False
    return True


def check_identity(path: Path, meta: dict[str, Any], session) -> None:
    """The file belongs to the session's bundle: its manifest's sha256 (a saved session), or its files' (a prompt
    cache shipped in the bundle)."""
    ident = meta["bundle"]
    key, have = (
        ("manifest_sha256", bundle_identity(session.bundle))
        if "manifest_sha256" in ident
        else ("files_sha256", files_identity(session.manifest))
    )
    if ident[key] != have:
        _refuse(
            path,
            f"saved with another bundle ({key.replace('_', ' ')} {ident[key][:12]}..., this one {have[:12]}...)",
            "load it with the bundle it was saved with",
        )


def checked_state(path: Path, meta: dict[str, Any], tensors: dict[str, np.ndarray], session):
    """The state and checkpoints of a read session file, checked against the session's bundle (identity, ids,
    every state's shape and dtype): ({state: array}, [(position, {state: array})])."""
    check_identity(path, meta, session)
    p, ids = meta["position"], meta["ids"]
    if len(ids) != p or p > session.max_context or any(i >= session.vocab_size for i in ids):
        _refuse(path, f"{len(ids)} token ids for position {p} (max context {session.max_context})")
    layout = session.state_layout()
    for name, (shape, dtype, axis) in layout.items():
        a = tensors.get(f"state/{name}")
        want = list(shape)
        if axis is not None:
            want[axis] = p
        if a is None or list(a.shape) != want or str(a.dtype) != dtype:
            _refuse(path, f"state {name} is missing or not {dtype} {want}")
    cps = []
    for i, c in enumerate(meta["checkpoints"]):
        states = {}
        for s in session.deltanet_states():
            a = tensors.get(f"checkpoint/{i}/{s['name']}")
            shape, dtype, _ = layout[s["name"]]
            if a is None or tuple(a.shape) != shape or str(a.dtype) != dtype or c["position"] > p:
                _refuse(path, f"checkpoint {i} is incomplete or out of range")
            states[s["name"]] = a
        cps.append((c["position"], states))
    last = meta["last_turn"]
    if last is not None:
        for key in ("before", "before_reply"):
            if last[key] is not None and last[key] >= len(cps):
                _refuse(path, f"last_turn.{key} names checkpoint {last[key]}, which it does not hold")
    return {n: tensors[f"state/{n}"] for n in layout}, cps


# ---- prompt caches shipped in bundles ------------------------------------------------------------------------


def prompt_cache_settings(path: Path) -> tuple[str, dict[str, Any]]:
    """`export --prompt-cache FILE`: a text file (the system message; its final newline left out), or a JSON object
    {"system": text, "template_kwargs": {...}}."""
    path = Path(path)
    if not path.is_file():
        raise DeltashipError(f"--prompt-cache {path}: no such file", "pass a text file holding the system message")
    if path.stat().st_size > 1 << 20:
        raise DeltashipError(f"--prompt-cache {path}: over 1 MiB", "a system message is a few KiB at most")
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".json":
        return text.removesuffix("\n"), {}  # the file's final newline is not part of the message
    obj = parse_json(text, f"--prompt-cache {path}", "prompt-cache settings file", 'write {"system": "..."}')
    if not isinstance(obj, dict) or not isinstance(obj.get("system"), str) or set(obj) - {"system", "template_kwargs"}:
        raise DeltashipError(
            f'--prompt-cache {path}: expected {{"system": text, "template_kwargs": {{...}}}}', "fix the file"
        )
    kwargs = obj.get("template_kwargs", {})
    if not isinstance(kwargs, dict):
        raise DeltashipError(f"--prompt-cache {path}: template_kwargs must be an object", "fix the file")
    return obj["system"], kwargs


def bundle_prompt_cache(session) -> dict[str, Any] | None:
    """The manifest's chat.prompt_cache record of the session's bundle, or None."""
    record = (session.manifest.get("chat") or {}).get("prompt_cache")
    return record if isinstance(record, dict) else None


def apply_prompt_cache(chat) -> bool:
    """Put the bundle's shipped prompt cache into the chat's (reset) session if it holds the chat's system message
    with the same template settings and its tokens are the chat's rendering of it; return whether it did."""
    record = bundle_prompt_cache(chat.session)
    if record is None or record.get("system") != chat.system or record.get("template_kwargs") != chat.template_kwargs:
        return False
    # listed and hashed in the manifest (open_bundle checked it); joined under the closed-world rule
    path = bundle_path(chat.session.bundle, chat.session.manifest, PROMPT_CACHE_FILE, "chat.prompt_cache.file")
    meta, tensors = read_session_file(path, chat.session)
    state, _ = checked_state(path, meta, tensors, chat.session)
    if meta["ids"] != chat.render_ids(chat.messages, add_generation_prompt=False):
        return False  # another template or tokenizer than the one it was built with: feed the system message
    chat.session.load_state_file_arrays(meta["position"], state)
    chat._ids = list(meta["ids"])
    return True
