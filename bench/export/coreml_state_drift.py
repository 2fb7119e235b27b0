"""Drift of fp16 DeltaNet states over a long run (Core ML), the measurement behind the default.

    python bench/export/coreml_state_drift.py [--tokens 1000] --out docs/results/coreml-drift.md

Exports the trained qwen3.5-tiny to Core ML fp16 twice: DeltaNet conv/recurrent states as fp32
inputs/outputs ("io") and as fp16 Core ML states ("state"; the KV cache is an fp16 state in both).
Feeds the same held-out text token by token through each (the saved ML programs, evaluated on
Linux) and compares every step's logits with transformers fp32, per window of 100 tokens.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from deltaship.check.evaluate import HELDOUT
from deltaship.check.verify import log_softmax
from deltaship.compile import export
from deltaship.models.source import load_source
from deltaship.oracle.reference import reference_model
from deltaship.runtimes.tokenizer import load_tokenizer
from deltaship.targets import open_bundle


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--window", type=int, default=100)
    ap.add_argument("--out", type=Path, required=True, help="the markdown results page to write")
    a = ap.parse_args()
    source = load_source("qwen3.5-tiny")
    ref = reference_model(source)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        ids = None
        for mode in ("io", "state"):
            out = Path(tmp) / mode
            m = export(
                "qwen3.5-tiny",
                out,
                target="coreml",
                precision="fp16",
                max_context=max(1024, a.tokens + 8),
                verify=False,
                progress=False,
                coreml_states=mode,
            )
            if ids is None:
                ids = load_tokenizer(out, m).encode(HELDOUT.read_text())[: a.tokens]
                with torch.no_grad():
                    want = ref(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
            s = open_bundle(out)
            got = [s.prefill(ids[:1])] + [s.decode(t) for t in ids[1:]]
            got = np.stack(got)
            lp, lq = log_softmax(want), log_softmax(got)
            kl = (np.exp(lp) * (lp - lq)).sum(-1)
            top1 = want.argmax(-1) == got.argmax(-1)
            rel = np.abs(got - want).max(-1) / want.std(-1)
            rows[mode] = [
                (w, kl[w : w + a.window].mean(), top1[w : w + a.window].mean(), rel[w : w + a.window].max())
                for w in range(0, len(ids), a.window)
            ]
    lines = [
        "# Core ML: drift of the DeltaNet state over a long run",
        "",
        f"`python bench/export/coreml_state_drift.py --tokens {a.tokens}`: trained qwen3.5-tiny, Core ML fp16, "
        f"{len(ids)} held-out tokens fed one by one (saved ML program evaluated on Linux), against "
        "transformers fp32.",
        "",
        "| tokens | KL io | KL state | top-1 io | top-1 state | max rel diff io | max rel diff state |",
        "|---|---|---|---|---|---|---|",
    ]
    for (w, kl_i, t_i, r_i), (_, kl_s, t_s, r_s) in zip(rows["io"], rows["state"]):
        lines.append(
            f"| {w}-{w + a.window - 1} | {kl_i:.2e} | {kl_s:.2e} | {t_i:.3f} | {t_s:.3f} | {r_i:.3f} | {r_s:.3f} |"
        )
    mean = {k: np.mean([r[1] for r in v]) for k, v in rows.items()}
    lines += [
        "",
        f"Mean KL: io {mean['io']:.3e}, state {mean['state']:.3e}. "
        "io = DeltaNet states as fp32 inputs/outputs; state = fp16 Core ML states.",
    ]
    a.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
