"""The transformers versions deltaship supports (see pyproject.toml) differ here, and only here.

transformers 5.24 renamed the cache that models take and return from `past_key_values` (5.23; Mamba-like models
said `cache_params`) to `cache`: the forward keyword, the field of model outputs (`CausalLMOutputWithPast.cache`)
and of generate()'s outputs. 5.24 still accepts the old names, with a deprecation warning, until 6.0.
"""

from __future__ import annotations

from typing import Any

from transformers.modeling_outputs import CausalLMOutputWithPast

# Read off the output class rather than the version string, so a patched or pre-release build answers for itself.
CACHE_NAME: str = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def output_cache(output: Any) -> Any:
    """The cache a transformers model (or generate()) returned in `output`, whichever name this version gives it."""
    return getattr(output, CACHE_NAME)
