"""`deltaship generate`: a prompt through a bundle in its runtime (no torch for ONNX bundles)."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from deltaship import options
from deltaship.bundle.paths import bundle_path
from deltaship.chat.template import ChatTemplate, bundle_chat_template
from deltaship.constrain import Constraint, build_constraint, token_table
from deltaship.errors import DeltashipError, DeltashipRunError
from deltaship.failures import run_failure
from deltaship.files import read_json_object
from deltaship.models.vision import Preprocessor, load_image, smart_resize
from deltaship.progress import Progress, heartbeat
from deltaship.runtimes.genai import GENAI_CONSTRAINT
from deltaship.runtimes.speculative import generate_speculative, parse_speculative
from deltaship.runtimes.tokenizer import load_tokenizer
from deltaship.runtimes.vision import image_prompt
from deltaship.targets import open_bundle, open_multimodal, text_runtime


def parse_ids(text: str) -> list[int]:
    """--input-ids "1,2,3" as token ids (deltaship.options.token_ids)."""
    return options.token_ids(text)


def _check_ids(ids: list[int]) -> list[int]:
    """Token ids given as a list: non-negative integers, at least one."""
    if not ids:
        raise DeltashipError("--input-ids is empty", "pass at least one token id")
    for n, i in enumerate(ids, 1):
        options.at_least(f"--input-ids item {n}", i, 0, "pass non-negative token ids, e.g. [1, 2, 3]")
    return [int(i) for i in ids]


def generate(
    bundle: str | Path,
    prompt: str | None = None,
    input_ids: str | list[int] | None = None,
    max_new_tokens: int = 32,
    threads: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_at_eos: bool = True,
    dump_logits: str | Path | None = None,
    provider: str = "cpu",
    runtime: str | None = None,
    cuda_graph: bool = False,
    prepack_cache: str | Path | None = None,
    speculative: str | None = None,
    images: list[str | Path] | None = None,
    videos: list[str] | None = None,
    fps: float | None = None,
    json_schema: dict[str, Any] | bool | str | Path | None = None,
    regex: str | None = None,
    grammar: str | Path | None = None,
    progress: bool | Callable = True,
    chat: bool = False,
) -> dict[str, Any]:
    """Generate from a prompt (text, needs the bundle's tokenizer) or token ids; return a result dict.

    speculative="mtp[:K]": draft K tokens per step with the bundle's MTP head and verify them in one decoder call
    (deltaship/runtimes/speculative.py); the result then has a `speculative` block (acceptance and lengths).
    images: image files for the prompt (a bundle exported with --vision; runtimes/vision.py). A text prompt
    gets one vision span per image before it (unless it has <|image_pad|> markers) and, when the tokenizer has
    them, Qwen3.5's chat markers; token ids must hold one image token per image. videos: each a video file
    (frames sampled at `fps` per second) or a comma-separated list of frame image files (taken `fps` apart),
    after the images; a text prompt gets each video's timestamped spans (one per 2 frames), token ids must hold
    one video token per 2 frames.

    temperature 0 is greedy; top_k (>= 1), top_p (in (0, 1]) and seed (>= 0) need temperature > 0 and are refused
    without it. Every value is range-checked (deltaship/options.py, as the CLI's flags) before the bundle is
    opened; a bad one raises DeltashipError.

    json_schema (a dict or a file), regex (a pattern) or grammar (a file in llguidance's Lark-like syntax): at most
    one; the output then follows it (deltaship/constrain, docs/agents.md) and the result has a `constraint` block,
    {"kind": ..., "complete": true|false} (false: the budget or the context ended mid-structure).

    chat: the prompt as one user turn through the bundle's chat template, rendered as `deltaship chat` renders it
    (deltaship/chat/template.py), generation stopping at the end of the assistant's turn; `text` is the reply.

    progress: a generation that runs long (Core ML's op-by-op evaluator on Linux, a large model) reports the tokens
    it has on stderr, in a log once it has been silent for a while (deltaship/progress.py); False: never."""

    depth = parse_speculative(speculative)
    constraint = build_constraint(json_schema, regex, grammar)  # checked before anything is opened
    if depth is not None and (images or videos):
        raise DeltashipError(
            "--speculative is not available with --image/--video yet (the multimodal decoder has no verify call)",
            "drop --speculative for image prompts",
        )
    if fps is not None and not videos:
        raise DeltashipError("--fps applies to --video only", "drop --fps, or pass a --video")
    if (prompt is None) == (input_ids is None):
        raise DeltashipError(
            "pass exactly one of --prompt or --input-ids", "e.g. --prompt 'Hello' or --input-ids 1,2,3"
        )
    if chat and (prompt is None or images or videos):
        raise DeltashipError(
            "--chat renders a text --prompt as a user turn; it cannot take "
            + ("--input-ids" if prompt is None else "--image/--video (an image prompt gets the chat markers already)"),
            "pass --prompt TEXT" if prompt is None else "drop --chat",
        )
    # before the bundle is opened: the CLI checked these as it parsed them, the API checks them here
    options.max_new_tokens(max_new_tokens)
    options.threads(threads)
    options.sampling(temperature, top_k, top_p, seed)
    if prompt is not None:
        options.text(prompt)
    if input_ids is not None:
        input_ids = parse_ids(input_ids) if isinstance(input_ids, str) else _check_ids(list(input_ids))
    if dump_logits is not None:
        options.new_file(dump_logits, "--dump-logits")
    text = text_runtime(bundle, runtime)
    if constraint is not None:
        _constraint_runtime(runtime, text is not None)
    if (images or videos) and runtime == "genai":
        return _generate_genai_images(
            bundle,
            prompt,
            images or [],
            max_new_tokens,
            threads,
            refused=[
                flag
                for flag, v in (
                    ("--video", videos),
                    ("--input-ids", input_ids is not None),
                    ("--temperature", temperature > 0),
                    ("--top-k", top_k is not None),
                    ("--top-p", top_p is not None),
                    ("--seed", seed is not None),
                    ("--no-stop-at-eos", not stop_at_eos),
                    ("--dump-logits", dump_logits),
                    ("--provider", provider != "cpu"),
                    ("--cuda-graph", cuda_graph),
                    ("--prepack-cache", prepack_cache),
                )
                if v
            ],
        )
    if (images or videos) and runtime is not None:
        raise DeltashipError(
            f"--image runs in deltaship's own session and in --runtime genai (ONNX bundles), not --runtime {runtime}",
            "drop --runtime",
        )
    if text is not None:  # a runtime that takes text (ExecuTorch's C++ LLM runner)
        given = [
            flag
            for flag, v in (
                ("--input-ids", input_ids),
                ("--dump-logits", dump_logits),
                ("--top-k", top_k is not None),
                ("--top-p", top_p is not None),
                ("--seed", seed is not None),
                ("--threads", threads),
                ("--provider", provider != "cpu"),
                ("--no-stop-at-eos", not stop_at_eos),
                ("--prepack-cache", prepack_cache),
            )
            if v
        ]
        if depth is not None:
            given.append("--speculative")
        if chat:
            given.append("--chat")
        if given or prompt is None:
            raise DeltashipError(
                f"--runtime {runtime} takes a text prompt and greedy or temperature sampling only; "
                f"it cannot take {', '.join(given) or 'token ids'}",
                f"pass --prompt and drop {', '.join(given) or '--input-ids'}, or drop --runtime",
            )
        module, spec = text
        res = getattr(module, spec.generate)(bundle, prompt, max_new_tokens=max_new_tokens, temperature=temperature)
        return {**res, "seconds": res.get("stats", {}).get("total_seconds")}
    say = Progress() if progress is True else progress or None
    with heartbeat(_beat(say), "generate: opening the bundle"):
        session = open_bundle(
            bundle,
            threads=threads,
            provider=provider,
            runtime=runtime,
            prepack_cache=prepack_cache,
            **({"cuda_graph": True} if cuda_graph else {}),
        )
    mm, notices, loaded = None, [], []
    if images or videos:
        mm = open_multimodal(session)  # refuses a bundle without a vision tower
        loaded = mm.load(images or [], notices)
        clips = [mm.load_video(v, notices, fps) for v in videos or []]
        loaded += clips
        if prompt is not None:
            markers = "im_start" in session.manifest.get("tokens", {})
            prompt = image_prompt(prompt, len(images or []), markers, videos=clips)
    tok = load_tokenizer(Path(bundle), session.manifest) if prompt is not None else None
    stops: set[int] = set()
    if chat:
        ids, stops = _chat_turn(bundle, session, tok, prompt)
        session.eos_ids |= stops  # this call's own session: the reply ends with the assistant's turn
    else:
        ids = tok.encode(prompt) if tok else input_ids
    if depth is not None and dump_logits is not None:
        raise DeltashipError("--dump-logits cannot be combined with --speculative", "drop one of them")
    guide = _guide(constraint, bundle, session, tok) if constraint is not None else None
    t0 = time.monotonic()
    kw = dict(
        temperature=temperature,
        top_k=top_k or 0,  # the sessions' "no cut"
        top_p=1.0 if top_p is None else top_p,
        seed=seed,
        stop_at_eos=stop_at_eos,
        **({"guide": guide} if guide is not None else {}),
    )
    spec_stats = None
    clock = _TokenClock(t0)
    beat = _beat(say, lambda m: f"{m}: {clock.count} of {max_new_tokens} new tokens")
    try:
        with heartbeat(beat, f"generate: {len(ids)} prompt tokens, then decoding"):
            if depth is not None:
                gen, spec_stats = generate_speculative(session, ids, max_new_tokens, depth, on_token=clock, **kw)
            elif mm:
                keep = dump_logits is not None
                gen = mm.generate(ids, loaded, max_new_tokens, keep_logits=keep, on_token=clock, **kw)
            else:
                gen = session.generate(ids, max_new_tokens, keep_logits=dump_logits is not None, on_token=clock, **kw)
    except DeltashipRunError as e:  # the tokens so far, as text where the prompt was text
        e.text = (prompt or "") + tok.decode(e.output_ids) if tok is not None else None
        raise
    except Exception as e:  # the speculative and image drivers' runtime errors, without their tokens
        failure = run_failure(e, None)
        if failure is None:
            raise
        raise failure from e
    if isinstance(say, Progress):
        say.done()
    elapsed = time.monotonic() - t0
    result: dict[str, Any] = {
        **_ids_result(gen, elapsed, session),
        **clock.rates(),
        **({"speculative": spec_stats.as_dict()} if spec_stats else {}),
        **({"constraint": {"kind": constraint.kind, "complete": guide.complete()}} if constraint else {}),
    }
    if mm is not None:
        merge = mm.spec.spatial_merge_size
        result["image_tokens"] = [im.tokens(merge) for im in loaded]
        result["images"] = [
            {"grid_thw": list(im.grid), "resized": list(im.resized)}
            | ({"video": True, "timestamps": im.timestamps} if im.video else {})
            for im in loaded
        ]
        result["notices"] = notices
    if tok is None:
        try:
            tok = load_tokenizer(Path(bundle), session.manifest)
        except DeltashipError:
            tok = None
    if tok is not None:
        out = [t for t in gen.output_ids if t not in stops]
        if constraint is not None and gen.stopped == "eos" and out and out[-1] in session.eos_ids:
            out = out[:-1]  # a constrained text parses as it is: the end-of-text token is not part of the structure
        result["text"] = tok.decode(out)
    if dump_logits is not None:
        arr = np.stack(gen.logits).astype(np.float32) if gen.logits else np.zeros((0, session.vocab_size), np.float32)
        path = Path(dump_logits)
        tmp = path.with_name(f".{path.name}.partial-{os.getpid()}.npy")
        try:
            np.save(tmp, arr)
            tmp.rename(path)
        except BaseException:  # a full disk: no partial file left beside the one asked for
            tmp.unlink(missing_ok=True)
            raise
        result["logits_file"] = str(path)
    return result


def _constraint_runtime(runtime: str | None, takes_text: bool) -> None:
    """A constraint runs in deltaship's own sessions (every target's, through the shared loop); say why not here."""
    if runtime == "genai":
        raise DeltashipError(*GENAI_CONSTRAINT)
    if takes_text:
        raise DeltashipError(
            f"--runtime {runtime} takes text and runs its own sampler, so it cannot mask tokens for "
            "--json-schema/--regex/--grammar",
            "drop --runtime: deltaship's own session for the bundle's target constrains the output",
        )


def _guide(constraint: Constraint, bundle: str | Path, session: Any, tok: Any) -> Any:
    """The constraint's parser over the bundle's tokenizer (its token table built once per tokenizer and cached)."""
    if tok is None:
        tok = load_tokenizer(Path(bundle), session.manifest)  # refuses a bundle without one, saying why
    return constraint.guide(token_table(tok.json_text, session.vocab_size, sorted(session.eos_ids)))


def _generate_genai_images(
    bundle: str | Path,
    prompt: str | None,
    images: list[str | Path],
    max_new_tokens: int,
    threads: int | None,
    refused: list[str],
) -> dict[str, Any]:
    """--image with --runtime genai: the prompt and image files go to onnxruntime-genai as an app gives them (its
    image processor, placeholder expansion, vision/embedding/decoder graphs and greedy search)."""
    if refused:
        raise DeltashipError(
            f"--runtime genai with --image takes a text prompt, image files and greedy decoding only; it cannot take "
            f"{', '.join(refused)}",
            f"drop {', '.join(refused)}, or drop --runtime genai (deltaship's own session takes them)",
        )

    session = open_bundle(bundle, threads=threads, runtime="genai")
    chat = "im_start" in session.manifest.get("tokens", {})
    text = image_prompt(prompt, len(images), chat)
    t0 = time.monotonic()
    gen, grids = session.generate_images(text, images, max_new_tokens)
    elapsed = time.monotonic() - t0
    spec = session.manifest["vision"]["spec"]
    merge, patch = int(spec["spatial_merge_size"]), int(spec["patch_size"])
    result: dict[str, Any] = {
        **_ids_result(gen, elapsed, session),
        "image_tokens": [t * h * w // merge**2 for t, h, w in grids],
        "images": [{"grid_thw": g, "resized": [g[1] * patch, g[2] * patch]} for g in grids],
        "notices": _genai_resize_notices(bundle, session.manifest, images, grids),
    }
    try:
        result["text"] = load_tokenizer(Path(bundle), session.manifest).decode(gen.output_ids)
    except DeltashipError:
        pass
    return result


def _genai_resize_notices(
    bundle: str | Path, manifest: dict[str, Any], images: list[str | Path], grids: list[list[int]]
) -> list[str]:
    """Which images genai resized, and where its size is not transformers' (onnxruntime-extensions' smart_resize
    rounds a half patch-merge block up; transformers' Python round() to even): such an image gets other tokens."""

    block = manifest["vision"]
    path = bundle_path(bundle, manifest, block["preprocessor"], "vision.preprocessor")
    pre = Preprocessor.from_config(read_json_object(path, "image preprocessor config", "export the bundle again"))
    pre = dataclasses.replace(pre, max_pixels=min(pre.max_pixels, int(block["max_pixels"])))
    notices = []
    for path, (_, gh, gw) in zip(images, grids):
        w0, h0 = load_image(path).size
        h, w = gh * pre.patch_size, gw * pre.patch_size
        if (h, w) != (h0, w0):
            notices.append(f"--image {path}: onnxruntime-genai resized it from {w0}x{h0} to {w}x{h} pixels")
        want = smart_resize(h0, w0, pre.factor, pre.min_pixels, pre.max_pixels)
        if (h, w) != want:
            notices.append(
                f"--image {path}: transformers and deltaship's own session resize it to {want[1]}x{want[0]} pixels, "
                f"onnxruntime-genai to {w}x{h} (its smart_resize rounds a half {pre.factor}-pixel block up), so its "
                "tokens differ from the checkpoint's; an image whose sides are not odd multiples of "
                f"{pre.factor // 2} pixels avoids it"
            )
    return notices


def _chat_turn(bundle: str | Path, session, tok, prompt: str) -> tuple[list[int], set[int]]:
    """generate(chat=True): the prompt as one user turn through the bundle's chat template with the generation
    prompt, as a chat's first turn without a system message renders it (deltaship.chat.Chat.render_ids), and the
    tokens that end the assistant's turn."""
    source, special = bundle_chat_template(Path(bundle), session.manifest)
    text = ChatTemplate(source, **special).render([{"role": "user", "content": prompt}], add_generation_prompt=True)
    end = session.manifest.get("tokens", {}).get("im_end")
    return tok.encode(text), set(session.eos_ids) | ({end} if isinstance(end, int) else set())


def _beat(say, detail: Callable[[str], str] = str) -> Callable[[str], None] | None:
    """heartbeat()'s reporter for generate's progress: a Progress's inline detail, or the caller's function."""
    if say is None:
        return None
    if isinstance(say, Progress):
        return lambda m: say(detail(m), inline=True)
    return lambda m: say(detail(m))


class _TokenClock:
    """on_token for a generation: when the first and the last new token came, for --json's ttft_s (from the start
    of the prefill to the first token) and decode_tok_s (tokens per second after the first), as `chat --json`."""

    def __init__(self, t0: float):
        self.t0, self.first, self.last, self.count = t0, None, None, 0

    def __call__(self, token: int) -> None:
        self.last = time.monotonic()
        self.first = self.first or self.last
        self.count += 1

    def rates(self) -> dict[str, float]:
        if self.first is None:
            return {}
        span = self.last - self.first
        rate = (self.count - 1) / span if self.count > 1 and span > 0 else 0.0
        return {"ttft_s": round(self.first - self.t0, 6), "decode_tok_s": round(rate, 3)}


def _ids_result(gen, elapsed: float, session) -> dict[str, Any]:
    """The --json fields every generation reports: ids in and out, why it stopped, seconds, the runtime."""
    return {
        "input_ids": gen.input_ids,
        "output_ids": gen.output_ids,
        "stopped": gen.stopped,
        "seconds": round(elapsed, 4),
        "runtime": session.runtime_name(),
    }
