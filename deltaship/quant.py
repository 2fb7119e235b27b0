"""Block-wise weight quantization in the layouts ONNX Runtime's MatMulNBits and GatherBlockQuantized read.

Symmetric, no zero points (both ops then use the implicit zero point 2^(bits-1)). The value of
largest magnitude in each block maps exactly onto the most negative code, keeping its sign in the
scale (as llama.cpp's Q4_0 does), so a block loses at most half a step at its other extreme.
"""

from __future__ import annotations

import numpy as np


def quantize_blocks(w: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] float32 -> (codes uint8 [N, nb, block], scales float32 [N, nb]), K padded to nb*block."""
    n, k = w.shape
    nb = -(-k // block)
    if nb * block != k:
        w = np.pad(w, ((0, 0), (0, nb * block - k)))
    wb = w.reshape(n, nb, block).astype(np.float32)
    idx = np.abs(wb).argmax(axis=-1)
    extreme = np.take_along_axis(wb, idx[..., None], axis=-1)[..., 0]
    half = float(1 << (bits - 1))
    scales = extreme / -half
    safe = np.where(scales == 0, 1.0, scales)
    q = np.clip(np.rint(wb / safe[..., None]) + half, 0, 2 * half - 1).astype(np.uint8)
    return q, scales.astype(np.float32)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack codes along the last axis, low bits first: 4-bit pairs into bytes; 8-bit unchanged."""
    if bits == 8:
        return codes
    if bits != 4:
        raise ValueError(f"unsupported bit width {bits}")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def dequantize(packed: np.ndarray, scales: np.ndarray, bits: int, k: int) -> np.ndarray:
    """Inverse of quantize_blocks + pack (for tests and error reports): float32 [N, K]."""
    if bits == 4:
        codes = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
        codes[..., 0::2], codes[..., 1::2] = packed & 0x0F, packed >> 4
    else:
        codes = packed
    half = float(1 << (bits - 1))
    w = (codes.astype(np.float32) - half) * scales[..., None]
    return w.reshape(w.shape[0], -1)[:, :k]


def quantize_matmul_weight(w: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """A linear weight [N, K] -> MatMulNBits (B uint8 [N, nb, block*bits/8], scales [N*nb])."""
    codes, scales = quantize_blocks(w, bits, block)
    return pack(codes, bits), scales.reshape(-1)
