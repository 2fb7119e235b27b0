"""Open a bundle as a session: `open_bundle(path).generate(ids, 32)`.

Each target's session imports only its own runtime (onnxruntime for ONNX bundles: no torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deltaship.errors import DeltashipError
from deltaship.runtimes.base import Generation, Session
from deltaship.bundle.reader import read_manifest, require_intact

PROVIDERS = ("cpu", "cuda")


def open_bundle(bundle: str | Path, *, threads: int | None = None, check_hashes: bool = True,
                prefill_chunk: int | None = None, provider: str = "cpu", **options: Any) -> Session:
    """Open a bundle for generation. Files are checked against the manifest's sizes (and sha256).

    provider: "cpu", or "cuda" (ONNX bundles on ONNX Runtime's CUDA execution provider)."""
    from deltaship.targets import get_target, target_names
    if provider not in PROVIDERS:
        raise DeltashipError(f"unknown provider {provider!r}; providers: {', '.join(PROVIDERS)}", "use cpu or cuda")
    manifest = read_manifest(bundle)
    require_intact(bundle, manifest, hashes=check_hashes)
    name = manifest["target"]
    if name not in target_names():
        raise DeltashipError(f"{bundle}: unknown target {name!r} in the manifest; known: {', '.join(target_names())}",
                             "export the bundle again with this version of deltaship")
    target = get_target(name)
    if provider not in target.providers:
        raise DeltashipError(f"--provider {provider} runs ONNX bundles only; this is a {name} bundle",
                             "export the model with --target onnx for the GPU tier, or drop --provider")
    return target.open_session(Path(bundle), manifest, threads=threads, prefill_chunk=prefill_chunk,
                               provider=provider, **options)


__all__ = ["open_bundle", "Session", "Generation", "read_manifest", "PROVIDERS"]
