"""Peak RSS of deltaship ONNX bundles and onnxruntime-genai's int4 export, measured alternately in fresh processes.
Regenerates: the peers' peak RSS of docs/results/memory.md.

    python bench/memory/memory_peers.py ROUNDS OUT_JSON [--bundle LABEL=BUNDLE[@CHECKOUT] ...] [--threads 2]
        [--genai-python PY --genai-model DIR | --no-genai] [--peer LABEL=TOOL:ARTIFACT[@PYTHON] ...]

bench/tools/peer_worker.py per measurement (what bench/peers/peers.py runs: prefills of 16, 128 and 512 random
tokens, then 64 decode steps, a fresh process each); every round runs each tool once, in the order given, and the
samples so far are written to OUT_JSON after each measurement. --bundle may repeat: LABEL names the row, @CHECKOUT
runs that bundle with another deltaship checkout's code (its PYTHONPATH; default: this one), e.g. main's against
a branch's. --peer adds any other tool of bench/tools/peer_worker.py with its python (e.g. genai on a deltaship bundle, with
genai's venv). The defaults are the artifacts bench/peers/peers.py --only-build leaves in deltaship-bench/peers
under the system temp dir (its 0.8B int4 bundle, genai's venv and its int4 export).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "bench" / "tools" / "peer_worker.py"
PEERS = Path(tempfile.gettempdir()) / "deltaship-bench" / "peers"  # bench/peers/peers.py's build


def bundle_arg(value: str) -> tuple[str, Path, Path]:
    """LABEL=BUNDLE[@CHECKOUT] -> (label, bundle, checkout)."""
    label, sep, rest = value.partition("=")
    if not sep or not label or not rest:
        raise argparse.ArgumentTypeError(f"{value!r}: expected LABEL=BUNDLE[@CHECKOUT]")
    bundle, _, checkout = rest.partition("@")
    return label, Path(bundle), Path(checkout) if checkout else ROOT


def peer_arg(value: str) -> tuple[str, str, Path, str]:
    """LABEL=TOOL:ARTIFACT[@PYTHON] -> (label, tool, artifact, python)."""
    label, sep, rest = value.partition("=")
    tool, colon, rest = rest.partition(":")
    if not sep or not colon or not label or not tool or not rest:
        raise argparse.ArgumentTypeError(f"{value!r}: expected LABEL=TOOL:ARTIFACT[@PYTHON]")
    artifact, _, python = rest.partition("@")
    return label, tool, Path(artifact), python or sys.executable


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rounds", type=int)
    ap.add_argument("out", type=Path, help="the raw JSON (e.g. bench/results/memory-peers-order.json)")
    ap.add_argument(
        "--bundle",
        action="append",
        type=bundle_arg,
        help=f"LABEL=BUNDLE[@CHECKOUT], repeatable (default: deltaship onnx int4={PEERS / 'deltaship-onnx-int4'})",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--genai-python", type=Path, default=PEERS / "genai-venv" / "bin" / "python")
    ap.add_argument("--genai-model", type=Path, default=PEERS / "genai-int4")
    ap.add_argument("--no-genai", action="store_true", help="measure the deltaship bundles only")
    ap.add_argument("--peer", action="append", type=peer_arg, default=[], help="LABEL=TOOL:ARTIFACT[@PYTHON]")
    a = ap.parse_args()
    bundles = a.bundle or [("deltaship onnx int4", PEERS / "deltaship-onnx-int4", ROOT)]
    # label -> (python, peer_worker tool, artifact, PYTHONPATH)
    tools = {label: (sys.executable, "deltaship", bundle, str(src)) for label, bundle, src in bundles}
    if not a.no_genai:
        tools["onnxruntime-genai int4"] = (str(a.genai_python), "genai", a.genai_model, "")
    for label, tool, artifact, python in a.peer:
        tools[label] = (python, tool, artifact, str(ROOT))
    for label, (py, _, artifact, src) in tools.items():
        for what, path in (("python", Path(py)), ("artifact", artifact), ("checkout", Path(src or "."))):
            if not path.exists():
                ap.error(
                    f"{label}: no {what} at {path}; build the peers with `python bench/peers/peers.py --only-build`, "
                    "pass the paths (--bundle, --genai-python, --genai-model), or --no-genai"
                )
    samples = {k: [] for k in tools}
    for r in range(a.rounds):
        for name, (py, tool, path, src) in tools.items():
            env = dict(os.environ, TQDM_DISABLE="1", PYTHONPATH=src)
            p = subprocess.run(
                [py, str(WORKER), tool, str(path), str(a.threads)], capture_output=True, text=True, env=env
            )
            if p.returncode:
                print(name, "died", p.stderr[-400:], flush=True)
                continue
            res = json.loads(p.stdout.strip().splitlines()[-1])
            samples[name].append(res)
            print(r, name, {k: round(v, 3) for k, v in res.items() if k != "tool"}, flush=True)
            record = {
                "command": shlex.join(["python", "bench/memory/memory_peers.py", *sys.argv[1:]]),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "samples": samples,
            }
            a.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
