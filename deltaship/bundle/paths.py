"""A bundle is a closed world: every path its manifest names stays inside its directory and is hashed.

Every reader joins a manifest value to the bundle directory through `bundle_path`, never `bundle / name`:
a name is relative, normalized (no `.`, `..` or empty component, no backslash), resolves (symlinks
followed) inside the bundle, and is listed in `files` with its sha256 (a directory such as
`model.mlpackage` by the files under it). `check_paths` applies the rule to every path field of a
manifest before any file of the bundle is opened.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

from deltaship.errors import DeltashipError

FIX = (
    "export the bundle again (or restore it from where it was shipped); a bundle names only files inside its own "
    "directory, each listed in `files` with its sha256"
)
# the characters of every name deltaship writes: a name also lands in shell lines and in the kits' Kotlin and
# Swift string literals, where a quote or a `$` would be syntax
MAX_NAME = 200  # schema.json's $defs/file and $defs/name
NAME = re.compile(r"[A-Za-z0-9._+@=-]+(/[A-Za-z0-9._+@=-]+)*")
# vision.graphs values that name files: a program or package holding the parts as methods or functions (ExecuTorch,
# Core ML), or, in a block that names none, the parts themselves (one graph file each: ONNX)
_GRAPH_FILES = {"program", "decoder_program", "package"}
_GRAPH_PARTS = {"vision", "embedding", "decoder"}


def name_problem(name: Any) -> str | None:
    """Why `name` is not a plain relative path inside a directory (None when it is one)."""
    if not isinstance(name, str) or not name:
        return f"is {type(name).__name__ if not isinstance(name, str) else 'empty'}, not a file name"
    if len(name) > MAX_NAME:
        return f"is {len(name)} characters long, more than a name in a bundle may be ({MAX_NAME})"
    if "\x00" in name or "\\" in name:
        return "holds a NUL or backslash"
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return "is an absolute path"
    parts = name.split("/")
    if ".." in parts:
        return "has a `..` component (it would leave the bundle)"
    if any(p in ("", ".") for p in parts) or PurePosixPath(name).as_posix() != name:
        return "is not a normalized relative path"
    if not NAME.fullmatch(name):
        return "holds characters outside A-Z a-z 0-9 . _ + @ = - and /"
    return None


def _listed(name: str, files: dict) -> bool:
    return name in files or any(isinstance(k, str) and k.startswith(name + "/") for k in files)


def _at(manifest: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(manifest, dict):
            return None
        manifest = manifest.get(k)
    return manifest


def _list(x: Any) -> list:
    return x if isinstance(x, list) else []


def _dict(x: Any) -> dict:
    return x if isinstance(x, dict) else {}


def named_paths(manifest: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(field, name) for every file the manifest names apart from `files` itself."""
    yield "entry", manifest.get("entry")
    for i, f in enumerate(_list(_at(manifest, "tokenizer", "files"))):
        yield f"tokenizer.files[{i}]", f
    g = _at(manifest, "lowering", "genai", "config")
    if g is not None:
        yield "lowering.genai.config", g
    for key, graph in _dict(_at(manifest, "lowering", "graphs")).items():  # qnn: decode.onnx, prefill.onnx
        if isinstance(graph, dict) and "file" in graph:
            yield f"lowering.graphs.{key}.file", graph["file"]
    for key, made in _dict(_at(manifest, "lowering", "context")).items():  # qnn --qnn-context: EPContext models
        if isinstance(made, dict):
            if "model" in made:
                yield f"lowering.context.{key}.model", made["model"]
            for i, f in enumerate(_list(made.get("files"))):
                if isinstance(f, dict) and "path" in f:
                    yield f"lowering.context.{key}.files[{i}].path", f["path"]
    for i, part in enumerate(_list(_at(manifest, "lowering", "parts"))):
        if isinstance(part, dict) and "package" in part:
            yield f"lowering.parts[{i}].package", part["package"]
    sp = manifest.get("speculative")
    if isinstance(sp, dict):
        for key in ("draft", "verify"):
            if _at(sp, key, "file") is not None:
                yield f"speculative.{key}.file", _at(sp, key, "file")
        if _at(sp, "draft", "vocab", "file") is not None:
            yield "speculative.draft.vocab.file", _at(sp, "draft", "vocab", "file")
        for i, f in enumerate(_list(sp.get("files"))):
            yield f"speculative.files[{i}]", f
    v = manifest.get("vision")
    if isinstance(v, dict):
        graphs = _dict(v.get("graphs"))
        parts_are_files = not _GRAPH_FILES & graphs.keys()
        for key, f in graphs.items():
            if key in _GRAPH_FILES or (parts_are_files and key in _GRAPH_PARTS):
                yield f"vision.graphs.{key}", f
        for key in ("preprocessor", "video_preprocessor"):
            if v.get(key) is not None:
                yield f"vision.{key}", v[key]
        for key in ("config", "processor"):
            if _at(v, "genai", key) is not None:
                yield f"vision.genai.{key}", _at(v, "genai", key)
    if _at(manifest, "chat", "prompt_cache", "file") is not None:
        yield "chat.prompt_cache.file", _at(manifest, "chat", "prompt_cache", "file")


def _refuse(bundle: Path, field: str, name: Any, why: str) -> DeltashipError:
    shown = repr(name) if len(repr(name)) <= 120 else repr(name)[:100] + "..."  # one line, even for a 10 KB name
    return DeltashipError(f"{bundle}: manifest field {field} = {shown} {why}; refused before opening any file", FIX)


def _inside(bundle: Path, root: Path, field: str, name: str) -> Path:
    p = bundle / name
    resolved = p.resolve()
    if resolved != root and root not in resolved.parents:
        raise _refuse(bundle, field, name, f"resolves to {resolved}, outside the bundle (a symlink?)")
    return p


def check_paths(bundle: str | Path, manifest: dict[str, Any]) -> None:
    """Refuse (one DeltashipError naming the field and the path) a manifest that names a file outside the
    bundle, or a file it does not list in `files`. Opens nothing."""
    bundle = Path(bundle)
    root = bundle.resolve()
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise _refuse(bundle, "files", files, "is not an object listing the bundle's files")
    for name in files:
        why = name_problem(name)
        if why:
            raise _refuse(bundle, "files", name, why)
        _inside(bundle, root, "files", name)
    for field, name in named_paths(manifest):
        why = name_problem(name)
        if why:
            raise _refuse(bundle, field, name, why)
        if not _listed(name, files):
            raise _refuse(bundle, field, name, "is not listed in `files`, so its integrity cannot be checked")
        _inside(bundle, root, field, name)


def bundle_path(bundle: str | Path, manifest: dict[str, Any], name: Any, field: str) -> Path:
    """The path of the file `name` (from manifest field `field`) in the bundle, after the closed-world rule:
    relative, normalized, inside the bundle with symlinks resolved, and listed in `files`."""
    bundle = Path(bundle)
    why = name_problem(name)
    if why:
        raise _refuse(bundle, field, name, why)
    files = manifest.get("files")
    if not isinstance(files, dict) or not _listed(name, files):
        raise _refuse(bundle, field, name, "is not listed in `files`, so its integrity cannot be checked")
    return _inside(bundle, bundle.resolve(), field, name)


def beside(bundle: str | Path, manifest: dict[str, Any], owner: str, name: Any, field: str) -> Path:
    """The file `name` that the bundle file `owner` names, resolved as its runtime resolves it: relative to
    owner's directory (ONNX Runtime's external-data locations, onnxruntime-genai's model filenames, a QNN
    EPContext model's context binary), and then under the closed-world rule of `bundle_path`. `name` itself is
    a plain relative path (no `..`), so what deltaship checks is the file the runtime opens."""
    why = name_problem(name)
    if why:
        raise _refuse(Path(bundle), field, name, why)
    return bundle_path(bundle, manifest, posixpath.join(posixpath.dirname(owner), name), field)


def require_entry(
    bundle: str | Path, manifest: dict[str, Any], suffix: str, kind: str, directory: bool = False
) -> Path:
    """The entry's path, refused unless it names what the target's runtime opens: a file (a directory for a
    Core ML package) named *`suffix`*, `kind` in the refusal. A renamed entry (model.bin) is refused here, so
    every check that selects graph files by name sees the file the runtime runs."""
    bundle = Path(bundle)
    entry = manifest.get("entry")
    path = bundle_path(bundle, manifest, entry, "entry")
    if not entry.endswith(suffix) or not (path.is_dir() if directory else path.is_file()):
        what = "directory" if directory else "file"
        raise _refuse(bundle, "entry", entry, f"is not {kind} (a {what} named *{suffix})")
    return path
