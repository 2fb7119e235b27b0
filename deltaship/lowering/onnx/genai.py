"""genai_config.json: what onnxruntime-genai needs to run an ONNX bundle as it is.

onnxruntime-genai (the runtime Android, iOS and desktop apps embed through its Java/Kotlin, ObjC/Swift
and C# bindings) drives a `decoder` graph through name templates: it feeds input_ids [B, T] and, when the
graph has both, current_sequence_length [1] / past_sequence_length [1, 1] (tokens consumed after the call,
and one less; src/models/input_ids.cpp), reads logits [B, 1, V], finds the KV cache by `past.%d.key` and the
DeltaNet states by `past.%d.recurrent` (layer indices from the graph's input names, shapes and dtypes from
the graph), and zero-fills them. A static KV length in the graph becomes its cache size (shared past/present
buffer).
Sources: microsoft/onnxruntime-genai src/config.cpp, src/models/{decoder_only,kv_cache,recurrent_state,
logits,position_inputs}.cpp.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deltaship.errors import DeltashipError
from deltaship.files import read_json_object

GENAI_CONFIG = "genai_config.json"
MODEL_TYPE = "qwen3_5_text"
# genai adds to current_sequence_length only the appended tokens before the first pad_token_id, so a pad id that a
# prompt or a generated token could hold (the tokenizer's pad, often eos) would shift every later position: the
# bundle's pad is an id no tokenizer or argmax gives (batch 1 never pads)
GENAI_PAD = -1  # genai's text-only Qwen3.5 type: its plain decoder-only path, nothing else
# tokenizer_config.json classes onnxruntime-genai's tokenizer (onnxruntime-extensions) accepts for an HF
# tokenizer.json; it rejects the others (e.g. transformers 5's Qwen3_5Tokenizer) when it loads the model.
GENAI_TOKENIZER_CLASSES = (
    "PreTrainedTokenizerFast",
    "PreTrainedTokenizer",
    "Qwen2Tokenizer",
    "GPT2Tokenizer",
    "LlamaTokenizer",
    "GemmaTokenizer",
    "Phi3Tokenizer",
)
GENAI_TOKENIZER_FALLBACK = "PreTrainedTokenizerFast"  # reads tokenizer.json as it is, as transformers does
TOKENIZER_CONFIG = "tokenizer_config.json"


def deltanet_states_share_in_place(nodes, states: list[dict], in_place: dict[str, list[str]]) -> bool:
    """True when every DeltaNet state's past and present may be one buffer on the CPU.

    genai's past_present_share_buffer binds one buffer as both past and present of every conv and
    recurrent state. That is safe for a state when its present is written by a kernel that reads the
    past completely first (`in_place`, from export/onnx IN_PLACE_KERNELS), or when every node reading
    the past is an ancestor of the node writing the present (ONNX Runtime runs nodes one at a time in
    topological order, so all reads finish before the write): the standard-ops conv, Concat(state, x)
    then Slice.
    """
    producer: dict[str, int] = {}
    readers: dict[str, set[int]] = {}
    for i, n in enumerate(nodes):
        for name in n.output:
            producer[name] = i
        for name in n.input:
            readers.setdefault(name, set()).add(i)
    for s in states:
        if s["kind"].startswith("kv_cache"):
            continue  # genai always shares the KV cache (static length); GroupQueryAttention is built for it
        if "CPUExecutionProvider" in in_place.get(s["name"], []):
            continue
        writer = producer.get(s["output"])
        while writer is not None and nodes[writer].op_type == "Identity":
            writer = producer.get(nodes[writer].input[0])
        if writer is None:
            return False
        ancestors, todo = set(), [writer]
        while todo:
            for name in nodes[todo.pop()].input:
                p = producer.get(name)
                if p is not None and p not in ancestors:
                    ancestors.add(p)
                    todo.append(p)
        if not readers.get(s["name"], set()) <= ancestors:
            return False
    return True


def genai_config(
    spec,
    states: list[dict],
    tokens: dict[str, Any] | None,
    max_context: int,
    prefill_chunk: int,
    model_file: str,
    share_buffer: bool,
) -> dict[str, Any]:
    """The genai_config.json of a bundle: counts from the spec, ids from the bundle's tokens, names from
    deltaship's state contract (past.L.kind / present.L.kind). search.chunk_size makes genai feed a prompt
    in the bundle's prefill chunks (as deltaship does) instead of in one call."""
    tokens = tokens or {}
    eos = list(tokens.get("eos") or spec.eos_token_id or [])
    if not eos:
        raise DeltashipError(
            "genai_config.json: the model has no eos token id (config.json eos_token_id, generation_config.json)",
            "set eos_token_id in the checkpoint's config.json",
        )
    bos = tokens.get("bos") if tokens.get("bos") is not None else spec.bos_token_id
    kinds = {s["kind"] for s in states}
    inputs = {
        "input_ids": "input_ids",
        "current_sequence_length": "current_sequence_length",
        "past_sequence_length": "past_sequence_length",
    }
    outputs = {"logits": "logits"}
    if {"kv_cache_key", "kv_cache_value"} & kinds:  # none (deltanet_only): genai then keeps no KV cache
        inputs |= {"past_key_names": "past.%d.key", "past_value_names": "past.%d.value"}
        outputs |= {"present_key_names": "present.%d.key", "present_value_names": "present.%d.value"}
    if {"deltanet_conv", "deltanet_recurrent"} & kinds:
        inputs |= {"past_conv_names": "past.%d.conv", "past_recurrent_names": "past.%d.recurrent"}
        outputs |= {"present_conv_names": "present.%d.conv", "present_recurrent_names": "present.%d.recurrent"}
    return {
        "model": {
            "type": MODEL_TYPE,
            **({"bos_token_id": bos} if bos is not None else {}),
            "eos_token_id": eos if len(eos) > 1 else eos[0],
            "pad_token_id": GENAI_PAD,
            "vocab_size": spec.vocab_size,
            "context_length": max_context,
            "decoder": {
                "filename": model_file,
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "hidden_size": spec.hidden_size,
                "num_attention_heads": spec.num_attention_heads,
                "num_key_value_heads": spec.num_key_value_heads,
                "head_size": spec.head_dim,
                "num_hidden_layers": spec.num_layers,
                "inputs": inputs,
                "outputs": outputs,
            },
        },
        "search": {
            "max_length": max_context,
            "chunk_size": prefill_chunk,
            "past_present_share_buffer": share_buffer,
            "do_sample": False,
            "num_beams": 1,
            "num_return_sequences": 1,
            "min_length": 0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
            "repetition_penalty": 1.0,
            "early_stopping": True,
            "length_penalty": 1.0,
            "no_repeat_ngram_size": 0,
            "diversity_penalty": 0.0,
        },
    }


# Why a bundle has no genai_config.json (the manifest's app_runtimes says so); the bundle runs everywhere else.
NO_EOS = (
    "the checkpoint names no EOS token id (config.json, generation_config.json, tokenizer), which "
    "genai_config.json needs; set eos_token_id in config.json and export again"
)


def write_genai_config(
    out_dir: Path, ctx, tokens: dict[str, Any] | None, model_file: str, nodes, in_place: dict[str, list[str]]
) -> dict[str, Any]:
    """Write genai_config.json next to the model; return what the manifest records about it: {"config": None,
    "unavailable": why} when genai cannot run the bundle (no EOS id: genai stops on one)."""
    if not ((tokens or {}).get("eos") or ctx.spec.eos_token_id):
        return {"config": None, "unavailable": NO_EOS}
    share = deltanet_states_share_in_place(nodes, ctx.states, in_place)
    cfg = genai_config(ctx.spec, ctx.states, tokens, ctx.max_context, ctx.settings.prefill_chunk, model_file, share)
    (Path(out_dir) / GENAI_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    return {"config": GENAI_CONFIG, "type": MODEL_TYPE, "past_present_share_buffer": share}


def adapt_tokenizer_config(bundle_dir: Path) -> str | None:
    """Make the bundle's tokenizer_config.json loadable by onnxruntime-genai; return the class it replaced.

    genai reads tokenizer.json itself and tokenizer_config.json only for the class and special tokens,
    and refuses classes it does not know (transformers 5 checkpoints of Qwen3.5 say Qwen3_5Tokenizer).
    PreTrainedTokenizerFast loads the same tokenizer.json in transformers' AutoTokenizer (Qwen3_5Tokenizer
    is tokenizer.json behind transformers' TokenizersBackend too), and deltaship's own loader reads only
    tokenizer.json, so the rewrite changes no token. The original class is kept under
    `deltaship_original_tokenizer_class`. Must run after the tokenizer files are copied into the bundle.
    """
    path = Path(bundle_dir) / TOKENIZER_CONFIG
    if not path.is_file() or not (Path(bundle_dir) / "tokenizer.json").is_file():
        return None
    cfg = read_json_object(path, "tokenizer config", "restore it from the original checkpoint")  # the checkpoint's
    cls = cfg.get("tokenizer_class")
    if not isinstance(cls, str) or cls in GENAI_TOKENIZER_CLASSES:  # none, or a value that names no class
        return None
    cfg["tokenizer_class"] = GENAI_TOKENIZER_FALLBACK
    cfg["deltaship_original_tokenizer_class"] = cls
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return cls


# ---- the multimodal bundle (export --vision): genai's `qwen3_5` type ------------------------------------------
MULTIMODAL_TYPE = "qwen3_5"
PROCESSOR_CONFIG = "processor_config.json"  # genai's image processor (onnxruntime-extensions), vision.config_filename


def processor_config(pre) -> dict[str, Any]:
    """onnxruntime-extensions' image pipeline for Qwen3.5 (read by genai's QwenImageProcessor) from the bundle's
    preprocessor_config.json (a models.vision.Preprocessor): decode, RGB, bicubic smart resize within the pixel
    limits (its port of PIL's resampler, as deltaship resizes), rescale, normalize, patch rows in merge-block order
    with the image's grid_thw."""
    return {
        "processor": {
            "name": "qwen3_vl_image_processor",
            "transforms": [
                {"operation": {"name": "decode_image", "type": "DecodeImage", "attrs": {"color_space": "RGB"}}},
                {"operation": {"name": "convert_to_rgb", "type": "ConvertRGB"}},
                {
                    "operation": {
                        "name": "resize",
                        "type": "Resize",
                        "attrs": {
                            "interpolation": "CUBIC",
                            "smart_resize": 1,
                            "min_pixels": pre.min_pixels,
                            "max_pixels": pre.max_pixels,
                            "patch_size": pre.patch_size,
                            "merge_size": pre.merge_size,
                        },
                    }
                },
                {"operation": {"name": "rescale", "type": "Rescale", "attrs": {"rescale_factor": pre.rescale_factor}}},
                {
                    "operation": {
                        "name": "normalize",
                        "type": "Normalize",
                        "attrs": {"mean": list(pre.image_mean), "std": list(pre.image_std), "qwen3_vl": 1},
                    }
                },
                {
                    "operation": {
                        "name": "patch_image",
                        "type": "PatchImage",
                        "attrs": {
                            "patch_size": pre.patch_size,
                            "temporal_patch_size": pre.temporal_patch_size,
                            "merge_size": pre.merge_size,
                        },
                    }
                },
            ],
        }
    }


def multimodal_genai_config(
    text: dict[str, Any], vspec, graphs: dict[str, str], processor: str = PROCESSOR_CONFIG
) -> dict[str, Any]:
    """genai_config.json of a --vision bundle, from the text one: type `qwen3_5` (genai's MultiModalLanguageModel:
    vision.onnx per image, embedding.onnx per call, decoder_mm.onnx with the M-RoPE positions genai computes from
    image_grid_thw and the vision token ids). Text-only prompts take the same path (no image: no vision call)."""
    cfg = json.loads(json.dumps(text))
    model, search = cfg["model"], cfg["search"]
    model["type"] = MULTIMODAL_TYPE
    model |= {
        "image_token_id": vspec.image_token_id,
        "video_token_id": vspec.video_token_id,
        "vision_start_token_id": vspec.vision_start_token_id,
    }
    dec = model["decoder"]
    dec["filename"] = graphs["decoder"]
    names = {k: v for k, v in dec["inputs"].items() if k.endswith("_names")}
    dec["inputs"] = {
        "inputs_embeds": "inputs_embeds",
        "attention_mask": "attention_mask",
        "position_ids": "position_ids",
    }
    dec["inputs"] |= names
    model["embedding"] = {
        "filename": graphs["embedding"],
        "inputs": {"input_ids": "input_ids", "image_features": "image_features"},
        "outputs": {"inputs_embeds": "inputs_embeds"},
    }
    model["vision"] = {
        "filename": graphs["vision"],
        "config_filename": processor,
        "patch_size": vspec.patch_size,
        "spatial_merge_size": vspec.spatial_merge_size,
        "inputs": {"pixel_values": "pixel_values", "image_grid_thw": "image_grid_thw"},
        "outputs": {"image_features": "image_features"},
    }
    # genai 0.18's multimodal path feeds a prompt in one call whatever chunk_size says (same logits with and without);
    # its M-RoPE positions are computed over the whole prompt, so the key is left out rather than promised
    search.pop("chunk_size", None)
    return cfg
