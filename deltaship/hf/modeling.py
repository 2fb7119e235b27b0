"""A deltaship bundle as a transformers causal LM: `generate()`, `pipeline("text-generation")`, streamers.

Follows optimum's `ORTModelForCausalLM` conventions (`from_pretrained(dir)`, `generate(**tokenizer(...))`,
usable in transformers pipelines) over deltaship's own runtime session (`deltaship.runtimes.open_bundle`).

Built on transformers' `PreTrainedModel` + `GenerationMixin`, not optimum's `OptimizedModel`: in optimum 2.3.0
`OptimizedModel` is no transformers `PreTrainedModel` (pipelines and `GenerationMixin` need one) and its
`from_pretrained` reads a `config.json` through `AutoConfig`, which a bundle does not have (its manifest is the config).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    GenerationMixin,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_outputs import CausalLMOutputWithPast

from deltaship.bundle.paths import bundle_path
from deltaship.errors import DeltashipError
from deltaship.files import read_json_object
from deltaship.oracle.compat import CACHE_NAME
from deltaship.targets import open_bundle


class DeltashipConfig(PretrainedConfig):
    """The bundle's model section (manifest.json `model`), with its special tokens, as a transformers config."""

    model_type = "deltaship"

    def __init__(self, vocab_size: int = 0, max_context: int = 0, target: str = "", precision: str = "", **kwargs):
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.target = target
        self.precision = precision
        super().__init__(**kwargs)

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> "DeltashipConfig":
        model = {
            k: v
            for k, v in manifest["model"].items()
            if k not in ("vocab_size", "eos_token_id", "bos_token_id", "pad_token_id", "torch_dtype")
        }
        tokens = manifest.get("tokens", {})
        eos = tokens.get("eos") or []
        return cls(
            vocab_size=int(manifest["model"]["vocab_size"]),
            max_context=int(manifest["max_context"]),
            target=manifest["target"],
            precision=manifest["precision"],
            eos_token_id=eos[0] if len(eos) == 1 else (list(eos) or None),
            bos_token_id=tokens.get("bos"),
            pad_token_id=tokens.get("pad"),
            **model,
        )


class SessionCache:
    """What generate() passes around as the model's cache (`cache`; `past_key_values` before transformers 5.24):
    the session holds the real DeltaNet/KV states; this records which tokens they have consumed, so the model
    knows whether a call continues them.

    Duck-typed, not a transformers `Cache` (a list of per-layer tensor caches, which the session does not expose):
    it answers what generate() asks of a cache, below.
    """

    is_compileable = False  # read by generate() to decide on torch.compile: never here
    is_croppable = False  # recurrent state cannot be rolled back (assisted decoding needs that)
    # Per cache layer: the session is one layer holding DeltaNet and full-attention (KV) state, which transformers
    # (5.24+) counts as not linear, like its own hybrid layers. Were it linear, generate() would not cut a
    # continued sequence down to the tokens after get_seq_length(), and the session would see them twice.
    is_linear = (False,)

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return len(self.tokens)


class DeltashipModelForCausalLM(PreTrainedModel, GenerationMixin):
    """A causal LM over a deltaship bundle (ONNX, ExecuTorch or Core ML), driven through its runtime session.

    Batch size 1; `forward` returns the logits of the last position only ([1, 1, vocab]), which is all
    `generate()` reads. The session keeps the recurrent and KV state itself: a call without a cache starts a new
    sequence (the session is reset), a call with the cache the previous call returned continues it.
    """

    config_class = DeltashipConfig
    base_model_prefix = "deltaship"
    main_input_name = "input_ids"

    def __init__(self, config: DeltashipConfig, session: Any = None, bundle: Path | None = None):
        super().__init__(config)
        self.session = session
        self.bundle = bundle
        self._latest: SessionCache | None = None  # the cache that matches the session's state now
        self.post_init()

    @classmethod
    def from_pretrained(
        cls,
        bundle_dir: str | Path,
        *,
        threads: int | None = None,
        provider: str = "cpu",
        check_hashes: bool = True,
        **session_options: Any,
    ) -> "DeltashipModelForCausalLM":
        """Open a bundle directory (manifest.json + artifact) for generation; its files are checked first."""

        path = Path(bundle_dir)
        if not (path / "manifest.json").is_file():
            raise DeltashipError(
                f"{path}: no manifest.json, so this is not a deltaship bundle",
                "pass a directory written by `deltaship export` (or deltaship.export())",
            )
        session = open_bundle(path, threads=threads, provider=provider, check_hashes=check_hashes, **session_options)
        return cls.over_session(session, path)

    @classmethod
    def over_session(cls, session: Any, bundle: Path) -> "DeltashipModelForCausalLM":
        """The model over a session already open on `bundle` (what `deltaship.load()` builds on first use)."""
        config = DeltashipConfig.from_manifest(session.manifest)
        config.name_or_path = str(bundle)
        model = cls(config, session=session, bundle=bundle)
        model.generation_config = _generation_config(bundle, session.manifest, config)
        return model

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # logits come back on the host whatever the runtime ran on

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the session is the cache: generate() must not build a transformers DynamicCache

    def can_generate(self) -> bool:
        return True

    def forward(
        self,
        input_ids: torch.LongTensor,
        cache: SessionCache | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: SessionCache | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """input_ids [1, T]: a new prompt (no cache) or the tokens after `cache`. generate() passes the cache as
        `cache` from transformers 5.24 on and as `past_key_values` before; either is taken."""
        cache = cache if cache is not None else past_key_values
        if self.session is None:
            raise DeltashipError(
                "this DeltashipModelForCausalLM has no runtime session",
                "create it with DeltashipModelForCausalLM.from_pretrained(bundle_dir)",
            )
        if input_ids is None or input_ids.ndim != 2:
            raise DeltashipError(
                "deltaship models take input_ids of shape [1, tokens] (inputs_embeds are not supported)",
                "pass input_ids, e.g. model.generate(**tokenizer(text, return_tensors='pt'))",
            )
        if input_ids.shape[0] != 1:
            raise DeltashipError(
                f"deltaship models run batch size 1; got a batch of {input_ids.shape[0]} (beam search "
                "and num_return_sequences > 1 also make batches)",
                "call generate once per prompt, with num_beams=1 and num_return_sequences=1",
            )
        if attention_mask is not None and not bool(attention_mask.all()):
            raise DeltashipError(
                "the attention mask masks some tokens out; deltaship sessions do not take padding",
                "pass one unpadded prompt (batch size 1)",
            )
        if cache is not None and not isinstance(cache, SessionCache):
            raise DeltashipError(
                f"deltaship models continue only a cache they returned themselves; got a {type(cache).__name__}",
                f"pass the `{CACHE_NAME}` of an earlier output of this model (generate(..., "
                "return_dict_in_generate=True)), or no cache to start a new sequence",
            )
        ids = [int(t) for t in input_ids[0].tolist()]
        if cache is None:
            self.session.reset()
            seen: list[int] = []
        else:
            seen = list(cache.tokens)
            if cache is not self._latest:  # an older cache: the session has moved on, replay it
                self.session.reset()
                ids = seen + ids
                seen = []
        logits = self.session.decode(ids[0]) if len(ids) == 1 and seen else self.session.prefill(ids)
        self._latest = SessionCache(seen + ids)
        out = torch.from_numpy(logits.astype("float32", copy=False)).reshape(1, 1, -1)
        return CausalLMOutputWithPast(logits=out, **{CACHE_NAME: self._latest})

    def save_pretrained(self, save_directory: str | Path, **kwargs: Any) -> None:
        """Copy the bundle (manifest, artifact, tokenizer files) to `save_directory`."""
        if self.bundle is None:
            raise DeltashipError("this model was not opened from a bundle directory", "use from_pretrained(bundle)")
        shutil.copytree(self.bundle, save_directory, dirs_exist_ok=True)


def _generation_config(bundle: Path, manifest: dict[str, Any], config: DeltashipConfig) -> GenerationConfig:
    """The checkpoint's generation_config.json when the bundle lists it, else greedy; eos/pad from the manifest."""

    if "generation_config.json" in manifest["files"]:
        path = bundle_path(bundle, manifest, "generation_config.json", "files")
        cfg = read_json_object(path, "generation config", "export the bundle again")
        try:
            gen = GenerationConfig.from_dict(cfg)
        except (TypeError, ValueError) as e:
            raise DeltashipError(f"{path}: not a usable generation config ({e})", "export the bundle again") from None
    else:
        gen = GenerationConfig()
    if gen.eos_token_id is None:
        gen.eos_token_id = config.eos_token_id
    if gen.pad_token_id is None:  # batch size 1 never pads; set it so generate() does not warn
        eos = config.eos_token_id
        gen.pad_token_id = (
            config.pad_token_id if config.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
        )
    if gen.bos_token_id is None:
        gen.bos_token_id = config.bos_token_id
    return gen


# Known to the Auto classes, so that pipeline("text-generation", model=...) counts it among the causal LMs it supports
# (it logs every supported model's name otherwise).
AutoConfig.register(DeltashipConfig.model_type, DeltashipConfig, exist_ok=True)
AutoModelForCausalLM.register(DeltashipConfig, DeltashipModelForCausalLM, exist_ok=True)
