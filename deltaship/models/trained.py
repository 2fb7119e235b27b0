"""Trained weights that ship inside the package (trained by tools/train_tiny.py)."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).parent / "data"
# held-out text (not trained on) for fidelity, KV calibration, draft-vocabulary ranking and acceptance
HELDOUT = DATA / "qwen3.5-tiny" / "heldout.txt"


def checkpoint_dir(preset: str) -> Path | None:
    """The packaged checkpoint directory of a preset, or None when it has random weights."""
    d = DATA / preset
    return d if (d / "config.json").is_file() and any(d.glob("*.safetensors")) else None
