"""deltaship against the tools a user would otherwise pick: one machine, one run, alternating.

    python bench/peers/peers.py [--rounds 3] [--threads 2] [--skip llamacpp,...] --out docs/results/peers.md

0.8B preset (random weights, published shape) written once as a bf16 checkpoint, text-only and in the
multimodal layout onnxruntime-genai's builder needs. Peers: transformers eager (fp32, bf16),
onnxruntime-genai's model builder (fp32, int4; its own venv under the work dir, so that its
onnxruntime does not replace ours), ExecuTorch's own Qwen3.5 export (fp32, 8da4w; shipped static
config and dynamic shape; built by bench/peers/et_vs_example.py), llama.cpp through llama-cpp-python
(F32, Q4_0; its own venv, built from source, only where it builds). deltaship: ONNX fp32/int4 and
ExecuTorch fp32/int4 from the same checkpoint. Every measurement is a fresh process
(bench/tools/peer_worker.py); rounds alternate between the tools; medians with bootstrap 95% CIs.
Also measures this machine's memory bandwidth and the decode roofline of each artifact.
Artifacts, venvs and raw samples are kept in deltaship-bench/ under the system temp dir (reused by
later runs; bench/peers/et_vs_example.py builds into deltaship-bench/et there by default).
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

TOOLS = Path(__file__).resolve().parents[1] / "tools"  # make_checkpoint.py, peer_worker.py, bandwidth.py
sys.path.insert(0, str(TOOLS))
from bandwidth import bandwidth  # noqa: E402  (bench/tools/)

WORK = Path(tempfile.gettempdir()) / "deltaship-bench" / "peers"
ET = Path(tempfile.gettempdir()) / "deltaship-bench" / "et"  # bench/peers/et_vs_example.py's default --work


def sh(cmd: list[str], log: Path, env: dict | None = None, cwd: Path | None = None) -> None:
    print("$", " ".join(map(str, cmd)), flush=True)
    t0 = time.monotonic()
    with open(log, "a") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    if r.returncode:
        raise RuntimeError(f"{cmd[:3]} failed ({r.returncode}) after {time.monotonic() - t0:.0f}s; see {log}")
    print(f"  done in {time.monotonic() - t0:.0f}s", flush=True)


def venv(path: Path, packages: list[str], log: Path) -> Path:
    py = path / "bin" / "python"
    if not py.exists():
        sh([sys.executable, "-m", "venv", str(path)], log)
        sh([str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"], log)
        sh([str(py), "-m", "pip", "install", "-q", *packages], log)
    return py


def build(skip: set[str]) -> dict[str, dict]:
    WORK.mkdir(parents=True, exist_ok=True)
    log = WORK / "build.log"
    text, mm = ET / "q08-ckpt", WORK / "q08-mm"
    if not (text / "model.safetensors").exists():
        sh([sys.executable, str(TOOLS / "make_checkpoint.py"), "qwen3.5-0.8b", str(text)], log)
    tools: dict[str, dict] = {}
    # deltaship
    for prec in ("fp32", "int4"):
        out = WORK / f"deltaship-onnx-{prec}"
        if not (out / "manifest.json").exists():
            sh(
                [
                    sys.executable,
                    "-m",
                    "deltaship.cli",
                    "export",
                    "--model",
                    str(text),
                    "--target",
                    "onnx",
                    "--precision",
                    prec,
                    "--max-context",
                    "1024",
                    "--out",
                    str(out),
                    "--force",
                    "--no-verify",
                    "--quiet",
                ],
                log,
            )
        tools[f"deltaship onnx {prec}"] = {"tool": "deltaship", "path": out, "py": sys.executable, "precision": prec}
    for prec in ("fp32", "int4"):
        if (ET / f"deltaship-{prec}" / "manifest.json").exists():
            tools[f"deltaship executorch {prec}"] = {
                "tool": "deltaship",
                "path": ET / f"deltaship-{prec}",
                "py": sys.executable,
                "precision": prec,
            }
    # transformers
    if "transformers" not in skip:
        for d in ("fp32", "bf16") if has_bf16() else ("fp32",):
            tools[f"transformers eager {d}"] = {
                "tool": f"transformers-{d}",
                "path": text,
                "py": sys.executable,
                "precision": d,
            }
    # ExecuTorch's own export (bench/peers/et_vs_example.py builds them)
    if "et" not in skip:
        for name, prec in (
            ("et-example-fp32-static", "fp32"),
            ("et-example-8da4w-static", "int4"),
            ("et-example-fp32-dynamic", "fp32"),
            ("et-example-8da4w-dynamic", "int4"),
        ):
            pte = ET / f"{name}.pte"
            if pte.exists():
                per_call = ":1" if "static" in name else ":512"
                tools[name.replace("et-example", "executorch example")] = {
                    "tool": "et-example",
                    "path": pte,
                    "suffix": per_call,
                    "py": sys.executable,
                    "precision": prec,
                }
    # onnxruntime-genai
    if "genai" not in skip:
        py = venv(
            WORK / "genai-venv",
            ["torch==2.13.0", "onnxruntime-genai", "onnx_ir", "transformers>=5.23,<6", "numpy"],
            log,
        )
        if not (mm / "model.safetensors").exists():
            sh([sys.executable, str(TOOLS / "make_checkpoint.py"), "qwen3.5-0.8b", str(mm), "--multimodal"], log)
        for prec in ("fp32", "int4"):
            out = WORK / f"genai-{prec}"
            if not (out / "genai_config.json").exists():
                sh(
                    [
                        str(py),
                        "-m",
                        "onnxruntime_genai.models.builder",
                        "-i",
                        str(mm),
                        "-o",
                        str(out),
                        "-p",
                        prec,
                        "-e",
                        "cpu",
                        "-c",
                        str(WORK / "genai-cache"),
                    ],
                    log,
                )
                cfg = json.loads((out / "genai_config.json").read_text())
                opts = cfg["model"]["decoder"].setdefault("session_options", {})
                opts["intra_op_num_threads"] = 2
                (out / "genai_config.json").write_text(json.dumps(cfg, indent=1))
            tools[f"onnxruntime-genai {prec}"] = {"tool": "genai", "path": out, "py": str(py), "precision": prec}
    if "llamacpp" not in skip:
        tools.update(build_llamacpp(text, log))
    return tools


LLAMA_CPP = "llama-cpp-python==0.3.36"  # its sdist vendors a llama.cpp with the qwen35 architecture


def build_llamacpp(text: Path, log: Path) -> dict[str, dict]:
    """llama-cpp-python (built from source, own venv), the checkpoint converted with the vendored
    convert_hf_to_gguf.py (a byte-level tokenizer stands in: the weights carry no tokenizer; the
    pre-tokenizer name is forced to qwen35), F32 and Q4_0 GGUFs (quantized with llama_model_quantize)."""
    py = venv(WORK / "llamacpp-venv", ["numpy", LLAMA_CPP], log)
    src = WORK / "llamacpp-src"
    if not (src / "convert_hf_to_gguf.py").exists():
        dl = WORK / "llamacpp-sdist"
        sh(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                str(dl),
                LLAMA_CPP,
            ],
            log,
        )
        import tarfile

        with tarfile.open(next(dl.glob("llama_cpp_python-*.tar.gz"))) as tf:
            tf.extractall(dl)
        next(dl.glob("llama_cpp_python-*/vendor/llama.cpp")).rename(src)
    ckpt = WORK / "q08-gguf-src"  # the checkpoint plus a stand-in tokenizer
    if not (ckpt / "tokenizer.json").exists():
        ckpt.mkdir(parents=True, exist_ok=True)
        for f in text.iterdir():
            (ckpt / f.name).unlink(missing_ok=True)
            (ckpt / f.name).symlink_to(f.resolve())
        from deltaship.models.presets import write_tiny_tokenizer

        write_tiny_tokenizer(ckpt)
    f32 = WORK / "q08-f32.gguf"
    if not f32.exists():
        conv = (
            "import sys, runpy; sys.argv = sys.argv[1:]; d = sys.argv[0].rsplit('/', 1)[0]; "
            "sys.path[:0] = [d, d + '/gguf-py']; import conversion.base as b; "
            "b.TextModel.get_vocab_base_pre = lambda self, tok: 'qwen35'; "
            "runpy.run_path(sys.argv[0], run_name='__main__')"
        )
        sh(
            [
                sys.executable,
                "-c",
                conv,
                str(src / "convert_hf_to_gguf.py"),
                str(ckpt),
                "--outtype",
                "f32",
                "--outfile",
                str(f32),
                "--no-mtp",
            ],
            log,
        )
    q4 = WORK / "q08-q4_0.gguf"
    if not q4.exists():
        quant = (
            "import sys, llama_cpp as l; p = l.llama_model_quantize_default_params(); "
            "p.ftype = l.LLAMA_FTYPE_MOSTLY_Q4_0; p.nthread = 2; "
            "sys.exit(l.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))"
        )
        sh([str(py), "-c", quant, str(f32), str(q4)], log)
    return {
        "llama.cpp f32": {"tool": "llamacpp", "path": f32, "py": str(py), "precision": "fp32"},
        "llama.cpp Q4_0": {"tool": "llamacpp", "path": q4, "py": str(py), "precision": "int4"},
    }


def has_bf16() -> bool:
    """bf16 matmuls are only worth timing on a CPU with bf16 units (AVX512_BF16 or AMX); without them
    torch's bf16 GEMM runs over 100x slower than fp32 (measured here: 0.001 vs 0.17 TFLOP/s) and a 512-token prefill takes many minutes."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def artifact_bytes(path: Path) -> int:
    p = Path(path)
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def state_traffic_bytes(context: int) -> int:
    """Bytes of state one decode step of the 0.8B moves in any runtime: every DeltaNet conv and recurrent
    state read and written once, and the attention layers' KV cache read up to `context` (all fp32)."""
    from deltaship.models.presets import get_preset

    b = get_preset("qwen3.5-0.8b").spec().state_bytes(context)
    return 2 * (b["deltanet_recurrent"] + b["deltanet_conv"]) + b["kv_cache"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip", default="", help="comma-separated: transformers, genai, et, llamacpp")
    ap.add_argument("--only-build", action="store_true", help="build every artifact, measure nothing")
    ap.add_argument("--only", default="", help="comma-separated name prefixes to measure (e.g. deltaship,llama.cpp)")
    ap.add_argument("--out", type=Path, help="the markdown results page to write (required unless --only-build)")
    a = ap.parse_args()
    if not a.only_build and a.out is None:
        ap.error("--out is required (the markdown results page), unless --only-build")
    skip = set(filter(None, a.skip.split(",")))
    tools = build(skip)
    if a.only:
        keep = tuple(filter(None, a.only.split(",")))
        tools = {k: v for k, v in tools.items() if k.startswith(keep)}
    if a.only_build:
        return 0
    bw = [bandwidth(a.threads)]
    samples: dict[str, list[dict]] = {k: [] for k in tools}
    for r in range(a.rounds):
        for name, t in tools.items():
            cmd = [
                t["py"],
                str(TOOLS / "peer_worker.py"),
                t["tool"],
                str(t["path"]) + t.get("suffix", ""),
                str(a.threads),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, TQDM_DISABLE="1"))
            if out.returncode:
                print(f"round {r} {name}: died ({out.returncode}): {out.stderr[-300:]}", flush=True)
                continue
            res = json.loads(out.stdout.strip().splitlines()[-1])
            samples[name].append(res)
            print(
                f"round {r} {name}: " + json.dumps({k: round(v, 2) for k, v in res.items() if k != "tool"}), flush=True
            )
        bw.append(bandwidth(a.threads))
    (WORK / f"samples-{a.out.stem}.json").write_text(json.dumps({"samples": samples, "bandwidth_gbs": bw}, indent=1))
    text = report(tools, samples, bw, a)
    a.out.write_text(text)
    print(text)
    return 0


def report(tools: dict, samples: dict, bw: list[float], a) -> str:
    med_bw = float(np.median(bw))
    lines = [
        "# deltaship against its peers (0.8B, random weights at the published shape)",
        "",
        f"`python bench/peers/peers.py --rounds {a.rounds} --threads {a.threads}"
        f"{' --only ' + a.only if a.only else ''}` on this machine (2 cores, AMD EPYC; "
        f"{a.threads} threads for every tool); every measurement a fresh process, tools alternated each round; "
        "median and bootstrap 95% CI over the rounds. Memory read bandwidth (multi-threaded sum of 1 GiB, "
        f"best of 5, measured between rounds): median {med_bw:.1f} GB/s (range {min(bw):.1f}-{max(bw):.1f}).",
        "",
        *(
            []
            if has_bf16()
            else [
                "transformers eager bf16 is left out: this CPU has no bf16 units (no AVX512_BF16 "
                "or AMX), where torch's bf16 GEMM is over 100x slower than fp32.",
                "",
            ]
        ),
        "| tool | precision | prefill 128 tok/s | prefill 512 tok/s | TTFT 512 s | decode tok/s | peak RSS GiB | "
        "artifact GiB | decode roofline tok/s | % of roofline | roofline with state tok/s | % of it |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    # decode runs 64 steps after the 512-token prompt: the KV cache read grows from 512 to 575 positions
    state = state_traffic_bytes(512 + 32)
    ci = lambda xs: (lambda s: f"{s['median']:.1f} [{s['ci95'][0]:.1f}, {s['ci95'][1]:.1f}]")(summarize(xs))  # noqa: E731
    for name, t in tools.items():
        s = samples[name]
        if not s:
            lines.append(f"| {name} | {t['precision']} | died | | | | | | | | | |")
            continue
        get = lambda k: [x[k] for x in s]  # noqa: E731
        size = artifact_bytes(t["path"])
        roof, roof_state = med_bw * 1e9 / size, med_bw * 1e9 / (size + state)
        dec = float(np.median(get("decode_tok_s")))
        lines.append(
            f"| {name} | {t['precision']} | {ci(get('prefill_128_tok_s'))} | {ci(get('prefill_512_tok_s'))} | "
            f"{np.median(get('ttft_512_s')):.2f} | {ci(get('decode_tok_s'))} | "
            f"{np.median(get('peak_rss_bytes')) / 2**30:.2f} | {size / 2**30:.2f} | {roof:.0f} | "
            f"{100 * dec / roof:.0f}% | {roof_state:.0f} | {100 * dec / roof_state:.0f}% |"
        )
    lines += [
        "",
        "Roofline: bandwidth / artifact bytes, i.e. every stored weight read once per token (an upper "
        "bound on bytes read, so the roofline is conservative for artifacts that store an embedding "
        "table apart from the LM head). Roofline with state: bandwidth / (artifact bytes + the state a decode "
        f"step must move in any runtime: the DeltaNet conv and recurrent states read and written, the KV cache "
        f"read at the mean decode context, all fp32: {state / 1e6:.1f} MB), which the first roofline leaves "
        "out.",
        "",
        "## Ratios, best deltaship bundle vs best peer, same precision",
        "",
    ]
    for prec in ("fp32", "int4"):
        ours = [n for n, t in tools.items() if n.startswith("deltaship") and t["precision"] == prec and samples[n]]
        theirs = [
            n for n, t in tools.items() if not n.startswith("deltaship") and t["precision"] == prec and samples[n]
        ]
        for metric in ("prefill_128_tok_s", "prefill_512_tok_s", "decode_tok_s"):
            if not ours or not theirs:
                continue
            best_o = max(ours, key=lambda n: np.median([x[metric] for x in samples[n]]))
            best_t = max(theirs, key=lambda n: np.median([x[metric] for x in samples[n]]))
            r = ratio_ci([x[metric] for x in samples[best_o]], [x[metric] for x in samples[best_t]])
            lines.append(
                f"- {prec} {metric}: {best_o} / {best_t} = x{r['ratio']:.2f} [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
