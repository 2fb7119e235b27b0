"""Image-encode latency of the vision tower at the published shapes: one image per call, as a bundle runs it.

    python bench/runtimes/vision_encode.py --out docs/results/vision-encode.md [--models qwen3.5-0.8b,qwen3.5-2b]
        [--sizes 224,448,896] [--reps 5] [--threads 0] [--executorch] [--note "loaded machine"]

For each preset, builds the tower alone from the preset's random vision weights (the tower does not depend on
the values) as `export --vision` lowers it: vision.onnx (ONNX Runtime, CPU provider) and, with --executorch,
vision.pte's `vision_encoder` (XNNPACK; its patch bound is the largest image asked for). Each image is seeded
noise of S x S pixels, preprocessed by Qwen3.5's published preprocessor (224 px is below its min_pixels and is
upscaled to 256 x 256); the timed call is the graph alone (inputs computed beforehand). Writes the markdown
page and the JSON of every sample (bench/results/vision-encode.json, or --json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from deltaship.models.source import load_source
from deltaship.models.vision import (
    DEFAULT_PREPROCESSOR,
    Preprocessor,
    VisionWeights,
    encoder_inputs,
    preprocess_image,
    vision_spec_of,
)
from deltaship.stats import summarize


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines() if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores, {mem:.0f} GiB"


def timed(run, reps: int) -> list[float]:
    run()  # warm-up (ONNX Runtime / XNNPACK plan their buffers on the first call)
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        out.append(time.perf_counter() - t)
    return out


def bench_model(name: str, sizes: list[int], reps: int, threads: int, executorch: bool, tmp: Path) -> list[dict]:
    import onnxruntime as ort
    from PIL import Image

    from deltaship.lowering.onnx.vision import build_vision

    source = load_source(name)
    spec = vision_spec_of(source)
    if spec is None:
        raise SystemExit(f"{name} has no vision tower")
    weights = VisionWeights(source.weights.files, spec, name)
    pre = Preprocessor.from_config(DEFAULT_PREPROCESSOR)
    rng = np.random.default_rng(0)
    images = {s: preprocess_image(Image.fromarray(rng.integers(0, 256, (s, s, 3), dtype=np.uint8)), pre) for s in sizes}
    inputs = {s: encoder_inputs(spec, im) for s, im in images.items()}
    rows = []

    path = tmp / f"{name}-vision.onnx"
    t = time.perf_counter()
    build_vision(spec, weights, path)
    build_s = time.perf_counter() - t
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
    for s in sizes:
        samples = timed(lambda s=s: sess.run(["image_features"], inputs[s]), reps)
        rows.append(_row(name, "onnxruntime", s, images[s], spec, samples, build_s))

    if executorch:
        import torch
        from executorch.runtime import Runtime

        from deltaship.lowering.executorch.vision import INPUTS, lower_vision_pte

        pte = tmp / f"{name}-vision.pte"
        t = time.perf_counter()
        lower_vision_pte(spec, weights, pte, max(im.patches.shape[0] for im in images.values()))
        build_s = time.perf_counter() - t
        method = Runtime.get().load_program(str(pte)).load_method("vision_encoder")
        for s in sizes:
            args = [torch.from_numpy(inputs[s][n]) for n in INPUTS]
            samples = timed(lambda args=args: method.execute(args), reps)
            rows.append(_row(name, "executorch-xnnpack", s, images[s], spec, samples, build_s))
    return rows


def _row(name, runtime, side, image, spec, samples, build_s) -> dict:
    h, w = image.resized
    st = summarize(samples)
    return {
        "model": name,
        "tower": f"{spec.depth} x {spec.hidden_size}",
        "runtime": runtime,
        "image": side,
        "resized": [h, w],
        "patches": int(image.patches.shape[0]),
        "tokens": image.tokens(spec.spatial_merge_size),
        "median_s": st["median"],
        "p90_s": st["p90"],
        "cv": st["cv"],
        "samples_s": samples,
        "build_s": build_s,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True, help="the markdown page; the JSON goes beside it")
    ap.add_argument("--models", default="qwen3.5-0.8b")
    ap.add_argument("--sizes", default="224,448,896")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: its default)")
    ap.add_argument("--executorch", action="store_true", help="also vision.pte's vision_encoder (XNNPACK)")
    ap.add_argument("--note", default="", help="a line about the conditions (e.g. a machine shared with other jobs)")
    ap.add_argument("--json", type=Path, help="every sample (default: bench/results/ + the page's name, .json)")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="deltaship-vis-bench-") as tmp:
        for name in a.models.split(","):
            rows += bench_model(name, sizes, a.reps, a.threads, a.executorch, Path(tmp))
            print(f"{name}: done", file=sys.stderr)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "machine": machine(),
        "command": "python bench/runtimes/vision_encode.py " + " ".join(shlex.quote(x) for x in sys.argv[1:]),
        "note": a.note,
        "threads": a.threads,
        "rows": rows,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    raw = a.json or Path("bench/results") / a.out.with_suffix(".json").name
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(result, indent=1))
    lines = [
        "# Vision tower: image-encode latency",
        "",
        f"- **Measured:** {result['date']}, commit `{commit}`",
        f"- **Machine:** {result['machine']}, ONNX Runtime threads {a.threads or 'default'}",
        f"- **Command:** `{result['command']}`",
        f"- **Raw:** {raw.as_posix()}",
    ]
    if a.note:
        lines.append(f"- **Conditions:** {a.note}")
    lines += [
        "- **What:** one image per call through the tower alone (random weights at the preset's published vision"
        " shape, fp32), inputs precomputed; median and p90 of the timed calls after one warm-up.",
        "",
        "| model | tower | runtime | image | resized | patches | tokens | median | p90 | CV |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        h, w = r["resized"]
        lines.append(
            f"| {r['model']} | {r['tower']} | {r['runtime']} | {r['image']} px | {w}x{h} | {r['patches']} | "
            f"{r['tokens']} | {r['median_s'] * 1e3:.0f} ms | {r['p90_s'] * 1e3:.0f} ms | {r['cv']:.2f} |"
        )
    a.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
