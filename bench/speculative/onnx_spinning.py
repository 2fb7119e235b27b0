"""ONNX Runtime's thread spinning and speculative decoding: plain and speculative decode tokens/s of one --mtp bundle
with the sessions' intra-op threads spinning after a call (ONNX Runtime's default) and stopping when it returns
(`session.force_spinning_stop`, what deltaship sets for the sessions of an --mtp bundle), alternated in fresh
processes (A B, B A, ...).

    python bench/speculative/onnx_spinning.py B08 [--pairs 4] [--gen 32] [--acceptance 0.776] [--out bench/results/x.json]

B08: an int4 --mtp ONNX bundle (e.g. `deltaship export --model qwen3.5-0.8b --target onnx --precision int4 --mtp
--mtp-draft-vocab 32768 --max-context 512 --no-verify --out B08`). Speculative decoding runs at an imposed
acceptance (the profile's ImposedAcceptance: a random-weight head accepts nothing), greedy, depth 1, 2 threads.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def worker(bundle: str, spin: bool, gen: int, acceptance: float) -> dict:
    import numpy as np

    import deltaship.runtimes.onnx as onnx_runtime
    import deltaship.runtimes.onnx_speculative as onnx_speculative
    from deltaship.profiling.speculative.imposed import ImposedAcceptance
    from deltaship.runtimes.speculative import generate_speculative
    from deltaship.targets import open_bundle

    options = onnx_runtime.session_options

    def spinning(*a, **k):
        opts = options(*a, **k)
        opts.add_session_config_entry("session.force_spinning_stop", "0")  # ORT's default: spin after a call
        return opts

    if spin:  # the decoder's session and the draft head's each take their options by this name
        onnx_runtime.session_options = onnx_speculative.session_options = spinning
    s = open_bundle(bundle, threads=2, check_hashes=False)
    prompts = [list(range(100 + 7 * i, 164 + 7 * i)) for i in range(4)]

    def rate(fn) -> float:
        stamps: list[float] = []
        fn(lambda _t: stamps.append(time.perf_counter()))
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    generate_speculative(ImposedAcceptance(s, acceptance), prompts[0], 8, 1, stop_at_eos=False)
    plain, spec = [], []
    for i, p in enumerate(prompts):
        s.reset()
        plain.append(rate(lambda cb, p=p: s.generate(p, gen, stop_at_eos=False, on_token=cb)))
        im = ImposedAcceptance(s, acceptance, seed=i)
        spec.append(rate(lambda cb, p=p, im=im: generate_speculative(im, p, gen, 1, stop_at_eos=False, on_token=cb)))
    return {"plain": float(np.median(plain)), "speculative": float(np.median(spec))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--acceptance", type=float, default=0.776)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--worker", choices=["spin", "stop"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.bundle, a.worker == "spin", a.gen, a.acceptance)))
        return 0
    runs: dict[str, list[dict]] = {"spin": [], "stop": []}
    for i in range(a.pairs):
        for mode in ("spin", "stop") if i % 2 == 0 else ("stop", "spin"):
            cmd = [sys.executable, __file__, a.bundle, "--gen", str(a.gen), "--acceptance", str(a.acceptance)]
            out = subprocess.run([*cmd, "--worker", mode], capture_output=True, text=True, check=True).stdout
            runs[mode].append(json.loads(out.strip().splitlines()[-1]))
            print(mode, runs[mode][-1], file=sys.stderr, flush=True)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    summary = {
        mode: {k: round(med([r[k] for r in rs]), 2) for k in ("plain", "speculative")} for mode, rs in runs.items()
    }
    for mode in summary:
        summary[mode]["speculative_over_plain"] = round(summary[mode]["speculative"] / summary[mode]["plain"], 3)
    doc = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["python", "bench/speculative/onnx_spinning.py", *sys.argv[1:]]),
        "acceptance_imposed": a.acceptance,
        "median_tok_s": summary,
        "runs": runs,
    }
    text = json.dumps(doc, indent=1)
    if a.out:
        a.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
