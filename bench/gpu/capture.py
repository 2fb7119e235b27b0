"""CUDA graph capture of the decode step on ONNX Runtime's CUDA provider (bundles exported with --onnx-cuda-graph):
parity against the CPU provider and decode/prefill speed with and without capture, in one process per bundle.

    python bench/gpu/capture.py export --work DIR [--only tiny,0.8b-int4,...]   # the bundles (CPU work, any machine)
    python bench/gpu/capture.py parity --work DIR --json OUT.json              # trained tiny: CUDA (+graph) vs CPU
    python bench/gpu/capture.py speed BUNDLE --json OUT.json [--bandwidth GBS] # one bundle: graph on/off
    python bench/gpu/capture.py run --work DIR --out OUTDIR [--deadline S]     # all of it, as bundles get ready
    python bench/gpu/capture.py check [--speed LIST]                          # the lease's plan, checked on the CPU

`check` (what `bash bench/gpu/capture.sh dry-run` runs first) refuses a typo before a device minute is spent: every
bundle's model preset and export options through the ONNX target's own checks and the CLI's parser, every name in
--speed, every file the lease script reads.

Needs onnxruntime-gpu 1.31 (CUDA 13) in place of onnxruntime; bench/gpu/capture.sh brings it onto the lent
machine. What was measured and how: docs/results/gpu.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# name -> (model, precision, export options); the tiny ones for parity, the published shapes for speed
BUNDLES = {
    "tiny-fp16": ("qwen3.5-tiny", "fp16", {"onnx_cuda_graph": True}),
    "tiny-int4": ("qwen3.5-tiny", "int4", {"onnx_cuda_graph": True, "onnx_activations": "fp16"}),
    "tiny-fp32": ("qwen3.5-tiny", "fp32", {}),
    "tiny-fp16-plain": ("qwen3.5-tiny", "fp16", {}),
    "0.8b-int4": ("qwen3.5-0.8b", "int4", {"onnx_cuda_graph": True, "onnx_activations": "fp16"}),
    "0.8b-fp16": ("qwen3.5-0.8b", "fp16", {"onnx_cuda_graph": True}),
    "2b-int4": ("qwen3.5-2b", "int4", {"onnx_cuda_graph": True, "onnx_activations": "fp16"}),
    "4b-int4": ("qwen3.5-4b", "int4", {"onnx_cuda_graph": True, "onnx_activations": "fp16"}),
    "9b-int4": ("qwen3.5-9b", "int4", {"onnx_cuda_graph": True, "onnx_activations": "fp16"}),
    # the trained tiny's head: speculative decoding captured on CUDA against plain greedy on the CPU provider
    "tiny-fp16-mtp": ("qwen3.5-tiny", "fp16", {"onnx_cuda_graph": True, "mtp": True}),
    # DeltaNet's conv and output norm as ONNX Runtime's CausalConvWithState / GatedRMSNorm (CUDA kernels in 1.31.1):
    # 17 nodes fewer per DeltaNet layer (tests/test_cuda_graph.py NODES_PER_LAYER), timed beside 0.8b-int4
    "0.8b-int4-contrib": (
        "qwen3.5-0.8b",
        "int4",
        {"onnx_cuda_graph": True, "onnx_activations": "fp16", "onnx_deltanet_ops": "contrib"},
    ),
    # speculative decoding (--mtp): plain captured decode and MTP depth 1 at an imposed acceptance, on one bundle
    "0.8b-int4-mtp": ("qwen3.5-0.8b", "int4", {"onnx_cuda_graph": True, "onnx_activations": "fp16", "mtp": True}),
    "2b-int4-mtp": ("qwen3.5-2b", "int4", {"onnx_cuda_graph": True, "onnx_activations": "fp16", "mtp": True}),
    "9b-int4-mtp": ("qwen3.5-9b", "int4", {"onnx_cuda_graph": True, "onnx_activations": "fp16", "mtp": True}),
}
# the trained tiny head's measured depth-1 acceptance (docs/results/mtp.md), imposed on the published shapes' heads
# (random weights: their own heads accept nothing)
IMPOSED_ACCEPTANCE = 0.75
TINY_CHUNK = 8  # tiny bundles: prompts of 1, 7 and 20 tokens are shorter and longer than a prefill chunk
MAX_CONTEXT = 8192  # published shapes: room for the 4096-token prefill and decode after it
CODE = b"def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


def code_prompt(n: int) -> list[int]:
    """n bytes of a short Python function, repeated: what the trained tiny (byte-level) model continues well."""
    return list((CODE * (n // len(CODE) + 1))[:n])


def export_all(work: Path, only: list[str] | None) -> None:
    from deltaship.compile import export

    for name, (model, precision, opts) in BUNDLES.items():
        out = work / name
        if (only and name not in only) or (out / "manifest.json").exists():
            continue
        t = time.time()
        tiny = model == "qwen3.5-tiny"
        export(
            model,
            out,
            target="onnx",
            precision=precision,
            verify=False,
            progress=False,
            max_context=128 if tiny else MAX_CONTEXT,
            prefill_chunk=TINY_CHUNK if tiny else None,
            **opts,
        )
        print(f"exported {name} in {time.time() - t:.0f} s", flush=True)


REHEARSE = False  # --rehearse: every "cuda" session on the CPU provider (the graph path with host buffers)


def _open(bundle: Path, provider: str, graph: bool = False):
    from deltaship.targets import open_bundle

    if REHEARSE:  # a run of this script's own code on a machine without a GPU, as tests/test_cuda_graph.py does
        s = open_bundle(bundle)
        if graph:
            s.cuda_graph = True
            s._graph_buffers("cpu", plan_for="CUDAExecutionProvider")
        return s
    return open_bundle(bundle, provider=provider, **({"cuda_graph": graph} if provider == "cuda" else {}))


def _run(session, prompt: list[int], steps: int):
    session.reset()
    g = session.generate(prompt, steps, stop_at_eos=False, keep_logits=True)
    return g.output_ids, np.stack(g.logits)


def parity(work: Path, steps: int = 64) -> dict:
    """Greedy tokens and logits of the CUDA provider, uncaptured and captured, against the CPU provider."""
    rows = []
    for name in ("tiny-fp16", "tiny-int4"):
        b = work / name
        cpu, cuda, graph = _open(b, "cpu"), _open(b, "cuda"), _open(b, "cuda", graph=True)
        for n in (1, 7, 20):
            prompt = code_prompt(n)
            want, lw = _run(cpu, prompt, steps)
            got = {}
            for label, s in (("cuda", cuda), ("cuda_graph", graph), ("cuda_graph_again", graph)):
                ids, lg = _run(s, prompt, steps)
                scale = float(lw.std())
                got[label] = {
                    "tokens_equal_cpu": ids == want,
                    "first_difference": next((i for i, (a, c) in enumerate(zip(ids, want)) if a != c), None),
                    "max_abs_logit_diff_vs_cpu": float(np.abs(lg - lw).max()),
                    "max_rel_logit_diff_vs_cpu": float(np.abs(lg - lw).max() / scale),
                }
            _, lu = _run(cuda, prompt, steps)
            _, lg = _run(graph, prompt, steps)
            rows.append(
                {
                    "bundle": name,
                    "prompt_length": n,
                    "new_tokens": steps,
                    **got,
                    "graph_vs_uncaptured_max_abs_diff": float(np.abs(lg - lu).max()),
                    "runtime": graph.runtime_name(),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    spec_rows = []  # the trained tiny's head: speculative decoding captured on CUDA == plain greedy on the CPU
    if (work / "tiny-fp16-mtp" / "manifest.json").exists():
        from deltaship.runtimes.speculative import generate_speculative

        b = work / "tiny-fp16-mtp"
        cpu, graph = _open(b, "cpu"), _open(b, "cuda", graph=True)
        for n in (1, 7, 20):
            cpu.reset()
            want = cpu.generate(code_prompt(n), steps, stop_at_eos=False).output_ids
            for label in ("captured", "captured_again"):
                got, st = generate_speculative(graph, code_prompt(n), steps, stop_at_eos=False)
                spec_rows.append(
                    {
                        "bundle": b.name,
                        "prompt_length": n,
                        "run": label,
                        "tokens_equal_cpu_plain_greedy": got.output_ids == want,
                        "first_difference": next(
                            (i for i, (a, c) in enumerate(zip(got.output_ids, want)) if a != c), None
                        ),
                        "acceptance_rate": st.as_dict()["acceptance_rate"],
                        "rollbacks": st.rollbacks,
                        "graphs": len(graph._graphs),
                    }
                )
                print(json.dumps(spec_rows[-1]), flush=True)
    plain_rows = []  # bundles without the rewrite, on CUDA uncaptured (fp32: GQA runs on the CPU there)
    for name in ("tiny-fp32", "tiny-fp16-plain"):
        cpu, cuda = _open(work / name, "cpu"), _open(work / name, "cuda")
        for n in (1, 7, 20):
            want, lw = _run(cpu, code_prompt(n), steps)
            ids, lg = _run(cuda, code_prompt(n), steps)
            plain_rows.append(
                {
                    "bundle": name,
                    "prompt_length": n,
                    "tokens_equal_cpu": ids == want,
                    "max_rel_logit_diff_vs_cpu": float(np.abs(lg - lw).max() / lw.std()),
                    "runtime": cuda.runtime_name(),
                }
            )
    return {"rows": rows, "speculative": spec_rows, "plain_uncaptured": plain_rows, "refusals": _refusals(work)}


def _refusals(work: Path) -> dict:
    """What ORT itself says when asked to capture the plain graph, and deltaship's errors around it."""
    import onnxruntime as ort

    from deltaship.errors import DeltashipError

    out = {}
    try:
        ort.InferenceSession(
            str(work / "tiny-fp32" / "model.onnx"),
            providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"}), "CPUExecutionProvider"],
        )
        out["ort_plain_graph"] = "accepted"
    except Exception as e:  # ORT raises its own exception types
        out["ort_plain_graph"] = str(e)[:400]
    try:
        _open(work / "tiny-fp32", "cuda", graph=True)
    except DeltashipError as e:
        out["deltaship_plain_bundle"] = str(e)[:400]
    return out


def ort_placement(bundle: Path) -> dict:
    """ORT's own placement log (INFO) for the CUDA session of a bundle, in a subprocess (ORT logs on fd 2)."""
    code = (
        "import onnxruntime as o, sys; so = o.SessionOptions(); so.log_severity_level = 0; "
        "o.InferenceSession(sys.argv[1], so, providers=['CUDAExecutionProvider', 'CPUExecutionProvider'])"
    )
    manifest = json.loads((bundle / "manifest.json").read_text())
    p = subprocess.run([sys.executable, "-c", code, str(bundle / manifest["entry"])], capture_output=True, text=True)
    keep, cpu_block = [], False
    for ln in (p.stdout + p.stderr).splitlines():
        if "placed on" in ln:
            cpu_block = "CPUExecutionProvider" in ln
            keep.append(ln[-300:])
        elif ln[:4].isdigit():  # a new log record ends a placement block
            cpu_block = False
            if "Memcpy" in ln:
                keep.append(ln[-300:])
        elif cpu_block:  # a node of the CPU placement block ("  Gather (n_Gather_5)")
            keep.append(ln[-300:])
    return {"lines": keep[:80], "rc": p.returncode}


def speed(
    bundle: Path,
    bandwidth_gbs: float | None,
    reps: int = 4,
    steps: int = 64,
    prompt_len: int = 128,
    prefills=(512, 4096),
) -> dict:
    """Decode ms/token (after a 128-token prompt) with and without the captured graph, alternating the two
    sessions rep by rep; prefill tokens/s at 512 and 4096 (never captured: measured once, uncaptured)."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    plain, graph = _open(bundle, "cuda"), _open(bundle, "cuda", graph=True)
    prompt = code_prompt(prompt_len)
    decode = {"uncaptured": [], "captured": []}
    for s in (plain, graph):  # warm-up: allocations, and the capture of both parity graphs
        s.reset()
        s.prefill(prompt)
        s.decode(1)
        s.decode(1)
        s.decode(1)
    for _ in range(reps):
        for label, s in (("uncaptured", plain), ("captured", graph)):
            s.reset()
            s.prefill(prompt)
            tok = 1
            t = time.perf_counter()
            for _ in range(steps):
                tok = int(np.argmax(s.decode(tok)))
            decode[label].append((time.perf_counter() - t) / steps * 1e3)
    prefill = {}
    for n in prefills:
        times = []
        for _ in range(3):
            plain.reset()
            t = time.perf_counter()
            plain.prefill(code_prompt(n))
            times.append(time.perf_counter() - t)
        prefill[n] = n / statistics.median(times)
    row = {
        "bundle": bundle.name,
        "runtime": graph.runtime_name(),
        "decode_ms_per_token": {k: statistics.median(v) for k, v in decode.items()},
        "decode_ms_per_token_runs": decode,
        "prefill_tokens_per_s": prefill,
        "weights_gib": sum(f["bytes"] for n, f in manifest["files"].items() if ".onnx" in n) / 2**30,
        # what the decode step launches (deltaship/lowering/onnx/census.py) and what the CUDA lowering fused
        "nodes_per_layer": manifest["lowering"].get("nodes_per_layer"),
        "fusions": manifest["lowering"].get("fusions"),
        "deltanet_ops": manifest["lowering"].get("deltanet_ops", {}).get("mode"),
    }
    if bandwidth_gbs:
        sys.path.insert(0, str(ROOT / "bench" / "gpu"))
        from run import bytes_per_token

        b = bytes_per_token(manifest, prompt_len + steps // 2)
        row["gb_per_token"] = b / 1e9
        row["roofline_ms"] = b / (bandwidth_gbs * 1e9) * 1e3
        row["roofline_fraction"] = {k: row["roofline_ms"] / v for k, v in row["decode_ms_per_token"].items()}
    print(json.dumps({k: row[k] for k in row if k != "decode_ms_per_token_runs"}), flush=True)
    return row


def speculative_speed(
    bundle: Path, acceptance: float = IMPOSED_ACCEPTANCE, reps: int = 4, steps: int = 64, prompt: int = 128
) -> dict:
    """Captured decode ms/token of an --mtp bundle, plain (one token a call) and speculative (MTP depth 1: a draft
    call and a 2-token verify call per step) with `acceptance` imposed on the verify rows (ImposedAcceptance), the
    two alternated rep by rep in one session; the ratio is the speed-up the issue asks >= 1.5x of."""
    from deltaship.profiling.speculative.imposed import ImposedAcceptance
    from deltaship.runtimes.speculative import generate_speculative

    s = _open(bundle, "cuda", graph=True)
    ids = code_prompt(prompt)
    times: dict[str, list[float]] = {"plain": [], "speculative": []}
    stats = None
    for rep in range(reps + 1):  # rep 0 warms up: allocations and the captures of every graph
        s.reset()
        t = time.perf_counter()
        s.generate(ids, steps, stop_at_eos=False)
        plain = (time.perf_counter() - t) / steps * 1e3
        rigged = ImposedAcceptance(s, acceptance, seed=rep)
        t = time.perf_counter()
        gen, stats = generate_speculative(rigged, ids, steps, stop_at_eos=False)
        spec = (time.perf_counter() - t) / len(gen.output_ids) * 1e3
        if rep:
            times["plain"].append(plain)
            times["speculative"].append(spec)
    row = {
        "bundle": bundle.name,
        "runtime": s.runtime_name(),
        "imposed_acceptance": acceptance,
        "ms_per_token": {k: statistics.median(v) for k, v in times.items()},
        "runs": times,
        "last_run": stats.as_dict(),
        "note": f"each includes the {prompt}-token prompt's prefill, uncaptured, over {steps} new tokens",
    }
    row["speedup"] = row["ms_per_token"]["plain"] / row["ms_per_token"]["speculative"]
    print(json.dumps({k: row[k] for k in row if k != "runs"}), flush=True)
    return row


def check(speed_names=None) -> list[str]:
    """The lease's plan checked on this machine, without exporting or running anything: each bundle's preset and
    options through the ONNX target's own checks and the CLI's parser, the --speed names, the files the lease
    script reads. Returns the problems (empty: ready)."""
    from deltaship.cli import build_parser
    from deltaship.models.presets import PRESETS
    from deltaship.targets.registry import get_target

    problems = []
    target = get_target("onnx")
    for name, (model, precision, opts) in BUNDLES.items():
        if model not in PRESETS:
            problems.append(f"{name}: no preset {model}")
            continue
        tiny = model == "qwen3.5-tiny"
        unknown = sorted(set(opts) - {f.name for f in dataclasses.fields(target.Options)})
        if unknown:  # (argparse would take a prefix of a flag: --onnx-activation for --onnx-activations)
            problems.append(f"{name}: {', '.join(unknown)}: not an option of the ONNX target")
            continue
        try:
            target.check(
                precision, 128 if tiny else MAX_CONTEXT, TINY_CHUNK if tiny else 512, target.typed_options(opts)
            )
        except Exception as e:  # the target's refusal, as the export would give it
            problems.append(f"{name}: {e}")
        argv = ["export", "--model", model, "--target", "onnx", "--precision", precision, "--out", "/nonexistent/b"]
        for k, v in opts.items():
            flag = "--" + k.replace("_", "-")
            argv += [flag] if v is True else [flag, str(v)]
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            problems.append(f"{name}: the CLI does not parse {' '.join(argv)}")
    for name in speed_names or ():
        if name not in BUNDLES:
            problems.append(f"--speed {name}: not a bundle here ({', '.join(BUNDLES)})")
    here = Path(__file__).parent
    for f in ("capture.sh", "placement.py", "fatbin.py", "run.py", "gpu_transformers.py"):
        if not (here / f).exists():
            problems.append(f"bench/gpu/{f} is missing")
    return problems


def bandwidth() -> dict:
    sys.path.insert(0, str(ROOT / "bench" / "gpu"))
    import tempfile

    from run import bandwidth as probe

    return probe(Path(tempfile.mkdtemp()) / "bandwidth.json")


SPEED = ("0.8b-int4", "0.8b-int4-contrib", "0.8b-int4-mtp", "2b-int4-mtp", "9b-int4-mtp")


def run_all(work: Path, out: Path, deadline: float, speed_names=SPEED) -> int:
    """Parity, then each published-shape bundle as its export (started elsewhere) finishes, until the deadline."""
    start = time.time()
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "speed": []}

    def save():
        (out / "capture.json").write_text(json.dumps(res, indent=2) + "\n")

    import onnxruntime as ort

    res["onnxruntime"] = ort.__version__
    smi = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    res["gpu"] = "none (rehearsal)" if REHEARSE else subprocess.run(smi, capture_output=True, text=True).stdout.strip()
    res["bandwidth"] = {} if REHEARSE else bandwidth()
    print("bandwidth", res["bandwidth"], flush=True)
    for name in ("tiny-fp16", "tiny-int4", "tiny-fp32", "tiny-fp16-plain", "tiny-fp16-mtp"):
        _wait(work / name, start + deadline)
    res["placement"] = {n: ort_placement(work / n) for n in ("tiny-fp16", "tiny-fp32", "tiny-fp16-plain")}
    save()
    res["parity"] = parity(work)
    save()
    for name in speed_names:
        left = start + deadline - time.time()
        if not _wait(work / name, start + deadline - 60) or left < 90:
            res.setdefault("skipped", []).append(name)
            continue
        try:
            res["speed"].append(speed(work / name, res["bandwidth"].get("gbs")))
            if BUNDLES[name][2].get("mtp"):
                save()
                res.setdefault("speculative", []).append(speculative_speed(work / name))
        except Exception as e:  # one bundle's failure is recorded, the others still run
            res["speed"].append({"bundle": name, "error": f"{type(e).__name__}: {e}"[:600]})
            print("error", name, e, flush=True)
        save()
    save()
    return 0


def _wait(bundle: Path, until: float) -> bool:
    while not (bundle / "manifest.json").exists():
        if time.time() > until or REHEARSE:
            return False
        time.sleep(2)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("--work", type=Path, required=True)
    e.add_argument("--only", default=None)
    q = sub.add_parser("parity")
    q.add_argument("--work", type=Path, required=True)
    q.add_argument("--json", type=Path, required=True)
    s = sub.add_parser("speed")
    s.add_argument("bundle", type=Path)
    s.add_argument("--json", type=Path, required=True)
    s.add_argument("--bandwidth", type=float, default=None, help="device copy bandwidth, GB/s (for the roofline)")
    s.add_argument(
        "--bandwidth-json", type=Path, default=None, help="or read it from bench/gpu/run.py's bandwidth.json"
    )
    c = sub.add_parser("check")
    c.add_argument("--speed", default=",".join(SPEED), help="the bundles the run will time")
    r = sub.add_parser("run")
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--deadline", type=float, default=540, help="seconds: start nothing that would end after it")
    r.add_argument("--speed", default=",".join(SPEED), help="the bundles to time, in order")
    for x in (q, s, r):
        x.add_argument("--rehearse", action="store_true", help="no GPU: run the script's code on the CPU provider")
    a = p.parse_args(argv)
    global REHEARSE
    REHEARSE = bool(getattr(a, "rehearse", False))
    if a.cmd == "check":
        problems = check(a.speed.split(","))
        for line in problems:
            print("problem:", line, file=sys.stderr)
        print(f"{len(BUNDLES)} bundles, speed list {a.speed}: " + ("ready" if not problems else "NOT ready"))
        return 1 if problems else 0
    if a.cmd == "export":
        export_all(a.work, a.only.split(",") if a.only else None)
    elif a.cmd == "parity":
        a.json.write_text(json.dumps(parity(a.work), indent=2) + "\n")
    elif a.cmd == "speed":
        gbs = a.bandwidth
        if gbs is None and a.bandwidth_json and a.bandwidth_json.exists():
            gbs = json.loads(a.bandwidth_json.read_text()).get("gbs")
        # a rehearsal on a tiny bundle (max context 128): the same code at sizes that fit it
        small = {"reps": 1, "steps": 8, "prompt_len": 16, "prefills": (32,)} if REHEARSE else {}
        row = speed(a.bundle, gbs, **small)
        if json.loads((a.bundle / "manifest.json").read_text()).get("speculative"):
            small = {"reps": 1, "steps": 8, "prompt": 16} if REHEARSE else {}
            row["speculative"] = speculative_speed(a.bundle, **small)
        a.json.write_text(json.dumps(row, indent=2) + "\n")
    else:
        return run_all(a.work, a.out, a.deadline, [x for x in a.speed.split(",") if x])
    return 0


if __name__ == "__main__":
    sys.exit(main())
