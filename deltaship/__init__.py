"""deltaship: compile Qwen3.5 hybrid (Gated DeltaNet + attention) models into on-device bundles.

    from deltaship import export, load
    export("qwen3.5-tiny", "tiny-onnx", target="onnx", precision="int4")   # or a checkpoint dir / "org/name"
    model = load("tiny-onnx")                 # a transformers-style causal LM over the bundle's runtime
    model.generate(**tokenizer("def f(", return_tensors="pt"), max_new_tokens=16)

This module stays thin: nothing (torch included) is imported until a name is used.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    __version__ = metadata.version("deltaship")
except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
    __version__ = "0+unknown"

if TYPE_CHECKING:
    from deltaship.export import export
    from deltaship.hf.modeling import DeltashipModelForCausalLM

__all__ = ["export", "load", "__version__"]


def load(
    bundle: str | Path, *, threads: int | None = None, provider: str = "cpu", **session_options: Any
) -> "DeltashipModelForCausalLM":
    """Open an exported bundle as a transformers causal LM (`generate()`, `pipeline("text-generation")`).

    Same as `deltaship.hf.DeltashipModelForCausalLM.from_pretrained(bundle)`; the tokenizer is
    `transformers.AutoTokenizer.from_pretrained(bundle)`."""
    from deltaship.hf.modeling import DeltashipModelForCausalLM

    return DeltashipModelForCausalLM.from_pretrained(bundle, threads=threads, provider=provider, **session_options)


def __getattr__(name: str) -> Any:
    # `deltaship.export` is both the package and its export() function: the package module is callable
    # (deltaship/export/__init__.py), so `from deltaship import export; export(...)` works either way.
    if name == "export":
        import deltaship.export as module

        return module
    raise AttributeError(f"module 'deltaship' has no attribute {name!r}")
