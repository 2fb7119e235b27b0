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
import os
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from deltaship.errors import DeltashipEnvironmentError, DeltashipError

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


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def save_chat(chat, path: Path) -> Path:
    from safetensors.numpy import save

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
        "bundle": {"manifest_sha256": bundle_identity(s.bundle), "target": s.manifest["target"]},
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
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise DeltashipEnvironmentError(f"{path}: could not save the chat session: {e}", "check the disk") from None
    return path


def _refuse(path: Path, what: str, fix: str = "load a session saved by deltaship chat for this bundle") -> None:
    raise DeltashipError(f"{path}: {what}; nothing was loaded", fix)


def read_session_file(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The metadata and tensors of a saved session, every check done (hashes, schema, version)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        _refuse(path, "no such session file", "pass a file written by chat.save / --session")
    if path.stat().st_size > MAX_FILE_BYTES:
        _refuse(path, f"{path.stat().st_size} bytes, more than a chat session may have here")
    try:
        with safe_open(str(path), framework="np") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own errors for a truncated or foreign file
        _refuse(path, f"not a readable session file (truncated or not a safetensors file: {e})")
    text, sha = header.get(META_KEY), header.get(META_SHA_KEY)
    if not isinstance(text, str):
        _refuse(path, "a safetensors file without deltaship chat metadata")
    if hashlib.sha256(text.encode()).hexdigest() != sha:
        _refuse(path, "its metadata does not match its sha256 (the file was altered)")
    try:
        meta = json.loads(text)
    except json.JSONDecodeError:
        _refuse(path, "its metadata is not JSON")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        _refuse(path, f"not a {FORMAT} file")
    version = meta.get("version")
    if not isinstance(version, int) or version > VERSION:
        _refuse(
            path,
            f"format version {version!r}, newer than this deltaship reads ({VERSION})",
            "upgrade deltaship to load it",
        )
    import jsonschema

    schema = json.loads(resources.files("deltaship.chat").joinpath("session.schema.json").read_text())
    try:
        jsonschema.validate(meta, schema)
    except jsonschema.ValidationError as e:
        where = "/".join(map(str, e.absolute_path)) or "(top)"
        _refuse(path, f"metadata invalid at {where}: {e.message}")
    if set(meta["tensors"]) != set(tensors):
        _refuse(path, f"tensors {sorted(set(meta['tensors']) ^ set(tensors))[:4]} do not match its metadata")
    for name, entry in meta["tensors"].items():
        a = tensors[name]
        if str(a.dtype) != entry["dtype"] or list(a.shape) != entry["shape"] or _sha(a) != entry["sha256"]:
            _refuse(path, f"tensor {name} does not match its sha256, dtype or shape (the file was altered)")
    return meta, tensors


def load_chat(path: Path, session_or_bundle, **kwargs: Any):
    from deltaship.chat.conversation import Chat, Turn
    from deltaship.runtimes.base import Checkpoint, Session

    meta, tensors = read_session_file(path)
    if isinstance(session_or_bundle, Session):
        session = session_or_bundle
    else:
        from deltaship.runtimes import open_bundle

        session = open_bundle(session_or_bundle, threads=kwargs.pop("threads", None))
    if meta["bundle"]["manifest_sha256"] != bundle_identity(session.bundle):
        _refuse(
            path,
            f"saved with another bundle (manifest sha256 {meta['bundle']['manifest_sha256'][:12]}..., this one "
            f"{bundle_identity(session.bundle)[:12]}...)",
            "load it with the bundle it was saved with",
        )
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
    chat = Chat(session, system=meta["system"], template_kwargs=meta["template_kwargs"], **kwargs)
    session.load_state_file_arrays(p, {n: tensors[f"state/{n}"] for n in layout})
    chat.messages = [dict(m) for m in meta["messages"]]
    chat._ids = list(ids)
    if last is not None:
        made = [Checkpoint(pos, st, session._owner, len(session._rewinds)) for pos, st in cps]
        chat.turns = [
            Turn(
                messages_before=last["messages_before"],
                before=made[last["before"]] if last["before"] is not None else None,
                before_reply=made[last["before_reply"]] if last["before_reply"] is not None else None,
                ids_before_reply=last["ids_before_reply"],
            )
        ]
    return chat
