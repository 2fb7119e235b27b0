"""`--model org/name[@revision]`: a Hugging Face Hub id, resolved from the local Hugging Face cache.

Offline by default: the cache is read through `huggingface_hub.snapshot_download(local_files_only=True)`.
A download happens only when the caller passes allow_download=True (`--allow-download`), and then only
for the files an export reads; HF_HUB_OFFLINE=1 still wins over the flag (huggingface_hub refuses).
A model already in the cache is used as it is (no network look-up of a newer `main`): `hf download`
refreshes it.
"""

from __future__ import annotations

import os
import re
from importlib import metadata
from pathlib import Path

from deltaship.errors import DeltashipError

# What an export reads from a checkpoint repo (weights, config, tokenizer, model card); nothing else is fetched.
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "README.md"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")
_REVISION = re.compile(r"^[\w./-]{1,256}$")


def parse_hub_id(text: str) -> tuple[str, str | None] | None:
    """`org/name` or `org/name@revision` -> (repo_id, revision or None); None if `text` is not shaped like one."""
    repo_id, _, revision = text.partition("@")
    if not _REPO_ID.match(repo_id) or ".." in repo_id or repo_id.endswith((".", "-")):
        return None
    if "@" in text and not _REVISION.match(revision):
        return None
    return repo_id, (revision or None)


def hub_cache_dir() -> Path:
    """The Hub cache as huggingface_hub locates it (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub).

    Read from the environment at call time: huggingface_hub's own constant is frozen when it is imported."""
    from huggingface_hub import constants  # lazy: huggingface_hub

    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.environ[var])).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def download_command(repo_id: str, revision: str | None) -> str:
    """The shell command that puts the repo in the cache, with the CLI the installed huggingface_hub provides."""
    try:
        scripts = {
            e.name for e in metadata.distribution("huggingface_hub").entry_points if e.group == "console_scripts"
        }
    except metadata.PackageNotFoundError:
        scripts = set()
    cli = "hf" if "hf" in scripts or "huggingface-cli" not in scripts else "huggingface-cli"
    rev = f" --revision {revision}" if revision else ""
    return f"{cli} download {repo_id}{rev}"


def _offline() -> bool:
    return any(
        os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def resolve_hub_model(repo_id: str, revision: str | None = None, *, allow_download: bool = False) -> Path:
    """The snapshot directory of `repo_id` at `revision` (default `main`) in the local Hugging Face cache.

    The directory is `<cache>/models--org--name/snapshots/<commit>`, so its path names the resolved commit.
    With allow_download=True a model absent from the cache is downloaded (the export's files only)."""
    from huggingface_hub import snapshot_download  # lazy: huggingface_hub
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    rev = revision or "main"
    spelled = f"{repo_id}@{revision}" if revision else repo_id
    fetch = download_command(repo_id, revision)
    try:
        return Path(snapshot_download(repo_id, revision=rev, cache_dir=cache, local_files_only=True))
    except IncompleteSnapshotError as e:
        if not allow_download:
            raise DeltashipError(
                f"--model {spelled}: the cached snapshot at {e.snapshot_path} is incomplete",
                f"complete it with `{fetch}` (or pass --allow-download)",
            ) from None
    except LocalEntryNotFoundError:
        if not allow_download:
            raise _absent(repo_id, revision, cache, fetch) from None
    if _offline():
        raise DeltashipError(
            f"--model {spelled} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is "
            "set, so --allow-download cannot fetch it",
            f"unset HF_HUB_OFFLINE, or fetch it elsewhere with `{fetch}` and copy the cache",
        )
    try:
        return Path(snapshot_download(repo_id, revision=rev, cache_dir=cache, allow_patterns=DOWNLOAD_PATTERNS))
    except Exception as e:  # network, authentication, unknown repo or revision: huggingface_hub says which
        raise DeltashipError(
            f"--model {spelled}: downloading from the Hugging Face Hub failed: {type(e).__name__}: {e}".strip(),
            f"check the id and your network or token, or fetch it with `{fetch}`",
        ) from None


def _absent(repo_id: str, revision: str | None, cache: Path, fetch: str) -> DeltashipError:
    """Which part is missing: the whole repo, or only the revision (listing the ones the cache has)."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    if not storage.is_dir():
        return DeltashipError(
            f"--model {repo_id!r} is not a preset, not a local directory, and not in the Hugging Face cache "
            f"({cache}); nothing is downloaded without --allow-download",
            f"fetch it with `{fetch}`, then run again (or pass --allow-download)",
        )
    refs = (
        sorted(p.relative_to(storage / "refs").as_posix() for p in (storage / "refs").rglob("*") if p.is_file())
        if (storage / "refs").is_dir()
        else []
    )
    snaps = sorted(p.name for p in (storage / "snapshots").iterdir()) if (storage / "snapshots").is_dir() else []
    have = ", ".join(refs + snaps) or "none"
    return DeltashipError(
        f"--model {repo_id}@{revision or 'main'}: revision {revision or 'main'!r} is not in the Hugging Face cache "
        f"({storage}); cached revisions: {have}",
        f"fetch it with `{fetch}`, or pick a cached revision with --model {repo_id}@<revision>",
    )
