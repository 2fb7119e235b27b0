"""Built-in models: the published Qwen3.5 text-decoder shapes, with seeded random weights.

Each preset is a config.json-shaped dict, read by the same ModelSpec.from_config as a real
checkpoint, so presets are never hand-retyped dataclasses. `qwen3.5-tiny` is small enough to
export and run in seconds and comes with a byte-level tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltaship.errors import DeltashipError
from deltaship.models.spec import ModelSpec

_COMMON = {
    "model_type": "qwen3_5_text",
    "architectures": ["Qwen3_5ForCausalLM"],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "max_position_embeddings": 262144,
    "vocab_size": 248320,
    "eos_token_id": 248044,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    "dtype": "bfloat16",
}


# The published checkpoints' vision towers (config.json `vision_config`, Qwen3_5ForConditionalGeneration).
# Values as the published config.json files spell them, read from public copies of those files (no download here):
# 0.8B 12 x 768 (12 heads, MLP 3072) and 4B 24 x 1024 (16 heads, MLP 4096) agree across several independent
# copies; 9B 27 x 1152 (16 heads, MLP 4304) is also transformers' Qwen3_5VisionConfig default; the 2B's
# 24 x 1024 follows issue 18 and the 4B's tower (no copy of the 2B's own config.json was found: approximate).
# Every tower: patch 16, temporal patch 2, merge 2, 3 channels, a 48 x 48 position table (2304), gelu (tanh),
# out_hidden_size = the text hidden size; the marker ids are transformers' Qwen3_5Config defaults, which the
# published configs repeat.
_VISION_TOKENS = {
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
}


def _vision(depth: int, hidden: int, heads: int, mlp: int, out: int) -> dict[str, Any]:
    return {
        "model_type": "qwen3_5",
        "depth": depth,
        "hidden_size": hidden,
        "num_heads": heads,
        "intermediate_size": mlp,
        "out_hidden_size": out,
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [],
    }


def _published(
    hidden: int, mlp: int, layers: int, heads: int, kv: int, v_heads: int, tied: bool, vision: dict[str, Any]
) -> dict[str, Any]:
    return {
        **_COMMON,
        "hidden_size": hidden,
        "intermediate_size": mlp,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "linear_num_value_heads": v_heads,
        "tie_word_embeddings": tied,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "mtp_num_hidden_layers": 1,  # the published checkpoints ship a one-layer MTP head (random here too)
        # the vision tower (random here too): `export --vision`; the text decoder reads none of it
        "vision_config": vision,
        **_VISION_TOKENS,
    }


# Byte-level vocabulary of the tiny model: 256 bytes, then the special tokens, padded to 272.
TINY_SPECIAL_TOKENS = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258}
TINY_VOCAB = 272

_TINY = {
    **_COMMON,
    "vocab_size": TINY_VOCAB,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
    "eos_token_id": 256,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8)],
    "mtp_num_hidden_layers": 1,  # trained by tools/train_tiny.py --mtp-only
    # M-RoPE's T/H/W sections split rotary_dim / 2 = 64 * 0.25 / 2 = 8 frequencies (the published [11, 11, 10]
    # split the 0.8B's 32); text-only positions do not depend on it
    "rope_parameters": {**_COMMON["rope_parameters"], "mrope_section": [3, 3, 2]},
    "dtype": "float32",
}


# one copy, beside the tiny checkpoint's tokenizer files (its bundles carry it like any checkpoint's template)
CHAT_TEMPLATE_FILE = Path(__file__).parent / "data" / "qwen3.5-tiny" / "chat_template.jinja"


@dataclass(frozen=True)
class Preset:
    name: str
    config: dict[str, Any]
    default_max_context: int
    description: str
    seed: int = 0
    weights: str = "random (seeded)"  # where the weights come from, for the bundle's model card
    base_model: str | None = None  # the published checkpoint whose shape the preset copies
    sample_prompt: str | None = None  # a prompt that suits what the weights learned (the manifest's sample_prompt)

    def chat_template(self) -> str:
        """The preset's chat template (ChatML in Qwen3.5's layout, with <think> blocks; the same for every
        preset). The trained tiny checkpoint ships it as chat_template.jinja, which export copies into bundles."""
        return CHAT_TEMPLATE_FILE.read_text(encoding="utf-8")

    def spec(self) -> ModelSpec:
        return ModelSpec.from_config(self.config, where=f"preset {self.name}")

    def multimodal_config(self) -> dict[str, Any] | None:
        """The preset's vision side as a multimodal (`qwen3_5`) config.json would hold it (VisionSpec.from_config
        reads it); None for a text-only preset."""
        if "vision_config" not in self.config:
            return None
        return {**self.config, "model_type": "qwen3_5"}


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "qwen3.5-tiny",
            _TINY,
            1024,
            "8 layers (6 DeltaNet + 2 attention), hidden 256, byte-level vocab",
            weights="trained by deltaship on the Python standard library's source (tools/train_tiny.py)",
            sample_prompt="def ",
        ),
        Preset(
            "qwen3.5-0.8b",
            _published(1024, 3584, 24, 8, 2, 16, True, _vision(12, 768, 12, 3072, 1024)),
            4096,
            "published 0.8B shape, random weights",
            base_model="Qwen/Qwen3.5-0.8B",
        ),
        Preset(
            "qwen3.5-2b",
            _published(2048, 6144, 24, 8, 2, 16, True, _vision(24, 1024, 16, 4096, 2048)),
            4096,
            "published 2B shape, random weights",
            base_model="Qwen/Qwen3.5-2B",
        ),
        Preset(
            "qwen3.5-4b",
            _published(2560, 9216, 32, 16, 4, 32, True, _vision(24, 1024, 16, 4096, 2560)),
            4096,
            "published 4B shape, random weights",
            base_model="Qwen/Qwen3.5-4B",
        ),
        Preset(
            "qwen3.5-9b",
            _published(4096, 12288, 32, 16, 4, 32, False, _vision(27, 1152, 16, 4304, 4096)),
            4096,
            "published 9B shape, random weights",
            base_model="Qwen/Qwen3.5-9B",
        ),
    )
}
DEFAULT_PRESET = "qwen3.5-tiny"


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise DeltashipError(
            f"unknown preset {name!r}; presets: {', '.join(PRESETS)}",
            "pass a preset name or a checkpoint directory to --model",
        )
    return PRESETS[name]


def write_tiny_tokenizer(directory: Path) -> list[str]:
    """Write the tiny preset's byte-level tokenizer (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # lazy: tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins for bytes, in the GPT-2 order
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    for tok, idx in TINY_SPECIAL_TOKENS.items():
        vocab[tok] = idx
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(TINY_SPECIAL_TOKENS))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "<|endoftext|>",
                "model_max_length": _TINY["max_position_embeddings"],
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            indent=2,
        )
    )
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE_FILE.read_text(encoding="utf-8"), encoding="utf-8")
    return ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))
