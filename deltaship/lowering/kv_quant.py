"""Quantized KV caches with static scales (`export --kv-cache int8|int4` on ONNX).

ONNX Runtime's GroupQueryAttention stores its cache as int8 (or int4, two values a byte in uint8) when
given `k_quant_type`/`v_quant_type` and `kv_cache_bit_width`, with fp32 scales as inputs: symmetric,
q = clamp(round(x / scale)), x' = q * scale, the scale per KV head and channel ([1, Hkv, 1, D],
PER_CHANNEL). The scales are static: calibrated once at export and stored in the graph, so the cache
costs exactly Hkv x D x bits/8 bytes a token and layer, with no per-token scales.

Calibration: the fp32 transformers reference (the checkpoint's own weights) runs a calibration
prompt; the cache it fills (keys after k_norm and RoPE, values) gives each channel's absolute
maximum. RoPE rotates channel pairs (i, i + rotary_dim/2) by a position-dependent angle, so a key
channel's bound is the largest norm of its pair, which holds at every position, also those past the
calibration prompt. Values and the unrotated key channels use their absolute maximum. scale =
bound x KV_MARGIN / qmax (127 for int8, 7 for int4); what exceeds it is clipped.
The prompt: the trained tiny model's held-out text from CALIBRATION_OFFSET on (deltaship eval reads
from its start), tokenized with the checkpoint's tokenizer, else seeded random token ids.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from deltaship.errors import DeltashipError
from deltaship.lowering.settings import KvCachePlan
from deltaship.models.trained import HELDOUT
from deltaship.oracle.budget import available_memory, reference_fits, reference_need
from deltaship.oracle.reference import reference_model

CALIBRATION_TOKENS = 512
CALIBRATION_OFFSET = 2048  # characters of heldout.txt skipped: eval scores its first tokens
KV_MARGIN = 1.0  # head room over the calibrated bound; the pair bound already covers every RoPE angle
QMAX = {8: 127, 4: 7}
BITS = {"int8": 8, "int4": 4}
STATE_DTYPE = {8: "int8", 4: "uint8"}  # int4: two values a byte along head_dim


def calibration_ids(source, n: int) -> tuple[list[int], str]:

    tok = next((f for f in source.tokenizer_files if f.name == "tokenizer.json"), None)
    if tok is not None and HELDOUT.is_file():
        from tokenizers import Tokenizer  # lazy: tokenizers, only where text is encoded

        text = HELDOUT.read_text(encoding="utf-8", errors="replace")[CALIBRATION_OFFSET:]
        ids = Tokenizer.from_file(str(tok)).encode(text).ids[:n]
        if len(ids) == n:
            return ids, f"heldout.txt from character {CALIBRATION_OFFSET}, {n} tokens"
    ids = np.random.default_rng(0).integers(0, source.spec.vocab_size, n).tolist()
    return ids, f"{n} seeded random token ids (no tokenizer)"


@torch.no_grad()
def calibrate(source, max_context: int) -> tuple[dict[int, dict[str, np.ndarray]], str]:
    """{attention layer: {"key": bound [Hkv, D], "value": bound [Hkv, D]}} and how the prompt was made."""
    from deltaship.oracle.compat import output_cache  # lazy: transformers

    spec = source.spec
    ids, how = calibration_ids(source, min(CALIBRATION_TOKENS, max_context))
    model = reference_model(source)
    out = model(torch.tensor([ids], dtype=torch.long), use_cache=True)
    cache = output_cache(out)
    bounds = {
        layer: {
            "key": key_bound(cache.layers[layer].keys[0].float(), spec.rotary_dim),
            "value": cache.layers[layer].values[0].float().abs().amax(1).numpy(),
        }
        for layer in spec.attention_layers
    }
    del model
    return bounds, how


def key_bound(k: torch.Tensor, rotary_dim: int) -> np.ndarray:
    """|k| max per channel of keys [Hkv, T, D]; on RoPE channel pairs (i, i + rotary_dim/2), the pair's largest
    norm: a rotation to any position keeps each channel within it."""
    half = rotary_dim // 2
    kb = k.abs().amax(1)
    if half:
        pair = torch.sqrt(k[..., :half] ** 2 + k[..., half : 2 * half] ** 2).amax(1)
        kb[:, :half] = pair
        kb[:, half : 2 * half] = pair
    return kb.numpy()


def scales(bound: np.ndarray, bits: int) -> np.ndarray:
    """GroupQueryAttention's PER_CHANNEL scale [1, Hkv, 1, D] from a bound [Hkv, D]."""
    s = np.maximum(bound * KV_MARGIN, 1e-6) / QMAX[bits]
    return s.astype(np.float32)[None, :, None, :]


def quantized_states(states: list[dict], kv: KvCachePlan) -> list[dict]:
    """The state contract with the KV caches stored quantized as `kv` plans (int4: head_dim halved, two values a
    byte)."""
    bits = kv.bits
    out = []
    for s in states:
        if s["kind"].startswith("kv_cache"):
            shape = list(s["shape"])
            shape[-1] = shape[-1] * bits // 8
            s = dict(
                s,
                shape=shape,
                dtype=STATE_DTYPE[bits],
                quantization={
                    "kv_dtype": kv.dtype,
                    "bits": bits,
                    "scheme": kv.scheme,
                    "packing": "two 4-bit values a byte along head_dim" if bits == 4 else "none",
                },
            )
        out.append(s)
    return out


def stored_states(states: list[dict], kv: KvCachePlan) -> list[dict]:
    """The state contract with the KV caches as `kv` stores them: int8/int4 codes (quantized_states), or fp16
    under fp32 activations; the states of a cache at the activations' dtype unchanged. Each lowering applies it
    once, to the states its program holds."""
    if kv.quantized:
        return quantized_states(states, kv)
    if kv.narrower:  # fp16 buffers under fp32 activations, widened where attention reads them
        return [
            dict(s, dtype="float16") if s["kind"].startswith("kv_cache") and s["dtype"] == "float32" else s
            for s in states
        ]
    return states


def prepare(source, kv: KvCachePlan, max_context: int, progress=None) -> tuple[dict[int, dict[str, Any]], dict]:
    """Calibrate an int8/int4 cache's static scales on the fp32 reference: ({attention layer: {"bits", "key",
    "value"}}, the manifest's record of the calibration)."""
    kv_cache = kv.dtype
    bits = BITS[kv_cache]
    if not reference_fits(source.spec):
        raise DeltashipError(
            f"--kv-cache {kv_cache} calibrates its static scales on the fp32 transformers reference, which needs "
            f"about {reference_need(source.spec) / 2**30:.1f} GiB; {available_memory() / 2**30:.1f} GiB are available",
            "export on a machine with more memory, or drop --kv-cache",
        )
    if progress:
        progress(f"calibrating {kv_cache} KV-cache scales on the fp32 reference")
    bounds, how = calibrate(source, max_context)
    kv_scales = {
        layer: {"bits": bits, "key": scales(b["key"], bits), "value": scales(b["value"], bits)}
        for layer, b in bounds.items()
    }
    return kv_scales, {
        "kv_dtype": kv_cache,
        "bits": bits,
        "scales": "static, per KV head and channel, fp32, stored in the graph",
        "calibration": how,
        "key_bound": "per channel: |k| max; RoPE channel pairs: the pair's largest norm",
        "margin": KV_MARGIN,
    }


class rounded_cache_attention:
    """Within this context, transformers' attention (every model whose config names the implementation
    "deltaship_kv_rounded") sees keys and values rounded as the int8 cache stores them: the reference for
    what the quantized cache alone should cost. `scales`: {layer: (key scale, value scale)}, as
    GroupQueryAttention's inputs [1, Hkv, 1, D]."""

    NAME = "deltaship_kv_rounded"

    def __init__(self, model, scales: dict[int, tuple[np.ndarray, np.ndarray]] | None, bits: int = 8):
        """bits 16: an fp16 cache under fp32 activations (keys and values rounded to fp16; no scales)."""
        self.model, self.bits = model, bits
        self.scales = {
            k: (torch.tensor(np.array(a)), torch.tensor(np.array(b))) for k, (a, b) in (scales or {}).items()
        }

    def __enter__(self):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # lazy: transformers

        self.impl = self.model.config._attn_implementation
        if self.impl in ALL_ATTENTION_FUNCTIONS:
            inner = ALL_ATTENTION_FUNCTIONS[self.impl]
        else:  # "eager" is the modeling file's own function, not registered
            from transformers.models.qwen3_5.modeling_qwen3_5 import (  # lazy: transformers
                eager_attention_forward as inner,
            )
        q = QMAX.get(self.bits)

        def rounded(module, query, key, value, *args, **kwargs):
            if self.bits == 16:
                key, value = key.to(torch.float16).to(key.dtype), value.to(torch.float16).to(value.dtype)
                return inner(module, query, key, value, *args, **kwargs)
            ks, vs = self.scales[module.layer_idx]
            key = torch.clamp(torch.round(key / ks), -q, q) * ks
            value = torch.clamp(torch.round(value / vs), -q, q) * vs
            return inner(module, query, key, value, *args, **kwargs)

        ALL_ATTENTION_FUNCTIONS.register(self.NAME, rounded)
        self.model.config._attn_implementation = self.NAME
        return self.model

    def __exit__(self, *exc):
        self.model.config._attn_implementation = self.impl
