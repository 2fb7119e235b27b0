"""deltaship: compile Qwen3.5 hybrid (Gated DeltaNet + attention) models into on-device bundles.

    from deltaship import export, load
    export("qwen3.5-tiny", "tiny-onnx", target="onnx", precision="int4")   # or a checkpoint dir / "org/name"
    model = load("tiny-onnx")                 # the bundle in its runtime (no torch for ONNX)
    model.generate("def f(", max_new_tokens=16)                             # -> the new text
    model.generate(**tokenizer("def f(", return_tensors="pt"), max_new_tokens=16)  # transformers' generate()

This module stays thin: nothing (torch included) is imported until a name is used.
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    __version__ = metadata.version("deltaship")
except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
    __version__ = "0+unknown"

from deltaship.logs import quiet_import_notices

quiet_import_notices()  # torchao's and torch's import-time notices, whoever imports them first

if TYPE_CHECKING:
    from deltaship.compile import export
    from deltaship.hf.bundle_model import BundleModel

__all__ = ["export", "load", "Chat", "__version__"]


def load(
    bundle: str | Path, *, threads: int | None = None, provider: str = "cpu", **session_options: Any
) -> "BundleModel":
    """Open an exported bundle for generation: `generate("text")` on its runtime (no torch for an ONNX bundle),
    and a transformers causal LM (`generate(**tokenizer(...))`, `pipeline("text-generation")`) on first such use.

    The transformers side is `deltaship.hf.DeltashipModelForCausalLM` over the same session; the tokenizer is
    `transformers.AutoTokenizer.from_pretrained(bundle)`. The bundle's files are checked first."""
    # lazy: `import deltaship` (run by every `import deltaship.<module>`) stays thin
    from deltaship.errors import DeltashipError  # lazy: the package's face
    from deltaship.hf.bundle_model import BundleModel  # lazy: the package's face
    from deltaship.targets import open_bundle  # lazy: the package's face

    if not isinstance(bundle, (str, os.PathLike)) or not isinstance(os.fspath(bundle), str):
        raise DeltashipError(
            f"load(bundle): bundle must be a path (str or pathlib.Path), got {type(bundle).__name__}",
            "pass the directory written by `deltaship export`, e.g. load('tiny-onnx')",
        )
    path = Path(bundle)
    if not (path / "manifest.json").is_file():
        raise DeltashipError(
            f"{path}: no manifest.json, so this is not a deltaship bundle",
            "pass a directory written by `deltaship export` (or deltaship.export())",
        )
    return BundleModel(open_bundle(path, threads=threads, provider=provider, **session_options), path)


def __getattr__(name: str) -> Any:
    if name == "export":  # deltaship.compile.export (the lowering package is deltaship.lowering: no name clash)
        from deltaship.compile import export  # lazy: `import deltaship` stays thin (PEP 562)

        return export
    if name == "Chat":  # deltaship.Chat.load(path, session): a saved conversation
        from deltaship.chat import Chat  # lazy: `import deltaship` stays thin (PEP 562)

        return Chat
    raise AttributeError(f"module 'deltaship' has no attribute {name!r}")
