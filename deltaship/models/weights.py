"""Weight sources: a checkpoint directory (safetensors, lazy) or seeded random weights.

Both expose the Hugging Face `Qwen3_5ForCausalLM` tensor names (`model.layers.3.mlp.up_proj.weight`,
`lm_head.weight`, ...), whatever the checkpoint's own naming, and read tensors as float32 numpy
arrays, optionally a range of rows at a time. Pickled checkpoints are refused.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Protocol

import numpy as np

from deltaship.errors import DeltashipError
from deltaship.files import read_json_object, sha256_file
from deltaship.models.safetensors_io import FLOAT_DTYPES, SafetensorsFile
from deltaship.models.spec import ModelSpec
from deltaship.models.vision.weights import vision_tensors

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Parts of a multimodal checkpoint the text decoder does not use.
IGNORED_PREFIXES = {"model.visual.": "vision encoder", "mtp.": "multi-token-prediction head"}


class WeightSource(Protocol):
    """What export and verification need from weights, whatever their origin."""

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, rows: slice | None = None) -> np.ndarray: ...


def mtp_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The multi-token-prediction head's tensors (`mtp.*`, as Qwen3.5 checkpoints store them), with their shapes:
    two zero-centred norms on the embedding of the next token and on the trunk's last hidden state, `fc`
    (2H -> H over their concatenation, embedding first), `mtp_num_hidden_layers` full-attention decoder layers
    and a final norm. The embedding and the LM head are the trunk's."""
    h = spec.hidden_size
    out: dict[str, tuple[int, ...]] = {}
    if not spec.mtp_num_hidden_layers:
        return out
    out["mtp.pre_fc_norm_embedding.weight"] = (h,)
    out["mtp.pre_fc_norm_hidden.weight"] = (h,)
    out["mtp.fc.weight"] = (h, 2 * h)
    out["mtp.norm.weight"] = (h,)
    for i in range(spec.mtp_num_hidden_layers):
        out.update(_layer_tensors(spec, f"mtp.layers.{i}.", "full_attention"))
    return out


def _layer_tensors(spec: ModelSpec, p: str, kind: str) -> dict[str, tuple[int, ...]]:
    h = spec.hidden_size
    out: dict[str, tuple[int, ...]] = {}
    out[p + "input_layernorm.weight"] = (h,)
    out[p + "post_attention_layernorm.weight"] = (h,)
    out[p + "mlp.gate_proj.weight"] = (spec.intermediate_size, h)
    out[p + "mlp.up_proj.weight"] = (spec.intermediate_size, h)
    out[p + "mlp.down_proj.weight"] = (h, spec.intermediate_size)
    if kind == "linear_attention":
        a, hv = p + "linear_attn.", spec.linear_num_value_heads
        out[a + "in_proj_qkv.weight"] = (spec.conv_dim, h)
        out[a + "in_proj_z.weight"] = (spec.linear_value_dim, h)
        out[a + "in_proj_b.weight"] = (hv, h)
        out[a + "in_proj_a.weight"] = (hv, h)
        out[a + "conv1d.weight"] = (spec.conv_dim, 1, spec.linear_conv_kernel_dim)
        out[a + "dt_bias"] = (hv,)
        out[a + "A_log"] = (hv,)
        out[a + "norm.weight"] = (spec.linear_value_head_dim,)
        out[a + "out_proj.weight"] = (h, spec.linear_value_dim)
    else:
        a, d = p + "self_attn.", spec.head_dim
        out[a + "q_proj.weight"] = (2 * spec.num_attention_heads * d, h)
        out[a + "k_proj.weight"] = (spec.num_key_value_heads * d, h)
        out[a + "v_proj.weight"] = (spec.num_key_value_heads * d, h)
        out[a + "o_proj.weight"] = (h, spec.num_attention_heads * d)
        out[a + "q_norm.weight"] = (d,)
        out[a + "k_norm.weight"] = (d,)
    return out


def expected_tensors(spec: ModelSpec, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor a Qwen3_5ForCausalLM checkpoint of this spec holds, with its shape (and, with mtp=True,
    the multi-token-prediction head's)."""
    h = spec.hidden_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = (spec.vocab_size, h)
    for i, kind in enumerate(spec.layer_types):
        out.update(_layer_tensors(spec, f"model.layers.{i}.", kind))
    if mtp:
        out.update(mtp_tensors(spec))
    return out


def _canonical_name(name: str, multimodal: bool) -> str:
    if multimodal and name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


class CheckpointWeights:
    """Tensors of a local Hugging Face checkpoint directory, read lazily from safetensors."""

    def __init__(self, directory: Path, spec: ModelSpec):
        self.directory = Path(directory)
        self.spec = spec
        files = self._weight_files()
        self.files = {f.name: SafetensorsFile(f) for f in files}
        self._where: dict[str, tuple[SafetensorsFile, str]] = {}
        self.ignored: dict[str, int] = {}
        # The MTP head is kept when config.json declares it (mtp_num_hidden_layers) and the checkpoint holds it.
        keep_mtp = spec.mtp_num_hidden_layers > 0 and any(
            raw.startswith("mtp.") for sf in self.files.values() for raw in sf.entries
        )
        self.has_mtp = keep_mtp
        for sf in self.files.values():
            for raw in sf.entries:
                if keep_mtp and raw.startswith("mtp."):
                    self._where[raw] = (sf, raw)
                    continue
                ignored = next((what for pre, what in IGNORED_PREFIXES.items() if raw.startswith(pre)), None)
                if ignored:
                    self.ignored[ignored] = self.ignored.get(ignored, 0) + 1
                    continue
                self._where[_canonical_name(raw, spec.is_multimodal)] = (sf, raw)
        # A tied head may still be saved; it is ignored (transformers ties it to the embedding).
        if spec.tie_word_embeddings and "lm_head.weight" in self._where:
            del self._where["lm_head.weight"]
            self.ignored["tied lm_head copy"] = 1
        self._check(sf_names=list(self.files))

    def _weight_files(self) -> list[Path]:
        d = self.directory
        index = d / "model.safetensors.index.json"
        if index.is_file():
            try:
                wm = read_json_object(index, "safetensors index", "restore it from the original checkpoint")[
                    "weight_map"
                ]
            except (KeyError, TypeError):
                raise DeltashipError(
                    f"{index}: not a valid safetensors index (no weight_map)",
                    "restore the index file from the original checkpoint",
                ) from None
            names = sorted(set(wm.values()))
            missing = [n for n in names if not (d / n).is_file()]
            if missing:
                raise DeltashipError(
                    f"{d}: the safetensors index names shard(s) that are missing: {', '.join(missing)}",
                    "copy the missing shards into the checkpoint directory",
                )
            return [d / n for n in names]
        files = sorted(d.glob("*.safetensors"))
        if files:
            return files
        pickled = sorted(p.name for p in d.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickled:
            raise DeltashipError(
                f"{d}: only pickled weights found ({', '.join(pickled)}); deltaship never loads pickles, which can "
                "execute code",
                "convert the checkpoint to safetensors (e.g. save_pretrained(..., safe_serialization=True)) "
                "on a machine you trust",
            )
        raise DeltashipError(
            f"{d}: no *.safetensors weights in this directory",
            "point --model at a Hugging Face checkpoint directory with safetensors weights",
        )

    def _check(self, sf_names: list[str]) -> None:
        expected = expected_tensors(self.spec, mtp=self.has_mtp)
        missing = sorted(set(expected) - set(self._where))
        extra = sorted(set(self._where) - set(expected))
        wrong = []
        for name, shape in expected.items():
            if name in self._where:
                sf, raw = self._where[name]
                if sf.shape(raw) != shape:
                    wrong.append(f"{name}: {list(sf.shape(raw))} (expected {list(shape)})")
                elif sf.dtype(raw) not in FLOAT_DTYPES:
                    wrong.append(f"{name}: dtype {sf.dtype(raw)} (expected one of {', '.join(FLOAT_DTYPES)})")
        problems = []
        if missing:
            problems.append(f"missing {len(missing)} tensor(s): {_names(missing)}")
        if extra:
            problems.append(f"unexpected {len(extra)} tensor(s): {_names(extra)}")
        if wrong:
            problems.append(f"{len(wrong)} tensor(s) with the wrong shape or dtype: {_names(wrong)}")
        if problems:
            raise DeltashipError(
                f"{self.directory}: the weights do not match config.json: " + "; ".join(problems),
                "use the config.json that came with these weights (or weights that match it)",
            )

    def names(self) -> list[str]:
        return sorted(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        sf, raw = self._where[name]
        return sf.shape(raw)

    def dtype(self, name: str) -> str:
        sf, raw = self._where[name]
        return sf.dtype(raw)

    def read(self, name: str, rows: slice | None = None) -> np.ndarray:
        sf, raw = self._where[name]
        return sf.read(raw, rows)

    def fingerprint(self) -> str:
        """sha256 over config.json, the index and every weight file, in name order."""
        h = hashlib.sha256()
        paths = [self.directory / "config.json"]
        if (self.directory / "model.safetensors.index.json").is_file():
            paths.append(self.directory / "model.safetensors.index.json")
        paths += [sf.path for _, sf in sorted(self.files.items())]
        for p in paths:
            h.update(p.name.encode())
            h.update(sha256_file(p).encode())
        return h.hexdigest()


def _names(items: list[str], limit: int = 12) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


class RandomWeights:
    """Seeded random weights at a spec's shapes, generated on demand, block by block.

    Values follow transformers' initialisation (normal std 0.02, zero-centred norms, A_log from
    log U(1, 16), dt_bias 1) so activations stay in a realistic range; speed and memory do not
    depend on the values. The same (seed, name, rows) always gives the same numbers.
    """

    ROW_BLOCK = 4096

    def __init__(self, spec: ModelSpec, seed: int = 0, std: float = 0.02, vision=None):
        self.spec, self.seed, self.std = spec, seed, std
        # a random MTP head of the spec's shape whenever the spec declares one (mtp_num_hidden_layers)
        self.has_mtp = spec.mtp_num_hidden_layers > 0
        self._shapes = expected_tensors(spec, mtp=self.has_mtp)
        self.ignored: dict[str, int] = {}
        # A random vision tower (a VisionSpec: the published-shape presets) is laid out as a checkpoint holds
        # it, one more safetensors-like file of `model.visual.*` tensors beside the text weights, which the
        # text decoder never reads (names() lists the text tensors only); VisionWeights reads it from `files`.
        self.files = {} if vision is None else {"random vision tower": RandomVisionFile(vision, seed, std)}

    def names(self) -> list[str]:
        return sorted(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def _rng(self, name: str, block: int) -> np.random.Generator:
        digest = hashlib.sha256(f"{self.seed}:{name}:{block}".encode()).digest()
        return np.random.default_rng(int.from_bytes(digest[:8], "little"))

    def _block(self, name: str, block: int, nrows: int, row_shape: tuple[int, ...]) -> np.ndarray:
        rng, shape = self._rng(name, block), (nrows, *row_shape)
        if name.endswith("A_log"):
            return np.log(rng.uniform(1.0, 16.0, size=shape)).astype(np.float32)
        if name.endswith("dt_bias"):
            return np.ones(shape, np.float32)
        if name.endswith("linear_attn.norm.weight"):  # the one norm that is not zero-centred
            return (1.0 + self.std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        return (self.std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)

    def read(self, name: str, rows: slice | None = None) -> np.ndarray:
        shape = self._shapes[name]
        start, stop, _ = (rows or slice(None)).indices(shape[0])
        parts = []
        b0, b1 = start // self.ROW_BLOCK, (max(stop, start + 1) - 1) // self.ROW_BLOCK
        for b in range(b0, b1 + 1):
            lo = b * self.ROW_BLOCK
            n = min(self.ROW_BLOCK, shape[0] - lo)
            blk = self._block(name, b, n, shape[1:])
            parts.append(blk[max(start - lo, 0) : max(min(stop - lo, n), 0)])
        return np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]

    def fingerprint(self) -> str:
        return hashlib.sha256(
            json.dumps({"random": self.seed, "std": self.std, "spec": self.spec.to_dict()}, sort_keys=True).encode()
        ).hexdigest()


class RandomVisionFile:
    """Seeded random weights of a vision tower (`model.visual.*`), read like one safetensors file
    (`entries`, `shape`, `read`), one whole tensor at a time (the largest, the 9B's merger fc1, is 85 MB).
    Values follow transformers' initialisation: normal std 0.02 for the linear, patch and position weights,
    LayerNorms at weight 1 and bias 0, the other biases 0."""

    def __init__(self, vision, seed: int = 0, std: float = 0.02):
        self.seed, self.std = seed, std
        self._shapes = vision_tensors(vision)
        self.entries = sorted(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def read(self, name: str) -> np.ndarray:
        shape = self._shapes[name]
        if "norm" in name.rsplit(".", 2)[-2] and name.endswith(".weight"):  # norm1, norm2, merger.norm
            return np.ones(shape, np.float32)
        if name.endswith(".bias"):
            return np.zeros(shape, np.float32)
        digest = hashlib.sha256(f"{self.seed}:{name}:0".encode()).digest()
        rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
        return (self.std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
