"""Core ML sessions: MLModel + MLState on macOS; on Linux, the saved program evaluated op by op.

Both run `prefill` for full chunks of prefill_chunk tokens and `decode` for the rest of a prompt
and for generation, and pass the same state to both functions.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import numpy as np

from deltaship.bundle.paths import bundle_path
from deltaship.errors import DeltashipError
from deltaship.runtimes.base import Session
from deltaship.runtimes.coreml_speculative import CoreMLSpeculation
from deltaship.runtimes.mil_eval import Interpreter, load_program

_NP = {"float32": np.float32, "float16": np.float16}


class _CoreMLBase(CoreMLSpeculation, Session):
    fixed_shapes = True

    def __init__(self, bundle: Path, manifest: dict[str, Any], prefill_chunk: int | None = None):
        super().__init__(bundle, manifest, None)
        if prefill_chunk not in (None, manifest["prefill_chunk"]):
            raise DeltashipError(
                f"a Core ML bundle has a fixed prefill chunk of {manifest['prefill_chunk']} tokens",
                "do not override prefill_chunk",
            )
        self.io_states = [s for s in manifest["states"] if s["mode"] == "io"]
        self.ml_states = [s for s in manifest["states"] if s["mode"] == "state"]
        by_name = {s["name"]: s for s in manifest["states"]}
        # packages run in order; each takes token ids or the previous part's hidden states
        self.parts = [dict(p, state_specs=[by_name[n] for n in p["states"]]) for p in manifest["lowering"]["parts"]]

    def _chunks(self, n: int) -> list[int]:
        """Full prefill chunks, then single tokens (every function has a fixed shape)."""
        full = n // self.prefill_chunk
        return [self.prefill_chunk] * full + [1] * (n - full * self.prefill_chunk)

    def _feeds(self, part: dict, x: np.ndarray) -> dict[str, np.ndarray]:
        x = x.reshape(1, -1).astype(np.int32) if part["input"] == "input_ids" else x
        feeds = {part["input"]: x, "position": np.array([self.position], np.int32)}
        for s in part["state_specs"]:
            if s["mode"] == "io":
                feeds[s["coreml_input"]] = self._io[s["name"]]
        return feeds

    def _take_outputs(self, part: dict, out: dict[str, np.ndarray]) -> np.ndarray:
        for s in part["state_specs"]:
            if s["mode"] == "io":
                self._io[s["name"]] = np.asarray(out[s["coreml_output"]], dtype=np.float32)
        y = out[part["output"]]
        return np.asarray(y, dtype=np.float32).reshape(-1) if part["output"] == "logits" else y

    def _forward(self, ids: np.ndarray) -> np.ndarray:
        fname = "decode" if ids.size == 1 else "prefill"
        x = ids
        for i, part in enumerate(self.parts):
            x = self._take_outputs(part, self._run(i, fname, self._feeds(part, x)))
        return x

    def _package(self, part: dict[str, Any]) -> Path:
        return bundle_path(self.bundle, self.manifest, part["package"], "lowering.parts[].package")

    def _read_states(self, names) -> dict[str, np.ndarray]:
        # io states are the arrays the session holds; Core ML states are read from the model's state (fp16)
        by_name = {s["name"]: s for s in self.manifest["states"]}
        out = {}
        for n in names:
            s = by_name[n]
            out[n] = self._io[n].copy() if s["mode"] == "io" else self._read_state(s["coreml_input"])
        return out

    def _write_states(self, arrays: dict[str, np.ndarray]) -> None:
        by_name = {s["name"]: s for s in self.manifest["states"]}
        for n, value in arrays.items():
            s = by_name[n]
            if s["mode"] == "io":
                self._io[n] = np.array(value, np.float32, copy=True)
            else:
                self._write_state(s["coreml_input"], value)

    def _reset_io(self) -> None:
        self._io = {s["name"]: np.zeros(s["shape"], np.float32) for s in self.io_states}


class CoreMLEvalSession(_CoreMLBase):
    """Linux: the converted program, evaluated op by op (deltaship.runtimes.mil_eval)."""

    latency_note = (
        "the saved ML program evaluated op by op with numpy on Linux (deltaship's MIL evaluator), not Core ML: "
        "these latencies are the evaluator's, not a device's; tokens and acceptance are the program's own"
    )

    def __init__(
        self, bundle: Path, manifest: dict[str, Any], threads: int | None = None, prefill_chunk: int | None = None
    ):
        super().__init__(bundle, manifest, prefill_chunk)

        self.interps = [Interpreter(load_program(self._package(p))) for p in self.parts]
        self._states = {s["coreml_input"]: np.zeros(s["shape"], np.float16) for s in self.ml_states}
        draft = (manifest.get("speculative") or {}).get("draft", {"states": []})["states"]
        self._states.update(
            {s["coreml_input"]: np.zeros(s["shape"], np.float16) for s in draft if s["mode"] == "state"}
        )
        self._reset_io()

    def runtime_name(self) -> str:
        import coremltools as ct  # lazy: coremltools

        return f"coremltools {ct.__version__} MIL program evaluated with numpy on Linux (not Core ML)"

    def _run(self, i: int, fname: str, feeds: dict) -> dict:
        return self.interps[i].run(fname, feeds, self._states)

    def _run_draft(self, fname: str, feeds: dict) -> dict:
        return self.interps[0].run(fname, feeds, self._states)

    def _read_state(self, name: str) -> np.ndarray:
        return self._states[name].copy()

    def _write_state(self, name: str, value: np.ndarray) -> None:
        self._states[name][...] = value

    def _reset_draft_states(self) -> None:
        for s in self._block()["draft"]["states"]:
            if s["mode"] == "state":
                self._states[s["coreml_input"]][...] = 0

    def _reset_states(self) -> None:
        trunk = {s["coreml_input"] for s in self.ml_states}
        for name, a in self._states.items():
            if name in trunk:
                a[...] = 0
        self._reset_io()

    def state_arrays(self) -> dict[str, np.ndarray]:
        out = {s["name"]: self._io[s["name"]].copy() for s in self.io_states}
        out.update({s["name"]: self._states[s["coreml_input"]].astype(np.float32) for s in self.ml_states})
        return out


class CoreMLDeviceSession(_CoreMLBase):
    """macOS 15+: Core ML itself (MLModel per function, one MLState shared by both).
    Not run in this project's CI (Linux); written against coremltools 9's documented API."""

    def __init__(
        self,
        bundle: Path,
        manifest: dict[str, Any],
        threads: int | None = None,
        prefill_chunk: int | None = None,
        compute_units: str = "ALL",
    ):
        super().__init__(bundle, manifest, prefill_chunk)
        import coremltools as ct  # lazy: coremltools

        cu = self._compute_units = getattr(ct.ComputeUnit, compute_units)
        self.models = [
            {
                f: ct.models.MLModel(str(self._package(p)), function_name=f, compute_units=cu)
                for f in ("prefill", "decode")
            }
            for p in self.parts
        ]
        self._reset_states()

    def runtime_name(self) -> str:
        import coremltools as ct  # lazy: coremltools

        return f"Core ML via coremltools {ct.__version__} on macOS {platform.mac_ver()[0]}"

    def _run(self, i: int, fname: str, feeds: dict) -> dict:
        if fname not in self.models[i]:  # a verify function, loaded on first use; it shares decode's MLState
            self.models[i][fname] = self._load(self.parts[i], fname)
        return self.models[i][fname].predict(feeds, state=self.state[i])

    def _load(self, part: dict, fname: str):
        import coremltools as ct  # lazy: coremltools

        return ct.models.MLModel(str(self._package(part)), function_name=fname, compute_units=self._compute_units)

    def _run_draft(self, fname: str, feeds: dict) -> dict:
        return self._draft_model.predict(feeds, state=self._draft_state)

    def _read_state(self, name: str) -> np.ndarray:
        return np.array(self.state[0].read_state(name), copy=True)

    def _write_state(self, name: str, value: np.ndarray) -> None:
        self.state[0].write_state(name, value)

    def _reset_draft_states(self) -> None:
        if not hasattr(self, "_draft_model"):  # the draft head's KV cache is its own MLState
            self._draft_model = self._load(self.parts[0], self._block()["draft"]["function"])
        self._draft_state = self._draft_model.make_state()

    def _reset_states(self) -> None:
        self.state = [m["decode"].make_state() for m in self.models]  # a new state is a reset
        self._reset_io()


def open_coreml_session(
    bundle: Path, manifest: dict[str, Any], threads: int | None = None, prefill_chunk: int | None = None, **options: Any
) -> Session:
    if platform.system() == "Darwin" and not options.get("evaluate"):
        return CoreMLDeviceSession(bundle, manifest, threads, prefill_chunk)
    return CoreMLEvalSession(bundle, manifest, threads, prefill_chunk)
