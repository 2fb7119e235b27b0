"""The target registry: `get_target("onnx")`, `target_names()`, `register(MyTarget)`.

Built-in targets register themselves when this package is imported; a new target is one package
(its lowering under deltaship/export/, its session under deltaship/runtimes/) plus one `Target`
subclass registered here. See docs/architecture.md.
"""

from __future__ import annotations

from deltaship.errors import DeltashipError
from deltaship.targets.base import (
    DEFAULT_PREFILL_CHUNK,
    PRECISIONS,
    Lowered,
    StorageFormat,
    Target,
    TargetOptions,
    TextRuntime,
    flag,
    option,
)

_REGISTRY: dict[str, Target] = {}


def register(cls: type[Target]) -> type[Target]:
    """Class decorator: make `cls` a target (one instance, keyed by its name)."""
    _REGISTRY[cls.name] = cls()
    return cls


def unregister(name: str) -> None:
    """Remove a target (tests that register a toy target clean up with this)."""
    _REGISTRY.pop(name, None)


def target_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def all_targets() -> tuple[Target, ...]:
    return tuple(_REGISTRY.values())


def get_target(name: str) -> Target:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise DeltashipError(
            f"unknown --target {name!r}; targets: {', '.join(_REGISTRY)}", "pick one of the targets"
        ) from None


# The built-in targets register themselves, in this order (the order of --help and of `plan`).
from deltaship.targets import onnx  # noqa: E402,F401,I001
from deltaship.targets import executorch  # noqa: E402,F401
from deltaship.targets import coreml  # noqa: E402,F401

__all__ = [
    "Target",
    "TargetOptions",
    "TextRuntime",
    "Lowered",
    "StorageFormat",
    "option",
    "flag",
    "register",
    "unregister",
    "get_target",
    "target_names",
    "all_targets",
    "PRECISIONS",
    "DEFAULT_PREFILL_CHUNK",
]
