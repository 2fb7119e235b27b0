"""The device tier catalog: data in tiers.toml, plus the user's own tiers from a file."""

from __future__ import annotations

import argparse
import tomllib
from dataclasses import dataclass
from pathlib import Path

from deltaship.errors import DeltashipError
from deltaship.lowering.qnn.soc import soc as find_soc
from deltaship.targets import PRECISIONS, get_target, target_names

CATALOG = Path(__file__).parent / "tiers.toml"
GIB = 1 << 30


@dataclass(frozen=True)
class NpuLimits:
    """A tier's NPU (a [tiers.NAME.npu] table): the SoC its NPU bundles are compiled for, and the largest compiled
    context binary one NPU session maps (the sources are in tiers.toml beside each value)."""

    soc: str  # a --qnn-soc name (lowering/qnn/soc.py)
    context_binary_bytes: int


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
    npu: NpuLimits | None = None  # the NPU an NPU target (Target.npu_graphs) runs on; None: the tier has none


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
                npu=_npu(t["npu"], f"{where}: tier {name!r}") if "npu" in t else None,
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
        needs_npu = [x for x in tier.targets if get_target(x).npu_graphs]
        if needs_npu and tier.npu is None:
            raise DeltashipError(
                f"{where}: tier {name!r} lists the NPU target(s) {needs_npu} but has no [tiers.{name}.npu] table",
                "give the tier its NPU: soc (a --qnn-soc name) and context_binary_gib",
            )
        tiers[name] = tier
    return tiers, dict(data.get("models") or {})


def _npu(t: dict, where: str) -> NpuLimits:
    """A [tiers.NAME.npu] table: soc and context_binary_gib."""
    try:
        soc = find_soc(str(t["soc"])).name
    except DeltashipError as e:
        raise DeltashipError(f"{where}: npu.soc: {e.message}", e.fix) from None
    limits = NpuLimits(soc=soc, context_binary_bytes=int(float(t["context_binary_gib"]) * GIB))
    if limits.context_binary_bytes <= 0:
        raise DeltashipError(f"{where}: npu.context_binary_gib must be positive", "give the NPU's per-context limit")
    return limits


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


# The docs' tier tables are generated from the catalog: the text between these markers (docs/profiling.md).
DOC_MARKERS = ("<!-- tiers:begin -->", "<!-- tiers:end -->")
REGENERATE = "python -m deltaship.devices.catalog --write"  # + the pages


def _gib(n: int) -> str:
    return f"{n / GIB:g} GiB"


def tier_table_markdown() -> str:
    """The built-in tiers as a markdown table, in catalog order: what each tier gives a bundle, and the published
    sizes the catalog's [models] table says it is meant for."""
    tiers, models = load_catalog()
    rows = [
        "| tier | kind | RAM | budget | targets | precisions | context | threads | NPU | meant for | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in tiers.values():
        npu = f"{t.npu.soc}, {_gib(t.npu.context_binary_bytes)} per context binary" if t.npu else "none"
        sizes = ", ".join(m for m, names in models.items() if t.name in names)
        cells = (t.name, t.kind, _gib(t.ram_bytes), _gib(t.budget_bytes), ", ".join(t.targets))
        cells += (", ".join(t.precisions), f"{t.context:,}", str(t.threads), npu, sizes, t.notes)
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def with_tier_table(doc: str, where: str) -> str:
    """`doc` with the text between DOC_MARKERS replaced by tier_table_markdown()."""
    begin, end = DOC_MARKERS
    if doc.count(begin) != 1 or doc.count(end) != 1 or doc.index(begin) > doc.index(end):
        raise DeltashipError(f"{where}: needs one {begin} line and one {end} line after it", "add the two markers")
    head, rest = doc.split(begin)
    return head + begin + "\n" + tier_table_markdown() + end + rest.split(end, 1)[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deltaship.devices.catalog", description="The built-in device tiers as a markdown table."
    )
    parser.add_argument(
        "--write",
        nargs="+",
        metavar="DOC",
        help=f"rewrite the table between {DOC_MARKERS[0]} and {DOC_MARKERS[1]} in each DOC (else print it)",
    )
    args = parser.parse_args(argv)
    if not args.write:
        print(tier_table_markdown(), end="")
        return 0
    for name in args.write:
        path = Path(name)
        path.write_text(with_tier_table(path.read_text(), name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
