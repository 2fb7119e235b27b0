"""ExecuTorch session (executorch.runtime): the program keeps every state in its own buffers."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from deltaship.errors import DeltashipError
from deltaship.runtimes.base import Session
from deltaship.runtimes.executorch_speculative import ExecuTorchSpeculation


def _installed_executorch() -> str:
    try:
        return metadata.version("executorch")
    except metadata.PackageNotFoundError:
        return "not installed"


class ExecuTorchSession(ExecuTorchSpeculation, Session):
    def __init__(
        self, bundle: Path, manifest: dict[str, Any], threads: int | None = None, prefill_chunk: int | None = None
    ):
        super().__init__(bundle, manifest, prefill_chunk)
        built = manifest.get("tools", {}).get("executorch", "?")
        have = _installed_executorch()
        try:
            import executorch.kernels.quantized  # noqa: F401  (quantized_decomposed:: kernels)
            import torch
            from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401  (llama:: kernels)
            from executorch.extension.pybindings import portable_lib
            from executorch.runtime import Runtime
        except ImportError as e:
            raise DeltashipError(
                f"this bundle needs the ExecuTorch runtime ({e})", f"pip install executorch=={built}"
            ) from None
        self._torch = torch
        if threads:
            portable_lib._unsafe_reset_threadpool(int(threads))
        self.threads = threads
        path = self.bundle / manifest["entry"]
        try:
            self.program = Runtime.get().load_program(str(path))
            self.method = self.program.load_method("forward")
        except RuntimeError as e:
            hint = (
                (
                    f"the bundle was built with executorch {built} but this runtime is {have}: export it again "
                    f"with executorch {have}, or install executorch=={built}"
                )
                if built != have
                else "export the bundle again"
            )
            raise DeltashipError(f"{path}: ExecuTorch {have} could not load this program ({e})", hint) from None
        self._buffers = [s["buffer"] for s in manifest["states"]]

    def runtime_name(self) -> str:
        return f"executorch {_installed_executorch()} (XNNPACK)"

    def _forward(self, ids: np.ndarray) -> np.ndarray:
        t = self._torch
        out = self.method.execute(
            [t.from_numpy(np.ascontiguousarray(ids).reshape(1, -1)), t.tensor([self.position], dtype=t.long)]
        )
        return out[0].reshape(-1).float().numpy().copy()

    def _state(self, name: str):
        return self.method._method.get_attribute(name)

    def _reset_states(self) -> None:
        # Position 0 already discards the DeltaNet state in the graph; zero everything anyway.
        for name in self._buffers:
            self._state(name).zero_()

    def _read_states(self, names) -> dict[str, np.ndarray]:
        # the program's own buffers (method attributes), in its layout (KV caches [1, S, Hkv, D])
        buffers = {s["name"]: s["buffer"] for s in self.manifest["states"]}
        return {n: self._state(buffers[n]).detach().numpy().copy() for n in names}

    def _write_states(self, arrays: dict[str, np.ndarray]) -> None:
        buffers = {s["name"]: s["buffer"] for s in self.manifest["states"]}
        for name, value in arrays.items():
            self._state(buffers[name]).copy_(self._torch.from_numpy(np.ascontiguousarray(value)))

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Current value of every state, by the manifest's state name (KV cache in ExecuTorch's
        [1, S, Hkv, D] layout, transposed back to the canonical [1, Hkv, S, D])."""
        out = {}
        for s in self.manifest["states"]:
            a = self._state(s["buffer"]).float().numpy().copy()
            out[s["name"]] = a.transpose(0, 2, 1, 3) if s["kind"].startswith("kv_cache") else a
        return out
