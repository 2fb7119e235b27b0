"""Fidelity of every target x precision on the trained built-in model, as one markdown table.

    python bench/export/fidelity_table.py [--tokens 512] --out docs/results/fidelity.md

Exports qwen3.5-tiny (trained on Python's standard library, shipped with the package) for each
target and precision, then runs `deltaship eval` on each bundle: perplexity on the held-out text,
the fp32 transformers reference's perplexity on the same tokens, top-1 agreement and KL divergence.
Core ML bundles are evaluated on Linux by interpreting the saved ML program (see docs/design.md).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from deltaship.check.evaluate import evaluate
from deltaship.compile import export

TARGETS = ("onnx", "executorch", "coreml")
PRECISIONS = ("fp32", "fp16", "int8", "int4")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--out", type=Path, required=True, help="the markdown results page to write")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for target in a.targets.split(","):
            for precision in PRECISIONS:
                out = Path(tmp) / f"{target}-{precision}"
                t0 = time.monotonic()
                m = export(
                    "qwen3.5-tiny",
                    out,
                    target=target,
                    precision=precision,
                    max_context=1024,
                    verify=False,
                    progress=False,
                )
                res = evaluate(out, tokens=a.tokens, threads=a.threads)
                res.update(
                    target=target,
                    precision=precision,
                    bundle_mib=m["bundle_bytes"] / 2**20,
                    seconds=time.monotonic() - t0,
                )
                rows.append(res)
                print(
                    json.dumps(
                        {
                            k: res[k]
                            for k in (
                                "target",
                                "precision",
                                "perplexity",
                                "reference_perplexity",
                                "top1_agreement",
                                "kl_divergence",
                                "tokens",
                            )
                        }
                    ),
                    flush=True,
                )
    lines = [
        "# Fidelity on the trained qwen3.5-tiny",
        "",
        f"`python bench/export/fidelity_table.py --tokens {a.tokens}`: held-out Python standard library source (bytes), "
        "each bundle run token by token in its own runtime; reference = transformers fp32 on the same tokens.",
        "",
        "| target | precision | bundle MiB | perplexity | reference perplexity | top-1 agreement | KL (nats/token) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['target']} | {r['precision']} | {r['bundle_mib']:.1f} | {r['perplexity']:.4f} | "
            f"{r['reference_perplexity']:.4f} | {r['top1_agreement']:.4f} | {r['kl_divergence']:.2e} |"
        )
    lines += ["", f"Tokens: {rows[0]['tokens']}. Runtimes: " + "; ".join(sorted({r["runtime"] for r in rows})) + "."]
    a.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
