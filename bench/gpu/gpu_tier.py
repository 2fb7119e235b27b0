"""The GPU tier: deltaship ONNX bundles on ONNX Runtime's CUDA execution provider.

Run on a machine with an NVIDIA GPU and onnxruntime-gpu 1.31 installed in place of onnxruntime:

    python bench/gpu/gpu_tier.py parity --out OUTDIR
        tiny bundles (fp32, fp16, int4 with fp32 and with fp16 activations) exported on the spot, each run
        through the CUDA provider and the CPU provider: greedy tokens and logits against transformers'
        fp32 reference (teacher-forced), and CUDA against CPU on the same bundle; which nodes stay on the
        CPU (ORT refuses the session when CPU fallback is disabled) is recorded.

bench/gpu/gpu_tier.sh drives the whole GPU run (this parity, the exports, `deltaship profile --provider cuda`,
the transformers baseline); docs/results/gpu.md holds the measured numbers and the commands.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TINY_CASES = [("fp32", {}), ("fp16", {}), ("int4", {}), ("int4", {"onnx_activations": "fp16"})]


def _case_name(precision: str, opts: dict) -> str:
    return precision + ("-fp16act" if opts.get("onnx_activations") == "fp16" else "")


def parity(out: Path) -> dict:
    from deltaship.check.verify import compare, default_prompts, fidelity, reference_continuation, teacher_forced
    from deltaship.compile import export
    from deltaship.models.source import load_source
    from deltaship.oracle.reference import reference_model
    from deltaship.targets import open_bundle, tolerance

    source = load_source("qwen3.5-tiny")
    ref = reference_model(source)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for precision, opts in TINY_CASES:
            name = _case_name(precision, opts)
            bundle = Path(tmp) / name
            export("qwen3.5-tiny", bundle, target="onnx", precision=precision, verify=False, progress=False, **opts)
            cuda = open_bundle(bundle, provider="cuda")
            cpu = open_bundle(bundle)
            prompts = default_prompts(source.spec.vocab_size, cuda.prefill_chunk, cuda.max_context, 8)
            tol = tolerance("onnx", precision)
            res = {
                "case": name,
                "runtime": cuda.runtime_name(),
                "cpu_fallback": cuda.cpu_fallback,
                "prompt_lengths": [len(p) for p in prompts],
            }
            worst_ref = worst_cpu = 0.0
            agree_ref = agree_cpu = 1.0
            kls, top1 = [], []
            for prompt in prompts:
                toks, ref_rows = reference_continuation(ref, prompt, 8)
                got = teacher_forced(cuda, prompt, toks)
                on_cpu = teacher_forced(cpu, prompt, toks)
                r = compare(got, ref_rows, toks, tol.tie_margin)
                c = compare(got, on_cpu, [int(np.argmax(x)) for x in on_cpu], tol.tie_margin)
                f = fidelity(got, ref_rows)
                worst_ref, agree_ref = max(worst_ref, r["max_rel_logit_diff"]), min(agree_ref, r["greedy_agreement"])
                worst_cpu, agree_cpu = max(worst_cpu, c["max_rel_logit_diff"]), min(agree_cpu, c["greedy_agreement"])
                kls.append(f["kl_divergence"])
                top1.append(f["top1_agreement"])
            res.update(
                vs_transformers_max_rel_logit_diff=worst_ref,
                vs_transformers_greedy_agreement=agree_ref,
                vs_transformers_kl=float(np.mean(kls)),
                vs_transformers_top1=float(np.mean(top1)),
                cuda_vs_cpu_max_rel_logit_diff=worst_cpu,
                cuda_vs_cpu_greedy_agreement=agree_cpu,
            )
            gen = cuda.generate(prompts[1], 32, stop_at_eos=False)
            gen_cpu = cpu.generate(prompts[1], 32, stop_at_eos=False)
            res["greedy32_cuda_equals_cpu"] = gen.output_ids == gen_cpu.output_ids
            print(json.dumps(res), flush=True)
            rows.append(res)
            del cuda, cpu
    (out / "gpu_parity.json").write_text(json.dumps(rows, indent=2) + "\n")
    return {"rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("parity")
    a.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    parity(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
