"""The Hugging Face side of deltaship: a bundle as a transformers model (modeling.py), and `optimum-cli export
deltaship` (optimum/commands/register/deltaship.py at the repository root). Imports torch/transformers on use."""

from __future__ import annotations

from typing import Any

__all__ = ["DeltashipModelForCausalLM", "DeltashipConfig"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from deltaship.hf import modeling  # lazy: transformers

        return getattr(modeling, name)
    raise AttributeError(f"module 'deltaship.hf' has no attribute {name!r}")
