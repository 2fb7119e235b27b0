"""An ONNX bundle in another Python's ONNX Runtime: for bundles the installed onnxruntime cannot load.

An opset-27 bundle (`--onnx-opset 27`) needs ONNX Runtime >= 1.32; deltaship pins 1.31. With
DELTASHIP_ORT_PYTHON naming a Python that has onnxruntime >= 1.32 and numpy (nothing else: deltaship's
ONNX session imports no torch), `open_bundle` runs the bundle there: `RemoteOnnxSession` starts
`python -m deltaship.runtimes.ort_worker BUNDLE` with this deltaship on its PYTHONPATH and sends it
one JSON line per call; the worker runs deltaship's own OnnxSession and answers with the logits.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from deltaship.bundle.reader import read_manifest
from deltaship.errors import DeltashipError
from deltaship.runtimes.base import Session
from deltaship.runtimes.onnx import OnnxSession

ENV = "DELTASHIP_ORT_PYTHON"


def version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def required_onnxruntime(manifest: dict[str, Any]) -> str | None:
    """The minimum onnxruntime version a bundle's manifest names ("1.32"), or None."""
    need = manifest.get("lowering", {}).get("runtime_requirements", {}).get("onnxruntime")
    return need.removeprefix(">=").strip() if need else None


class RemoteOnnxSession(Session):
    """deltaship's OnnxSession, run by `python` (a Python with a newer onnxruntime) in a subprocess."""

    def __init__(
        self,
        python: str,
        bundle: Path,
        manifest: dict[str, Any],
        threads: int | None = None,
        prefill_chunk: int | None = None,
    ):
        super().__init__(bundle, manifest, prefill_chunk)
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop(ENV, None)
        try:
            self._proc = subprocess.Popen(
                [python, "-m", "deltaship.runtimes.ort_worker", str(self.bundle), str(threads or 0)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                text=True,
            )
        except OSError as e:
            raise DeltashipError(f"{ENV}={python}: cannot start it ({e})", f"point {ENV} at a Python executable")
        hello = self._call({"op": "hello"})
        self._name = f"{hello['runtime']}, via {python}"

    def _call(self, msg: dict[str, Any]) -> dict[str, Any]:
        self._proc.stdin.write(json.dumps(msg) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise DeltashipError(
                f"the ONNX Runtime worker ({ENV}) exited with status {self._proc.wait()}",
                f"check that {ENV} names a Python with onnxruntime >= {required_onnxruntime(self.manifest)} and "
                "numpy (its error is above)",
            )
        reply = json.loads(line)
        if "error" in reply:
            raise DeltashipError(f"ONNX Runtime worker ({ENV}): {reply['error']}", reply.get("fix"))
        return reply

    def _forward(self, ids: np.ndarray) -> np.ndarray:
        reply = self._call({"op": "forward", "ids": [int(i) for i in ids], "position": self.position})
        return np.frombuffer(base64.b64decode(reply["logits"]), dtype=np.float32).copy()

    def _reset_states(self) -> None:
        self._call({"op": "reset"})

    def runtime_name(self) -> str:
        return self._name

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def main(argv: list[str]) -> int:
    bundle, threads = Path(argv[0]), int(argv[1])
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but replies on the pipe
    session = None
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if session is None:
                # the parent validated this manifest against the schema before starting the worker (open_bundle);
                # this Python has only onnxruntime and numpy, so the paths are checked here, not the schema again
                session = OnnxSession(bundle, read_manifest(bundle, validate=False), threads=threads or None)
            if msg["op"] == "hello":
                reply = {"runtime": session.runtime_name()}
            elif msg["op"] == "reset":
                session.reset()
                reply = {}
            else:
                session.position = int(msg["position"])
                logits = session._forward(np.asarray(msg["ids"], dtype=np.int64))
                reply = {"logits": base64.b64encode(np.ascontiguousarray(logits, np.float32).tobytes()).decode()}
        except DeltashipError as e:
            reply = {"error": e.message, "fix": e.fix}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
