"""The whole GPU bench on a bare Linux machine with an NVIDIA GPU, in one resumable command.
Regenerates: docs/results/gpu.md's table once it runs on a GPU (not yet run).

    bash bench/gpu/run.sh [--work DIR] [--only 0.8b,9b] [--precisions int4,fp16] [--skip-peers genai,llamacpp]
                          [--dry-run]
    python3 bench/gpu/run.py report RESULTS.json [--md OUT.md]      # the markdown table from a results JSON

Steps, each skipped when its output already exists (so a re-run resumes where the last one stopped):
  1. check: nvidia-smi answers (else a clear "no NVIDIA GPU" message, exit 2) and the work dir has the free
     disk the chosen presets need.
  2. venv WORK/venv: deltaship installed from this working tree (its pinned torch, from PyPI: the CUDA build on
     Linux, which the transformers peer and the bandwidth probe use; --torch-cpu takes the CPU build, enough
     for export), then onnxruntime replaced by onnxruntime-gpu==1.31.* (both ship the `onnxruntime` module).
  3. bandwidth: device-to-device copy bandwidth (torch if it sees CUDA, else cupy, else onnxruntime-gpu).
  4. export each preset at int4 (`--onnx-cuda-graph`; `--onnx-activations fp16`: ORT's CUDA GroupQueryAttention is fp16/bf16
     only) and fp16, `--max-context 8192` so a 4096-token prompt plus 64 generated tokens fits.
  5. `deltaship profile BUNDLE --device host --provider cuda --prompt-lengths 512,4096` per bundle.
  6. peers where they can be had (--skip-peers to leave one out):
     transformers bf16 eager (bench/gpu/gpu_transformers.py, same venv, needs torch's CUDA build);
     onnxruntime-genai-cuda on its own builder's export (own venv WORK/genai-venv; its builder accepts only a
       Qwen3_5ForConditionalGeneration checkpoint, which bench/tools/make_checkpoint.py --multimodal writes with random
       weights at the preset's shape; measured by bench/tools/peer_worker.py: prompts 128/512, 64 decode steps);
     llama.cpp built with -DGGML_CUDA=on from the source vendored in the llama-cpp-python sdist (`pip download`
       from PyPI, or drop the sdist into WORK/llamacpp-sdist/ on a machine without PyPI); needs cmake and the
       CUDA toolkit (nvcc); llama-bench -p 512,4096 -n 64 -ngl 99 on a Q4_0 GGUF.
  7. report: WORK/results/gpu-bench.json + gpu-bench.md (date, machine: GPU, driver, CUDA; commit; command;
     one row per bundle and peer with the fraction of the HBM roofline).

Roofline: bytes streamed per decoded token (weights less an untied embedding table, of which a token reads one
row, + the DeltaNet states read and written + the KV cache read at the context) / the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ("0.8b", "2b", "4b", "9b")
PRECISIONS = ("int4", "fp16")
PEERS = ("transformers", "genai", "llamacpp")
PROMPTS, GEN, CONTEXTS, MAX_CONTEXT = (512, 4096), 64, (128, 1024, 4096), 8192
# the extras pull NVIDIA's CUDA 13 / cuDNN wheels (pip warns and goes on where an extra does not exist)
ORT_GPU = "onnxruntime-gpu[cuda,cudnn]==1.31.*"
LLAMA_CPP = "llama-cpp-python==0.3.36"  # its sdist vendors a llama.cpp with the qwen35 architecture
# Free disk an export needs (the bundle; the export streams weights, no checkpoint is written), GiB, with margin.
DISK_GIB = {
    "0.8b": {"int4": 1.5, "fp16": 3},
    "2b": {"int4": 3, "fp16": 6},
    "4b": {"int4": 5, "fp16": 11},
    "9b": {"int4": 8, "fp16": 22},
}
VENV_GIB = 8  # torch with its CUDA libraries + onnxruntime-gpu
# Peers per preset: the bf16 checkpoints (multimodal for genai, text for llama.cpp), genai's int4 export, the GGUFs.
PEER_GIB = {"0.8b": 6, "2b": 14, "4b": 26, "9b": 55}


class GpuBenchError(Exception):
    """What went wrong, and the fix."""

    def __init__(self, message: str, fix: str):
        super().__init__(f"{message}\n  fix: {fix}")


@dataclass
class Step:
    name: str
    kind: str  # setup, export, profile, peer, report
    argv: list[str]
    done: Path | None = None  # the step is skipped when this exists
    env: dict[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + " ".join(shlex.quote(str(a)) for a in self.argv)


def bundle_name(preset: str, precision: str) -> str:
    return f"q{preset}-{precision}" + ("-fp16act" if precision == "int4" else "")


def plan(
    work: Path,
    presets: list[str],
    precisions: list[str],
    peers: list[str],
    torch_cpu: bool = False,
    python: str = "python3",
) -> list[Step]:
    """Every step of the run, in order; `done` says which output makes a step finished."""
    venv = work / "venv"
    py = str(venv / "bin" / "python")
    res = work / "results"
    torch_pin = _torch_pin()
    torch_args = [torch_pin] + (["--index-url", "https://download.pytorch.org/whl/cpu"] if torch_cpu else [])
    installed = venv / ".deltaship-gpu-installed"
    steps = [
        Step("venv", "setup", [python, "-m", "venv", str(venv)], venv / "bin" / "python"),
        Step(
            "install",
            "setup",
            [
                "bash",
                "-c",
                " && ".join(
                    [
                        f"{py} -m pip install -q --upgrade pip",
                        f"{py} -m pip install -q " + " ".join(map(shlex.quote, torch_args)),
                        f"{py} -m pip install -q -e {shlex.quote(str(ROOT))}",
                        f"{py} -m pip uninstall -q -y onnxruntime",  # both wheels ship `onnxruntime`: keep only the GPU one
                        f"{py} -m pip install -q {shlex.quote(ORT_GPU)}",
                        f'{py} -c \'import onnxruntime as o; assert "CUDAExecutionProvider" in o.get_available_providers(), '
                        f"o.get_available_providers()'",
                        f"touch {shlex.quote(str(installed))}",
                    ]
                ),
            ],
            installed,
        ),
        Step(
            "bandwidth",
            "setup",
            [py, str(Path(__file__)), "bandwidth", "--json", str(res / "bandwidth.json")],
            res / "bandwidth.json",
        ),
    ]
    for preset in presets:
        for prec in precisions:
            name = bundle_name(preset, prec)
            out = work / "bundles" / name
            # --onnx-cuda-graph: the sequence lengths on the device (the plain graph's Memcpy of total_sequence_length
            # gave wrong logits on ORT 1.31.1's CUDA provider, docs/results/gpu.md), and a capturable decode step
            acts = (["--onnx-activations", "fp16"] if prec == "int4" else []) + ["--onnx-cuda-graph"]
            # manifest.json appears only when the bundle is complete (the writer renames a temp dir)
            steps.append(
                Step(
                    f"export {name}",
                    "export",
                    [
                        py,
                        "-m",
                        "deltaship.cli",
                        "export",
                        "--model",
                        f"qwen3.5-{preset}",
                        "--target",
                        "onnx",
                        "--precision",
                        prec,
                        *acts,
                        "--max-context",
                        str(MAX_CONTEXT),
                        "--no-verify",
                        "--quiet",
                        "--force",
                        "--out",
                        str(out),
                    ],
                    out / "manifest.json",
                )
            )
    for preset in presets:
        for prec in precisions:
            name = bundle_name(preset, prec)
            steps.append(
                Step(
                    f"profile {name}",
                    "profile",
                    [
                        py,
                        "-m",
                        "deltaship.cli",
                        "profile",
                        str(work / "bundles" / name),
                        "--device",
                        "host",
                        "--provider",
                        "cuda",
                        "--prompt-lengths",
                        ",".join(map(str, PROMPTS)),
                        "--gen",
                        str(GEN),
                        "--contexts",
                        ",".join(map(str, CONTEXTS)),
                        "--no-breakdown",
                        "--json",
                        str(res / f"{name}-cuda.json"),
                    ],
                    res / f"{name}-cuda.json",
                )
            )
            # decode with and without CUDA graph capture, alternated in one process (the profile above captures)
            steps.append(
                Step(
                    f"capture {name}",
                    "profile",
                    [
                        py,
                        str(Path(__file__).with_name("capture.py")),
                        "speed",
                        str(work / "bundles" / name),
                        "--json",
                        str(res / f"{name}-capture.json"),
                        "--bandwidth-json",
                        str(res / "bandwidth.json"),
                    ],
                    res / f"{name}-capture.json",
                )
            )
    for preset in presets:
        if "transformers" in peers:
            steps.append(
                Step(
                    f"peer transformers {preset}",
                    "peer",
                    [
                        py,
                        str(ROOT / "bench" / "gpu" / "gpu_transformers.py"),
                        "--model",
                        f"qwen3.5-{preset}",
                        "--prompt-lengths",
                        ",".join(map(str, PROMPTS)),
                        "--json",
                        str(res / f"transformers-{preset}.json"),
                    ],
                    res / f"transformers-{preset}.json",
                )
            )
        if "genai" in peers:
            gpy = str(work / "genai-venv" / "bin" / "python")
            mm, gout = work / "ckpt" / f"{preset}-mm", work / "genai" / f"{preset}-int4"
            steps += [
                Step(
                    "genai venv",
                    "setup",
                    [
                        "bash",
                        "-c",
                        f"{python} -m venv {work / 'genai-venv'} && {gpy} -m pip "
                        f"install -q {torch_pin} onnxruntime-genai-cuda onnx_ir 'transformers>=5.23,<6' numpy",
                    ],
                    work / "genai-venv" / "bin" / "python",
                ),
                Step(
                    f"checkpoint {preset} multimodal",
                    "setup",
                    [
                        py,
                        str(ROOT / "bench" / "tools" / "make_checkpoint.py"),
                        f"qwen3.5-{preset}",
                        str(mm),
                        "--multimodal",
                    ],
                    mm / "model.safetensors",
                ),
                Step(
                    f"genai build {preset} int4",
                    "peer",
                    [
                        gpy,
                        "-m",
                        "onnxruntime_genai.models.builder",
                        "-i",
                        str(mm),
                        "-o",
                        str(gout),
                        "-p",
                        "int4",
                        "-e",
                        "cuda",
                        "-c",
                        str(work / "genai-cache"),
                    ],
                    gout / "genai_config.json",
                ),
                Step(
                    f"peer genai {preset}",
                    "peer",
                    [
                        "bash",
                        "-c",
                        f"{gpy} {ROOT / 'bench' / 'tools' / 'peer_worker.py'} genai {gout} 0 | tail -1 > "
                        f"{res / f'genai-{preset}.json'}.tmp && mv {res / f'genai-{preset}.json'}.tmp "
                        f"{res / f'genai-{preset}.json'}",
                    ],
                    res / f"genai-{preset}.json",
                ),
            ]
        if "llamacpp" in peers:
            src, build = work / "llamacpp-src", work / "llamacpp-build"
            text, q4 = work / "ckpt" / f"{preset}-text", work / "gguf" / f"{preset}-q4_0.gguf"
            steps += [
                Step(
                    "llama.cpp source",
                    "setup",
                    [
                        "bash",
                        "-c",
                        f"mkdir -p {work / 'llamacpp-sdist'} && cd {work / 'llamacpp-sdist'} && "
                        f"(ls llama_cpp_python-*.tar.gz || {py} -m pip download -q --no-deps --no-binary :all: "
                        f"{LLAMA_CPP}) && tar xzf llama_cpp_python-*.tar.gz && "
                        f"mv llama_cpp_python-*/vendor/llama.cpp {src}",
                    ],
                    src / "convert_hf_to_gguf.py",
                ),
                Step(
                    "llama.cpp CUDA build",
                    "setup",
                    [
                        "bash",
                        "-c",
                        f"cmake -S {src} -B {build} -DGGML_CUDA=on -DCMAKE_BUILD_TYPE=Release && cmake --build {build} "
                        f"-j --target llama-bench llama-quantize",
                    ],
                    build / "bin" / "llama-bench",
                ),
                Step(
                    f"checkpoint {preset} text",
                    "setup",
                    [py, str(ROOT / "bench" / "tools" / "make_checkpoint.py"), f"qwen3.5-{preset}", str(text)],
                    text / "model.safetensors",
                ),
                Step(
                    f"gguf {preset} q4_0",
                    "peer",
                    [
                        py,
                        str(Path(__file__)),
                        "gguf",
                        str(src),
                        str(text),
                        str(q4),
                        "--quantize",
                        str(build / "bin" / "llama-quantize"),
                    ],
                    q4,
                ),
                Step(
                    f"peer llama.cpp {preset}",
                    "peer",
                    [
                        "bash",
                        "-c",
                        f"{build / 'bin' / 'llama-bench'} -m {q4} -p {','.join(map(str, PROMPTS))} -n {GEN} -ngl 99 "
                        f"-o json > {res / f'llamacpp-{preset}.json'}.tmp && mv {res / f'llamacpp-{preset}.json'}.tmp "
                        f"{res / f'llamacpp-{preset}.json'}",
                    ],
                    res / f"llamacpp-{preset}.json",
                ),
            ]
    steps.append(Step("report", "report", [py, str(Path(__file__)), "collect", str(work)]))
    seen: set[str] = set()  # shared setup steps (a venv, the llama.cpp build) appear once
    return [s for s in steps if not (s.name in seen or seen.add(s.name))]


def _torch_pin() -> str:
    for line in (ROOT / "pyproject.toml").read_text().splitlines():
        if line.strip().strip('",').startswith("torch=="):
            return line.strip().strip('",')
    raise GpuBenchError("pyproject.toml pins no torch==", "pin torch in pyproject.toml's dependencies")


def check_machine(work: Path, presets: list[str], precisions: list[str], peers: list[str] = ()) -> dict:
    """nvidia-smi answers and the disk has room; returns the GPU's name, driver and CUDA version."""
    if sys.version_info < (3, 11):
        raise GpuBenchError(
            f"python3 is {sys.version.split()[0]}; deltaship needs 3.11 or later",
            "run bench/gpu/run.py with a python 3.11+ (e.g. python3.12 bench/gpu/run.py ...)",
        )
    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise GpuBenchError(
            "no NVIDIA GPU: nvidia-smi is not on PATH, so this machine has no NVIDIA driver",
            "run this on a Linux machine with an NVIDIA GPU and its driver; the CPU-side checks "
            "are `--dry-run` and `python -m pytest tests/test_gpu_bench.py`",
        )
    r = subprocess.run(
        [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"], capture_output=True, text=True
    )
    if r.returncode or not r.stdout.strip():
        raise GpuBenchError(
            f"no NVIDIA GPU: nvidia-smi failed ({r.returncode}): {(r.stderr or r.stdout).strip()}",
            "check the driver (nvidia-smi must list a GPU) and that the GPU is visible here",
        )
    name, driver, mem = [x.strip() for x in r.stdout.splitlines()[0].split(",")]
    head = subprocess.run([smi], capture_output=True, text=True).stdout
    cuda = head.split("CUDA Version:")[1].split()[0] if "CUDA Version:" in head else None
    need = sum(DISK_GIB[p][q] for p in presets for q in precisions) + VENV_GIB
    if set(peers) & {"genai", "llamacpp"}:
        need += sum(PEER_GIB[p] for p in presets) + VENV_GIB
    work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work).free / 2**30
    if free < need:
        raise GpuBenchError(
            f"{work} has {free:.0f} GiB free; the chosen presets need about {need:.0f} GiB",
            "free disk, pass --work on a larger disk, pick fewer presets with --only, or --skip-peers genai,llamacpp",
        )
    return {"gpu": name, "driver": driver, "memory": mem, "cuda": cuda}


def run(a) -> int:
    presets, precisions = _pick(a.only, PRESETS, "--only"), _pick(a.precisions, PRECISIONS, "--precisions")
    peers = [p for p in PEERS if p not in _pick(a.skip_peers, PEERS, "--skip-peers", empty_ok=True)]
    if a.torch_cpu and "transformers" in peers:  # transformers on the GPU needs torch's CUDA build
        print("--torch-cpu: leaving out the transformers peer", file=sys.stderr)
        peers.remove("transformers")
    steps = plan(a.work, presets, precisions, peers, a.torch_cpu)
    if a.dry_run:
        for s in steps:
            state = "done" if s.done and s.done.exists() else "todo"
            print(f"[{state}] {s.kind:8} {s.name}\n    {s.shell()}")
        return 0
    machine = check_machine(a.work, presets, precisions, peers)
    (a.work / "results").mkdir(parents=True, exist_ok=True)
    (a.work / "results" / "run.json").write_text(
        json.dumps(
            {
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "machine": machine,
                "commit": _commit(),
                "command": " ".join(map(shlex.quote, sys.argv)),
                "presets": presets,
                "precisions": precisions,
                "peers": peers,
            },
            indent=2,
        )
        + "\n"
    )
    failed = []
    for s in steps:
        if s.done and s.done.exists():
            print(f"[skip] {s.name} ({s.done} exists)", flush=True)
            continue
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        libs = cuda_lib_dirs(a.work / "venv")  # after install: onnxruntime's CUDA provider dlopens these
        if libs:
            env["LD_LIBRARY_PATH"] = ":".join(libs + [env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
        print(f"[run ] {s.name}\n    {s.shell()}", flush=True)
        log = a.work / "logs" / (s.name.replace(" ", "_").replace("/", "_") + ".log")
        log.parent.mkdir(exist_ok=True)
        with open(log, "a") as f:
            rc = subprocess.call(s.argv, stdout=f, stderr=subprocess.STDOUT, env=dict(env, **s.env), cwd=ROOT)
        if rc:
            print(f"[FAIL] {s.name}: exit {rc}; see {log}", flush=True)
            failed.append(s.name)
            if s.name in ("venv", "install"):
                return 1  # nothing after it can run
    print("failed: " + ", ".join(failed) if failed else "all steps done", flush=True)
    return 1 if failed else 0


def cuda_lib_dirs(venv: Path) -> list[str]:
    """The lib dirs of the NVIDIA wheels (CUDA runtime, cuBLAS, cuDNN, ...) installed in the venv."""
    return sorted(str(d) for d in venv.glob("lib/python3*/site-packages/nvidia/*/lib") if d.is_dir())


def _pick(value: str | None, allowed: tuple[str, ...], flag: str, empty_ok: bool = False) -> list[str]:
    if not value:
        return [] if empty_ok else list(allowed)
    got = [v.strip().removeprefix("qwen3.5-") for v in value.split(",") if v.strip()]
    bad = [v for v in got if v not in allowed]
    if bad:
        raise GpuBenchError(f"{flag}: unknown {', '.join(bad)}", f"pick from {', '.join(allowed)}")
    return got


def _commit() -> str:
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    ).stdout.strip()
    return (r.stdout.strip() or "unknown") + ("-dirty" if dirty else "")


# ---- measurements run inside the venv ---------------------------------------------------------------


def bandwidth(out: Path, gib: float = 1.0, reps: int = 20) -> dict:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written per second), best of `reps`."""
    n = int(gib * 2**30)
    try:
        import torch

        if torch.cuda.is_available():
            a, b = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
            best = float("inf")
            for _ in range(reps):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                b.copy_(a)
                e.record()
                torch.cuda.synchronize()
                best = min(best, s.elapsed_time(e) / 1e3)
            res = {"method": "torch copy_ (cuda events)", "gbs": 2 * n / best / 1e9}
            return _write(out, res)
    except ImportError:
        pass
    try:
        import cupy

        a, b = cupy.empty(n, dtype=cupy.uint8), cupy.empty(n, dtype=cupy.uint8)
        best = float("inf")
        for _ in range(reps):
            s, e = cupy.cuda.Event(), cupy.cuda.Event()
            s.record()
            b[...] = a
            e.record()
            e.synchronize()
            best = min(best, cupy.cuda.get_elapsed_time(s, e) / 1e3)
        return _write(out, {"method": "cupy copy (cuda events)", "gbs": 2 * n / best / 1e9})
    except ImportError:
        pass
    return _write(out, _ort_bandwidth(n, reps))


def _ort_bandwidth(n: int, reps: int) -> dict:
    """onnxruntime-gpu only: an Identity graph with input and output bound to device buffers (a D2D copy)."""
    import time

    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "copy",
        [helper.make_tensor_value_info("x", TensorProto.UINT8, [n])],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, [n])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CUDAExecutionProvider"])
    x = ort.OrtValue.ortvalue_from_numpy(np.zeros(n, np.uint8), "cuda", 0)
    y = ort.OrtValue.ortvalue_from_shape_and_type([n], np.uint8, "cuda", 0)
    io = sess.io_binding()
    io.bind_ortvalue_input("x", x)
    io.bind_ortvalue_output("y", y)
    best = float("inf")
    for _ in range(reps):  # host-timed: includes a launch and a sync, so a slight underestimate
        t = time.perf_counter()
        sess.run_with_iobinding(io)
        io.synchronize_outputs()
        best = min(best, time.perf_counter() - t)
    return {
        "method": f"onnxruntime {ort.__version__} Identity, host-timed",
        "gbs": 2 * n / best / 1e9,
        "onnx": onnx.__version__,
    }


def _write(out: Path, res: dict) -> dict:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res))
    return res


def gguf(src: Path, ckpt: Path, q4: Path, quantize: Path) -> None:
    """The checkpoint to a Q4_0 GGUF with llama.cpp's own converter (a stand-in byte-level tokenizer, pre-tokenizer
    forced to qwen35, as bench/peers/peers.py does on the CPU) and its llama-quantize."""
    sys.path.insert(0, str(ROOT))
    from deltaship.models.presets import write_tiny_tokenizer

    if not (ckpt / "tokenizer.json").exists():
        write_tiny_tokenizer(ckpt)
    f16 = q4.with_name(q4.stem + "-f16.gguf")
    q4.parent.mkdir(parents=True, exist_ok=True)
    conv = (
        "import sys, runpy; sys.argv = sys.argv[1:]; d = sys.argv[0].rsplit('/', 1)[0]; "
        "sys.path[:0] = [d, d + '/gguf-py']; import conversion.base as b; "
        "b.TextModel.get_vocab_base_pre = lambda self, tok: 'qwen35'; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    subprocess.check_call(
        [
            sys.executable,
            "-c",
            conv,
            str(src / "convert_hf_to_gguf.py"),
            str(ckpt),
            "--outtype",
            "f16",
            "--outfile",
            str(f16),
            "--no-mtp",
        ]
    )
    subprocess.check_call([str(quantize), str(f16), str(q4) + ".tmp", "Q4_0"])
    os.replace(str(q4) + ".tmp", q4)
    f16.unlink()


# ---- results ---------------------------------------------------------------------------------------


def bytes_per_token(manifest: dict, context: int) -> int:
    """Bytes one decode step streams: the stored weights (less an untied embedding table: a token reads one row of
    it; a tied one is the LM head, read whole), the DeltaNet states read and written, the KV cache read to `context`."""
    weights = sum(f["bytes"] for n, f in manifest["files"].items() if n.endswith((".onnx", ".data", ".onnx_data")))
    m = manifest["model"]
    if not m.get("tie_word_embeddings", True):
        emb = manifest.get("quantization", {}).get("embedding")
        if emb:
            elems = m["vocab_size"] * m["hidden_size"]
            weights -= elems * emb["bits"] // 8 + elems // emb["block_size"] * 2
        else:
            weights -= (
                m["vocab_size"] * m["hidden_size"] * (2 if manifest["precision"] in ("fp16", "int4", "int8") else 4)
            )
    mem = manifest["memory"]
    return weights + 2 * mem["deltanet_state_bytes"] + context * mem["kv_bytes_per_token"][mem["kv_dtype"]]


def _metric(profile: dict, metric: str, **key) -> float | None:
    for r in profile["results"]:
        if r["metric"] == metric and all(r.get(k) == v for k, v in key.items()):
            return r["median"]
    return None


def collect(work: Path) -> dict:
    """WORK/results/*.json -> one results JSON (and its markdown table) under WORK/results/."""
    res = work / "results"
    run = json.loads((res / "run.json").read_text())
    bw = json.loads((res / "bandwidth.json").read_text()) if (res / "bandwidth.json").exists() else None
    rows = []
    for preset in run["presets"]:
        for prec in run["precisions"]:
            name = bundle_name(preset, prec)
            prof, man = res / f"{name}-cuda.json", work / "bundles" / name / "manifest.json"
            if not prof.exists() or not man.exists():
                rows.append({"tool": "deltaship", "preset": preset, "precision": prec, "missing": True})
                continue
            p, m = json.loads(prof.read_text()), json.loads(man.read_text())
            rows.append(
                {
                    "tool": "deltaship",
                    "preset": preset,
                    "precision": prec,
                    "bundle": name,
                    **{f"prefill_{n}_tok_s": _metric(p, "prefill_tok_s", prompt_length=n) for n in PROMPTS},
                    "tpot_ms": (_metric(p, "tpot_s") or 0) * 1e3 or None,
                    **_capture_row(res / f"{name}-capture.json"),
                    "decode_context": PROMPTS[0],
                    "bytes_per_token": bytes_per_token(m, PROMPTS[0]),
                    "gpu_peak_bytes": _metric(p, "gpu_peak_bytes"),
                    "runtime": p.get("runtime"),
                    "measured": p.get("created"),
                }
            )  # a resumed run's date is the last invocation's
        for tool, f in (
            ("transformers bf16 eager", f"transformers-{preset}.json"),
            ("onnxruntime-genai-cuda int4", f"genai-{preset}.json"),
            ("llama.cpp CUDA Q4_0", f"llamacpp-{preset}.json"),
        ):
            if (res / f).exists():
                rows.append({"tool": tool, "preset": preset, **_peer_row(tool, json.loads((res / f).read_text()))})
    out = {**run, "bandwidth": bw, "rows": rows}
    (res / "gpu-bench.json").write_text(json.dumps(out, indent=2) + "\n")
    (res / "gpu-bench.md").write_text(table(out))
    print(table(out))
    return out


def _capture_row(path: Path) -> dict:
    """bench/gpu/capture.py speed's decode ms/token with and without CUDA graph capture, where it ran."""
    if not path.exists():
        return {}
    ms = json.loads(path.read_text())["decode_ms_per_token"]
    return {"decode_ms_uncaptured": ms.get("uncaptured"), "decode_ms_captured": ms.get("captured")}


def _peer_row(tool: str, d) -> dict:
    if tool.startswith("transformers"):
        return {
            "precision": "bf16",
            **{f"prefill_{n}_tok_s": d.get(f"prefill_{n}_tok_s") for n in PROMPTS},
            "tpot_ms": d.get("decode_ms_per_token"),
        }
    if tool.startswith("onnxruntime-genai"):  # bench/tools/peer_worker.py measures prompts of 128 and 512
        return {
            "precision": "int4",
            "prefill_512_tok_s": d.get("prefill_512_tok_s"),
            "tpot_ms": 1e3 / d["decode_tok_s"] if d.get("decode_tok_s") else None,
        }
    row: dict = {"precision": "Q4_0"}  # llama-bench -o json: one entry per test, n_prompt or n_gen set
    for t in d:
        if t.get("n_prompt") and not t.get("n_gen"):
            row[f"prefill_{t['n_prompt']}_tok_s"] = t["avg_ts"]
        elif t.get("n_gen"):
            row["tpot_ms"] = 1e3 / t["avg_ts"]
    return row


def _pair(row: dict) -> str:
    c, u = row.get("decode_ms_captured"), row.get("decode_ms_uncaptured")
    return f"{c:.2f} / {u:.2f}" if c is not None and u is not None else ""


def table(res: dict) -> str:
    """The markdown page: header (date, machine, commit, command, bandwidth) and one row per bundle / peer."""
    m = res.get("machine") or {}
    bw = (res.get("bandwidth") or {}).get("gbs")
    lines = [
        f"- **Date:** {res.get('date')}",
        f"- **Machine:** {m.get('gpu')}, driver {m.get('driver')}, CUDA {m.get('cuda')}",
        f"- **Commit:** `{res.get('commit')}`",
        f"- **Command:** `{res.get('command')}`",
        "- **Device copy bandwidth:** " + (f"{bw:.0f} GB/s ({res['bandwidth']['method']})" if bw else "not measured"),
        "",
        "| model | tool | precision | prefill 512 tok/s | prefill 4096 tok/s | decode ms/token | "
        "decode ms/token captured / uncaptured | GB streamed/token | roofline ms/token | % of roofline | GPU peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x, fmt="{:,.0f}"):
        return fmt.format(x) if x is not None else ""

    for r in res["rows"]:
        if r.get("missing"):
            lines.append(f"| {r['preset']} | {r['tool']} | {r['precision']} | not run | | | | | | | |")
            continue
        bpt, tpot = r.get("bytes_per_token"), r.get("tpot_ms")
        roof = bpt / (bw * 1e9) * 1e3 if bpt and bw else None
        frac = roof / tpot if roof and tpot else None
        peak = r.get("gpu_peak_bytes")
        lines.append(
            f"| {r['preset']} | {r['tool']} | {r['precision']} | {f(r.get('prefill_512_tok_s'))} | "
            f"{f(r.get('prefill_4096_tok_s'))} | {f(tpot, '{:.2f}')} | {_pair(r)} | {f(bpt and bpt / 1e9, '{:.2f}')} | "
            f"{f(roof, '{:.2f}')} | {f(frac and 100 * frac, '{:.0f}%')} | {f(peak and peak / 2**20)} |"
        )
    lines += [
        "",
        "decode ms/token: `deltaship profile`'s tpot (bundles exported with --onnx-cuda-graph: decode captured). "
        "Captured / uncaptured: bench/gpu/capture.py speed, the two sessions alternated in one process.",
        "",
        "Roofline: bytes streamed per decoded token (weights less an untied embedding table, DeltaNet states "
        "read and written, KV cache read at the 512-token context) / the device copy bandwidth. Peers' "
        "bytes are not computed (their formats differ), so their roofline columns are empty.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if argv and argv[0] in ("bandwidth", "gguf", "collect", "report"):
        sub = p.add_subparsers(dest="cmd", required=True)
        b = sub.add_parser("bandwidth")
        b.add_argument("--json", type=Path, required=True)
        g = sub.add_parser("gguf")
        for x in ("src", "ckpt", "q4"):
            g.add_argument(x, type=Path)
        g.add_argument("--quantize", type=Path, required=True)
        c = sub.add_parser("collect")
        c.add_argument("work", type=Path)
        r = sub.add_parser("report")
        r.add_argument("results", type=Path)
        r.add_argument("--md", type=Path)
        a = p.parse_args(argv)
        if a.cmd == "bandwidth":
            bandwidth(a.json)
        elif a.cmd == "gguf":
            gguf(a.src, a.ckpt, a.q4, a.quantize)
        elif a.cmd == "collect":
            collect(a.work)
        else:
            md = table(json.loads(a.results.read_text()))
            a.md.write_text(md) if a.md else print(md, end="")
        return 0
    p.add_argument(
        "--work",
        type=Path,
        default=Path(os.environ.get("DELTASHIP_GPU_WORK", "/tmp/deltaship-gpu")),
        help="where venvs, bundles, logs and results go (default /tmp/deltaship-gpu)",
    )
    p.add_argument("--only", help=f"comma-separated presets ({', '.join(PRESETS)}); default all")
    p.add_argument("--precisions", help=f"comma-separated ({', '.join(PRECISIONS)}); default both")
    p.add_argument("--skip-peers", help=f"comma-separated peers to leave out ({', '.join(PEERS)})")
    p.add_argument("--torch-cpu", action="store_true", help="torch's CPU build (export only; no transformers peer)")
    p.add_argument("--dry-run", action="store_true", help="print the plan (done/todo per step) and exit")
    a = p.parse_args(argv)
    try:
        return run(a)
    except GpuBenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
