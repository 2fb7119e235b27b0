"""ExecuTorch weight quantization: torchao 8da4w / 8da8w linears and ExecuTorch's quantized embedding.

The vocabulary-sized tables (embedding, LM head: 248320 rows) are quantized a block of rows at a time
straight from the weight plan, so no fp32 copy of them is ever held whole (torchao's HQQ scale search
makes several full-size temporaries of whatever it is given). Groups never cross rows, so block-wise
quantization gives exactly the numbers whole-table quantization gives (tested).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from deltaship.logs import native_stderr

ROW_BLOCK = 16384
ReadRows = Callable[[slice], np.ndarray]  # rows of a [N, K] float table, as float32


def linear_group(precision: str, group_size: int, in_features: int) -> tuple[int, int]:
    """(bits, group) of one linear: int4 groups that are multiples of 32 dividing the row (what XNNPACK
    takes), else 8-bit per output channel (group 0)."""
    if precision == "int4":
        g = next(
            (
                x
                for x in (group_size, group_size // 2, group_size // 4)
                if x >= 32 and x % 32 == 0 and in_features % x == 0
            ),
            0,
        )
        return (4, g) if g else (8, 0)
    return 8, 0


def linear_config(bits: int, group: int):
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig  # lazy: torchao
    from torchao.quantization.granularity import PerAxis, PerGroup

    return Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4 if bits == 4 else torch.int8,
        weight_granularity=PerGroup(group) if group else PerAxis(0),
        **({"intx_choose_qparams_algorithm": "hqq_scale_only"} if bits == 4 else {}),
    )


def quantize_linears(model: nn.Module, precision: str, group_size: int, prefix: str = "") -> None:
    """8da4w (int8 dynamic activations, int4 weights per group) or 8da8w on every nn.Linear under `prefix`."""
    from torchao.quantization import quantize_  # lazy: torchao

    linears = {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and (n.startswith(prefix) or n == prefix.rstrip("."))
    }
    groups: dict[tuple[int, int], set[str]] = {}
    for name, m in linears.items():
        groups.setdefault(linear_group(precision, group_size, m.in_features), set()).add(name)
    for (bits, g), names in groups.items():
        quantize_(model, linear_config(bits, g), filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn in names)


def _row_blocks(rows: int):
    return [slice(r, min(rows, r + ROW_BLOCK)) for r in range(0, rows, ROW_BLOCK)]


@torch.no_grad()
def quantized_table_linear(read: ReadRows, shape: tuple[int, int], precision: str, group_size: int) -> torch.Tensor:
    """A [N, K] linear weight (the LM head) quantized like every other linear, one block of rows at a time:
    returns the torchao tensor to use as the Linear's weight."""
    from torchao.quantization import quantize_  # lazy: torchao
    from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import IntxUnpackedToInt8Tensor

    bits, g = linear_group(precision, group_size, shape[1])
    cfg = linear_config(bits, g)
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    w = None
    for sl in _row_blocks(shape[0]):
        block = nn.Linear(shape[1], sl.stop - sl.start, bias=False)
        block.weight.data = torch.from_numpy(np.ascontiguousarray(read(sl), dtype=np.float32))
        quantize_(block, cfg)
        w = block.weight
        parts.append((w.qdata, w.scale, w.zero_point))
    return IntxUnpackedToInt8Tensor(
        torch.cat([p[0] for p in parts]),
        torch.cat([p[1] for p in parts]),
        torch.cat([p[2] for p in parts]),
        w.target_dtype,
        w.block_size,
        w.dtype,
        w.activation_quantization,
    )


def embedding_scheme(precision: str, hidden: int) -> tuple[int, int]:
    """(bits, group) of ExecuTorch's quantized embedding: 4-bit rows in groups of 32 (or 16), or 8-bit rows."""
    if precision == "int4":
        return 4, next((x for x in (32, 16) if hidden % x == 0), 0)
    return 8, 0


@torch.no_grad()
def quantized_embedding(read: ReadRows, shape: tuple[int, int], precision: str) -> tuple[nn.Module, str]:
    """ExecuTorch's QuantizedGroupEmbedding (quantized_decomposed::embedding_4bit / embedding_byte kernels),
    filled a block of rows at a time with what its own EmbeddingQuantHandler computes (torchao HQQ scales,
    4-bit codes packed high nibble first). Returns (module, scheme string as ExecuTorch writes it)."""
    from torchao.quantization import IntxWeightOnlyConfig, quantize_  # lazy: torchao (the executorch extra)
    from torchao.quantization.granularity import PerAxis, PerGroup

    # Loading ExecuTorch's llama example loads pytorch_tokenizers, whose C++ writes "I tokenizers:regex.cpp:40]
    # Registering override fallback regex" to fd 2 (shown with --verbose).
    with native_stderr():
        # lazy: executorch (its quantized embedding module)
        from executorch.examples.models.llama.source_transformation.quantize import QuantizedGroupEmbedding

    rows, hidden = shape
    bits, group = embedding_scheme(precision, hidden)
    cfg = IntxWeightOnlyConfig(
        weight_dtype=getattr(torch, f"int{bits}"),
        granularity=PerGroup(group) if group else PerAxis(0),
        intx_choose_qparams_algorithm="hqq_scale_only",
    )
    packed = bits == 4
    data = torch.empty(rows, hidden // 2 if packed else hidden, dtype=torch.uint8 if packed else torch.int8)
    scales = None
    for sl in _row_blocks(rows):
        tmp = nn.Embedding(sl.stop - sl.start, hidden)
        tmp.weight = nn.Parameter(torch.from_numpy(np.ascontiguousarray(read(sl), dtype=np.float32)))
        quantize_(tmp, cfg, lambda m, fqn: isinstance(m, nn.Embedding))
        q, s = tmp.weight.qdata, tmp.weight.scale.squeeze(-1)
        if packed:
            pairs = q.add(8).view(torch.uint8).view(q.shape[0], hidden // 2, 2)
            q = pairs[:, :, 0] * 16 + pairs[:, :, 1]
        if scales is None:
            scales = torch.empty((rows, *s.shape[1:]), dtype=s.dtype)
        data[sl] = q
        scales[sl] = s
    module = QuantizedGroupEmbedding(
        device="cpu",
        vocab_size=rows,
        embedding_dim=hidden,
        group_size=group or None,
        dtype=torch.float32,
        packed=packed,
        bitwidth=bits,
    )
    module.weight, module.scales = data, scales  # as load_state_dict(assign=True) would
    return module, f"{bits},{group}"


def describe(precision: str, group_size: int) -> dict[str, Any]:
    return {
        "scheme": "torchao 8da4w (hqq scales)" if precision == "int4" else "torchao 8da8w per channel",
        "activations": "int8 dynamic",
        "group_size": group_size if precision == "int4" else "per channel",
        "linears": "every Linear, LM head included (8-bit per channel where no group of 32k divides a row)",
    }


@torch.no_grad()
def rounded_weights(model: nn.Module) -> dict[str, np.ndarray]:
    """The weight values the program holds, dequantized: canonical parameter name -> float32 array."""
    out: dict[str, np.ndarray] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            w = m.weight
            out[f"{name}.weight"] = (w.dequantize() if hasattr(w, "dequantize") else w).float().numpy()
    emb = model.model.embed_tokens
    ids = torch.arange(model.spec.vocab_size).reshape(1, -1)
    out["model.embed_tokens.weight"] = emb(ids)[0].float().numpy()
    return out
