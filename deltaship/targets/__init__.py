"""The target registry: `get_target("onnx")`, `target_names()`, `register(MyTarget)`.

Built-in targets register themselves when this package is imported; a new target is one package
(its lowering under deltaship/lowering/, its session under deltaship/runtimes/) plus one `Target`
subclass registered here. See docs/architecture.md.
"""

from __future__ import annotations

# The built-in targets register themselves, in this order (the order of --help and of `plan`).
from deltaship.targets import (
    coreml,  # noqa: E402,F401
    executorch,  # noqa: E402,F401
    onnx,  # noqa: E402,F401,I001
    qnn,  # noqa: E402,F401
)
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
from deltaship.targets.open import (  # noqa: E402
    check_prepack_cache,
    open_bundle,
    open_multimodal,
    require_artifact,
    runtime_names,
    text_runtime,
)
from deltaship.targets.registry import (
    a_bundle,
    all_targets,
    get_target,
    on_platform,
    register,
    table,
    target_names,
    tolerance,
    unregister,
)

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
    "a_bundle",
    "on_platform",
    "table",
    "tolerance",
    "PRECISIONS",
    "DEFAULT_PREFILL_CHUNK",
    "check_prepack_cache",
    "open_bundle",
    "open_multimodal",
    "require_artifact",
    "runtime_names",
    "text_runtime",
]
