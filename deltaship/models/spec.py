"""ModelSpec: the frozen description of a Qwen3.5 text decoder, read from config.json.

Both text-only (`Qwen3_5ForCausalLM`, model_type `qwen3_5_text`) and multimodal
(`Qwen3_5ForConditionalGeneration`, model_type `qwen3_5`, decoder under `text_config`)
configs are accepted. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltaship.errors import DeltashipError
from deltaship.files import read_json_object
from deltaship.models.families import model_types

SUPPORTED_MODEL_TYPES = model_types()  # the family registry (deltaship/models/families.py)
LAYER_KINDS = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class KVDtype:
    """How a KV cache stores one element: bits, plus bytes kept per token and KV head (for K and for V each)
    by a per-token quantization: a float32 scale for int8/int4 (ExecuTorch's asymmetric int8 cache also
    keeps an int8 zero point: 1 byte more; ORT's GroupQueryAttention uses static per-channel scales: 0)."""

    bits: int
    token_head_bytes: int = 0


KV_DTYPES: dict[str, KVDtype] = {"fp32": KVDtype(32), "fp16": KVDtype(16), "int8": KVDtype(8, 4), "int4": KVDtype(4, 4)}


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and constants of one Qwen3.5 text decoder (batch size is always 1 on device)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    architecture: str = "Qwen3_5ForCausalLM"
    hidden_act: str = "silu"
    mrope_section: tuple[int, ...] | None = None
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "float32"
    # RoPE scaling of the attention layers (rope_parameters / rope_scaling in config.json). "default": none;
    # "yarn": YaRN (inv_freq blended between interpolation and extrapolation, cos/sin times attention factor).
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_original_max_position_embeddings: int | None = None
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_attention_factor: float = 1.0  # resolved (transformers infers it from factor / mscale when absent)
    rope_truncate: bool = True
    # Multi-token-prediction head (`mtp.*` tensors): decoder layers after the trunk that draft the token after next
    # from the last hidden state and the next token's embedding (0: the checkpoint's config declares none).
    mtp_num_hidden_layers: int = 0

    # ---- derived sizes -------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def deltanet_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def is_multimodal(self) -> bool:
        return self.architecture == "Qwen3_5ForConditionalGeneration"

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the DeltaNet causal conv: q, k and v side by side."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def deltanet_state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-layer DeltaNet state shapes (batch 1): conv is channels-last."""
        return {
            "conv": (1, self.linear_conv_kernel_dim - 1, self.conv_dim),
            "recurrent": (1, self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim),
        }

    def check_context(self, context: int, option: str = "--max-context") -> None:
        """Refuse a context past what the RoPE config covers (max_position_embeddings), saying how to extend it."""
        if context <= self.max_position_embeddings:
            return
        m = self.max_position_embeddings
        if self.rope_type == "yarn":
            raise DeltashipError(
                f"{option} {context} exceeds the model's max_position_embeddings ({m}, config.json), the context "
                f"its YaRN scaling (rope_parameters.factor {self.rope_factor:g} over original_max_position_embeddings "
                f"{self.rope_original_max_position_embeddings}) extends to",
                f"pass {option} {m} or less, or raise rope_parameters.factor and max_position_embeddings together",
            )
        raise DeltashipError(
            f"{option} {context} exceeds the model's max_position_embeddings ({m}, config.json), and it has no RoPE "
            f'scaling (rope_parameters.rope_type is "default"): positions past {m} were never trained',
            f"pass {option} {m} or less, or extend the context with YaRN in config.json: rope_parameters.rope_type: "
            f"yarn, factor F, original_max_position_embeddings {m}, and max_position_embeddings F x {m}",
        )

    def kv_cache_shape(self, max_context: int) -> tuple[int, ...]:
        return (1, self.num_key_value_heads, max_context, self.head_dim)

    def state_bytes(self, max_context: int, kv_bytes_per_elem: int = 4, conv_bytes_per_elem: int = 4) -> dict[str, int]:
        """Bytes of per-sequence state: DeltaNet (recurrent always fp32) and the KV cache."""
        shapes = self.deltanet_state_shapes()
        n_dn, n_at = len(self.deltanet_layers), len(self.attention_layers)
        recurrent = n_dn * _prod(shapes["recurrent"]) * 4
        conv = n_dn * _prod(shapes["conv"]) * conv_bytes_per_elem
        kv = n_at * 2 * _prod(self.kv_cache_shape(max_context)) * kv_bytes_per_elem
        return {"deltanet_recurrent": recurrent, "deltanet_conv": conv, "kv_cache": kv, "total": recurrent + conv + kv}

    def kv_bytes_per_token(self, kv_dtype: str = "fp16", static_scales: bool = False) -> int:
        """KV-cache bytes one more token of context costs (K and V of every attention layer, scales included).

        static_scales: the quantized cache's scales are constants of the graph (deltaship's int8/int4 KV caches:
        per KV head and channel, calibrated at export), not stored per token."""
        if kv_dtype not in KV_DTYPES:
            raise DeltashipError(
                f"unknown KV dtype {kv_dtype!r}; KV dtypes: {', '.join(KV_DTYPES)}", "pick one of the KV dtypes"
            )
        f = KV_DTYPES[kv_dtype]
        per_head = self.head_dim * f.bits // 8 + (0 if static_scales else f.token_head_bytes)
        return len(self.attention_layers) * 2 * self.num_key_value_heads * per_head

    def deltanet_state_bytes(self, conv_bytes_per_elem: int = 4) -> int:
        """The DeltaNet states (recurrent fp32 + conv), whatever the context: fixed per sequence."""
        s = self.state_bytes(0, conv_bytes_per_elem=conv_bytes_per_elem)
        return s["deltanet_recurrent"] + s["deltanet_conv"]

    def memory_arithmetic(self, kv_dtype: str, conv_bytes_per_elem: int) -> dict[str, Any]:
        """The manifest's `memory` block: state bytes = deltanet_state_bytes + context x
        kv_bytes_per_token[kv_dtype]; the other KV dtypes are there to plan with."""
        return {
            "kv_dtype": kv_dtype,
            "kv_bytes_per_token": {name: self.kv_bytes_per_token(name) for name in KV_DTYPES},
            "kv_scale_bytes_per_token_head": {n: f.token_head_bytes for n, f in KV_DTYPES.items()},
            "deltanet_state_bytes": self.deltanet_state_bytes(conv_bytes_per_elem),
            "max_position_embeddings": self.max_position_embeddings,
        }

    def parameter_count(self) -> dict[str, int]:
        """Parameters of the text decoder, by part (embedding, lm_head, body)."""
        h, v = self.hidden_size, self.vocab_size
        body = 0
        for kind in self.layer_types:
            body += 2 * h + 3 * h * self.intermediate_size  # norms + MLP
            if kind == "linear_attention":
                hv = self.linear_num_value_heads
                body += h * self.conv_dim + h * self.linear_value_dim + 2 * h * hv  # qkv, z, b, a
                body += self.conv_dim * self.linear_conv_kernel_dim + 2 * hv  # conv, A_log, dt_bias
                body += self.linear_value_head_dim + self.linear_value_dim * h  # norm, out_proj
            else:
                q = self.num_attention_heads * self.head_dim
                kv = self.num_key_value_heads * self.head_dim
                body += h * 2 * q + 2 * h * kv + q * h + 2 * self.head_dim
        body += h  # final norm
        embed = v * h
        head = 0 if self.tie_word_embeddings else v * h
        return {"embedding": embed, "lm_head": head, "body": body, "total": embed + head + body}

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in fields}
        return cls(**kw)

    # ---- reading config.json ---------------------------------------------------------
    @classmethod
    def from_config(cls, config: dict[str, Any], where: str = "config.json") -> "ModelSpec":
        """Build a spec from a parsed config.json; every problem names the field and the fix."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise DeltashipError(
                f"{where}: model_type {model_type!r} is not supported; supported: "
                + ", ".join(SUPPORTED_MODEL_TYPES)
                + " (Qwen3.5 text and multimodal checkpoints)",
                "point --model at a Qwen3.5 checkpoint directory or use a preset such as qwen3.5-tiny",
            )
        archs = config.get("architectures") or []
        if model_type == "qwen3_5":
            text = config.get("text_config")
            if not isinstance(text, dict):
                raise DeltashipError(
                    f"{where}: a multimodal qwen3_5 config needs a 'text_config' object",
                    "the checkpoint's config.json is incomplete; re-save it with transformers",
                )
            architecture = "Qwen3_5ForConditionalGeneration"
            # The composite model ties its head according to its own top-level flag.
            tie = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
            src = dict(text)
            for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
                if src.get(key) is None and config.get(key) is not None:
                    src[key] = config[key]
        else:
            architecture = archs[0] if archs else "Qwen3_5ForCausalLM"
            src = config
            tie = bool(config.get("tie_word_embeddings", False))

        def need(key: str, typ: type = int) -> Any:
            if key not in src or src[key] is None:
                raise DeltashipError(
                    f"{where}: required field {key!r} is missing",
                    "the checkpoint's config.json is incomplete; re-save it with transformers",
                )
            val = src[key]
            if typ is int and (not isinstance(val, int) or isinstance(val, bool) or val <= 0):
                raise DeltashipError(
                    f"{where}: field {key!r} must be a positive integer, got {val!r}", "fix the value in config.json"
                )
            if typ is float and not isinstance(val, (int, float)):
                raise DeltashipError(
                    f"{where}: field {key!r} must be a number, got {val!r}", "fix the value in config.json"
                )
            return val

        n_layers = need("num_hidden_layers")
        layer_types = src.get("layer_types")
        if layer_types is None:
            interval = src.get("full_attention_interval", 4)
            layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
        if not isinstance(layer_types, list) or len(layer_types) != n_layers:
            raise DeltashipError(
                f"{where}: layer_types has {len(layer_types) if isinstance(layer_types, list) else 'no'} entries "
                f"but num_hidden_layers is {n_layers}",
                "make layer_types list one kind per layer",
            )
        bad = sorted({t for t in layer_types if t not in LAYER_KINDS})
        if bad:
            raise DeltashipError(
                f"{where}: unknown layer kind(s) {bad} in layer_types; supported: {list(LAYER_KINDS)}",
                "this checkpoint is not a Qwen3.5 text model",
            )

        # transformers lets a (legacy) rope_scaling block win over rope_parameters
        rope_key = "rope_scaling" if src.get("rope_scaling") else "rope_parameters"
        rope = src.get(rope_key) or {}
        if not isinstance(rope, dict):
            raise DeltashipError(
                f"{where}: {rope_key} must be an object, got {rope!r}", f"fix {rope_key} in config.json"
            )
        scaling = _rope_scaling(rope, rope_key, src, where)
        theta = rope.get("rope_theta", src.get("rope_theta"))
        if theta is None:
            raise DeltashipError(
                f"{where}: rope_theta is missing (neither rope_parameters.rope_theta nor rope_theta)",
                "add rope_parameters to config.json",
            )
        prf = rope.get("partial_rotary_factor", src.get("partial_rotary_factor", 0.25))
        mrope = rope.get("mrope_section")
        eos = src.get("eos_token_id")
        eos_t = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        act = src.get("hidden_act", "silu")
        if act != "silu":
            raise DeltashipError(
                f"{where}: hidden_act {act!r} is not supported (Qwen3.5 uses silu)",
                "this checkpoint is not a Qwen3.5 text model",
            )

        spec = cls(
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size"),
            layer_types=tuple(layer_types),
            num_attention_heads=need("num_attention_heads"),
            num_key_value_heads=need("num_key_value_heads"),
            head_dim=need("head_dim"),
            linear_num_key_heads=need("linear_num_key_heads"),
            linear_num_value_heads=need("linear_num_value_heads"),
            linear_key_head_dim=need("linear_key_head_dim"),
            linear_value_head_dim=need("linear_value_head_dim"),
            linear_conv_kernel_dim=need("linear_conv_kernel_dim"),
            rms_norm_eps=float(need("rms_norm_eps", float)),
            rope_theta=float(theta),
            partial_rotary_factor=float(prf),
            tie_word_embeddings=tie,
            max_position_embeddings=int(src.get("max_position_embeddings", 262144)),
            architecture=architecture,
            hidden_act=act,
            mrope_section=tuple(mrope) if mrope else None,
            eos_token_id=eos_t,
            bos_token_id=src.get("bos_token_id"),
            pad_token_id=src.get("pad_token_id"),
            mtp_num_hidden_layers=_mtp_layers(src, where),
            torch_dtype=str(src.get("dtype", src.get("torch_dtype", config.get("dtype", "float32"))) or "float32"),
            **scaling,
        )
        spec.validate(where)
        return spec

    def validate(self, where: str = "config.json") -> None:
        """Check the head arithmetic every lowering relies on."""
        if self.attention_layers and self.num_attention_heads % self.num_key_value_heads:
            raise DeltashipError(
                f"qwen3_5: layer {self.attention_layers[0]} (full_attention) has {self.num_key_value_heads} KV heads "
                f"but {self.num_attention_heads} query heads are not a multiple; this checkpoint is not a Qwen3.5 "
                "text model"
            )
        if self.deltanet_layers and self.linear_num_value_heads % self.linear_num_key_heads:
            raise DeltashipError(
                f"qwen3_5: layer {self.deltanet_layers[0]} (linear_attention) has {self.linear_num_value_heads} value "
                f"heads, not a multiple of its {self.linear_num_key_heads} key heads; this checkpoint is not a "
                "Qwen3.5 text model"
            )
        if self.rotary_dim % 2 or self.rotary_dim <= 0 or self.rotary_dim > self.head_dim:
            raise DeltashipError(
                f"{where}: partial_rotary_factor {self.partial_rotary_factor} gives a rotary dim of {self.rotary_dim} "
                f"for head_dim {self.head_dim}; it must be even and in (0, head_dim]",
                "fix partial_rotary_factor",
            )
        if self.linear_conv_kernel_dim < 2:
            raise DeltashipError(f"{where}: linear_conv_kernel_dim must be at least 2", "fix linear_conv_kernel_dim")


SUPPORTED_ROPE_TYPES = ("default", "yarn")


def _rope_scaling(rope: dict[str, Any], key: str, src: dict[str, Any], where: str) -> dict[str, Any]:
    """The spec's rope_* fields from a rope_parameters / rope_scaling block, resolved as transformers'
    `_compute_yarn_parameters` resolves them (modeling_rope_utils.py)."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "mrope":  # legacy name of the multimodal rope; text positions make it plain rope
        rope_type = "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise DeltashipError(
            f"{where}: {key}.rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}",
            f"remove the scaling from {key} (the model then runs up to max_position_embeddings) or use "
            f'rope_type "yarn"',
        )
    if rope_type == "default":
        return {}

    def number(name: str, default: float | None) -> float | None:
        val = rope.get(name)
        if val is None:
            return default
        if not isinstance(val, (int, float)) or isinstance(val, bool) or val <= 0:
            raise DeltashipError(
                f"{where}: {key}.{name} must be a positive number, got {val!r}", f"fix {key}.{name} in config.json"
            )
        return float(val)

    max_pos = src.get("max_position_embeddings", 262144)
    # transformers: a top-level original_max_position_embeddings wins, else the block's, else max_position_embeddings
    original = src.get("original_max_position_embeddings", rope.get("original_max_position_embeddings", max_pos))
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise DeltashipError(
            f"{where}: {key}.original_max_position_embeddings must be a positive integer, got {original!r}",
            "set it to the context the model was pretrained with",
        )
    factor = number("factor", None)
    if factor is None:  # transformers: the ratio of the extended to the pretrained context
        factor = max_pos / original
    if factor < 1.0:
        raise DeltashipError(
            f"{where}: {key}.factor must be at least 1, got {factor}",
            f"fix {key}.factor (extended context / original_max_position_embeddings)",
        )
    attention = number("attention_factor", None)
    if attention is None:
        mscale, mscale_all = number("mscale", None), number("mscale_all_dim", None)
        attention = (
            _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
            if mscale and mscale_all
            else _yarn_mscale(factor)
        )
    beta_fast, beta_slow = number("beta_fast", 32.0), number("beta_slow", 1.0)
    truncate = rope.get("truncate", True)
    if not isinstance(truncate, bool):
        raise DeltashipError(
            f"{where}: {key}.truncate must be true or false, got {truncate!r}", f"fix {key}.truncate in config.json"
        )
    return {
        "rope_type": "yarn",
        "rope_factor": float(factor),
        "rope_original_max_position_embeddings": original,
        "rope_beta_fast": beta_fast,
        "rope_beta_slow": beta_slow,
        "rope_attention_factor": float(attention),
        "rope_truncate": truncate,
    }


def _mtp_layers(src: dict[str, Any], where: str) -> int:
    n = src.get("mtp_num_hidden_layers", 0) or 0
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise DeltashipError(
            f"{where}: field 'mtp_num_hidden_layers' must be a non-negative integer, got {n!r}",
            "fix the value in config.json (0 when the checkpoint has no mtp.* tensors)",
        )
    return n


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def read_config(path: Path) -> dict[str, Any]:
    """Parse config.json with errors that name the file."""
    if not path.is_file():
        raise DeltashipError(
            f"{path.parent}: no config.json in this directory",
            "point --model at a Hugging Face checkpoint directory (config.json + *.safetensors) or a preset",
        )
    return read_json_object(path, "config.json", "restore config.json from the original checkpoint")
