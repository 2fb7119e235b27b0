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

CALIBRATION_TOKENS = 512
CALIBRATION_OFFSET = 2048  # characters of heldout.txt skipped: eval scores its first tokens
KV_MARGIN = 1.0  # head room over the calibrated bound; the pair bound already covers every RoPE angle
QMAX = {8: 127, 4: 7}
BITS = {"int8": 8, "int4": 4}
STATE_DTYPE = {8: "int8", 4: "uint8"}  # int4: two values a byte along head_dim


def calibration_ids(source, n: int) -> tuple[list[int], str]:
    from deltaship.bundle.evaluate import HELDOUT

    tok = next((f for f in source.tokenizer_files if f.name == "tokenizer.json"), None)
    if tok is not None and HELDOUT.is_file():
        from tokenizers import Tokenizer

        text = HELDOUT.read_text(encoding="utf-8", errors="replace")[CALIBRATION_OFFSET:]
        ids = Tokenizer.from_file(str(tok)).encode(text).ids[:n]
        if len(ids) == n:
            return ids, f"heldout.txt from character {CALIBRATION_OFFSET}, {n} tokens"
    ids = np.random.default_rng(0).integers(0, source.spec.vocab_size, n).tolist()
    return ids, f"{n} seeded random token ids (no tokenizer)"


@torch.no_grad()
def calibrate(source, max_context: int) -> tuple[dict[int, dict[str, np.ndarray]], str]:
    """{attention layer: {"key": bound [Hkv, D], "value": bound [Hkv, D]}} and how the prompt was made."""
    from deltaship.export.reference import reference_model

    spec = source.spec
    ids, how = calibration_ids(source, min(CALIBRATION_TOKENS, max_context))
    model = reference_model(source)
    out = model(torch.tensor([ids], dtype=torch.long), use_cache=True)
    cache = out.past_key_values
    half = spec.rotary_dim // 2
    bounds: dict[int, dict[str, np.ndarray]] = {}
    for layer in spec.attention_layers:
        k = cache.layers[layer].keys[0].float()  # [Hkv, T, D]
        v = cache.layers[layer].values[0].float()
        kb = k.abs().amax(1)
        if half:
            pair = torch.sqrt(k[..., :half] ** 2 + k[..., half : 2 * half] ** 2).amax(1)
            kb[:, :half] = pair
            kb[:, half : 2 * half] = pair
        bounds[layer] = {"key": kb.numpy(), "value": v.abs().amax(1).numpy()}
    del model
    return bounds, how


def scales(bound: np.ndarray, bits: int) -> np.ndarray:
    """GroupQueryAttention's PER_CHANNEL scale [1, Hkv, 1, D] from a bound [Hkv, D]."""
    s = np.maximum(bound * KV_MARGIN, 1e-6) / QMAX[bits]
    return s.astype(np.float32)[None, :, None, :]


def quantized_states(states: list[dict], kv_cache: str) -> list[dict]:
    """The state contract with the KV caches stored quantized (int4: head_dim halved, two values a byte)."""
    bits = BITS[kv_cache]
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
                    "kv_dtype": kv_cache,
                    "bits": bits,
                    "scheme": "symmetric, static per-channel scales (per KV head and head_dim channel)",
                    "packing": "two 4-bit values a byte along head_dim" if bits == 4 else "none",
                },
            )
        out.append(s)
    return out


def prepare(ctx, source, kv_cache: str, progress=None) -> dict[str, Any]:
    """Calibrate the static scales into ctx.kv_quant and switch the KV states to the quantized dtype;
    returns the manifest's record of the calibration."""
    bits = BITS[kv_cache]
    if progress:
        progress(f"calibrating {kv_cache} KV-cache scales on the fp32 reference")
    bounds, how = calibrate(source, ctx.max_context)
    ctx.kv_quant = {
        layer: {"bits": bits, "key": scales(b["key"], bits), "value": scales(b["value"], bits)}
        for layer, b in bounds.items()
    }
    ctx.states = quantized_states(ctx.states, kv_cache)
    return {
        "kv_dtype": kv_cache,
        "bits": bits,
        "scales": "static, per KV head and channel, fp32, stored in the graph",
        "calibration": how,
        "key_bound": "per channel: |k| max; RoPE channel pairs: the pair's largest norm",
        "margin": KV_MARGIN,
    }
