"""Core ML sessions: MLModel + MLState on macOS; on Linux, the saved program evaluated op by op.

Both run `prefill` for full chunks of prefill_chunk tokens and `decode` for the rest of a prompt
and for generation, and pass the same state to both functions.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import numpy as np

from deltaship.errors import DeltashipError
from deltaship.runtimes.base import Session

_NP = {"float32": np.float32, "float16": np.float16}


class _CoreMLBase(Session):
    fixed_shapes = True

    def __init__(self, bundle: Path, manifest: dict[str, Any], prefill_chunk: int | None = None):
        super().__init__(bundle, manifest, None)
        if prefill_chunk not in (None, manifest["prefill_chunk"]):
            raise DeltashipError("a Core ML bundle has a fixed prefill chunk of "
                                 f"{manifest['prefill_chunk']} tokens", "do not override prefill_chunk")
        self.io_states = [s for s in manifest["states"] if s["mode"] == "io"]
        self.ml_states = [s for s in manifest["states"] if s["mode"] == "state"]

    def _chunks(self, n: int) -> list[int]:
        """Full prefill chunks, then single tokens (every function has a fixed shape)."""
        full = n // self.prefill_chunk
        return [self.prefill_chunk] * full + [1] * (n - full * self.prefill_chunk)

    def _feeds(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        feeds = {"input_ids": ids.reshape(1, -1).astype(np.int32), "position": np.array([self.position], np.int32)}
        for s in self.io_states:
            feeds[s["coreml_input"]] = self._io[s["name"]]
        return feeds

    def _take_outputs(self, out: dict[str, np.ndarray]) -> np.ndarray:
        for s in self.io_states:
            self._io[s["name"]] = np.asarray(out[s["coreml_output"]], dtype=np.float32)
        return np.asarray(out["logits"], dtype=np.float32).reshape(-1)

    def _reset_io(self) -> None:
        self._io = {s["name"]: np.zeros(s["shape"], np.float32) for s in self.io_states}


class CoreMLEvalSession(_CoreMLBase):
    """Linux: the converted program, evaluated op by op (deltaship.runtimes.mil_eval)."""

    def __init__(self, bundle: Path, manifest: dict[str, Any], threads: int | None = None,
                 prefill_chunk: int | None = None):
        super().__init__(bundle, manifest, prefill_chunk)
        from deltaship.runtimes.mil_eval import Interpreter, load_program
        self.interp = Interpreter(load_program(self.bundle / manifest["entry"]))
        self._states = {s["coreml_input"]: np.zeros(s["shape"], np.float16) for s in self.ml_states}
        self._reset_io()

    def runtime_name(self) -> str:
        import coremltools as ct
        return f"coremltools {ct.__version__} MIL program evaluated with numpy on Linux (not Core ML)"

    def _forward(self, ids: np.ndarray) -> np.ndarray:
        fname = "decode" if ids.size == 1 else "prefill"
        return self._take_outputs(self.interp.run(fname, self._feeds(ids), self._states))

    def _reset_states(self) -> None:
        for a in self._states.values():
            a[...] = 0
        self._reset_io()

    def state_arrays(self) -> dict[str, np.ndarray]:
        out = {s["name"]: self._io[s["name"]].copy() for s in self.io_states}
        out.update({s["name"]: self._states[s["coreml_input"]].astype(np.float32) for s in self.ml_states})
        return out


class CoreMLDeviceSession(_CoreMLBase):
    """macOS 15+: Core ML itself (MLModel per function, one MLState shared by both).
    Not run in this project's CI (Linux); written against coremltools 9's documented API."""

    def __init__(self, bundle: Path, manifest: dict[str, Any], threads: int | None = None,
                 prefill_chunk: int | None = None, compute_units: str = "ALL"):
        super().__init__(bundle, manifest, prefill_chunk)
        import coremltools as ct
        path = str(self.bundle / manifest["entry"])
        cu = getattr(ct.ComputeUnit, compute_units)
        self.models = {f: ct.models.MLModel(path, function_name=f, compute_units=cu) for f in ("prefill", "decode")}
        self._reset_states()

    def runtime_name(self) -> str:
        import coremltools as ct
        return f"Core ML via coremltools {ct.__version__} on macOS {platform.mac_ver()[0]}"

    def _forward(self, ids: np.ndarray) -> np.ndarray:
        fname = "decode" if ids.size == 1 else "prefill"
        return self._take_outputs(self.models[fname].predict(self._feeds(ids), state=self.state))

    def _reset_states(self) -> None:
        self.state = self.models["decode"].make_state()  # a new state is a reset
        self._reset_io()


def open_coreml_session(bundle: Path, manifest: dict[str, Any], threads: int | None = None,
                        prefill_chunk: int | None = None, **options: Any) -> Session:
    if platform.system() == "Darwin" and not options.get("evaluate"):
        return CoreMLDeviceSession(bundle, manifest, threads, prefill_chunk)
    return CoreMLEvalSession(bundle, manifest, threads, prefill_chunk)
