"""The device tier catalog: data in tiers.toml, plus the user's own tiers from a file."""

from __future__ import annotations

import argparse
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltaship.errors import DeltashipError
from deltaship.files import read_bounded_text
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


TIER_FIX = "each tier needs kind, ram_gib, budget_gib, targets, precisions, context (and may give threads, notes)"
MAX_TIER_GIB = 1 << 20  # a PiB: beyond any device, and within a float's exact integers once in bytes
MAX_TIER_CONTEXT = 1 << 24
MAX_TIER_THREADS = 1024


def _value(t: dict, key: str, where: str, kind: str, low: float = 0, high: float = 0, default: object = None) -> Any:
    """t[key] checked for its type and range, as data: one DeltashipError naming the tier and the key otherwise."""
    if key not in t:
        if default is not None:
            return default
        raise DeltashipError(f"{where}: {key} is missing", TIER_FIX)
    v = t[key]
    if kind in ("int", "number"):
        ok = not isinstance(v, bool) and isinstance(v, int if kind == "int" else (int, float))
        if not ok or not (low <= v <= high):  # NaN and inf fail the range
            what = f"an integer in {low:,}..{high:,}" if kind == "int" else f"a number in {low:.4g}..{high:,}"
            raise DeltashipError(f"{where}: {key} = {v!r:.60} is not {what}", TIER_FIX)
    elif kind == "str":
        if not isinstance(v, str) or len(v) > 4096:
            raise DeltashipError(f"{where}: {key} must be a string (at most 4096 characters), got {v!r:.60}", TIER_FIX)
    elif not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v) or len(v) > 64:
        raise DeltashipError(f"{where}: {key} must be a list of names, got {v!r:.60}", TIER_FIX)
    return v


def _parse(data: dict, where: str) -> tuple[dict[str, Tier], dict[str, list[str]]]:
    tiers = {}
    tables = data.get("tiers") or {}
    if not isinstance(tables, dict):
        raise DeltashipError(f"{where}: tiers must be [tiers.NAME] tables", TIER_FIX)
    for name, t in tables.items():
        at = f"{where}: tier {name!r}"
        if not isinstance(t, dict):
            raise DeltashipError(f"{at} is not a table", TIER_FIX)
        tier = Tier(
            name=name,
            kind=_value(t, "kind", at, "str"),
            ram_bytes=int(_value(t, "ram_gib", at, "number", 1 / 1024, MAX_TIER_GIB) * GIB),
            budget_bytes=int(_value(t, "budget_gib", at, "number", 1 / 1024, MAX_TIER_GIB) * GIB),
            targets=tuple(_value(t, "targets", at, "names")),
            precisions=tuple(_value(t, "precisions", at, "names")),
            context=_value(t, "context", at, "int", 1, MAX_TIER_CONTEXT),
            threads=_value(t, "threads", at, "int", 1, MAX_TIER_THREADS, default=2),
            notes=_value(t, "notes", at, "str", default=""),
            npu=_npu(t["npu"], at) if "npu" in t else None,
        )

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
    models = data.get("models") or {}
    if not isinstance(models, dict):
        raise DeltashipError(f"{where}: models must be a table of size = [tier names]", TIER_FIX)
    return tiers, {size: list(_value(models, size, f"{where}: models", "names")) for size in models}


def _npu(t: dict, where: str) -> NpuLimits:
    """A [tiers.NAME.npu] table: soc and context_binary_gib."""
    if not isinstance(t, dict):
        raise DeltashipError(f"{where}: npu must be a table", "give [tiers.NAME.npu] soc and context_binary_gib")
    try:
        soc = find_soc(_value(t, "soc", f"{where}: npu", "str")).name
    except DeltashipError as e:
        raise DeltashipError(f"{where}: npu.soc: {e.message.removeprefix(f'{where}: npu: ')}", e.fix) from None
    size = t.get("context_binary_gib")
    if isinstance(size, (int, float)) and not isinstance(size, bool) and size <= 0:
        raise DeltashipError(f"{where}: npu.context_binary_gib must be positive", "give the NPU's per-context limit")
    size = _value(t, "context_binary_gib", f"{where}: npu", "number", 1 / 1024, MAX_TIER_GIB)
    return NpuLimits(soc=soc, context_binary_bytes=int(size * GIB))


def load_catalog(user_file: str | Path | None = None) -> tuple[dict[str, Tier], dict[str, list[str]]]:
    """Built-in tiers, with the user's file (same TOML format) layered on top."""
    tiers, models = _parse(tomllib.loads(CATALOG.read_text()), str(CATALOG))
    if user_file:
        p = Path(user_file)
        if not p.is_file():
            raise DeltashipError(f"--tiers {p}: no such file", "pass a TOML file with [tiers.NAME] tables")
        text = read_bounded_text(p, "tiers file", "pass a TOML file with [tiers.NAME] tables", limit=1 << 20)
        try:
            data = tomllib.loads(text)
        except (tomllib.TOMLDecodeError, ValueError) as e:  # ValueError: an integer of 4300+ digits
            raise DeltashipError(f"{p}: not valid TOML ({str(e)[:200]})", "fix the file") from None
        except RecursionError:
            raise DeltashipError(f"{p}: arrays or tables nested too deep to be a tiers file", "fix the file") from None
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
