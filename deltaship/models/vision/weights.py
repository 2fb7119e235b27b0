"""The vision tower's tensors: their checkpoint names and shapes, and a lazy reader checked against them."""

from __future__ import annotations

import numpy as np

from deltaship.errors import DeltashipError
from deltaship.models.vision.spec import VisionSpec


def vision_tensors(spec: VisionSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of the tower, under its checkpoint name (`model.visual.` prefix), with its shape."""
    d, m, o = spec.hidden_size, spec.intermediate_size, spec.out_hidden_size
    t, p, c = spec.temporal_patch_size, spec.patch_size, spec.in_channels
    wide = d * spec.merge_unit
    v = "model.visual."
    out = {
        v + "patch_embed.proj.weight": (d, c, t, p, p),
        v + "patch_embed.proj.bias": (d,),
        v + "pos_embed.weight": (spec.num_position_embeddings, d),
        v + "merger.norm.weight": (d,),
        v + "merger.norm.bias": (d,),
        v + "merger.linear_fc1.weight": (wide, wide),
        v + "merger.linear_fc1.bias": (wide,),
        v + "merger.linear_fc2.weight": (o, wide),
        v + "merger.linear_fc2.bias": (o,),
    }
    for i in range(spec.depth):
        b = f"{v}blocks.{i}."
        out |= {
            b + "norm1.weight": (d,),
            b + "norm1.bias": (d,),
            b + "norm2.weight": (d,),
            b + "norm2.bias": (d,),
            b + "attn.qkv.weight": (3 * d, d),
            b + "attn.qkv.bias": (3 * d,),
            b + "attn.proj.weight": (d, d),
            b + "attn.proj.bias": (d,),
            b + "mlp.linear_fc1.weight": (m, d),
            b + "mlp.linear_fc1.bias": (m,),
            b + "mlp.linear_fc2.weight": (d, m),
            b + "mlp.linear_fc2.bias": (d,),
        }
    return out


class VisionWeights:
    """The tower's tensors in a checkpoint's safetensors files, read lazily (one tensor at a time), checked
    against the spec's shapes."""

    def __init__(self, files: dict, spec: VisionSpec, where: str):
        self.spec = spec
        self._where = {raw: sf for sf in files.values() for raw in sf.entries if raw.startswith("model.visual.")}
        expected = vision_tensors(spec)
        missing = sorted(set(expected) - set(self._where))
        wrong = [
            f"{n}: {list(self._where[n].shape(n))} (expected {list(s)})"
            for n, s in expected.items()
            if n in self._where and tuple(self._where[n].shape(n)) != s
        ]
        extra = sorted(set(self._where) - set(expected))
        if missing or wrong or extra:
            parts = [
                f"{len(x)} {what}: {', '.join(x[:6])}"
                for what, x in (("missing", missing), ("wrong", wrong), ("unexpected", extra))
                if x
            ]
            raise DeltashipError(
                f"{where}: the vision tower's weights do not match vision_config: " + "; ".join(parts),
                "use the config.json that came with these weights",
            )

    def read(self, name: str) -> np.ndarray:
        return self._where[name].read(name)
