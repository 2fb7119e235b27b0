"""Qwen3.5's vision tower as an ExecuTorch method `vision_encoder` (XNNPACK), for one image.

The canonical tower (models/qwen3_5_vision.py: patch embed as a Linear, host-computed grid tensors) is
captured with one dynamic size, the patch count N = 4k, up to `max_patches`. ExecuTorch plans memory for the
upper bound (ConstraintBasedSymShapeEvalPass), and attention holds heads x N x N scores: the bound is a real
memory cost, so it comes from the preprocessor's max_pixels (or a tier's cap), not from the 16,384-token limit.
Not yet wired into ExecuTorch bundles (no text_decoder on inputs_embeds with 3-row positions there yet).
"""

from __future__ import annotations

from pathlib import Path

import torch

from deltaship.models.qwen3_5_vision import load_tower
from deltaship.models.vision import VisionSpec, VisionWeights

METHOD = "vision_encoder"
INPUTS = ("pixel_values", "pos_indices", "pos_weights", "rope_cos", "rope_sin")


def example_inputs(spec: VisionSpec, patches: int) -> tuple[torch.Tensor, ...]:
    return (
        torch.zeros(patches, spec.patch_dim),
        torch.zeros(patches, 4, dtype=torch.long),
        torch.zeros(patches, 4),
        torch.ones(patches, spec.head_dim),
        torch.zeros(patches, spec.head_dim),
    )


def lower_vision_pte(spec: VisionSpec, weights: VisionWeights, path: Path, max_patches: int) -> dict:
    """Write a .pte whose method `vision_encoder` maps one image's inputs (models/vision.py encoder_inputs, in
    INPUTS order) to its merged features [N/4, text hidden]; N is a multiple of 4 up to max_patches."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    tower = load_tower(spec, weights)
    k = torch.export.Dim("merged", min=1, max=max(1, max_patches // 4))
    dyn = tuple({0: 4 * k} for _ in INPUTS)
    with torch.no_grad():
        ep = torch.export.export(tower, example_inputs(spec, 8), dynamic_shapes=dyn, strict=False)
        ep = ep.run_decompositions({})
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
