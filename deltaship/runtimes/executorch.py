"""ExecuTorch session (the C++ runtime through its pybindings): the program keeps every state in its own buffers."""

from __future__ import annotations

import functools
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from deltaship.bundle.paths import bundle_path
from deltaship.errors import DeltashipError
from deltaship.logs import native_stderr
from deltaship.runtimes.base import Session
from deltaship.runtimes.executorch_speculative import ExecuTorchSpeculation


def _installed_executorch() -> str:
    try:
        return metadata.version("executorch")
    except metadata.PackageNotFoundError:
        return "not installed"


# The kernel libraries the programs call into, by the module that would load them (the manifest's
# runtime_requirements.python), loaded directly: custom_ops.py also imports torch._inductor for the exporter's sake.
KERNEL_LIBRARIES = {
    "executorch.extension.llm.custom_ops.custom_ops": "extension/llm/custom_ops/libcustom_ops_aot_lib.*",  # llama::
    "executorch.kernels.quantized": "kernels/quantized/libquantized_ops_aot_lib.*",  # quantized_decomposed::
}


@functools.cache
def runtime() -> tuple[Any, Any]:
    """(torch, ExecuTorch's C++ pybindings) with the kernel libraries registered.

    Not through `executorch.runtime`: it imports `executorch.extension.pybindings.portable_lib`, which imports
    `executorch.exir` (the exporter: most of the import time) for a warning class only. torch itself cannot be
    avoided: the pybindings link libtorch, and a method takes and returns torch tensors."""
    import executorch  # lazy: executorch
    import torch

    roots = [Path(p) for p in executorch.__path__]  # a namespace package: every directory it spans
    for pattern in KERNEL_LIBRARIES.values():
        torch.ops.load_library(str(next(f for root in roots for f in root.glob(pattern))))
    from executorch.extension.pybindings import _C  # lazy: executorch

    return torch, _C


def load_program(path: Path) -> "Program":
    _, pybindings = runtime()
    return Program(
        pybindings._load_program(
            str(path),
            enable_etdump=False,
            debug_buffer_size=0,
            program_verification=pybindings.Verification.InternalConsistency,
        )
    )


class Program:
    """What deltaship uses of `executorch.runtime.Program` (load_method), over the pybindings' program."""

    def __init__(self, program: Any):
        self._program = program

    @property
    def method_names(self) -> set[str]:
        """The program's method names (as executorch.runtime.Program.method_names)."""
        return {self._program.get_method_name(i) for i in range(self._program.num_methods())}

    def load_method(self, name: str) -> "Method":
        return Method(self._program.load_method(name))


class Method:
    """`executorch.runtime.Method`'s execute(); `_method` is the pybindings' method (get_attribute for states)."""

    def __init__(self, method: Any):
        self._method = method

    def execute(self, inputs: list[Any]) -> list[Any]:
        return self._method(inputs)


class ExecuTorchSession(ExecuTorchSpeculation, Session):
    def __init__(
        self, bundle: Path, manifest: dict[str, Any], threads: int | None = None, prefill_chunk: int | None = None
    ):
        super().__init__(bundle, manifest, prefill_chunk)
        built = manifest.get("tools", {}).get("executorch", "?")
        have = _installed_executorch()
        try:
            with native_stderr():  # cpuinfo's probe of the CPU, on stderr at every start
                torch, pybindings = runtime()
        except (ImportError, OSError, StopIteration) as e:
            raise DeltashipError(
                f"this bundle needs the ExecuTorch runtime ({e!r})", f"pip install executorch=={built}"
            ) from None
        self._torch = torch
        if threads:
            pybindings._unsafe_reset_threadpool(int(threads))
        self.threads = threads
        path = bundle_path(self.bundle, manifest, manifest["entry"], "entry")
        try:
            with native_stderr():
                self.program = load_program(path)
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
