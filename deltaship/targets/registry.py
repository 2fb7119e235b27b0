"""The registry of targets: `register`, `get_target`, `target_names`, `all_targets`, and what is asked of all of
them at once (`a_bundle`, `on_platform`, the tolerance `table`)."""

from __future__ import annotations

from deltaship.errors import DeltashipError
from deltaship.targets.base import Target
from deltaship.targets.tolerances import Tolerance

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


def a_bundle(name: object) -> str:
    """'an ONNX bundle', 'a Core ML bundle' (the target's title); an unknown target is quoted: "a 'tflite' bundle"."""
    target = _REGISTRY.get(str(name))
    if target is None:
        return f"a {name!r} bundle"
    title = target.title or target.name
    return f"{'an' if title[0] in 'AEIOU' else 'a'} {title} bundle"


def on_platform(platform: str) -> tuple[Target, ...]:
    """The targets whose bundles the `platform` app kit runs (Target.app_platforms), in registry order."""
    return tuple(t for t in _REGISTRY.values() if platform in t.app_platforms)


def table() -> dict[tuple[str, str], Tolerance]:
    """The one table, (target, precision) -> Tolerance, assembled from each target's rows
    (deltaship/targets/<target>.py `tolerances`, where the reasons for each row are written)."""
    return {(t.name, precision): tol for t in all_targets() for precision, tol in t.tolerances.items()}


def tolerance(target: str, precision: str, kv_dtype: str | None = None) -> Tolerance:
    """The row for (target, precision); a bundle whose KV cache is narrower than its fp32 activations has its own
    row where the target states one, "fp32+kv-int8" (at lower precisions the weights' row, already looser,
    applies)."""
    rows = get_target(target).tolerances
    return rows.get(f"{precision}+kv-{kv_dtype}", rows[precision]) if kv_dtype else rows[precision]
