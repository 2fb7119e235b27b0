"""Peak RSS of ExecuTorch's own C++ LLM runner (TextLLMRunner, through its Python binding) beside deltaship's
ExecuTorch session on the same bundle, each in a fresh process, alternating.

    python bench/memory/et_runner_peak.py BUNDLE [--rounds 2] [--prompt 64] [--gen 8] [--json OUT]

Each process opens the bundle and runs a `--prompt`-token prefill and `--gen` new tokens (the runner: its own
generate loop on the bundle's tokenizer, greedy; the session: random token ids), then reports VmHWM. Both load
torch (the pybindings link libtorch), so the difference is the drivers', not the C++ runtime's alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def worker(kind: str, bundle: str, prompt: int, gen: int) -> dict:
    if kind == "runner":
        from deltaship.runtimes.et_runner import profile_with_runner

        profile_with_runner(bundle, prompt_length=prompt, gen=gen, reps=1, warmups=0)
    else:
        import numpy as np

        from deltaship.targets import open_bundle

        s = open_bundle(bundle, threads=2, check_hashes=False)
        tok = int(np.argmax(s.prefill(np.random.default_rng(0).integers(0, 200, prompt).tolist())))
        for _ in range(gen):
            tok = int(np.argmax(s.decode(tok)))
    return {"kind": kind, "peak_rss_bytes": hwm()}


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        print(json.dumps(worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    samples: dict[str, list[int]] = {"runner": [], "session": []}
    for _ in range(a.rounds):
        for kind in samples:
            cmd = [sys.executable, __file__, "--worker", kind, a.bundle, str(a.prompt), str(a.gen)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            samples[kind].append(json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_bytes"])
            print(kind, samples[kind][-1] / 2**30, flush=True)
    if a.json:
        doc = {"command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        a.json.write_text(json.dumps(doc | {"bundle": a.bundle, "samples": samples}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
