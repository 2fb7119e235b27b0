"""Qwen3.5's vision tower as an ExecuTorch method `vision_encoder` (XNNPACK), for one image.

The canonical tower (models/qwen3_5_vision.py: patch embed as a Linear, host-computed grid tensors) is
captured with one dynamic size, the patch count N = 4k, up to `max_patches`. ExecuTorch plans memory for the
upper bound (ConstraintBasedSymShapeEvalPass), and attention holds heads x N x N scores: the bound is a real
memory cost, so a bundle caps an image at MAX_IMAGE_TOKENS merged tokens (or the preprocessor's max_pixels when
lower; the manifest's vision.max_pixels, which the runtime resizes into), not at Qwen3.5's 16,384.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from deltaship.bundle.vision_io import ENCODER_INPUTS
from deltaship.errors import DeltashipError
from deltaship.lowering.executorch.program import ProgramState, prepare, xnnpack_passes_that_apply
from deltaship.lowering.passes import rerun_pipeline
from deltaship.models.qwen3_5_vision import load_tower
from deltaship.models.vision import (
    PREPROCESSOR_CONFIG,
    VIDEO_PREPROCESSOR_CONFIG,
    VisionSpec,
    VisionWeights,
    check_vision,
    interleave_mask,
    write_preprocessor,
)

METHOD = "vision_encoder"
# merged tokens per image an ExecuTorch bundle plans for: 4,096 patches (a 1024 x 1024 image at patch 16, merge 2);
# attention scores of one block at that bound: heads x 4096^2 floats (0.8 GiB at 12 heads)
MAX_IMAGE_TOKENS = 1024
INPUTS = ENCODER_INPUTS  # the method's inputs, in order (the runtime feeds the same contract)


def example_inputs(spec: VisionSpec, patches: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    return (
        torch.zeros(patches, spec.patch_dim, dtype=dtype),
        torch.zeros(patches, 4, dtype=torch.long),
        torch.zeros(patches, 4, dtype=dtype),
        torch.ones(patches, spec.head_dim, dtype=dtype),
        torch.zeros(patches, spec.head_dim, dtype=dtype),
    )


def lower_vision_pte(spec: VisionSpec, weights: VisionWeights, path: Path, max_patches: int) -> dict:
    """Write a .pte whose method `vision_encoder` maps one image's inputs (models/vision/rope.py encoder_inputs, in
    INPUTS order) to its merged features [N/4, text hidden]; N is a multiple of 4 up to max_patches."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner  # lazy: executorch
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass  # lazy: executorch
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    tower = load_tower(spec, weights)
    k = torch.export.Dim("merged", min=1, max=max(1, max_patches // 4))
    dyn = tuple({0: 4 * k} for _ in INPUTS)
    with torch.no_grad():
        ep = torch.export.export(tower, example_inputs(spec, 8), dynamic_shapes=dyn, strict=False)
    with xnnpack_passes_that_apply():
        edge = to_edge_transform_and_lower(
            {METHOD: ep},
            partitioner=[XnnpackPartitioner()],
            compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True),
        )
    prog = edge.to_executorch(
        ExecutorchBackendConfig(
            extract_delegate_segments=True,
            memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False),
            sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),
        )
    )
    with open(path, "wb") as f:
        prog.write_to_file(f)
    return {"method": METHOD, "inputs": list(INPUTS), "max_patches": max_patches - max_patches % 4}


# ---- the multimodal program of an ExecuTorch bundle: vision.pte ------------------------------------------
PTE_FILE = "vision.pte"  # vision_encoder, token_embedding
DECODER_PTE = "decoder_mm.pte"  # text_decoder


class MRopeRotary(torch.nn.Module):
    """XnnpackRotary's full-width cos/sin from 3-row M-RoPE positions [3, 1, T]: channel c turns at
    inv_freq_full[c] times the position of the row (T, H or W) its frequency follows (`select` [3, head_dim])."""

    def __init__(self, rotary, select):
        super().__init__()
        self.inv_freq_full = rotary.inv_freq_full
        self.register_buffer("select", torch.from_numpy(select))

    def forward(self, rope_positions, dtype):
        pos = rope_positions.float().reshape(3, -1, 1)  # [3, T, 1]
        freqs = (pos * (self.inv_freq_full.reshape(1, 1, -1) * self.select.reshape(3, 1, -1))).sum(0)
        freqs = freqs.reshape(1, -1, 1, self.inv_freq_full.shape[0])
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


def full_width_select(spec, mrope_section) -> np.ndarray:
    half = spec.rotary_dim // 2
    mask = interleave_mask(tuple(mrope_section), half)  # [3, half]
    out = np.zeros((3, spec.head_dim), np.float32)
    out[0] = 1.0  # channels past the rotary turn at 0 whatever the row
    out[:, :half], out[:, half : 2 * half] = mask, mask
    return out


def lower_vision(bundle: Path, source, ctx, pipeline: tuple) -> dict:
    """Beside model.pte: vision.pte with methods vision_encoder (one image) and token_embedding (ids ->
    embeddings; the host splices the image features in), and decoder_mm.pte with text_decoder (embeddings +
    3-row M-RoPE positions + input_pos -> logits, on state buffers of its own); the manifest's `vision` block."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner  # lazy: executorch
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass  # lazy: executorch
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    vspec, pre, pre_cfg, mrope = check_vision(source, ctx.spec)
    weights = VisionWeights(source.weights.files, vspec, str(source.path))
    # the text program consumed ctx's model: build the decoder again for the multimodal program
    ctx2 = rerun_pipeline(ctx, pipeline)  # the text pipeline again: the decoder to wrap
    prep = prepare(ctx2, source.weights)
    model, kernels = prep.model, prep.kernels
    if getattr(model.model.rotary, "scaled", False):
        raise DeltashipError(
            "--vision on ExecuTorch: RoPE scaling (YaRN) with M-RoPE is not exported yet",
            "export --target onnx --vision, or a checkpoint without rope scaling",
        )
    mrope_rotary = MRopeRotary(model.model.rotary, full_width_select(ctx.spec, mrope))

    class TextDecoder(ProgramState):
        def __init__(self, *args):
            super().__init__(*args)
            self.mrope = mrope_rotary

        def forward(self, embeds, rope_positions, input_pos):
            self.kernels.position = input_pos
            bufs = [getattr(self, n) for n in self.names]
            # Qwen35Model.run_layers with the M-RoPE angles in place of the 1-D rotary's
            cos, sin = self.mrope(rope_positions, embeds.dtype)
            x, new, i = embeds, [], 0
            for layer in self.model.model.layers:
                n = len(layer.mixer.state_kinds)
                x, states = layer(x, cos, sin, input_pos, bufs[i : i + n])
                new += states
                i += n
            with torch.no_grad():
                for buf, value in zip(bufs, new):
                    if value is not buf:
                        buf.copy_(value)
            return self.model.head(x)

    class TokenEmbedding(torch.nn.Module):
        def __init__(self, table):
            super().__init__()
            self.table = table

        def forward(self, tokens):
            return self.table(tokens)

    chunk = ctx.settings.prefill_chunk
    t = torch.export.Dim("tokens", min=1, max=chunk)
    h = ctx.spec.hidden_size
    n = min(2, chunk)
    decoder = TextDecoder(model, prep.states, kernels).eval()
    dt = ctx.dtype  # the text decoder's activation dtype (fp16 at --precision fp16): the tower's too
    tower = load_tower(vspec, weights, dt)
    max_tokens = min(pre.max_image_tokens(), MAX_IMAGE_TOKENS)
    max_pixels = min(pre.max_pixels, max_tokens * pre.factor**2)
    max_patches = max_tokens * vspec.merge_unit
    k = torch.export.Dim("merged", min=1, max=max(1, max_patches // 4))
    with torch.no_grad():
        programs = {
            "text_decoder": torch.export.export(
                decoder,
                (
                    torch.zeros(1, n, h, dtype=dt),
                    torch.zeros(3, 1, n, dtype=torch.long),
                    torch.zeros(1, dtype=torch.long),
                ),
                dynamic_shapes=({1: t} if chunk > 1 else None, {2: t} if chunk > 1 else None, None),
                strict=False,
            ),
            "token_embedding": torch.export.export(
                TokenEmbedding(model.model.embed_tokens),
                (torch.zeros(1, n, dtype=torch.long),),
                dynamic_shapes=({1: t} if chunk > 1 else None,),
                strict=False,
            ),
            METHOD: torch.export.export(
                tower, example_inputs(vspec, 8, dt), dynamic_shapes=tuple({0: 4 * k} for _ in INPUTS), strict=False
            ),
        }
    # text_decoder in a program of its own: in one program with the other two methods, its calls after the
    # first (input_pos > 0) gave wrong logits (ExecuTorch 1.5.1; not narrowed down further)
    for file, names in ((PTE_FILE, (METHOD, "token_embedding")), (DECODER_PTE, ("text_decoder",))):
        with xnnpack_passes_that_apply():
            edge = to_edge_transform_and_lower(
                {name: programs[name] for name in names},
                partitioner=[XnnpackPartitioner()],
                compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True),
            )
        prog = edge.to_executorch(
            ExecutorchBackendConfig(
                extract_delegate_segments=True,
                memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False),
                sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),
                emit_mutable_buffer_names=True,
            )
        )
        with open(bundle / file, "wb") as f:
            prog.write_to_file(f)
    write_preprocessor(bundle, source, pre_cfg)
    return {
        "spec": vspec.to_dict(),
        "mrope_section": list(mrope),
        "graphs": {
            "program": PTE_FILE,
            "vision": METHOD,
            "embedding": "token_embedding",
            "decoder_program": DECODER_PTE,
            "decoder": "text_decoder",
        },
        "preprocessor": PREPROCESSOR_CONFIG,
        "video_preprocessor": VIDEO_PREPROCESSOR_CONFIG,
        "min_image_tokens": pre.min_image_tokens(),
        "max_image_tokens": max_tokens,
        "max_pixels": max_pixels,
        "min_pixels": pre.min_pixels,
        "images_per_call": 1,
        "dtype": str(dt).removeprefix("torch."),
        "decoder_states": [s["buffer"] for s in prep.states],
    }
