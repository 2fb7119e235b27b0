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
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from deltaship.bundle.destination import replace_file
from deltaship.bundle.paths import bundle_path
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


def _refuse(path: Path, what: str, fix: str = "load a session saved by deltaship chat for this bundle") -> None:
    raise DeltashipError(f"{path}: {what}; nothing was loaded", fix)


def read_session_file(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The metadata and tensors of a saved session, every check done (hashes, schema, version)."""
    from safetensors import safe_open  # lazy: safetensors: session files only

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
    import jsonschema  # lazy: jsonschema: the schema check only

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
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise DeltashipError(f"--prompt-cache {path}: not JSON ({e})", 'write {"system": "..."}') from None
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
    meta, tensors = read_session_file(path)
    state, _ = checked_state(path, meta, tensors, chat.session)
    if meta["ids"] != chat.render_ids(chat.messages, add_generation_prompt=False):
        return False  # another template or tokenizer than the one it was built with: feed the system message
    chat.session.load_state_file_arrays(meta["position"], state)
    chat._ids = list(meta["ids"])
    return True
