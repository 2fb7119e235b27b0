"""App integration kits: source an app embeds to run a bundle, generated from its manifest.

`write_kit(bundle, out, platform)` writes a small project for one platform: a Swift package over
Core ML (ios), Kotlin over onnxruntime-android / onnxruntime-genai / ExecuTorch (android), or
JavaScript (web, desktop; deltaship.apps.web). Every name, shape and dtype in the generated code
is read from the bundle at generation time, and a `kit.json` beside it records them so a check
can compare the code, the record and the artifact.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from deltaship.bundle import read_manifest, require_intact
from deltaship.bundle.destination import Destination
from deltaship.bundle.writer import write_dir
from deltaship.errors import DeltashipError
from deltaship.runtimes.ort_worker import required_onnxruntime, version_tuple
from deltaship.targets import a_bundle, get_target, on_platform, require_artifact

PLATFORMS = ("android", "ios", "web", "desktop")
KIT_RECORD = "kit.json"

# platform -> the module that writes its kit; the bundles it runs are those of the targets that name the platform
# (Target.app_platforms)
_KITS: dict[str, str] = {
    "ios": "deltaship.apps.swift",
    "android": "deltaship.apps.kotlin",
    "web": "deltaship.apps.web",
    "desktop": "deltaship.apps.web",
}
# what the refusal of another target's bundle adds about the platform
_PLATFORM_NOTES = {
    "ios": " (an ONNX bundle runs on iOS through onnxruntime-objc / onnxruntime-genai, which this kit does not "
    "generate)"
}


def either(names) -> str:
    """ "A", "A or B", "A, B or C"."""
    names = list(names)
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 2 else names)


def export_for(platform: str) -> str:
    """The export that makes a bundle the `platform` kit runs, e.g. "export an ONNX or ExecuTorch bundle: ..."."""
    runs = on_platform(platform)
    kinds = either(t.title or t.name for t in runs)
    names = "|".join(t.name for t in runs)
    return (
        f"export {'an' if kinds[0] in 'AEIOU' else 'a'} {kinds} bundle: deltaship export --model M --target {names} "
        f"--out DIR{_PLATFORM_NOTES.get(platform, '')}"
    )


def write_kit(bundle: Path, out: Path, platform: str, force: bool = False) -> dict[str, Any]:
    """Write the app kit for `platform` from `bundle` into `out`; returns the kit record (kit.json).

    Writes into a temporary directory next to `out`, then renames it: a failure leaves nothing,
    and an existing `out` is replaced only with force=True.
    """
    bundle, out = Path(bundle), Path(out)
    if platform not in _KITS:
        raise DeltashipError(f"unknown platform {platform!r}", f"use one of {', '.join(PLATFORMS)}")
    manifest = read_manifest(bundle)  # refuses other schema versions, naming the export that rebuilds them
    with Destination(out, force, inputs=(bundle,)) as dest:  # checked and locked before the bundle is hashed
        return _write_kit(bundle, manifest, dest, platform)


def _write_kit(bundle: Path, manifest: dict[str, Any], dest: Destination, platform: str) -> dict[str, Any]:
    module_name = _KITS[platform]
    require_intact(bundle, manifest)
    target = manifest.get("target")
    runs = on_platform(platform)
    if target not in {t.name for t in runs}:
        raise DeltashipError(
            f"{bundle} is {a_bundle(target)}; the {platform} kit runs {either(t.title or t.name for t in runs)} "
            "bundles",
            export_for(platform),
        )
    require_artifact(bundle, manifest)  # the kit copies the artifact as the manifest describes it
    _check_runtime_version(bundle, manifest, platform)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise DeltashipError(
            f"the {platform} kit generator ({module_name}) is not installed in this deltaship",
            "update deltaship to a version with web/desktop kits, or use --platform ios|android",
        ) from e

    def build(tmp: Path) -> dict[str, Any]:
        if platform in ("ios", "android"):  # generate(bundle, manifest, out) -> the kit record
            record = module.generate(bundle, manifest, tmp)
        else:  # deltaship.apps.web's interface: write_kit(bundle, out, platform) -> written files
            files = module.write_kit(bundle, tmp, platform)
            record = {
                "platform": platform,
                "target": target,
                # relative to the kit: the staging directory is renamed to `out` once complete
                "files": sorted(Path(f).relative_to(tmp).as_posix() for f in files),
            }
        record = {"kit": "deltaship.app", "platform": platform, **record}
        if not (tmp / KIT_RECORD).exists():
            (tmp / KIT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        return record

    return write_dir(dest, dest.force, build)


def _check_runtime_version(bundle: Path, manifest: dict[str, Any], platform: str) -> None:
    """Refuse a bundle that needs a newer onnxruntime (an --onnx-opset 27 bundle: >= 1.32) than the kit pins:
    the JS package's onnxruntime-web/-node, or the Android kit's onnxruntime-android (the export's onnxruntime)."""
    need = required_onnxruntime(manifest)
    if not need:
        return
    runtime = get_target(manifest["target"]).app_platforms[platform]  # onnxruntime-web, -node or -android
    if platform in ("web", "desktop"):  # the JS package pins them
        package = json.loads((Path(__file__).parent / "js" / "package.json").read_text())
        pinned = package["dependencies"][runtime]
    else:  # the Android kit depends on the export's own version
        pinned = manifest.get("tools", {}).get("onnxruntime", "0")
    if version_tuple(pinned) < version_tuple(need):
        raise DeltashipError(
            f"{bundle} needs onnxruntime >= {need} (lowering.opset {manifest['lowering'].get('opset')}); the "
            f"{platform} kit pins {runtime} {pinned}, which refuses it",
            f"export the bundle without --onnx-opset 27 for the {platform} kit",
        )


def kit_name(manifest: dict[str, Any]) -> str:
    """A Swift/Kotlin identifier from the model's name, e.g. qwen3.5-tiny -> Qwen35Tiny."""
    raw = str(manifest.get("source", {}).get("model", "model")).rstrip("/").split("/")[-1]
    words = "".join(c if c.isalnum() else " " for c in raw).split()
    name = "".join(w[:1].upper() + w[1:] for w in words) or "Model"
    return name if name[0].isalpha() else "M" + name
