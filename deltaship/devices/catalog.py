"""The device tier catalog: data in tiers.toml, plus the user's own tiers from a file."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from deltaship.errors import DeltashipError
from deltaship.targets import PRECISIONS, target_names

CATALOG = Path(__file__).parent / "tiers.toml"
GIB = 1 << 30


@dataclass(frozen=True)
class Tier:
    name: str
    kind: str
    ram_bytes: int
    budget_bytes: int
    targets: tuple[str, ...]
    precisions: tuple[str, ...]
    context: int
    threads: int
    notes: str = ""


def _parse(data: dict, where: str) -> tuple[dict[str, Tier], dict[str, list[str]]]:
    tiers = {}
    for name, t in (data.get("tiers") or {}).items():
        try:
            tier = Tier(
                name=name,
                kind=str(t["kind"]),
                ram_bytes=int(float(t["ram_gib"]) * GIB),
                budget_bytes=int(float(t["budget_gib"]) * GIB),
                targets=tuple(t["targets"]),
                precisions=tuple(t["precisions"]),
                context=int(t["context"]),
                threads=int(t.get("threads", 2)),
                notes=str(t.get("notes", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise DeltashipError(
                f"{where}: tier {name!r} is missing or has a bad field ({e})",
                "each tier needs kind, ram_gib, budget_gib, targets, precisions, context",
            ) from None

        bad = [x for x in tier.targets if x not in target_names()] + [p for p in tier.precisions if p not in PRECISIONS]
        if bad or tier.budget_bytes > tier.ram_bytes or tier.context < 1:
            raise DeltashipError(
                f"{where}: tier {name!r} is inconsistent (unknown {bad}, or budget over RAM, or context < 1)",
                f"targets are {target_names()}, precisions {PRECISIONS}",
            )
        tiers[name] = tier
    return tiers, dict(data.get("models") or {})


def load_catalog(user_file: str | Path | None = None) -> tuple[dict[str, Tier], dict[str, list[str]]]:
    """Built-in tiers, with the user's file (same TOML format) layered on top."""
    tiers, models = _parse(tomllib.loads(CATALOG.read_text()), str(CATALOG))
    if user_file:
        p = Path(user_file)
        if not p.is_file():
            raise DeltashipError(f"--tiers {p}: no such file", "pass a TOML file with [tiers.NAME] tables")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise DeltashipError(f"{p}: not valid TOML ({e})", "fix the file") from None
        more, more_models = _parse(data, str(p))
        tiers.update(more)
        models.update(more_models)
    return tiers, models


def get_tier(name: str, user_file: str | Path | None = None) -> Tier:
    tiers, _ = load_catalog(user_file)
    if name not in tiers:
        raise DeltashipError(
            f"unknown tier {name!r}; tiers: {', '.join(tiers)}",
            "pick a tier from the catalog or add your own with --tiers FILE",
        )
    return tiers[name]
