"""The fleet's matrix file, read once into a frozen `Matrix`: models x targets x precisions x devices, the export
options of every cell and the profile workload of every device. Everything is checked here, before any work: an
unknown key or a bad value is refused naming the key and the values it allows.

    models = ["qwen3.5-tiny"]          # presets, Hub ids (org/name[@revision]) or checkpoint directories
    targets = ["onnx"]
    precisions = ["fp32", "int4"]
    devices = ["host"]                 # host, adb:SERIAL, ssh://user@host[:port], or a tier name
    [export]                           # export()'s options (ExportOptions and the targets' own), typed from them
    verify = false
    [profile]                          # the profile workload (ProfileSettings' fields)
    prompt_lengths = [8]
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltaship.compile.settings import EXPORT_OPTIONS, ExportOptions, build_settings
from deltaship.devices.catalog import load_catalog
from deltaship.devices.discovery import parse_ssh
from deltaship.errors import DeltashipError
from deltaship.models.hub import parse_hub_id
from deltaship.models.presets import PRESETS
from deltaship.profiling.settings import ProfileSettings
from deltaship.runtimes import PROVIDERS
from deltaship.targets import PRECISIONS, all_targets, target_names

MAX_CELLS = 4096  # a matrix is data: its size is bounded before anything is expanded
MAX_BYTES = 1 << 20
AXES = ("models", "targets", "precisions", "devices")
KEYS = AXES + ("export", "profile")
# export options a matrix does not set: the axes themselves, the store's own replacement, and file paths (a value
# read from a matrix is data, never a path to read)
EXPORT_EXCLUDED = ("target", "precision", "force", "prompt_cache")
# the profile workload a matrix sets; the rest of ProfileSettings is the device (an axis), outputs the fleet owns,
# or shell words and commands (ssh options, runners), which a matrix never carries
PROFILE_KEYS = (
    "prompt_lengths",
    "gen",
    "contexts",
    "warmups",
    "reps",
    "min_seconds",
    "threads",
    "breakdown",
    "provider",
)
SERIAL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


@dataclass(frozen=True)
class Matrix:
    """A checked matrix: the axes in file order, the export options (export() keyword arguments) and the profile
    workload (ProfileSettings keyword arguments) of every cell."""

    models: tuple[str, ...]
    targets: tuple[str, ...]
    precisions: tuple[str, ...]
    devices: tuple[str, ...]
    export: dict[str, Any]
    profile: dict[str, Any]

    def bundles(self) -> list[tuple[str, str, str]]:
        """(model, target, precision) of every export cell."""
        return [(m, t, p) for m in self.models for t in self.targets for p in self.precisions]


def _allowed(values: Any) -> str:
    return ", ".join(str(v) for v in values)


def _type_ok(annotation: str, value: Any) -> bool:
    """Does a TOML value fit a dataclass field's annotation (the option definitions are the one source of types)?"""
    for kind in (k.strip() for k in str(annotation).split("|")):
        if kind == "bool" and isinstance(value, bool):
            return True
        if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if kind == "str" and isinstance(value, str):
            return True
        if kind == "list[int]" and isinstance(value, list) and all(_type_ok("int", v) for v in value):
            return True
    return False


def _axis(doc: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    values = doc.get(key)
    if not isinstance(values, list) or not values or not all(isinstance(v, str) and v for v in values):
        raise DeltashipError(f"{where}: `{key}` must be a non-empty list of strings", f'e.g. {key} = ["..."]')
    if len(set(values)) != len(values):
        raise DeltashipError(f"{where}: `{key}` names {values!r}, with repeats", f"list each of {key} once")
    return tuple(values)


def _one_of(where: str, key: str, values: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    for v in values:
        if v not in allowed:
            raise DeltashipError(
                f"{where}: {key} {v!r} is unknown; {key}: {_allowed(allowed)}", f"use one of: {_allowed(allowed)}"
            )


def check_device(device: str, tiers: tuple[str, ...], where: str = "the matrix") -> str:
    """host, adb:SERIAL, ssh://user@host[:port] (no path: a remote command is deltaship's, not the matrix's) or a
    tier name; anything else is refused listing the forms and the tiers."""
    if device == "host" or device in tiers:
        return device
    if device.startswith("adb:") and SERIAL.fullmatch(device[4:]):
        return device
    if device.startswith("ssh://"):
        try:
            target = parse_ssh(device)
        except DeltashipError:
            target = None
        if target is not None and re.fullmatch(r"ssh://[A-Za-z0-9._@:-]+", device):
            return device
    raise DeltashipError(
        f"{where}: device {device!r} is unknown; devices: host, adb:SERIAL, ssh://user@host[:port], or a tier: "
        f"{_allowed(tiers)}",
        "name a device in one of those forms (`deltaship devices` lists what is attached)",
    )


def _model(model: str, base: Path, where: str) -> str:
    if model in PRESETS:
        return model
    path = (base / model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return str(path.resolve())
    if not model.startswith((".", "/", "~")) and parse_hub_id(model) is not None:
        return model
    raise DeltashipError(
        f"{where}: model {model!r} is neither a preset, a checkpoint directory (with config.json) nor a Hub id; "
        f"presets: {_allowed(PRESETS)}",
        "name a preset, a checkpoint directory (relative to the matrix file) or org/name",
    )


def _export_options(table: Any, where: str) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise DeltashipError(f"{where}: [export] must be a table of export options", "e.g. [export] verify = false")
    fields = {f.name: f for f in dataclasses.fields(ExportOptions) if f.name not in EXPORT_EXCLUDED}
    for t in all_targets():
        for f in t.Options.fields():
            if f.metadata.get("metavar") != "PATH" and "Path" not in str(f.type):
                fields.setdefault(f.name, f)
    for key, value in table.items():
        if key not in fields:
            why = " (it is an axis or the fleet's own)" if key in EXPORT_OPTIONS else ""
            raise DeltashipError(
                f"{where}: unknown [export] key {key!r}{why}; keys: {_allowed(fields)}", "check the option's spelling"
            )
        f = fields[key]
        choices = f.metadata.get("choices")
        if not _type_ok(f.type, value) or (choices and value not in choices):
            allowed = _allowed(choices) if choices else str(f.type).replace(" | None", "")
            raise DeltashipError(
                f"{where}: [export] {key} = {value!r}; allowed: {allowed}", f"set {key} to one of those"
            )
    return dict(table)


def _profile_options(table: Any, where: str) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise DeltashipError(f"{where}: [profile] must be a table of profile options", "e.g. [profile] gen = 16")
    fields = {f.name: f for f in dataclasses.fields(ProfileSettings) if f.name in PROFILE_KEYS}
    for key, value in table.items():
        if key not in fields:
            raise DeltashipError(f"{where}: unknown [profile] key {key!r}; keys: {_allowed(PROFILE_KEYS)}", "drop it")
        f = fields[key]
        if not _type_ok(f.type, value):
            raise DeltashipError(
                f"{where}: [profile] {key} = {value!r}; allowed: {str(f.type).replace(' | None', '')}",
                f"set {key} to a value of that type",
            )
        if key == "provider" and value not in PROVIDERS:
            raise DeltashipError(f"{where}: [profile] provider {value!r}; allowed: {_allowed(PROVIDERS)}", "use cpu")
        lows = {"gen": 2, "reps": 1, "warmups": 0, "threads": 1, "prompt_lengths": 1, "contexts": 1, "min_seconds": 0}
        values = value if isinstance(value, list) else [value]
        if key in ("prompt_lengths", "contexts") and not values:
            raise DeltashipError(f"{where}: [profile] {key} is empty", f"e.g. {key} = [128]")
        bad = [v for v in values if key in lows and (v < lows[key] or v != v or v in (float("inf"),))]
        if bad:
            raise DeltashipError(
                f"{where}: [profile] {key} must be >= {lows[key]}, got {bad[0]}", f"set {key} to {lows[key]} or more"
            )
    return dict(table)


def parse_matrix(text: str, where: str = "the matrix", base: Path | None = None) -> Matrix:
    """A Matrix from TOML text; every key and value checked, and every cell's export settings built (so a target
    that does not build a precision is refused here, not an hour in)."""
    if len(text.encode()) > MAX_BYTES:
        raise DeltashipError(f"{where}: larger than {MAX_BYTES} bytes", "a matrix is a few lines of TOML")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise DeltashipError(f"{where}: not TOML ({e})", "fix the syntax (https://toml.io)") from None
    for key in doc:
        if key not in KEYS:
            raise DeltashipError(f"{where}: unknown key {key!r}; keys: {_allowed(KEYS)}", "check the key's spelling")
    for key in AXES:
        if key not in doc:
            raise DeltashipError(f"{where}: `{key}` is missing; keys: {_allowed(KEYS)}", f"add {key} = [...]")
    axes = {key: _axis(doc, key, where) for key in AXES}
    _one_of(where, "targets", axes["targets"], target_names())
    _one_of(where, "precisions", axes["precisions"], PRECISIONS)
    tiers = tuple(load_catalog()[0])
    devices = tuple(check_device(d, tiers, where) for d in axes["devices"])
    models = tuple(_model(m, base or Path.cwd(), where) for m in axes["models"])
    count = len(models) * len(axes["targets"]) * len(axes["precisions"]) * (1 + len(devices))
    if count > MAX_CELLS:
        raise DeltashipError(f"{where}: {count} cells, more than {MAX_CELLS}", "split the matrix")
    export = _export_options(doc.get("export", {}), where)
    profile = _profile_options(doc.get("profile", {}), where)
    for t in axes["targets"]:
        for p in axes["precisions"]:
            try:
                build_settings(models[0], "unused", target=t, precision=p, **export)
            except DeltashipError as e:
                raise DeltashipError(f"{where}: the cell {t}/{p}: {e.message}", e.fix) from None
    return Matrix(models, axes["targets"], axes["precisions"], devices, export, profile)


def load_matrix(path: str | Path) -> Matrix:
    """The Matrix of a TOML file (models that are directories resolve relative to it)."""
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise DeltashipError(f"{p}: cannot read the matrix ({e})", "pass a TOML matrix file") from None
    return parse_matrix(text, str(p), p.resolve().parent)
