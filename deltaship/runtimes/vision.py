"""Images beside an open session of a bundle exported with --vision (no torch import for ONNX bundles).

`deltaship.targets.open_multimodal(session)` gives the driver the bundle's target names (Target.multimodal_session):
OnnxMultimodal drives vision.onnx, embedding.onnx and decoder_mm.onnx on the OnnxSession's own state buffers;
ExecuTorchMultimodal the programs' methods, CoreMLMultimodal the multimodal package's functions. Each image is
encoded on its own (full attention within it), the prompt's image placeholder rows of the token embedding are
replaced by the image features (a prefill chunk may start or end inside an image span: each call gets the feature
rows of its own placeholders), and the decoder gets 3-row M-RoPE positions: T/H/W over each image's merged grid,
then, for every later token (decode included), its cache position plus the prompt's rope delta. A prompt without
images takes the session's text-only path as before."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from deltaship import options
from deltaship.bundle.paths import bundle_path
from deltaship.bundle.vision_io import ENCODER_INPUTS, padded_inputs
from deltaship.errors import DeltashipError
from deltaship.files import read_json_object
from deltaship.models.vision import (
    DEFAULT_VIDEO_PREPROCESSOR,
    ImageInput,
    Preprocessor,
    VideoPreprocessor,
    VisionSpec,
    encoder_inputs,
    frame_timestamps,
    load_image,
    load_video,
    preprocess_frames,
    preprocess_image,
    rope_positions,
)
from deltaship.runtimes import mil_eval
from deltaship.runtimes.base import Generation, TokenGuide, check_sampling, decode_loop
from deltaship.runtimes.executorch import load_program
from deltaship.runtimes.onnx_io import session_options

IMAGE_MARKERS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
VIDEO_PAD = "<|video_pad|>"


def vision_block(manifest: dict[str, Any], bundle: Path) -> dict[str, Any]:
    block = manifest.get("vision")
    if not block:
        raise DeltashipError(
            f"{bundle}: this bundle has no vision tower (text only), so it cannot take --image",
            "export a Qwen3.5 vision-language checkpoint with `deltaship export --vision`, or drop --image",
        )
    return block


def _config(bundle: Path, manifest: dict[str, Any], name: str, field: str) -> dict[str, Any]:
    """A preprocessor config of the bundle (a file it lists; bounded, parsed into one error when broken)."""
    return read_json_object(bundle_path(bundle, manifest, name, field), field, "export the bundle again")


class Multimodal(ABC):
    """Image + text generation beside an open text session of a --vision bundle, on the backend's three parts:
    encode (one image -> features), _embed (a call's ids + its image feature rows -> embeddings), _run (the
    multimodal decoder on embeddings + 3-row positions, on states it owns). Each target names its subclass
    (`Target.multimodal_session`); `deltaship.targets.open_multimodal(session)` picks it."""

    def __init__(self, session):
        self.session = session
        bundle, manifest = session.bundle, session.manifest
        block = vision_block(manifest, bundle)
        self.block = block
        self.spec = VisionSpec(**block["spec"])
        pre = Preprocessor.from_config(_config(bundle, manifest, block["preprocessor"], "vision.preprocessor"))
        # a bundle may cap images below the preprocessor's limit (ExecuTorch plans memory for its largest image)
        self.pre = dataclasses.replace(pre, max_pixels=min(pre.max_pixels, int(block["max_pixels"])))
        self.max_image_tokens = int(block["max_image_tokens"])
        video_cfg = block.get("video_preprocessor")  # bundles before multi-frame video have none
        self.video_pre = VideoPreprocessor.from_config(
            _config(bundle, manifest, video_cfg, "vision.video_preprocessor")
            if video_cfg
            else DEFAULT_VIDEO_PREPROCESSOR
        )
        self.hidden = int(manifest["model"]["hidden_size"])
        self._file = lambda key: bundle_path(bundle, manifest, block["graphs"][key], f"vision.graphs.{key}")
        self.dtype = np.dtype(block.get("dtype", "float32"))  # image features and embeddings (fp16 bundles)
        self.delta = 0
        self._open()

    @abstractmethod
    def _open(self) -> None:
        """Open the backend's parts (the vision encoder, the embedding and the multimodal decoder)."""

    @abstractmethod
    def encode(self, image: ImageInput) -> np.ndarray:
        """Merged features [tokens, hidden] of one image (one temporal group of a video)."""

    @abstractmethod
    def _embed(self, ids: np.ndarray, features: np.ndarray) -> np.ndarray:
        """Embeddings [1, T, hidden] of a call's ids, its image rows replaced by `features` in order."""

    @abstractmethod
    def _run(self, embeds: np.ndarray, rope: np.ndarray) -> np.ndarray:
        """The multimodal decoder on embeddings and 3-row positions [3, T]: logits after the last row."""

    def _reset(self) -> None:
        self.session.reset()

    # ---- images ----------------------------------------------------------------------------------
    def load(self, paths: Sequence[str | Path], notices: list[str] | None = None) -> list[ImageInput]:
        out = []
        for p in paths:
            img = load_image(p)
            im = preprocess_image(img, self.pre)
            if im.resized != im.original and notices is not None:
                h0, w0 = im.original
                h, w = im.resized
                notices.append(
                    f"--image {p}: resized from {w0}x{h0} to {w}x{h} pixels ({im.tokens(self.spec.spatial_merge_size)}"
                    f" image tokens; limits {self.pre.min_pixels} .. {self.pre.max_pixels} pixels)"
                )
            out.append(im)
        return out

    def load_video(
        self, source: str | Path | Sequence[str | Path], notices: list[str] | None = None, fps: float | None = None
    ) -> ImageInput:
        """One video input: a video file (frames sampled at `fps` per second, default the video preprocessor's),
        or frame image files in time order (a list, or one comma-separated string; taken `fps` apart)."""

        fps = self.video_pre.fps if fps is None else fps
        options.number("--fps", fps, 0, above=True)  # finite and > 0, as the CLI's --fps
        tp = self.pre.temporal_patch_size
        if isinstance(source, (str, Path)) and "," not in str(source):
            frames, stamps = load_video(source, fps, self.video_pre)
        else:
            files = [f for f in str(source).split(",") if f] if isinstance(source, (str, Path)) else list(source)
            frames = [load_image(f) for f in files]
            stamps = frame_timestamps(range(len(frames)), fps, tp)
        video = preprocess_frames(frames, self.pre, self.video_pre, stamps, max_frame_pixels=self.pre.max_pixels)
        if notices is not None:
            h0, w0 = video.original
            h, w = video.resized
            notices.append(
                f"--video {source}: {len(frames)} frame(s) at {w}x{h} pixels (from {w0}x{h0}), {video.grid[0]} "
                f"temporal patch(es) of {video.tokens(self.spec.spatial_merge_size) // video.grid[0]} tokens"
            )
        return video

    def expand(self, ids: Sequence[int], images: Sequence[ImageInput]) -> list[int]:
        """One image (video) token per image (video frame group) in `ids` becomes its h*w/4 tokens; an already
        expanded prompt (each span as long as its input needs) is kept. `images` are in prompt order, a video
        as its temporal groups (one span each)."""
        sp, m = self.spec, self.spec.spatial_merge_size
        kinds = (sp.image_token_id, sp.video_token_id)
        spans, i, ids = [], 0, list(ids)
        while i < len(ids):
            if ids[i] in kinds:
                j = i
                while j < len(ids) and ids[j] == ids[i]:
                    j += 1
                spans.append((i, j, ids[i]))
                i = j
            else:
                i += 1
        if len(spans) != len(images):
            raise DeltashipError(
                f"the prompt has {len(spans)} image/video placeholder span(s) but {len(images)} image(s)/video(s) "
                "were given",
                "put one <|vision_start|><|image_pad|><|vision_end|> in the prompt per --image and one "
                "<timestamp><|vision_start|><|video_pad|><|vision_end|> per 2 frames of a --video (deltaship "
                "generate writes them for a --prompt)",
            )
        out, prev = [], 0
        for (a, z, tok), im in zip(spans, images):
            want = sp.video_token_id if im.video else sp.image_token_id
            if tok != want:
                raise DeltashipError(
                    f"the placeholder span at token {a} is for {'a video' if tok == sp.video_token_id else 'an image'}"
                    f" but the input in its place is {'a video' if im.video else 'an image'}",
                    "give the images and videos in the order their placeholders appear in the prompt",
                )
            n = im.tokens(m)
            out += ids[prev:a]
            if z - a not in (1, n):
                raise DeltashipError(
                    f"a placeholder span has {z - a} tokens; its input needs {n} (or 1, expanded here)",
                    "use one <|image_pad|> (<|video_pad|>) per image (video)",
                )
            out += [tok] * n
            prev = z
        return out + ids[prev:]

    def encode_input(self, image: ImageInput) -> np.ndarray:
        """Merged features [tokens, hidden] of one image or video (each temporal group encoded on its own)."""
        return np.concatenate([self.encode(g) for g in image.groups()])

    def prefill(self, ids: Sequence[int], images: Sequence[ImageInput]) -> np.ndarray:
        """Feed a prompt with (expanded) image spans from the start of the sequence; logits after its last token."""
        s = self.session
        self._reset()
        arr = s._check(ids)
        rope, self.delta = rope_positions(arr, [im.grid for im in images], self.spec)
        feats = [self.encode_input(im) for im in images]
        features = np.concatenate(feats) if feats else np.zeros((0, self.hidden), self.dtype)
        is_img = np.isin(arr, (self.spec.image_token_id, self.spec.video_token_id))
        if int(is_img.sum()) != features.shape[0]:
            raise DeltashipError(
                f"the prompt has {int(is_img.sum())} image tokens, the images give {features.shape[0]} features",
                "use one <|image_pad|> per image and let deltaship expand it",
            )
        row, start, logits = 0, 0, None
        for size in s._chunks(arr.size):
            chunk = arr[start : start + size]
            n = int(is_img[start : start + size].sum())
            logits = self._run(self._embed(chunk, features[row : row + n]), rope[:, start : start + size])
            row += n
            start += size
        return logits

    def decode(self, token: int) -> np.ndarray:
        s = self.session
        arr = s._check([token])
        rope = np.full((3, 1), s.position + self.delta, dtype=np.int64)
        return self._run(self._embed(arr, np.zeros((0, self.hidden), self.dtype)), rope)

    def generate(
        self,
        ids: Sequence[int],
        images: Sequence[ImageInput],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_at_eos: bool = True,
        keep_logits: bool = False,
        on_token: Callable[[int], None] | None = None,
        guide: TokenGuide | None = None,
    ) -> Generation:
        """As Session.generate, for a prompt with images and videos (ids: one image token per image and one video
        token per temporal patch of a video, or expanded spans)."""
        check_sampling(max_new_tokens, temperature, top_k, top_p)
        # a video is one span per temporal patch (each after its timestamp text; transformers' get_rope_index
        # splits video_grid_thw the same way): from here on each group is an input of its own
        images = [g for im in images for g in (im.groups() if im.video else [im])]
        for im in images:
            n = im.tokens(self.spec.spatial_merge_size)
            if n > self.max_image_tokens:
                raise DeltashipError(
                    f"an image (video frame pair) of {n} tokens is over the bundle's limit of {self.max_image_tokens}",
                    "resize the image (the preprocessor's max_pixels)",
                )
        ids = self.expand([int(i) for i in ids], images)
        rng = np.random.default_rng(seed)
        gen = Generation(input_ids=ids, output_ids=[])
        logits = self.prefill(ids, images)
        return decode_loop(
            self.session,
            gen,
            logits,
            max_new_tokens,
            self.decode,
            temperature,
            top_k,
            top_p,
            rng,
            stop_at_eos,
            keep_logits,
            on_token,
            guide,
        )


class OnnxMultimodal(Multimodal):
    """vision.onnx (pixel rows + image_grid_thw), embedding.onnx (the splice in the graph) and decoder_mm.onnx
    (position_ids [3, 1, T] + attention_mask [1, p + T]: onnxruntime-genai's inputs), on the OnnxSession's state
    buffers."""

    def _open(self) -> None:
        s, block = self.session, self.block
        ort = s._ort

        def open_graph(name: str):
            return ort.InferenceSession(
                str(bundle_path(s.bundle, s.manifest, block["graphs"][name], f"vision.graphs.{name}")),
                sess_options=session_options(ort, s.threads, None),
                providers=s.providers,
            )

        self.vision = open_graph("vision")
        self.embedding = open_graph("embedding")
        self.decoder = open_graph("decoder")
        # bundles before onnxruntime-genai's contract: the grid tensors come from the host, and the decoder takes
        # rope_position_ids [3, 1, T] with position_ids [1, positions] (the cache position) in place of
        # position_ids [3, 1, T] with attention_mask [1, p + T]
        self._grid_in_graph = "image_grid_thw" in {i.name for i in self.vision.get_inputs()}
        self._legacy_decoder = "rope_position_ids" in {i.name for i in self.decoder.get_inputs()}
        self._mask = np.ones((1, s.max_context), np.int64)

    def encode(self, image: ImageInput) -> np.ndarray:
        """Merged features [tokens, hidden] of one image."""
        if self._grid_in_graph:
            inputs = {"pixel_values": image.patches, "image_grid_thw": np.array([image.grid], np.int64)}
        else:
            inputs = encoder_inputs(self.spec, image)
        if self.dtype != np.float32:  # an fp16 bundle: the tower's float inputs in its dtype
            inputs = {k: v.astype(self.dtype) if v.dtype == np.float32 else v for k, v in inputs.items()}
        return self.vision.run(["image_features"], inputs)[0]

    def _run(self, embeds: np.ndarray, rope: np.ndarray) -> np.ndarray:
        s = self.session
        io = self.decoder.io_binding()
        io.bind_cpu_input("inputs_embeds", np.ascontiguousarray(embeds))
        rope = np.ascontiguousarray(rope.reshape(3, 1, -1))
        if self._legacy_decoder:
            io.bind_cpu_input("rope_position_ids", rope)
            io.bind_cpu_input("position_ids", s._positions[:, s.position : s.position + 1])
        else:
            io.bind_cpu_input("position_ids", rope)
            io.bind_cpu_input("attention_mask", self._mask[:, : s.position + embeds.shape[1]])
        for st in s.states:
            vals, cur = s._vals[st["name"]], s._cur[st["name"]]
            io.bind_ortvalue_input(st["name"], vals[cur])
            io.bind_ortvalue_output(st["output"], vals[(cur + 1) % len(vals)])
        io.bind_ortvalue_output("logits", s._logits_val)
        self.decoder.run_with_iobinding(io)
        for st in s.states:
            s._cur[st["name"]] = (s._cur[st["name"]] + 1) % len(s._vals[st["name"]])
        s.position += embeds.shape[1]
        if s.device == "cuda":
            return s._logits_val.numpy().reshape(-1).copy()
        return s._logits.reshape(-1).copy()

    def _embed(self, ids: np.ndarray, features: np.ndarray) -> np.ndarray:
        return self.embedding.run(["inputs_embeds"], {"input_ids": ids.reshape(1, -1), "image_features": features})[0]


class ExecuTorchMultimodal(Multimodal):
    """vision.pte's methods vision_encoder and token_embedding (the splice on the host), and decoder_mm.pte's
    text_decoder (its own state buffers: the text-only model.pte keeps its own)."""

    def _open(self) -> None:
        graphs = self.block["graphs"]
        program = load_program(self._file("program"))
        self._t = self.session._torch
        self.vision = program.load_method(graphs["vision"])
        self.embedding = program.load_method(graphs["embedding"])
        self._decoder_program = load_program(self._file("decoder_program"))
        self.decoder = self._decoder_program.load_method(graphs["decoder"])
        self._buffers = list(self.block["decoder_states"])

    def _reset(self) -> None:
        self.session.position = 0
        for name in self._buffers:
            self.decoder._method.get_attribute(name).zero_()

    def encode(self, image: ImageInput) -> np.ndarray:
        inputs = encoder_inputs(self.spec, image)
        if self.dtype != np.float32:
            inputs = {k: v.astype(self.dtype) if v.dtype == np.float32 else v for k, v in inputs.items()}
        return self.vision.execute([self._t.from_numpy(inputs[n]) for n in ENCODER_INPUTS])[0].numpy().copy()

    def _embed(self, ids: np.ndarray, features: np.ndarray) -> np.ndarray:
        out = self.embedding.execute([self._t.from_numpy(np.ascontiguousarray(ids).reshape(1, -1))])[0]
        out = out.numpy().copy()
        rows = np.flatnonzero(np.isin(ids, (self.spec.image_token_id, self.spec.video_token_id)))[: len(features)]
        out[0, rows] = features[: len(rows)]
        return out

    def _run(self, embeds: np.ndarray, rope: np.ndarray) -> np.ndarray:
        s, t = self.session, self._t
        out = self.decoder.execute(
            [
                t.from_numpy(np.ascontiguousarray(embeds)),
                t.from_numpy(np.ascontiguousarray(rope.reshape(3, 1, -1))),
                t.tensor([s.position], dtype=t.long),
            ]
        )
        s.position += embeds.shape[1]
        return out[0].reshape(-1).float().numpy().copy()


class CoreMLMultimodal(Multimodal):
    """multimodal.mlpackage's functions (evaluated op by op on Linux, like the text session): vision_N (the image
    padded to the smallest enumerated patch count, masked), token_embedding_T (the splice on the host) and
    text_decoder_T, T = the prefill chunk or 1, on io states of its own (model.mlpackage keeps the text path's)."""

    def _open(self) -> None:
        self.functions = self.block["functions"]
        self.counts = tuple(int(n) for n in self.functions["vision"])
        self.interp = mil_eval.Interpreter(mil_eval.load_program(self._file("package")))
        self._reset()

    def _reset(self) -> None:
        self.session.position = 0
        self._io = {s["name"]: np.zeros(s["shape"], np.float32) for s in self.block["decoder_states"]}

    def encode(self, image: ImageInput) -> np.ndarray:
        return encode_padded(self.interp, encoder_inputs(self.spec, image), self.counts)

    def _embed(self, ids: np.ndarray, features: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids).reshape(1, -1)
        fname = self.functions["embedding"][str(ids.shape[1])]
        out = np.array(self.interp.run(fname, {"input_ids": ids.astype(np.int32)}, {})["inputs_embeds"], np.float32)
        rows = np.flatnonzero(np.isin(ids[0], (self.spec.image_token_id, self.spec.video_token_id)))[: len(features)]
        out[0, rows] = features[: len(rows)]
        return out

    def _run(self, embeds: np.ndarray, rope: np.ndarray) -> np.ndarray:
        s = self.session
        t = embeds.shape[1]
        feeds = {
            "inputs_embeds": np.asarray(embeds, np.float32),
            "rope_positions": np.asarray(rope, np.int32).reshape(3, 1, -1),
            "position": np.array([s.position], np.int32),
        }
        for st in self.block["decoder_states"]:
            feeds[st["coreml_input"]] = self._io[st["name"]]
        out = self.interp.run(self.functions["decoder"][str(t)], feeds, {})
        for st in self.block["decoder_states"]:
            self._io[st["name"]] = np.asarray(out[st["coreml_output"]], np.float32)
        s.position += t
        return np.asarray(out["logits"], np.float32).reshape(-1)


def encode_padded(interp: Any, inputs: dict[str, np.ndarray], patch_counts: tuple[int, ...]) -> np.ndarray:
    """Run one image through an evaluated (or Core ML) vision package with functions vision_N (bundle/vision_io.py):
    merged features [n/4, text hidden]."""
    fname, feeds = padded_inputs(inputs, patch_counts)
    out = interp.run(fname, feeds, {})["image_features"]
    return np.asarray(out, np.float32)[: inputs["pixel_values"].shape[0] // 4]


def video_placeholder(video: ImageInput) -> str:
    """A video's prompt text as Qwen3.5's processor writes it: per temporal patch, its time then its span
    (`<0.5 seconds><|vision_start|><|video_pad|><|vision_end|>...`; one pad each, expanded later)."""
    start, _, end = IMAGE_MARKERS
    stamps = video.timestamps or [float(i) for i in range(video.grid[0])]
    return "".join(f"<{t:.1f} seconds>{start}{VIDEO_PAD}{end}" for t in stamps)


def image_prompt(prompt: str, n_images: int, chat: bool, videos: Sequence[ImageInput] = ()) -> str:
    """The prompt with one vision span per image (then the timestamped spans of each video) before the text
    (unless it already has placeholders: each `<|vision_start|><|video_pad|><|vision_end|>` or bare
    `<|video_pad|>` becomes its video's timestamped spans, in order), in Qwen3.5's chat template when `chat`
    (the tokenizer has <|im_start|>)."""
    start, pad, end = IMAGE_MARKERS
    if pad not in prompt and VIDEO_PAD not in prompt:
        prompt = (start + pad + end) * n_images + "".join(video_placeholder(v) for v in videos) + prompt
    elif VIDEO_PAD in prompt:
        parts = prompt.replace(start + VIDEO_PAD + end, VIDEO_PAD).split(VIDEO_PAD)
        if len(parts) - 1 != len(videos):
            raise DeltashipError(
                f"the prompt has {len(parts) - 1} <|video_pad|> marker(s) but {len(videos)} video(s) were given",
                "put one <|video_pad|> in the prompt per --video",
            )
        prompt = parts[0] + "".join(video_placeholder(v) + rest for v, rest in zip(videos, parts[1:]))
    if chat:
        return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    return prompt
