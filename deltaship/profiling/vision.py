"""Image-side profiling of a bundle exported with --vision: encode latency, memory and image+question TTFT
per image size.

Each image size runs in a fresh process (`python -m deltaship.profiling.vision CONFIG_JSON`, started like
the text worker, under the same tier limits), so its peak RSS is that of one session encoding images of that
size and nothing larger. The image is seeded noise of the stated size (the tower's cost depends on the patch
count, not the content); the bundle's preprocessor resizes it into its pixel limits first, and the records
say to what size and how many image tokens.

Records (profiling JSON `results`, each with `image` "WxH", `resized` [h, w], `image_tokens`):
  image_preprocess_s     resize + normalize + patchify on the host (NumPy/PIL)
  image_encode_s         the vision encoder alone (all temporal groups of the image: one for a still image)
  image_ttft_s           an image + question prompt, from the image's pixels to the first token: preprocess,
                         encode, prefill of the whole prompt (a few text tokens, the image span, a question of
                         QUESTION_TOKENS tokens)
  image_peak_rss_bytes   the process's peak RSS after all of the above (VmHWM)
  image_rss_growth_bytes that peak above the RSS with the session open and no image seen yet
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from deltaship.errors import DeltashipError
from deltaship.models.vision import preprocess_image
from deltaship.profiling.worker import now, peak_rss_bytes, record, repeat, rss_bytes
from deltaship.targets import open_bundle, open_multimodal

# the default sizes: three square photos and a document page at OCR resolution (US letter at 200 dpi)
DEFAULT_SIZES = ["224x224", "448x448", "896x896", "page"]
NAMED = {"page": (1700, 2200)}  # width x height
QUESTION_TOKENS = 16


def parse_sizes(text: str | list[str] | None) -> list[str]:
    """'224,448x336,page' -> ['224x224', '448x336', 'page']; 'none' -> []."""
    if text is None:
        return list(DEFAULT_SIZES)
    items = [s.strip() for s in (text.split(",") if isinstance(text, str) else text) if s.strip()]
    if items == ["none"]:
        return []
    for s in items:
        size(s)  # a bad name is refused before any work
    return [s if s in NAMED or "x" in s else f"{s}x{s}" for s in items]


def size(name: str) -> tuple[int, int]:
    """(width, height) of an image size name: 'WxH', 'N' (square) or 'page'."""
    if name in NAMED:
        return NAMED[name]
    parts = name.lower().split("x")
    try:
        w, h = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    except (ValueError, IndexError):
        w = h = 0
    if len(parts) > 2 or w < 1 or h < 1:
        raise DeltashipError(
            f"--image-sizes: {name!r} is not an image size", "use WxH, N (square) or page, e.g. 224,448x336,page"
        )
    return w, h


def check_sizes(
    manifest: dict[str, Any], text: str | list[str] | None, device: str, provider: str, runtime: str | None
) -> list[str]:
    """The image sizes `deltaship profile` runs: the defaults for a --vision bundle on the host, none for a
    text-only bundle; an explicit list where it cannot run is refused."""
    sizes = parse_sizes(text)
    runnable = device == "host" and provider == "cpu" and runtime is None
    if text is None or not sizes:  # the default: only where it can run
        return sizes if sizes and manifest.get("vision") and runnable else []
    if not manifest.get("vision"):
        raise DeltashipError(
            "--image-sizes: this bundle has no vision tower", "export with --vision, or drop --image-sizes"
        )
    if not runnable:
        raise DeltashipError(
            "--image-sizes profiles on the host's CPU in deltaship's own session only so far",
            "pass --image-sizes none, or profile on the host without --provider/--runtime",
        )
    return sizes


def profile_images(
    path: Path,
    sizes: list[str],
    cfg: dict[str, Any],
    threads: int | None,
    run: Callable[[dict[str, Any]], tuple[dict | None, dict | None]],
    say: Callable[[str], None],
) -> list[dict[str, Any]]:
    """One fresh worker per image size (`run` starts it, under the tier's memory cap): its records, or a
    'died' record naming the size."""
    results = []
    for s in sizes:
        say(f"profiling image encode + TTFT at {s} (a fresh process)")
        wcfg = {
            "bundle": str(path),
            "threads": threads,
            "image": s,
            **{k: cfg[k] for k in ("warmups", "reps", "min_seconds")},
        }
        out, died = run(wcfg)
        if died:
            results.append({**died, "image": s})
        else:
            results += out["results"]
    return results


# ---- the worker -------------------------------------------------------------------------------
def run_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    from PIL import Image  # lazy: PIL: images only

    rep = (cfg.get("warmups", 2), cfg.get("reps", 5), cfg.get("min_seconds", 1.0))
    name = cfg["image"]
    w, h = size(name)
    session = open_bundle(cfg["bundle"], threads=cfg.get("threads"), check_hashes=False)
    mm = open_multimodal(session)
    base_rss = rss_bytes()
    pixels = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    im = preprocess_image(image, mm.pre)
    where = {"image": name, "resized": list(im.resized), "image_tokens": im.tokens(mm.spec.spatial_merge_size)}
    if where["image_tokens"] > mm.max_image_tokens:
        raise DeltashipError(
            f"image {name}: {where['image_tokens']} tokens after resizing, over the bundle's {mm.max_image_tokens}",
            "this is a deltaship bug: the bundle's max_pixels should keep images within its limit",
        )

    def timed(fn: Callable[[], Any]) -> Callable[[], float]:
        def go() -> float:
            t0 = now()
            fn()
            return now() - t0

        return go

    results = [
        record("image_preprocess_s", "s", repeat(timed(lambda: preprocess_image(image, mm.pre)), *rep), **where),
        record("image_encode_s", "s", repeat(timed(lambda: mm.encode_input(im)), *rep), **where),
    ]
    # the prompt: a few text tokens, the image span (as `generate --image` writes it), a question of
    # QUESTION_TOKENS text tokens (none of them a vision marker), a few more text tokens
    sp, vocab = mm.spec, int(session.manifest["model"]["vocab_size"])
    markers = {sp.image_token_id, sp.video_token_id, sp.vision_start_token_id, sp.vision_end_token_id}
    text = [i for i in range(1, min(vocab, 4096)) if i not in markers]
    question = [text[(7 * k) % len(text)] for k in range(QUESTION_TOKENS)]
    prompt = text[:3] + [sp.vision_start_token_id, sp.image_token_id, sp.vision_end_token_id] + question + text[3:6]

    def ttft() -> None:
        one = preprocess_image(image, mm.pre)
        logits = mm.prefill(mm.expand(prompt, [one]), [one])
        int(np.argmax(logits))

    results.append(record("image_ttft_s", "s", repeat(timed(ttft), *rep), **where))
    peak = peak_rss_bytes()
    results.append(record("image_peak_rss_bytes", "bytes", [float(peak)], **where))
    results.append(record("image_rss_growth_bytes", "bytes", [float(max(0, peak - base_rss))], **where))
    return {"results": results, "prompt_tokens": len(mm.expand(prompt, [im]))}


def main() -> int:
    cfg = json.loads(sys.argv[1])
    t0 = time.monotonic()
    out = run_worker(cfg)
    out["seconds"] = round(time.monotonic() - t0, 3)
    sys.stdout.write(json.dumps(out))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DeltashipError as e:
        print(f"deltaship profile: {e}", file=sys.stderr)
        sys.exit(2)
