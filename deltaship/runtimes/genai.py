"""An ONNX bundle run by onnxruntime-genai, the runtime apps embed (its Python wheel has the same C++
core as the Android AAR, the iOS pods and the C# package). No torch import.

genai owns the sequence: it feeds input_ids and the sequence lengths (current_sequence_length,
past_sequence_length, from which the graph takes its start position), keeps the KV cache and the DeltaNet states,
splits a prompt into the bundle's prefill chunks (search.chunk_size) and samples. This session offers
deltaship's Session API on top of it: prefill/decode/reset/generate, and timed_generate for prefill and
decode timings of genai's own loop. A --vision bundle's genai_config.json is genai's multimodal `qwen3_5` type
(export/onnx/multimodal.py): generate_images runs image + text prompts through genai's image processor and loop.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from deltaship.bundle.paths import bundle_path
from deltaship.bundle.reader import read_manifest, require_intact
from deltaship.errors import DeltashipError
from deltaship.files import read_json_object
from deltaship.models.vision import load_image
from deltaship.runtimes.base import Generation, Session
from deltaship.runtimes.vision import vision_block

GENAI_CONFIG = "genai_config.json"  # written by deltaship.lowering.onnx.genai
INSTALL = 'pip install "onnxruntime-genai>=0.18,<0.19"'
PNG_SIGNATURE, JPEG_SIGNATURE = b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff"


def _import_genai():
    try:
        import onnxruntime_genai as og  # lazy: onnxruntime_genai
    except ImportError:
        raise DeltashipError(
            "onnxruntime-genai is not installed: it runs the bundle the way apps embed it",
            f"{INSTALL} (or pip install 'deltaship[genai]'), or run the bundle with deltaship's "
            "own ONNX Runtime session (drop --runtime genai)",
        ) from None
    return og


def _check_config_files(bundle: Path, manifest: dict[str, Any]) -> None:
    """onnxruntime-genai opens the files its config names (`filename`, `config_filename`, ...): each must be a
    file of the bundle, listed in `files`, as every path the manifest names."""
    path = bundle_path(bundle, manifest, GENAI_CONFIG, "genai config")
    fix = "export the bundle again"

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if isinstance(k, str) and k.endswith("filename") or k in ("filenames", "file"):
                    for name in v if isinstance(v, list) else [v]:
                        bundle_path(bundle, manifest, name, f"{GENAI_CONFIG} {where}.{k}")
                else:
                    walk(v, f"{where}.{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{where}[{i}]")

    walk(read_json_object(path, "onnxruntime-genai config", fix), "")


# why --runtime genai refuses a constraint: its guidance (GeneratorParams' set_guidance) lives inside its own search,
# where deltaship's checks (the complete flag, the speculative driver, one token table per tokenizer) cannot follow it
GENAI_CONSTRAINT = (
    "--runtime genai cannot take --json-schema/--regex/--grammar: onnxruntime-genai applies its own llguidance "
    "inside its search loop, which deltaship does not drive (no completeness report, no checked limits)",
    "drop --runtime genai: deltaship's own ONNX session constrains the same bundle",
)


class GenaiSession(Session):
    """One sequence of an ONNX bundle in onnxruntime-genai (CPU)."""

    def __init__(
        self,
        bundle: Path,
        manifest: dict[str, Any],
        threads: int | None = None,
        prefill_chunk: int | None = None,
    ):
        super().__init__(bundle, manifest, prefill_chunk)
        entry = str(manifest.get("entry", ""))
        if not entry.endswith(".onnx"):  # what genai opens is an ONNX graph (open_bundle asks the target first)
            raise DeltashipError(
                f"{bundle}: onnxruntime-genai runs ONNX graphs; this bundle's entry is {entry!r} "
                f"(target {manifest.get('target')!r})",
                "export with --target onnx, or drop --runtime genai",
            )
        why = str((manifest.get("app_runtimes") or {}).get("onnxruntime-genai", ""))
        if why.startswith("unavailable: "):  # exported without genai_config.json, on purpose (export/onnx/genai.py)
            raise DeltashipError(
                f"{bundle}: onnxruntime-genai cannot run this bundle: {why.removeprefix('unavailable: ')}",
                "drop --runtime genai (deltaship's own ONNX runtime runs it), or fix the checkpoint and export again",
            )
        if GENAI_CONFIG not in manifest.get("files", {}):
            raise DeltashipError(
                f"{bundle}: no {GENAI_CONFIG}; the bundle was exported by a deltaship that did not "
                "write one for onnxruntime-genai",
                "export the bundle again with this version of deltaship (deltaship export ... --target onnx)",
            )
        _check_config_files(self.bundle, manifest)
        og = _import_genai()
        self._og = og
        self.threads = threads
        config = og.Config(str(self.bundle))
        if threads:
            config.overlay(
                json.dumps(
                    {
                        "model": {
                            "decoder": {
                                "session_options": {"intra_op_num_threads": int(threads), "inter_op_num_threads": 1}
                            }
                        }
                    }
                )
            )
        try:
            self.model = og.Model(config)
        except Exception as e:  # genai raises RuntimeError with its own message
            raise DeltashipError(
                f"{bundle}: onnxruntime-genai {getattr(og, '__version__', '?')} could not load the bundle: {e}",
                "export the bundle again with this version of deltaship; if it "
                "still fails, report it with the bundle's manifest.json",
            ) from None
        self._gen = None
        self._looped = False  # the sequence came from genai's loop (timed_generate): it cannot continue

    def runtime_name(self) -> str:
        return f"onnxruntime-genai {getattr(self._og, '__version__', '?')} (CPU)"

    def _generator(self, max_length: int | None = None):
        params = self._og.GeneratorParams(self.model)
        params.set_search_options(max_length=max_length or self.max_context, do_sample=False)
        return self._og.Generator(self.model, params)

    # ---- Session's primitives: one call of genai per chunk, logits read back ------------------
    def _forward(self, ids: np.ndarray) -> np.ndarray:
        if self._looped:
            raise DeltashipError(
                "onnxruntime-genai: this sequence was generated by genai's own loop, which holds "
                "its last token unread, so it cannot be continued token by token",
                "call reset() first, or generate with keep_logits=True (deltaship's loop) to "
                "continue the sequence afterwards",
            )
        if self._gen is None:
            self._gen = self._generator()
        self._gen.append_tokens(ids.astype(np.int32))
        return np.asarray(self._gen.get_logits(), dtype=np.float32).reshape(-1)

    def _reset_states(self) -> None:
        # a new generator starts from zeroed states and counts from 0: never rewind_to, which in genai 0.18 zeroes
        # the DeltaNet states but does not rewind its current/past_sequence_length counters (wrong positions)
        self._gen = None  # freed before the next one allocates its caches
        # Made here, not on the first call: a Generator allocates and zeroes genai's KV cache and DeltaNet states
        # (~115 MiB at 0.8B), the work deltaship's own driver does in reset() (zeroing in place); done lazily it
        # landed inside the profile's timed prefill (TTFT) for genai only.
        self._gen = self._generator()
        self._looped = False

    def seek(self, position: int) -> None:
        """Profiling: reach `position` by prefilling filler tokens (genai has no way to move without computing;
        the cost of the next decode step depends on the depth, not on the state's values)."""
        super().seek(position)  # bounds check
        self.reset()
        if position:
            self.prefill(np.zeros(position, dtype=np.int64))

    # ---- genai's own loop ---------------------------------------------------------------
    def generate(
        self,
        ids: Sequence[int],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_at_eos: bool = True,
        keep_logits: bool = False,
        on_token: Callable[[int], None] | None = None,
        guide: Any = None,
    ) -> Generation:
        """Greedy generation of a new sequence by genai's own search (what an app runs). Sampling,
        keep_logits, or continuing a sequence go through Session.generate on genai's logits."""
        if guide is not None:
            raise DeltashipError(GENAI_CONSTRAINT[0], GENAI_CONSTRAINT[1])
        if temperature > 0 or keep_logits or not stop_at_eos or self.position:
            return super().generate(
                ids,
                max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed,
                stop_at_eos=stop_at_eos,
                keep_logits=keep_logits,
                on_token=on_token,
            )
        return self.timed_generate(ids, max_new_tokens, on_token=on_token)[0]

    def timed_generate(
        self, ids: Sequence[int], max_new_tokens: int, on_token: Callable[[int], None] | None = None
    ) -> tuple[Generation, dict[str, Any]]:
        """Greedy generation of a new sequence (the session is reset) in genai's loop, with wall-clock
        timings: prefill_s (prompt in, first token chosen) and decode_s (one per later token)."""
        if max_new_tokens < 0:
            raise DeltashipError("max_new_tokens must be >= 0", "pass --max-new-tokens 0 or more")
        arr = self._check(ids)
        self.reset()
        gen = Generation(input_ids=[int(i) for i in arr], output_ids=[])
        g = self._gen  # reset() made it
        times: dict[str, Any] = {"prefill_s": 0.0, "decode_s": [], "prompt_tokens": int(arr.size)}
        t0 = time.perf_counter()
        g.append_tokens(arr.astype(np.int32))
        self._loop(g, gen, max_new_tokens, on_token, times, t0)
        return gen, times

    def _loop(self, g, gen: Generation, max_new_tokens: int, on_token, times: dict | None = None, t0: float = 0.0):
        """genai's greedy loop over a generator whose prompt is in (gen.input_ids): tokens into gen, with the
        prefill and per-token times into `times` when given (t0: when the prompt went in)."""
        self.position = len(gen.input_ids)
        while len(gen.output_ids) < max_new_tokens:
            if g.is_done():
                gen.stopped = "context" if self.position >= self.max_context else "eos"
                break
            g.generate_next_token()
            tok = int(g.get_next_tokens()[0])
            t1 = time.perf_counter()
            if gen.output_ids:
                self.position += 1
                if times is not None:
                    times["decode_s"].append(t1 - t0)
            elif times is not None:
                times["prefill_s"] = t1 - t0
            t0 = t1
            gen.output_ids.append(tok)
            if on_token:
                on_token(tok)
            if tok in self.eos_ids:  # genai's search stops there too
                gen.stopped = "eos"
                break
        self._gen, self._looped = g, True

    # ---- image + text: genai's multimodal processor and loop (a --vision bundle) ------------------------
    def generate_images(
        self,
        prompt: str,
        images: Sequence[str | Path],
        max_new_tokens: int,
        *,
        on_token: Callable[[int], None] | None = None,
    ) -> tuple[Generation, list[list[int]]]:
        """Greedy generation of a new sequence from a text prompt and image files, all in genai as an app runs it:
        its image processor (processor_config.json: resize, normalize, patch rows), its placeholder expansion (one
        <|vision_start|> per image, each span grown to the image's tokens), vision.onnx per image, its M-RoPE
        positions and greedy search (stopping at EOS). Returns the generation (input_ids: the expanded prompt)
        and each image's grid_thw."""
        block = (self.manifest.get("vision") or {}).get("genai")
        if not self.manifest.get("vision"):
            vision_block(self.manifest, self.bundle)  # raises: no vision tower
        if not block:
            raise DeltashipError(
                f"{self.bundle}: this --vision bundle was exported before its genai_config.json described the "
                "multimodal graphs, so onnxruntime-genai runs it as text only",
                "export the bundle again with this version of deltaship (deltaship export ... --vision), or drop "
                "--runtime genai for image prompts",
            )
        if max_new_tokens < 0:
            raise DeltashipError("max_new_tokens must be >= 0", "pass --max-new-tokens 0 or more")

        for path in images:
            load_image(path)  # a clear error for a missing or unreadable file
            with open(path, "rb") as f:
                head = f.read(8)
            if not (head.startswith(PNG_SIGNATURE) or head.startswith(JPEG_SIGNATURE)):
                # onnxruntime-extensions (Linux) decodes PNG, else hands the bytes to libjpeg, whose error handler
                # ends the process on anything else
                raise DeltashipError(
                    f"--image {path}: onnxruntime-genai's image decoder reads PNG and JPEG files only",
                    "convert the image to PNG or JPEG, or drop --runtime genai (deltaship's own session reads it)",
                )
        og = self._og
        processor = self.model.create_multimodal_processor()
        try:
            inputs = processor(prompt, images=og.Images.open(*[str(p) for p in images]) if images else None)
        except Exception as e:  # genai raises RuntimeError with its own message (unreadable image, span count)
            raise DeltashipError(
                f"onnxruntime-genai could not take the prompt and images {[str(p) for p in images]}: {e}",
                "pass PNG or JPEG files and one <|vision_start|><|image_pad|><|vision_end|> per image (deltaship "
                "generate writes them for a --prompt)",
            ) from None
        ids = [int(i) for i in inputs["input_ids"].as_numpy().reshape(-1)]
        grids = inputs["image_grid_thw"].as_numpy().reshape(-1, 3).tolist() if images else []
        self._check(ids)
        self.reset()
        g, gen = self._gen, Generation(input_ids=ids, output_ids=[])
        g.set_inputs(inputs)
        self._loop(g, gen, max_new_tokens, on_token)
        return gen, [[int(x) for x in row] for row in grids]


def open_genai(
    bundle: str | Path,
    *,
    threads: int | None = None,
    check_hashes: bool = True,
    prefill_chunk: int | None = None,
) -> GenaiSession:
    """Open an ONNX bundle in onnxruntime-genai (files checked against the manifest first)."""
    manifest = read_manifest(bundle)
    require_intact(bundle, manifest, hashes=check_hashes)
    return GenaiSession(Path(bundle), manifest, threads=threads, prefill_chunk=prefill_chunk)
