"""deltaship's .pte against ExecuTorch's own Qwen3.5 export, same checkpoint, same machine, same run.

    python bench/peers/et_vs_example.py [--rounds 3] [--threads 2] [--work DIR] --out docs/results/executorch.md

The 0.8B preset is written as a bf16 Hugging Face checkpoint (bench/tools/make_checkpoint.py). ExecuTorch's
example (examples/models/qwen3_5 in the executorch 1.5.1 wheel) is exported from it with its shipped
yaml (static shape: the prompt goes one token per call) and with model.enable_dynamic_shape=True, at
fp32 and 8da4w (group 128, 4-bit embedding group 32, as bench/peers/peers.py builds it); deltaship exports the same
checkpoint at fp32 and int4 (8da4w, --block-size 128). Each measurement runs in a fresh process
(bench/peers/et_worker.py): prefill of a 512-token prompt, 64 greedy decode steps, peak RSS; rounds
alternate between the programs. Writes the markdown page given by --out; the programs stay in
--work (default: deltaship-bench/et in the system temp dir), where bench/runtimes/et_ops.py finds them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from deltaship.stats import ratio_ci, summarize

HERE = Path(__file__).parent  # et_worker.py
TOOLS = HERE.parent / "tools"  # make_checkpoint.py
ET = Path(list(__import__("importlib.util").util.find_spec("executorch").submodule_search_locations)[0])


def run(cmd: list[str], log: Path, env: dict | None = None) -> None:
    print("$", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    with open(log, "a") as f:
        # cwd: ExecuTorch's export_llm (hydra) writes an outputs/ folder where it runs
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=log.parent)
    if r.returncode:
        raise SystemExit(f"failed ({r.returncode}) after {time.monotonic() - t0:.0f}s; see {log}")
    print(f"  done in {time.monotonic() - t0:.0f}s", flush=True)


def et_params(ckpt: Path) -> dict:
    c = json.loads((ckpt / "config.json").read_text())
    return {
        "dim": c["hidden_size"],
        "hidden_dim": c["intermediate_size"],
        "n_heads": c["num_attention_heads"],
        "head_dim": c["head_dim"],
        "n_kv_heads": c["num_key_value_heads"],
        "n_layers": c["num_hidden_layers"],
        "norm_eps": c["rms_norm_eps"],
        "rope_theta": c["rope_parameters"]["rope_theta"],
        "use_scaled_rope": False,
        "vocab_size": c["vocab_size"],
        "use_hf_rope": True,
        "partial_rotary_factor": c["rope_parameters"]["partial_rotary_factor"],
        "attention_qkv_bias": False,
        "use_qk_norm": True,
        "qk_norm_before_rope": True,
        "attention_type": "mha",
        "use_q_gate": True,
        "rms_norm_add_unit_offset": True,
        "linear_conv_kernel_dim": c["linear_conv_kernel_dim"],
        "linear_key_head_dim": c["linear_key_head_dim"],
        "linear_value_head_dim": c["linear_value_head_dim"],
        "linear_num_key_heads": c["linear_num_key_heads"],
        "linear_num_value_heads": c["linear_num_value_heads"],
        "layer_types": c["layer_types"],
    }


def build(work: Path, threads: int) -> dict[str, dict]:
    log = work / "build.log"
    ckpt = work / "q08-ckpt"
    if not (ckpt / "model.safetensors").is_file():
        run([sys.executable, str(TOOLS / "make_checkpoint.py"), "qwen3.5-0.8b", str(ckpt)], log)
    programs: dict[str, dict] = {}
    # ExecuTorch's own export
    params = work / "0_8b_config.json"
    params.write_text(json.dumps(et_params(ckpt)))
    meta = work / "meta.pth"
    if not meta.is_file():
        run([sys.executable, "-m", "executorch.examples.models.qwen3_5.convert_weights", str(ckpt), str(meta)], log)
    yaml = ET / "examples/models/qwen3_5/config/qwen3_5_xnnpack_fp32.yaml"
    quant = ["+quantization.qmode=8da4w", "+quantization.group_size=128", "+quantization.embedding_quantize='4,32'"]
    for name, extra, dynamic in (
        ("et-example-fp32-static", [], False),
        ("et-example-8da4w-static", quant, False),
        ("et-example-fp32-dynamic", [], True),
        ("et-example-8da4w-dynamic", quant, True),
    ):
        out = work / f"{name}.pte"
        if not out.is_file():
            run(
                [
                    sys.executable,
                    "-m",
                    "executorch.extension.llm.export.export_llm",
                    "--config",
                    str(yaml),
                    "+base.model_class=qwen3_5_0_8b",
                    f"+base.params={params}",
                    f"+base.checkpoint={meta}",
                    f"+export.output_name={out}",
                    "export.max_seq_length=1024",
                    "export.max_context_length=1024",
                ]
                + (["model.enable_dynamic_shape=True"] if dynamic else [])
                + extra,
                log,
            )
        programs[name] = {"pte": out, "chunk": 512 if dynamic else 1}
    # deltaship
    # prefill chunk 512 (fastest prefill) and 128 (a smaller activation arena: less peak memory)
    for name, prec, chunk in (
        ("deltaship-fp32", "fp32", 512),
        ("deltaship-int4", "int4", 512),
        ("deltaship-fp32-c128", "fp32", 128),
        ("deltaship-int4-c128", "int4", 128),
    ):
        out = work / name
        if not (out / "manifest.json").is_file():
            run(
                [
                    sys.executable,
                    "-m",
                    "deltaship.cli",
                    "export",
                    "--model",
                    str(ckpt),
                    "--target",
                    "executorch",
                    "--precision",
                    prec,
                    "--block-size",
                    "128",
                    "--max-context",
                    "1024",
                    "--prefill-chunk",
                    str(chunk),
                    "--out",
                    str(out),
                    "--force",
                    "--no-verify",
                    "--quiet",
                ],
                log,
            )
        programs[name] = {"pte": out / "model.pte", "chunk": chunk}
    return programs


def measure(programs: dict[str, dict], rounds: int, threads: int, work: Path) -> dict[str, list[dict]]:
    samples: dict[str, list[dict]] = {k: [] for k in programs}
    for r in range(rounds):
        for name, p in programs.items():  # alternate: every round visits every program
            cmd = [sys.executable, str(HERE / "et_worker.py"), str(p["pte"]), str(p["chunk"]), str(threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, TQDM_DISABLE="1"))
            if out.returncode:
                print(f"round {r} {name}: died ({out.returncode}) {out.stderr[-400:]}")
                samples[name].append({"died": out.returncode})
                continue
            res = json.loads(out.stdout.strip().splitlines()[-1])
            samples[name].append(res)
            print(f"round {r} {name}: {res}", flush=True)
    (work / "samples.json").write_text(json.dumps(samples, indent=1))
    return samples


def report(programs: dict, samples: dict, threads: int, rounds: int) -> str:
    def stat(name: str, key: str) -> list[float]:
        return [s[key] for s in samples[name] if key in s]

    lines = [
        "# deltaship .pte vs ExecuTorch's own Qwen3.5 export (0.8B, random weights, published shape)",
        "",
        f"`python bench/peers/et_vs_example.py --rounds {rounds} --threads {threads}`: one machine, one run, "
        "programs alternated, each measurement a fresh process; medians with bootstrap 95% CI.",
        "",
        "| program | tokens per call | prefill 512 tok/s | decode tok/s | peak RSS GiB | .pte MiB |",
        "|---|---|---|---|---|---|",
    ]
    for name, p in programs.items():
        pre, dec, rss = stat(name, "prefill_tok_s"), stat(name, "decode_tok_s"), stat(name, "peak_rss_bytes")
        if not pre:
            lines.append(f"| {name} | - | died | died | - | {p['pte'].stat().st_size / 2**20:.0f} |")
            continue
        sp, sd = summarize(pre), summarize(dec)
        lines.append(
            f"| {name} | {p['chunk'] if p['chunk'] > 1 else 'one'} token(s) | {sp['median']:.1f} "
            f"[{sp['ci95'][0]:.1f}, {sp['ci95'][1]:.1f}] | {sd['median']:.2f} [{sd['ci95'][0]:.2f}, "
            f"{sd['ci95'][1]:.2f}] | {np.median(rss) / 2**30:.2f} | {p['pte'].stat().st_size / 2**20:.0f} |"
        )
    lines += ["", "Ratios, deltaship / ExecuTorch example (95% CI):", ""]
    pairs = [
        (f"deltaship-{p}{c}", f"et-example-{q}-{k}")
        for p, q in (("fp32", "fp32"), ("int4", "8da4w"))
        for c in ("", "-c128")
        for k in ("static", "dynamic")
    ]
    for ours, theirs in pairs:
        if stat(ours, "prefill_tok_s") and stat(theirs, "prefill_tok_s"):
            rp = ratio_ci(stat(ours, "prefill_tok_s"), stat(theirs, "prefill_tok_s"))
            rd = ratio_ci(stat(ours, "decode_tok_s"), stat(theirs, "decode_tok_s"))
            mem = np.median(stat(ours, "peak_rss_bytes")) / np.median(stat(theirs, "peak_rss_bytes"))
            lines.append(
                f"- {ours} vs {theirs}: prefill x{rp['ratio']:.2f} [{rp['ci95'][0]:.2f}, {rp['ci95'][1]:.2f}], "
                f"decode x{rd['ratio']:.2f} [{rd['ci95'][0]:.2f}, {rd['ci95'][1]:.2f}], peak RSS x{mem:.2f}"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "deltaship-bench" / "et")
    ap.add_argument("--only-build", action="store_true")
    ap.add_argument("--out", type=Path, help="the markdown results page to write (required unless --only-build)")
    a = ap.parse_args()
    if not a.only_build and a.out is None:
        ap.error("--out is required (the markdown results page), unless --only-build")
    a.work = a.work.resolve()
    a.work.mkdir(parents=True, exist_ok=True)
    programs = build(a.work, a.threads)
    if a.only_build:
        return 0
    samples = measure(programs, a.rounds, a.threads, a.work)
    text = report(programs, samples, a.threads, a.rounds)
    a.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
