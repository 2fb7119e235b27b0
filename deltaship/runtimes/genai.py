"""An ONNX bundle run by onnxruntime-genai, the runtime apps embed (its Python wheel has the same C++
core as the Android AAR, the iOS pods and the C# package). No torch import.

genai owns the sequence: it feeds input_ids/position_ids, keeps the KV cache and the DeltaNet states,
splits a prompt into the bundle's prefill chunks (search.chunk_size) and samples. This session offers
deltaship's Session API on top of it: prefill/decode/reset/generate, and timed_generate for prefill and
decode timings of genai's own loop.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from deltaship.errors import DeltashipError
from deltaship.runtimes.base import Generation, Session

GENAI_CONFIG = "genai_config.json"  # written by deltaship.export.onnx.genai
INSTALL = 'pip install "onnxruntime-genai>=0.18,<0.19"'


def _import_genai():
    try:
        import onnxruntime_genai as og
    except ImportError:
        raise DeltashipError(
            "onnxruntime-genai is not installed: it runs the bundle the way apps embed it",
            f"{INSTALL} (or pip install 'deltaship[genai]'), or run the bundle with deltaship's "
            "own ONNX Runtime session (drop --runtime genai)",
        ) from None
    return og


class GenaiSession(Session):
    """One sequence of an ONNX bundle in onnxruntime-genai (CPU)."""

    def __init__(
        self,
        bundle: Path,
        manifest: dict[str, Any],
        threads: int | None = None,
        prefill_chunk: int | None = None,
        prime_decode: bool = True,
    ):
        super().__init__(bundle, manifest, prefill_chunk)
        if manifest.get("target") != "onnx":
            raise DeltashipError(
                f"{bundle}: onnxruntime-genai runs ONNX bundles; this is a {manifest.get('target')} bundle",
                "export with --target onnx, or drop --runtime genai",
            )
        if not (self.bundle / GENAI_CONFIG).is_file():
            raise DeltashipError(
                f"{bundle}: no {GENAI_CONFIG}; the bundle was exported by a deltaship that did not "
                "write one for onnxruntime-genai",
                "export the bundle again with this version of deltaship (deltaship export ... --target onnx)",
            )
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
        if prime_decode:
            self._prime_decode()

    def _prime_decode(self) -> None:
        """One throwaway one-token call at load, so that decode steps run on an exact memory pattern.

        ONNX Runtime caches the memory pattern of a session's runs under a key built from the input shapes (an
        XOR of their dimensions, onnxruntime's CalculateMemoryPatternsKey), and the first pattern stored under a
        key is kept. genai feeds input_ids and position_ids both [1, T], so T cancels and every call shares one
        key: without this, the pattern is the first prompt's prefill and every decode step misses it ("fall
        back to default allocation behavior" in ORT's verbose log: hundreds of allocations a step). After a
        one-token call, decode steps reuse its pattern and prefills fall back (small next to their compute).
        deltaship's own driver avoids the collision by feeding decode's position as [[p]]; the app kits that
        drive genai do this same call (docs/ship.md)."""
        g = self._generator(max_length=2)
        g.append_tokens(np.zeros(1, dtype=np.int32))

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
        self._gen = None  # a new generator starts from zeroed states (genai cannot rewind DeltaNet state)
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
    ) -> Generation:
        """Greedy generation of a new sequence by genai's own search (what an app runs). Sampling,
        keep_logits, or continuing a sequence go through Session.generate on genai's logits."""
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
        g = self._generator()
        times: dict[str, Any] = {"prefill_s": 0.0, "decode_s": [], "prompt_tokens": int(arr.size)}
        t0 = time.perf_counter()
        g.append_tokens(arr.astype(np.int32))
        self.position = arr.size
        while len(gen.output_ids) < max_new_tokens:
            if g.is_done():
                gen.stopped = "context" if self.position >= self.max_context else "eos"
                break
            g.generate_next_token()
            tok = int(g.get_next_tokens()[0])
            t1 = time.perf_counter()
            if gen.output_ids:
                times["decode_s"].append(t1 - t0)
                self.position += 1
            else:
                times["prefill_s"] = t1 - t0
            t0 = t1
            gen.output_ids.append(tok)
            if on_token:
                on_token(tok)
            if tok in self.eos_ids:
                gen.stopped = "eos"
                break
        self._gen, self._looped = g, True
        return gen, times


def open_genai(
    bundle: str | Path,
    *,
    threads: int | None = None,
    check_hashes: bool = True,
    prefill_chunk: int | None = None,
    prime_decode: bool = True,
) -> GenaiSession:
    """Open an ONNX bundle in onnxruntime-genai (files checked against the manifest first); prime_decode: see
    GenaiSession._prime_decode (off only to measure what it saves)."""
    from deltaship.bundle.reader import read_manifest, require_intact

    manifest = read_manifest(bundle)
    require_intact(bundle, manifest, hashes=check_hashes)
    return GenaiSession(Path(bundle), manifest, threads=threads, prefill_chunk=prefill_chunk, prime_decode=prime_decode)
