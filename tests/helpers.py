"""Shared test helpers: the table of tiny configs, checkpoint writing, the parity runner."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

L, F = "linear_attention", "full_attention"

# One table of tiny random configs, run through one shared parity runner.
TINY_CONFIGS: dict[str, dict] = {
    # the 3:1 pattern, tied embeddings, equal key/value heads
    "base": dict(
        hidden_size=64,
        intermediate_size=96,
        layer_types=[L, L, L, F],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        tie_word_embeddings=True,
    ),
    # value heads > key heads (as in 4B/9B, ratio 3 here), untied LM head
    "grouped_values": dict(
        hidden_size=64,
        intermediate_size=128,
        layer_types=[L, F, L, L, F],
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        tie_word_embeddings=False,
    ),
    # odd head counts, d_k != d_v, attention first
    "odd_heads": dict(
        hidden_size=48,
        intermediate_size=80,
        layer_types=[F, L, L, L],
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=24,
        linear_num_key_heads=3,
        linear_num_value_heads=3,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        tie_word_embeddings=True,
    ),
    # no attention layer at all: no KV cache, only DeltaNet state
    "deltanet_only": dict(
        hidden_size=32,
        intermediate_size=64,
        layer_types=[L, L],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        tie_word_embeddings=True,
    ),
}
MULTIMODAL = "multimodal"  # "base" wrapped in Qwen3_5ForConditionalGeneration, with vision and MTP tensors
ALL_CONFIGS = list(TINY_CONFIGS) + [MULTIMODAL]
VOCAB = 160
# the tiny preset's MTP draft vocabulary in the tests: the smallest N that covers 99% of the ranking text's tokens
# with the 3 special ids kept (tests/test_draft_vocab.py; conftest's int4 .pte drafts over it too)
TINY_DRAFT_VOCAB = 53


def text_config(name: str) -> dict:
    base = TINY_CONFIGS["base" if name == MULTIMODAL else name]
    return dict(
        base,
        vocab_size=VOCAB,
        num_hidden_layers=len(base["layer_types"]),
        rms_norm_eps=1e-6,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        eos_token_id=VOCAB - 1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )


def randomize(model, seed: int, std: float = 0.15) -> None:
    """Weights with structure enough that greedy decoding has clear winners (matrices at `std`, random norms)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.0, 2.5, generator=g))
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-1, 1, generator=g))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:  # zero-centred norms
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def write_checkpoint(name: str, directory: Path, seed: int = 0, **overrides) -> Path:
    """A transformers-saved checkpoint of a tiny config (multimodal: with vision and MTP tensors)."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

    torch.manual_seed(seed)
    tcfg = dict(text_config(name), **overrides)
    if name == MULTIMODAL:
        cfg = Qwen3_5Config(
            text_config=tcfg,
            tie_word_embeddings=True,
            vision_config=dict(
                depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=tcfg["hidden_size"]
            ),
        )
        model = Qwen3_5ForConditionalGeneration(cfg)
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**tcfg))
    randomize(model, seed)
    model.save_pretrained(directory)
    if name == MULTIMODAL:
        _add_mtp_tensors(directory)
    return directory


def _add_mtp_tensors(directory: Path) -> None:
    from deltaship.models.safetensors_io import SafetensorsFile, write_safetensors

    path = directory / "model.safetensors"
    sf = SafetensorsFile(path)
    tensors = [(n, sf.read(n)) for n in sf.entries]
    tensors += [("mtp.fc.weight", np.ones((8, 8), np.float32)), ("mtp.norm.weight", np.ones(8, np.float32))]
    del sf
    write_safetensors(path, tensors, metadata={"format": "pt"})


def reference(ckpt: Path):
    """transformers' model for a test checkpoint, fp32, eval."""
    from deltaship.models.source import load_source
    from deltaship.oracle.reference import reference_model

    return reference_model(load_source(str(ckpt)))


def reference_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """transformers' own cached greedy decoding, and its fp32 logits rows [steps, vocab]."""
    from deltaship.check.verify import reference_continuation

    return reference_continuation(model, prompt, steps)


def set_json(path: Path, key: str, value) -> None:
    cfg = json.loads(path.read_text())
    cfg[key] = value
    path.write_text(json.dumps(cfg))


def export_context(ckpt: Path, precision: str, max_context: int = 128, target: str = "onnx", **options):
    """The target's export passes up to (not including) capture: the weight plan and quantization choices."""
    from deltaship.compile import build_settings
    from deltaship.compile.steps import lowering_settings, run_passes
    from deltaship.models.source import load_source

    settings = build_settings(
        str(ckpt), "unused", target=target, precision=precision, max_context=max_context, **options
    )
    lowering = lowering_settings(settings, load_source(str(ckpt)).spec, max_context, 8, None)
    return run_passes(lowering, settings.tgt.pipeline()[:-1], None)


def add_mtp_head(directory: Path, seed: int = 0, drop: str | None = None, reshape: str | None = None) -> Path:
    """Give a checkpoint written by write_checkpoint(..., mtp_num_hidden_layers=1) random `mtp.*` tensors of the
    published layout (deltaship.models.weights.mtp_tensors). drop/reshape: leave out or misshape one tensor."""
    from deltaship.models.safetensors_io import SafetensorsFile, write_safetensors
    from deltaship.models.spec import ModelSpec, read_config
    from deltaship.models.weights import mtp_tensors

    spec = ModelSpec.from_config(read_config(directory / "config.json"))
    rng = np.random.default_rng(seed)
    path = directory / "model.safetensors"
    sf = SafetensorsFile(path)
    tensors = [(n, sf.read(n)) for n in sf.entries]
    del sf
    for name, shape in mtp_tensors(spec).items():
        if name == drop:
            continue
        if name == reshape:
            shape = (shape[0] + 1, *shape[1:])
        scale = 0.2 if len(shape) == 1 else 0.15
        tensors.append((name, (scale * rng.standard_normal(shape)).astype(np.float32)))
    write_safetensors(path, tensors, metadata={"format": "pt"})
    return directory


def code_prompt(n: int) -> list[int]:
    """The first n bytes of a short Python function: a prompt the trained tiny (byte-level) model continues well."""
    text = b"def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    return list(text[:n])


def speculative_runs(session, lengths, depths=(1, 2), new_tokens: int = 64):
    """Greedy speculative generation against plain greedy on one session, for prompts of each length (code_prompt)
    and each draft depth: asserts the tokens are identical and that fewer verify calls than tokens were made;
    returns every run's SpeculativeStats (for the caller's acceptance checks)."""
    from deltaship.runtimes.speculative import generate_speculative

    runs = []
    for n in lengths:
        prompt = code_prompt(n)
        session.reset()
        plain = session.generate(prompt, new_tokens, stop_at_eos=False).output_ids
        for depth in depths:
            gen, stats = generate_speculative(session, prompt, new_tokens, depth, stop_at_eos=False)
            assert gen.output_ids == plain, (n, depth)
            assert stats.verify_calls < new_tokens  # drafts were accepted: fewer decoder calls than tokens
            runs.append(stats)
    return runs


def stub_bundle(bundle: Path, target: str, **fields) -> Path:
    """A directory every bundle reader accepts up to the artifact: a schema-valid manifest for `target`
    naming one small entry file, listed with its hash (`fields` override manifest fields)."""
    import hashlib

    from deltaship.bundle import SCHEMA, SCHEMA_VERSION

    bundle.mkdir(parents=True, exist_ok=True)
    entry = {"onnx": "model.onnx", "executorch": "model.pte", "coreml": "model.mlpackage"}.get(target, "model.bin")
    data = _stub_onnx() if target == "onnx" else b"stub"
    (bundle / entry).write_bytes(data)
    tensor = {"name": "input_ids", "shape": [1, "tokens"], "dtype": "int64", "kind": "tokens"}
    manifest = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": "2026-01-01T00:00:00Z",
        "source": {"model": "stub", "kind": "preset", "architecture": "stub", "sha256": "0" * 64, "notes": []},
        "model_card": {"source_repo": None, "revision": None, "license": None, "base_model": None},
        "model": {
            "vocab_size": 8,
            "hidden_size": 4,
            "layer_types": ["full_attention"],
            "num_layers": 1,
            "parameters": {"total": 1},
        },
        "target": target,
        "precision": "fp32",
        "quantization": {"scheme": "none"},
        "max_context": 16,
        "prefill_chunk": 4,
        "entry": entry,
        "inputs": [tensor],
        "outputs": [{"name": "logits", "shape": [1, 1, 8], "dtype": "float32", "kind": "logits"}],
        "states": [
            {
                "name": "past.0.key",
                "output": "present.0.key",
                "layer": 0,
                "kind": "kv_cache_key",
                "shape": [1, 1, 16, 4],
                "dtype": "float32",
                "init": "zeros",
                "reset": "zeros",
            }
        ],
        "state_bytes": 256,
        "usage": [],
        "tokens": {"eos": [1]},
        "tokenizer": {"files": []},
        "passes": [],
        "lowering": {},
        "tools": {"python": "3", "deltaship": "0"},
        "files": {entry: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}},
        "bundle_bytes": len(data),
        **fields,
    }
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    return bundle


def _stub_onnx() -> bytes:
    """An ONNX graph with stub_bundle's inputs, outputs and state (enough for the artifact check; it does not run)."""
    from onnx import TensorProto, helper

    f, i = TensorProto.FLOAT, TensorProto.INT64
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["past.0.key"], ["present.0.key"]),
            helper.make_node("Constant", [], ["logits"], value=helper.make_tensor("v", f, [1, 1, 8], [0.0] * 8)),
        ],
        "stub",
        [
            helper.make_tensor_value_info("input_ids", i, [1, "tokens"]),
            helper.make_tensor_value_info("past.0.key", f, [1, 1, 16, 4]),
        ],
        [
            helper.make_tensor_value_info("logits", f, [1, 1, 8]),
            helper.make_tensor_value_info("present.0.key", f, [1, 1, 16, 4]),
        ],
    )
    return helper.make_model(graph).SerializeToString()
