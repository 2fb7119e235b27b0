"""Qwen3.5's vision tower as a canonical torch module: what torch.export captures for the targets that lower
a program (ExecuTorch, Core ML), and a reference for the hand-built ONNX graph (export/onnx/vision.py).

Everything that depends on the image's patch grid comes in as tensors computed on the host
(models/vision/rope.py: `encoder_inputs`), so the program has no data-dependent control flow and one dynamic size,
the patch count N (a multiple of 4). The patch embedding (a Conv3d with stride == kernel in the checkpoint) is a
Linear over the flattened patch row: ExecuTorch's portable kernels reject 5-D convolution input.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaship.models.vision import GELU_APPROXIMATION, VisionSpec, VisionWeights

LN_EPS = 1e-6


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class VisionBlock(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        d = spec.hidden_size
        self.heads, self.head_dim = spec.num_heads, spec.head_dim
        self.norm1 = nn.LayerNorm(d, eps=LN_EPS)
        self.norm2 = nn.LayerNorm(d, eps=LN_EPS)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc1 = nn.Linear(d, spec.intermediate_size)
        self.fc2 = nn.Linear(spec.intermediate_size, d)
        self.approximate = GELU_APPROXIMATION[spec.hidden_act]

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).reshape(n, 3, self.heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)  # [N, H, hd]
        att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        x = x + self.proj(att.transpose(0, 1).reshape(n, -1))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate=self.approximate))


class VisionTower(nn.Module):
    """forward(pixel_values [N, C*T*P*P], pos_indices [N, 4], pos_weights [N, 4], rope_cos, rope_sin [N, hd])
    -> image features [N/4, text hidden], for one image (full attention over its N patches)."""

    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.spec = spec
        d, wide = spec.hidden_size, spec.hidden_size * spec.merge_unit
        self.patch_embed = nn.Linear(spec.patch_dim, d)
        self.pos_embed = nn.Embedding(spec.num_position_embeddings, d)
        self.blocks = nn.ModuleList([VisionBlock(spec) for _ in range(spec.depth)])
        self.merger_norm = nn.LayerNorm(d, eps=LN_EPS)
        self.merger_fc1 = nn.Linear(wide, wide)
        self.merger_fc2 = nn.Linear(wide, spec.out_hidden_size)

    def forward(
        self, pixel_values: Tensor, pos_indices: Tensor, pos_weights: Tensor, rope_cos: Tensor, rope_sin: Tensor
    ):
        x = self.patch_embed(pixel_values)
        x = x + (self.pos_embed(pos_indices) * pos_weights[:, :, None]).sum(1)
        cos, sin = rope_cos[:, None, :], rope_sin[:, None, :]
        for blk in self.blocks:
            x = blk(x, cos, sin)
        x = self.merger_norm(x).reshape(-1, self.spec.hidden_size * self.spec.merge_unit)
        return self.merger_fc2(F.gelu(self.merger_fc1(x)))


# canonical parameter -> checkpoint tensor (under model.visual.)
def checkpoint_names(spec: VisionSpec) -> dict[str, str]:
    out = {
        "patch_embed.weight": "patch_embed.proj.weight",
        "patch_embed.bias": "patch_embed.proj.bias",
        "pos_embed.weight": "pos_embed.weight",
        "merger_norm.weight": "merger.norm.weight",
        "merger_norm.bias": "merger.norm.bias",
        "merger_fc1.weight": "merger.linear_fc1.weight",
        "merger_fc1.bias": "merger.linear_fc1.bias",
        "merger_fc2.weight": "merger.linear_fc2.weight",
        "merger_fc2.bias": "merger.linear_fc2.bias",
    }
    for i in range(spec.depth):
        for mine, theirs in (
            ("norm1", "norm1"),
            ("norm2", "norm2"),
            ("qkv", "attn.qkv"),
            ("proj", "attn.proj"),
            ("fc1", "mlp.linear_fc1"),
            ("fc2", "mlp.linear_fc2"),
        ):
            for kind in ("weight", "bias"):
                out[f"blocks.{i}.{mine}.{kind}"] = f"blocks.{i}.{theirs}.{kind}"
    return out


def load_tower(spec: VisionSpec, weights: VisionWeights, dtype: torch.dtype = torch.float32) -> VisionTower:
    """The tower with the checkpoint's weights (the Conv3d kernel flattened into the Linear's rows)."""
    tower = VisionTower(spec)
    state = {}
    for mine, theirs in checkpoint_names(spec).items():
        arr = weights.read("model.visual." + theirs).astype(np.float32)
        if mine == "patch_embed.weight":
            arr = arr.reshape(arr.shape[0], -1)
        state[mine] = torch.from_numpy(np.ascontiguousarray(arr))
    tower.load_state_dict(state, strict=True)
    return tower.to(dtype).eval()
