"""The runtimes: one `Session` per target (prefill / decode / generate on the bundle's artifact).

Open a bundle with `deltaship.targets.open_bundle(path)`, which checks it and picks the target's session. Each
session imports only its own runtime (onnxruntime for ONNX bundles: no torch).
"""

from __future__ import annotations

from deltaship.runtimes.base import Generation, Session

PROVIDERS = ("cpu", "cuda")

__all__ = ["Session", "Generation", "PROVIDERS"]
