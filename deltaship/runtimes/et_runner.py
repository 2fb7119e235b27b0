"""ExecuTorch's own LLM runner on a deltaship bundle: the C++ TextLLMRunner behind Android's LlmModule and
iOS's ExecuTorchLLMTextRunner, through its Python binding. The .pte and tokenizer.json run unmodified.

What the runner does (pytorch/executorch extension/llm/runner, text_llm_runner.cpp, text_prefiller.cpp,
text_token_generator.h, stats.h), and how this driver keeps its results those of `deltaship generate`:
- the prompt is encoded with tokenizer.json and `num_bos` BOS tokens (0 here: deltaship encodes without
  special tokens), then fed in calls of get_max_seq_len (= the bundle's prefill chunk);
- it checks only prompt < get_max_context_len, not prompt + new tokens (with seq_len < context it treats
  the program as a sliding window): this driver caps the new tokens where deltaship's session stops
  (position == max_context), so the program is never asked for a position past its KV cache;
- the first token comes from the prefill, each further one from a decode call; it stops at an EOS id
  (the tokenizer's and get_eos_ids) after emitting its text, as deltaship's session does;
- its Stats are millisecond timestamps: prompt evaluation = inference start .. prompt_eval_end (tokenising
  included), decode = prompt_eval_end .. inference_end over num_generated_tokens decode calls.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from deltaship.bundle.paths import bundle_path
from deltaship.bundle.reader import read_manifest, require_intact
from deltaship.errors import DeltashipError
from deltaship.logs import native_stderr
from deltaship.runtimes.executorch import KERNEL_LIBRARIES, runtime
from deltaship.runtimes.tokenizer import load_tokenizer
from deltaship.stats import summarize

# what bundles exported before the manifest listed its runtime requirements need (both kernel libraries)
_LEGACY_IMPORTS = ("executorch.extension.llm.custom_ops.custom_ops", "executorch.kernels.quantized")


def _open(bundle: str | Path, check_hashes: bool) -> tuple[Path, dict[str, Any]]:
    path = Path(bundle)
    manifest = read_manifest(path)
    entry = str(manifest.get("entry", ""))
    if not entry.endswith(".pte"):  # the runner loads an ExecuTorch program (text_runtime asks the target first)
        raise DeltashipError(
            f"{path}: --runtime et-runner runs ExecuTorch programs (.pte); this bundle's entry is {entry!r} "
            f"(target {manifest.get('target')!r})",
            "export with --target executorch, or drop --runtime et-runner to use this bundle's own runtime",
        )
    require_intact(path, manifest, hashes=check_hashes)
    load_tokenizer(path, manifest)  # the runner needs tokenizer.json: fail here, with the fix, if it is missing
    return path, manifest


def _register_kernels(manifest: dict[str, Any]) -> None:
    """Import what registers the program's kernels (manifest lowering.runtime_requirements.python)."""
    req = manifest.get("lowering", {}).get("runtime_requirements", {})
    built = manifest.get("tools", {}).get("executorch", "?")

    for module in req.get("python", _LEGACY_IMPORTS):
        try:
            runtime() if module in KERNEL_LIBRARIES else importlib.import_module(module)
        except (ImportError, OSError, StopIteration) as e:
            raise DeltashipError(
                f"ExecuTorch's LLM runner needs {module} ({e})", f"pip install executorch=={built}"
            ) from None


def _runner(path: Path, manifest: dict[str, Any]):
    with native_stderr():
        _register_kernels(manifest)
        from executorch.extension.llm.runner import TextLLMRunner  # lazy: executorch

    try:
        with native_stderr():  # cpuinfo's probe and the loader's log
            return TextLLMRunner(
                str(bundle_path(path, manifest, manifest["entry"], "entry")),
                str(bundle_path(path, manifest, "tokenizer.json", "tokenizer.files")),
            )
    except RuntimeError as e:
        raise DeltashipError(
            f"{path}: ExecuTorch's LLM runner could not load the program ({e})",
            "export the bundle again with the installed executorch",
        ) from None


@contextlib.contextmanager
def _stdout_to(target: str | None) -> Iterator[None]:
    """The runner prints every piece and a report to the C stdout; send fd 1 to `target` meanwhile
    (None: leave it), so a caller's own stdout (e.g. JSON) stays clean."""
    if target is None:
        yield
        return

    sys.stdout.flush()
    saved = os.dup(1)
    fd = os.open(target, os.O_WRONLY)

    libc_fflush = ctypes.CDLL(None).fflush
    try:
        os.dup2(fd, 1)
        yield
    finally:
        libc_fflush(None)  # the runner's last lines may still sit in C's stdout buffer
        os.dup2(saved, 1)
        os.close(saved)
        os.close(fd)


def _stats_dict(s) -> dict[str, Any]:
    ms = s.SCALING_FACTOR_UNITS_PER_SECOND
    prefill_s = (s.prompt_eval_end_ms - s.inference_start_ms) / ms
    decode_s = (s.inference_end_ms - s.prompt_eval_end_ms) / ms
    return {
        "prompt_tokens": int(s.num_prompt_tokens),
        "decode_calls": int(s.num_generated_tokens),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "ttft_s": (s.first_token_ms - s.inference_start_ms) / ms,
        "model_execution_s": s.aggregate_model_execution_time_ms / ms,
        "prefill_tok_s": s.num_prompt_tokens / prefill_s if prefill_s > 0 else None,
        "decode_tok_s": s.num_generated_tokens / decode_s if decode_s > 0 else None,
    }


def _run(
    runner, prompt: str, new_tokens: int, temperature: float, on_text: Callable[[str], None] | None, quiet: bool
) -> tuple[str, dict[str, Any]]:
    from executorch.extension.llm.runner import GenerationConfig  # lazy: executorch

    pieces: list[str] = []
    stats: list[dict[str, Any]] = []

    def piece(text: str) -> None:
        pieces.append(text)
        if on_text:
            on_text(text)

    runner.reset()  # position 0: the program also drops its DeltaNet state there
    config = GenerationConfig(echo=False, max_new_tokens=new_tokens, temperature=temperature, num_bos=0, num_eos=0)
    try:
        with _stdout_to(os.devnull if quiet else None), native_stderr():  # its stats report goes to stderr
            runner.generate(prompt, config, token_callback=piece, stats_callback=lambda s: stats.append(_stats_dict(s)))
    except RuntimeError as e:
        raise DeltashipError(
            f"ExecuTorch's LLM runner failed ({e}); its log on stderr names the cause",
            "check the prompt fits the bundle's max context; export again if the program is from another executorch",
        ) from None
    return "".join(pieces), (stats[0] if stats else {})


def _budget(manifest: dict[str, Any], n_prompt: int, max_new_tokens: int) -> tuple[int, bool]:
    """New tokens the runner may produce (as deltaship's session: stop when the position reaches the
    context), and whether the context, not max_new_tokens, set it."""
    ctx = int(manifest["max_context"])
    if n_prompt == 0:
        raise DeltashipError("the prompt is empty", "pass a prompt of at least one token")
    if n_prompt >= ctx:  # the runner's own check (text_llm_runner.cpp) is prompt < max_context
        raise DeltashipError(
            f"the prompt is {n_prompt} tokens; ExecuTorch's LLM runner needs fewer than the "
            f"bundle's max context of {ctx}",
            "shorten the prompt, or export with a larger --max-context",
        )
    room = ctx - n_prompt + 1  # the last token is produced from the logits at position ctx - 1, never fed
    return min(max_new_tokens, room), room < max_new_tokens


def generate_with_runner(
    bundle: str | Path,
    prompt: str,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    check_hashes: bool = True,
    quiet: bool = True,
    on_text: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Generate from `prompt` with ExecuTorch's C++ LLM runner on an ExecuTorch bundle.

    Greedy at temperature 0 (the runner's own default is 0.8). Returns text (the new text only), the
    number of new tokens, why it stopped ("length", "context" or "eos"), and the runner's stats
    (prefill/decode seconds and tok/s, time to first token). quiet: keep the runner's printing off stdout."""
    if max_new_tokens < 1:
        raise DeltashipError("ExecuTorch's LLM runner produces at least one token", "pass --max-new-tokens 1 or more")
    if not 0.0 <= temperature <= 1.0:  # the runner's own range (text_token_generator.h)
        raise DeltashipError(
            f"temperature {temperature} is outside ExecuTorch's LLM runner range 0 .. 1",
            "pass --temperature between 0 and 1",
        )
    path, manifest = _open(bundle, check_hashes)
    tok = load_tokenizer(path, manifest)
    n_prompt = len(tok.encode(prompt))
    budget, by_context = _budget(manifest, n_prompt, max_new_tokens)
    runner = _runner(path, manifest)
    text, stats = _run(runner, prompt, budget, temperature, on_text, quiet)
    produced = stats["decode_calls"] + 1 if stats else None
    # the runner ends early only at an EOS id
    stopped = "eos" if produced is not None and produced < budget else ("context" if by_context else "length")

    return {
        "text": text,
        "prompt_tokens": n_prompt,
        "new_tokens": produced,
        "stopped": stopped,
        "runtime": f"executorch {metadata.version('executorch')} TextLLMRunner (C++ LLM runner)",
        "stats": stats,
    }


def prompt_of_length(tok, n: int, source: str) -> str:
    """Text from `source` that the bundle's tokenizer encodes to exactly n tokens (profiling prompts are
    text: the runner's binding takes no token ids)."""
    ids = tok.encode(source)
    while len(ids) < n + 64:
        ids = ids + ids
    for start in range(64):
        text = tok.decode(ids[start : start + n])
        if len(tok.encode(text)) == n:
            return text
    raise DeltashipError(
        f"no text of exactly {n} tokens found in the profiling source text", "pick another --prompt-lengths value"
    )


def profile_with_runner(
    bundle: str | Path,
    prompt_length: int = 128,
    gen: int = 64,
    reps: int = 5,
    warmups: int = 1,
    source_text: str | None = None,
) -> dict[str, Any]:
    """Prefill and decode speed as ExecuTorch's C++ LLM runner reports them (its Stats), `reps` times after
    `warmups` runs, on a prompt of `prompt_length` tokens and `gen` new tokens.

    Returns {"runtime", "results": records}, each record {"metric", "unit", "prompt_length", "gen",
    "samples", median/p90/cv...} as the profiler's worker writes them: prefill_tok_s, decode_tok_s, ttft_s.
    The runner's clock is in milliseconds: keep prompts and gen long enough that a phase takes tens of ms."""

    if gen < 2:
        raise DeltashipError("decode speed needs at least 2 new tokens", "pass --gen 2 or more")
    if reps < 1:
        raise DeltashipError("reps must be at least 1", "pass --reps 1 or more")
    path, manifest = _open(bundle, check_hashes=True)
    if prompt_length + gen - 1 > int(manifest["max_context"]) or prompt_length >= int(manifest["max_context"]):
        raise DeltashipError(
            f"prompt {prompt_length} + {gen} new tokens exceed the bundle's max context of {manifest['max_context']}",
            "pick a shorter prompt or fewer new tokens",
        )
    tok = load_tokenizer(path, manifest)
    if source_text is None:  # any real text: the speed does not depend on what the tokens say
        source_text = __doc__
    prompt = prompt_of_length(tok, prompt_length, source_text)
    runner = _runner(path, manifest)
    runs = [_run(runner, prompt, gen, 0.0, None, True)[1] for _ in range(warmups + reps)][warmups:]
    results = []
    for metric, unit, key in (
        ("prefill_tok_s", "tok/s", "prefill_tok_s"),
        ("decode_tok_s", "tok/s", "decode_tok_s"),
        ("ttft_s", "s", "ttft_s"),
    ):
        samples = [r[key] for r in runs if r.get(key) is not None]
        where = {"prompt_length": prompt_length, "gen": gen, "source": "TextLLMRunner stats (ms clock)"}
        if samples:
            results.append({"metric": metric, "unit": unit, **where, "samples": samples, **summarize(samples)})
        else:  # a phase under one millisecond: the runner's clock cannot time it
            results.append(
                {"metric": metric, "unit": unit, **where, "samples": [], "flags": ["below_clock_resolution"]}
            )

    return {
        "runtime": f"executorch {metadata.version('executorch')} TextLLMRunner (C++ LLM runner)",
        "results": results,
        "runs": runs,
    }
