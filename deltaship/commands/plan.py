"""`deltaship plan`: memory per tier, target and precision (deltaship/devices/plan), with a prompt cache shipped in
the bundle counted when one is asked for."""

from __future__ import annotations

from pathlib import Path

from deltaship.chat.conversation import prompt_cache_tokens as count_prompt_cache
from deltaship.devices import plan as planner
from deltaship.errors import DeltashipError
from deltaship.models.source import load_source


def plan(
    model: str,
    tier: str | None = None,
    tiers_file: str | None = None,
    context: int | str | None = None,
    targets: list[str] | None = None,
    kv_dtypes: list[str] | None = None,
    prefill_chunk: int | None = None,
    prompt_cache: str | Path | None = None,
    prompt_cache_tokens: int | None = None,
    block_size: int | None = None,
) -> list[dict]:
    """deltaship.devices.plan.plan's rows. prompt_cache: the file `export --prompt-cache` takes (the system message,
    or JSON {system, template_kwargs}), its tokens counted with the model's tokenizer and chat template as export
    would feed them; prompt_cache_tokens: that count given directly (a model without a tokenizer). Each row then
    counts the cache: its bytes in the bundle (prompt_cache_bytes) and its restore on the peak
    (prompt_cache_restore_bytes, in total_bytes). block_size: the quantization block (export --block-size)."""
    if prompt_cache is not None and prompt_cache_tokens is not None:
        raise DeltashipError("--prompt-cache and --prompt-cache-tokens both say the cache's length", "pass one of them")
    if prompt_cache is not None:
        prompt_cache_tokens = count_prompt_cache(load_source(model).tokenizer_files, Path(prompt_cache))
    return planner.plan(
        model,
        tier=tier,
        tiers_file=tiers_file,
        context=context,
        targets=targets,
        kv_dtypes=kv_dtypes,
        prefill_chunk=prefill_chunk,
        prompt_cache_tokens=prompt_cache_tokens,
        block_size=block_size,
    )
