"""Write a preset (published shape, seeded random weights) as a Hugging Face checkpoint directory.
Regenerates no page: the checkpoints of the peer runs (docs/results/peers.md).

    python bench/tools/make_checkpoint.py qwen3.5-0.8b OUT_DIR [--multimodal] [--dtype BF16]

For the peer tools, which read checkpoints from disk: the text-only layout (Qwen3_5ForCausalLM) or,
with --multimodal, Qwen3_5ForConditionalGeneration's (decoder under model.language_model, a small
vision config with no vision weights; onnxruntime-genai's builder accepts only that layout). The
weights are the same as deltaship's preset of that name, written one tensor at a time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from deltaship.models.presets import get_preset
from deltaship.models.qwen3_5 import hf_config
from deltaship.models.safetensors_io import write_safetensors_lazy
from deltaship.models.weights import RandomWeights


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("preset")
    ap.add_argument("out", type=Path)
    ap.add_argument("--multimodal", action="store_true")
    ap.add_argument("--dtype", default="BF16", choices=("BF16", "F16", "F32"))
    a = ap.parse_args()
    preset = get_preset(a.preset)
    spec = preset.spec()
    weights = RandomWeights(spec, seed=preset.seed)
    a.out.mkdir(parents=True, exist_ok=True)
    text = dict(
        hf_config(spec),
        model_type="qwen3_5_text",
        architectures=["Qwen3_5ForCausalLM"],
        eos_token_id=list(spec.eos_token_id)[0] if spec.eos_token_id else None,
        dtype={"BF16": "bfloat16", "F16": "float16", "F32": "float32"}[a.dtype],
        hidden_act="silu",
    )
    if a.multimodal:
        cfg = {
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "text_config": text,
            "vision_config": {
                "depth": 1,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_heads": 2,
                "out_hidden_size": spec.hidden_size,
                "model_type": "qwen3_5_vision",
            },
            "tie_word_embeddings": spec.tie_word_embeddings,
            "mtp_num_hidden_layers": 0,
        }
        rename = lambda n: n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n  # noqa: E731
    else:
        cfg, rename = text, (lambda n: n)
    (a.out / "config.json").write_text(json.dumps(cfg, indent=2))
    items = [(rename(n), weights.shape(n), (lambda n=n: weights.read(n))) for n in weights.names()]
    write_safetensors_lazy(a.out / "model.safetensors", items, metadata={"format": "pt"}, dtype=a.dtype)
    print(f"wrote {a.out} ({len(items)} tensors, {a.dtype})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
