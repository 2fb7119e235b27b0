"""The bundle format's constants: what a reader checks before it trusts a directory.

A bundle is a directory: the artifact files, the tokenizer files and `manifest.json`, which says
how an app drives the artifact (inputs, outputs, the state contract, tokens), how it was built and
verified, and the sha256 of every file. `schema.json` beside this file is the manifest's JSON
Schema; docs/bundle-format.md explains each field.
"""

from __future__ import annotations

from pathlib import Path

MANIFEST = "manifest.json"
SCHEMA = "deltaship.bundle"
SCHEMA_VERSION = 2  # 2: the model_card block
SCHEMA_FILE = Path(__file__).with_name("schema.json")
