"""Resolve `--model` (a preset name, a checkpoint directory or a Hub id in the local Hugging Face cache) into
spec + weights + tokenizer."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from deltaship.errors import DeltashipError
from deltaship.models import trained
from deltaship.models.hub import parse_hub_id, resolve_hub_model
from deltaship.models.presets import PRESETS, get_preset, write_tiny_tokenizer
from deltaship.models.spec import ModelSpec, read_config
from deltaship.models.vision.spec import VisionSpec
from deltaship.models.weights import CheckpointWeights, RandomWeights, WeightSource

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
)


@dataclass
class ModelSource:
    """Where a model comes from: everything export needs to know about its input."""

    name: str
    kind: str  # "preset" or "checkpoint"
    spec: ModelSpec
    weights: WeightSource
    tokenizer_files: list[Path] = field(default_factory=list)
    ignored: dict[str, int] = field(default_factory=dict)
    path: Path | None = None
    _fingerprint: str | None = None

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = self.weights.fingerprint()
        return self._fingerprint

    def model_card(self) -> dict[str, str | None]:
        """The bundle's model card: where the weights come from and under which terms (None where unknown)."""
        if self.kind == "preset":
            preset = get_preset(self.name)
            # Preset weights are deltaship's own (seeded random or trained here): the project's license.
            return {
                "source_repo": None,
                "revision": None,
                "license": "apache-2.0",
                "base_model": preset.base_model,
                "weights": preset.weights,
            }
        card: dict[str, str | None] = {
            "source_repo": None,
            "revision": None,
            "license": None,
            "base_model": None,
            "weights": "checkpoint",
        }
        if self.path is not None:
            card.update(hub_cache_origin(self.path))
            readme = self.path / "README.md"
            if readme.is_file():  # a Hugging Face model card: its YAML header says license and base model
                from huggingface_hub.repocard import metadata_load  # lazy: huggingface_hub

                meta = metadata_load(readme) or {}
                for key in ("license", "base_model"):
                    value = meta.get(key)
                    card[key] = ", ".join(map(str, value)) if isinstance(value, list) else value
        return card

    def sample_prompt(self) -> str | None:
        """A prompt that suits the model: the preset's, or the first `widget` text of the checkpoint's model card."""
        if self.kind == "preset":
            return get_preset(self.name).sample_prompt
        readme = self.path / "README.md" if self.path is not None else None
        if readme is None or not readme.is_file():
            return None
        from huggingface_hub.repocard import metadata_load  # lazy: huggingface_hub

        widget = (metadata_load(readme) or {}).get("widget")
        text = widget[0].get("text") if isinstance(widget, list) and widget and isinstance(widget[0], dict) else None
        return text[:1000] if isinstance(text, str) and text.strip() else None

    def notes(self) -> list[str]:
        notes = [f"ignored {n} tensor(s) of the {what}" for what, n in sorted(self.ignored.items())]
        if not any(f.name == "tokenizer.json" for f in self.tokenizer_files):
            notes.append("no tokenizer.json: the bundle takes token ids only (deltaship generate --input-ids)")
        return notes


def hub_cache_origin(path: Path) -> dict[str, str]:
    """Repo id and revision of a directory inside a Hugging Face cache (`models--org--name/snapshots/REV`)."""
    parts = path.resolve().parts
    for i, part in enumerate(parts[:-2]):
        if part.startswith("models--") and parts[i + 1] == "snapshots":
            return {"source_repo": part.removeprefix("models--").replace("--", "/"), "revision": parts[i + 2]}
    return {}


def load_source(model: str | Path, *, allow_download: bool = False) -> ModelSource:
    """A preset name (`qwen3.5-tiny`), a local checkpoint directory, or a Hub id (`org/name`, `org/name@revision`).

    A Hub id is read from the local Hugging Face cache (deltaship/models/hub.py); it is downloaded only with
    allow_download=True. An existing directory always wins over a Hub id of the same spelling."""
    text = str(model)
    if text in PRESETS:
        preset = get_preset(text)
        spec = preset.spec()

        ckpt = trained.checkpoint_dir(text)
        if ckpt is not None:  # a preset that ships trained weights is a checkpoint inside the package
            src = _load_dir(ckpt, name=text)
            src.kind = "preset"
            return src
        files: list[Path] = []
        if text == "qwen3.5-tiny":
            tdir = Path(tempfile.mkdtemp(prefix="deltaship-tok-"))
            files = [tdir / f for f in write_tiny_tokenizer(tdir)]
        mm = preset.multimodal_config()
        vision = VisionSpec.from_config(mm, where=f"preset {text}") if mm is not None else None
        weights = RandomWeights(spec, seed=preset.seed, vision=vision)
        return ModelSource(name=text, kind="preset", spec=spec, weights=weights, tokenizer_files=files)
    path = Path(text).expanduser()
    if not path.exists():
        hub_id = parse_hub_id(text)
        if hub_id is not None:
            return _load_hub(*hub_id, allow_download=allow_download)
        raise DeltashipError(
            f"--model {text!r} is neither a preset, an existing directory nor a Hub id (org/name); "
            "presets: " + ", ".join(PRESETS),
            "pass a local checkpoint directory, a preset name, or a Hugging Face id such as Qwen/Qwen3.5-0.8B",
        )
    if not path.is_dir():
        raise DeltashipError(
            f"--model {text!r} is a file, not a checkpoint directory",
            "pass the directory that holds config.json and the *.safetensors files",
        )
    return _load_dir(path, name=str(path))


def _load_hub(repo_id: str, revision: str | None, *, allow_download: bool) -> ModelSource:
    """A Hub id through the local cache; the source is named `org/name@<commit>` so it can be loaded again."""

    snapshot = resolve_hub_model(repo_id, revision, allow_download=allow_download)
    commit = snapshot.name
    spelled = f"{repo_id}@{revision}" if revision else repo_id
    try:
        return _load_dir(snapshot, name=f"{repo_id}@{commit}")
    except DeltashipError as e:  # name the Hub id the user typed, not only the cache path
        raise DeltashipError(f"--model {spelled} (commit {commit}): {e.message}", e.fix) from None


def _load_dir(path: Path, name: str) -> ModelSource:
    cfg_path = path / "config.json"
    spec = ModelSpec.from_config(read_config(cfg_path), where=str(cfg_path))
    weights = CheckpointWeights(path, spec)
    toks = [path / f for f in TOKENIZER_FILES if (path / f).is_file()]
    return ModelSource(
        name=name,
        kind="checkpoint",
        spec=spec,
        weights=weights,
        tokenizer_files=toks,
        ignored=dict(weights.ignored),
        path=path,
    )
