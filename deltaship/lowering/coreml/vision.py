"""Qwen3.5's vision tower as Core ML functions: one fixed-shape function per enumerated patch count, with a mask.

Core ML (and the Neural Engine) wants fixed shapes, so the tower (models/qwen3_5_vision.py: patch embed as a
Linear, every grid-dependent tensor computed on the host) is captured once per patch count N in
`patch_counts` (multiples of 4) and lowered to MIL by the decoder's lowerer (lowering.py). An image of n <= N
patches is padded to N rows: zero pixels, zero position weights, the identity rotation, and `key_bias` 0 for
its n patches and -30000 for the padding, added to every attention score row so no real patch attends to a
padded one. Padding comes in whole merge groups (n and N are multiples of 4), so the first n/4 rows of the
merged features are the image's and the rest are dropped. Each function is named `vision_N`; all share the
tower's weights (one blob entry each).

`lower_vision` (export --vision) puts these functions in multimodal.mlpackage beside the token embedding and
the decoder over embeddings with 3-row M-RoPE positions (docs/bundle-format.md "Images").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaship.bundle.vision_io import MASKED_ENCODER_INPUTS, check_patch_counts, vision_function
from deltaship.errors import DeltashipError
from deltaship.lowering.coreml.lowering import MILLowerer, WeightCache, share_across_functions, weight_const_name
from deltaship.lowering.coreml.package import mil_name, state_modes
from deltaship.lowering.passes import example_inputs as state_inputs
from deltaship.lowering.passes import rerun_pipeline
from deltaship.models.qwen3_5_vision import _rotate, load_tower
from deltaship.models.vision import (
    PREPROCESSOR_CONFIG,
    VisionSpec,
    VisionWeights,
    check_vision,
    interleave_mask,
    write_preprocessor,
)


class MaskedTower(nn.Module):
    """VisionTower.forward with an additive key bias [N] on every attention score row (0: a patch of the image,
    bundle/vision_io.py PAD_BIAS: padding); attention written as matmul / softmax / matmul."""

    def __init__(self, tower: nn.Module):
        super().__init__()
        self.t = tower

    def forward(self, pixel_values, pos_indices, pos_weights, rope_cos, rope_sin, key_bias) -> Tensor:
        t = self.t
        x = t.patch_embed(pixel_values)
        x = x + (t.pos_embed(pos_indices) * pos_weights.unsqueeze(2)).sum(1)
        cos, sin = rope_cos.unsqueeze(1), rope_sin.unsqueeze(1)
        for blk in t.blocks:
            n = x.shape[0]
            q, k, v = blk.qkv(blk.norm1(x)).reshape(n, 3, blk.heads, blk.head_dim).unbind(1)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, N, hd]
            scores = torch.matmul(q, k.transpose(1, 2)) * blk.head_dim**-0.5 + key_bias
            att = torch.matmul(torch.softmax(scores, dim=-1), v)
            x = x + blk.proj(att.transpose(0, 1).reshape(n, -1))
            x = x + blk.fc2(F.gelu(blk.fc1(blk.norm2(x)), approximate=blk.approximate))
        x = t.merger_norm(x).reshape(-1, t.spec.hidden_size * t.spec.merge_unit)
        return t.merger_fc2(F.gelu(t.merger_fc1(x)))


class ModuleWeights:
    """The lowerer's weight source (lowering.WeightCache's interface) over a module's own parameters, dense: one
    array per (parameter, dtype), so every function's const is the same array and shares one blob entry."""

    def __init__(self, module: nn.Module):
        self.params = {n: p.detach().float().numpy() for n, p in module.named_parameters()}
        self._arrays: dict[tuple, np.ndarray] = {}
        self.const_names: dict[str, tuple[str, str, int]] = {}

    def named(self, fqn: str, form: str, piece: int | None = None) -> str:
        name = weight_const_name("visual." + fqn, form, piece)
        self.const_names[name] = (fqn, form, piece or 0)
        return name

    def get(self, fqn: str, form: str, dtype) -> tuple:
        key = (fqn, np.dtype(dtype).str)
        if key not in self._arrays:
            self._arrays[key] = self.params[fqn].astype(dtype)
        return ("dense", self._arrays[key], None, None)

    def piece(self, fqn: str, form: str, dtype, rows: slice) -> tuple:
        key = (fqn, np.dtype(dtype).str, rows.start, rows.stop)
        if key not in self._arrays:
            self._arrays[key] = self.get(fqn, form, dtype)[1][rows]
        return ("dense", self._arrays[key], None, None)


def example_inputs(spec: VisionSpec, patches: int) -> tuple[Tensor, ...]:
    return (
        torch.zeros(patches, spec.patch_dim),
        torch.zeros(patches, 4, dtype=torch.long),
        torch.zeros(patches, 4),
        torch.ones(patches, spec.head_dim),
        torch.zeros(patches, spec.head_dim),
        torch.zeros(patches),
    )


def build_program(spec: VisionSpec, weights: VisionWeights, patch_counts: tuple[int, ...]):
    """The MIL program: one function per patch count (fp32)."""
    from coremltools.converters.mil.mil import Program  # lazy: coremltools

    counts = check_patch_counts(patch_counts)
    tower = MaskedTower(load_tower(spec, weights)).eval()
    cache = ModuleWeights(tower.t)
    prog = Program()
    for n in counts:
        with torch.no_grad():
            ep = torch.export.export(tower, example_inputs(spec, n), strict=False)
        func, _ = MILLowerer(ep, cache, {}, vision_function(n), param_prefix="t.").build(
            list(MASKED_ENCODER_INPUTS), [], ["image_features"]
        )
        prog.add_function(vision_function(n), func)
    share_across_functions(prog)
    prog.default_function_name = vision_function(counts[0])
    prog.export_as_multifunction = True
    return prog


def lower_vision_package(spec: VisionSpec, weights: VisionWeights, path: Path, patch_counts: tuple[int, ...]) -> dict:
    """Write a .mlpackage with functions vision_N (one image of up to N patches each); returns its description."""
    import coremltools as ct  # lazy: coremltools

    prog = build_program(spec, weights, patch_counts)
    model = ct.convert(
        prog, minimum_deployment_target=ct.target.iOS18, compute_precision=ct.precision.FLOAT32, skip_model_load=True
    )
    model.save(str(path))
    counts = check_patch_counts(patch_counts)
    return {
        "file": Path(path).name,
        "functions": {str(n): vision_function(n) for n in counts},
        "inputs": list(MASKED_ENCODER_INPUTS),
        "max_patches": counts[-1],
    }


# ---- the multimodal package of a Core ML bundle (export --vision) ---------------------------------------
PACKAGE = "multimodal.mlpackage"
# merged tokens per image a bundle encodes at most (as ExecuTorch's): 4,096 patches; attention scores of one
# block at that size: heads x 4096^2 floats
MAX_IMAGE_TOKENS = 1024
PATCH_COUNTS = (64, 256, 1024, 4096)  # the enumerated sizes (an image runs padded to the smallest that holds it)


class MRopeDecoder(nn.Module):
    """The decoder (layers, final norm, LM head of the last row) on embeddings [1, T, H] with 3-row M-RoPE
    positions [3, 1, T]: rotary channel c turns at inv_freq[c] times the position of the row (T, H or W) that
    `mrope_mask` [3, rotary_dim/2] assigns it (interleaved sections)."""

    def __init__(self, model: nn.Module, mask: np.ndarray):
        super().__init__()
        self.m = model
        # on the model's device (meta when captured for Core ML: the lowerer reads the values by name)
        device = model.model.rotary.inv_freq.device
        self.register_buffer("mrope_mask", torch.from_numpy(np.ascontiguousarray(mask, np.float32)).to(device))

    def forward(self, embeds: Tensor, rope_positions: Tensor, position: Tensor, states: list[Tensor]):
        m = self.m
        pos = rope_positions.reshape(3, -1).float()  # [3, T]
        freqs = (pos.unsqueeze(2) * self.mrope_mask.unsqueeze(1)).sum(0) * m.model.rotary.inv_freq.unsqueeze(0)
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(0).unsqueeze(2)  # [1, T, 1, rot]
        cos, sin = emb.cos().to(embeds.dtype), emb.sin().to(embeds.dtype)
        x, new, i = embeds, [], 0
        for layer in m.model.layers:
            n = len(layer.mixer.state_kinds)
            x, st = layer(x, cos, sin, position, states[i : i + n])
            new += st
            i += n
        return m.head(x), new


class TokenEmbedding(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.m = model

    def forward(self, ids: Tensor) -> Tensor:
        return self.m.model.embed_tokens(ids)


class WithBuffers:
    """A WeightCache that also serves a few arrays of the wrapper module's own (the M-RoPE mask)."""

    def __init__(self, inner, extra: dict[str, np.ndarray]):
        self.inner, self.extra = inner, extra
        self.const_names = inner.const_names

    def named(self, *args):
        return self.inner.named(*args)

    def get(self, fqn: str, form: str, dtype):
        if fqn in self.extra:
            return ("dense", self.extra[fqn].astype(dtype), None, None)
        return self.inner.get(fqn, form, dtype)

    def piece(self, *args):
        return self.inner.piece(*args)


def decoder_function(tokens: int) -> str:
    return f"text_decoder_{tokens}"


def embedding_function(tokens: int) -> str:
    return f"token_embedding_{tokens}"


def lower_vision(bundle: Path, source, ctx, pipeline: tuple) -> dict:
    """Beside model.mlpackage (the text-only path, unchanged): multimodal.mlpackage with functions vision_N (one
    image, enumerated patch counts, masked), token_embedding_T (ids -> embeddings; the host splices the image
    features in) and text_decoder_T (embeddings + 3-row M-RoPE positions + position -> logits of the last token)
    for T = the prefill chunk and 1, on io states of its own (an fp32 build); the manifest's `vision` block."""

    import coremltools as ct  # lazy: coremltools
    from coremltools.converters.mil.mil import Program

    vspec, pre, pre_cfg, mrope = check_vision(source, ctx.spec)
    weights = VisionWeights(source.weights.files, vspec, str(source.path))
    ctx2 = rerun_pipeline(ctx, pipeline)  # the text pipeline again: the decoder to wrap
    if len(ctx2.parts) > 1:
        raise DeltashipError(
            "--vision on Core ML: the decoder needs several packages", "raise --coreml-part-gb or drop --vision"
        )
    if getattr(ctx2.model.model.rotary, "attention_factor", 1.0) != 1.0:
        raise DeltashipError(
            "--vision on Core ML: RoPE scaling (YaRN) with M-RoPE is not exported yet",
            "export --target onnx --vision, or a checkpoint without rope scaling",
        )
    spec, chunk = ctx.spec, ctx.settings.prefill_chunk
    mask = interleave_mask(tuple(mrope), spec.rotary_dim // 2).astype(np.float32)
    decoder = MRopeDecoder(ctx2.model, mask)
    embedding = TokenEmbedding(ctx2.model)
    modes = {mil_name(k): v for k, v in state_modes(ctx2).items()}
    states = ctx2.states
    cache = WithBuffers(WeightCache(ctx2.plan, source.weights, ctx2.quant, None), {"mrope_mask": mask})
    prog = Program()
    for t in sorted({chunk, 1}):
        _, pos, st = state_inputs(states, t)
        embeds = torch.zeros(1, t, spec.hidden_size, device="meta")
        rope = torch.zeros(3, 1, t, dtype=torch.long, device="meta")
        ep = torch.export.export(decoder, (embeds, rope, pos, st), strict=False)
        func, _ = MILLowerer(ep, cache, modes, decoder_function(t), param_prefix="m.").build(
            ["inputs_embeds", "rope_positions", "position"],
            [mil_name(s["name"]) for s in states],
            ["logits"] + [mil_name(s["output"]) for s in states],
        )
        prog.add_function(decoder_function(t), func)
        ep = torch.export.export(embedding, (torch.zeros(1, t, dtype=torch.long, device="meta"),), strict=False)
        func, _ = MILLowerer(ep, cache, {}, embedding_function(t), param_prefix="m.").build(
            ["input_ids"], [], ["inputs_embeds"]
        )
        prog.add_function(embedding_function(t), func)
    max_tokens = min(pre.max_image_tokens(), MAX_IMAGE_TOKENS)
    max_patches = max_tokens * vspec.merge_unit
    counts = tuple(n for n in PATCH_COUNTS if n < max_patches) + (max_patches - max_patches % 4,)
    tower = MaskedTower(load_tower(vspec, weights)).eval()
    tcache = ModuleWeights(tower.t)
    for n in counts:
        with torch.no_grad():
            ep = torch.export.export(tower, example_inputs(vspec, n), strict=False)
        func, _ = MILLowerer(ep, tcache, {}, vision_function(n), param_prefix="t.").build(
            list(MASKED_ENCODER_INPUTS), [], ["image_features"]
        )
        prog.add_function(vision_function(n), func)
    share_across_functions(prog)
    prog.default_function_name = decoder_function(1)
    prog.export_as_multifunction = True
    model = ct.convert(
        prog, minimum_deployment_target=ct.target.iOS18, compute_precision=ct.precision.FLOAT32, skip_model_load=True
    )
    model.save(str(bundle / PACKAGE))
    write_preprocessor(bundle, source, pre_cfg)
    return {
        "spec": vspec.to_dict(),
        "mrope_section": list(mrope),
        "graphs": {
            "package": PACKAGE,
            "vision": "vision_N",
            "embedding": "token_embedding_T",
            "decoder": "text_decoder_T",
        },
        "functions": {
            "vision": {str(n): vision_function(n) for n in counts},
            "embedding": {str(t): embedding_function(t) for t in sorted({chunk, 1})},
            "decoder": {str(t): decoder_function(t) for t in sorted({chunk, 1})},
        },
        "preprocessor": PREPROCESSOR_CONFIG,
        "min_image_tokens": pre.min_image_tokens(),
        "max_image_tokens": max_tokens,
        "max_pixels": min(pre.max_pixels, max_tokens * pre.factor**2),
        "min_pixels": pre.min_pixels,
        "images_per_call": 1,
        "dtype": "float32",
        "decoder_states": [
            {
                "name": s["name"],
                "coreml_input": mil_name(s["name"]),
                "coreml_output": mil_name(s["output"]),
                "shape": s["shape"],
            }
            for s in states
        ],
    }
