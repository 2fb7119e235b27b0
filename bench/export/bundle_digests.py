"""Digest every model file of the tiny preset's bundles, per target x precision, to show a refactor
changed no artifact.
Regenerates no page: a check, not a measurement (the digests go in the refactor's commit message).

    python bench/export/bundle_digests.py --json before.json            # on the old commit
    python bench/export/bundle_digests.py --json after.json --compare before.json

Each bundle is exported with --no-verify (verification reads the artifact, it does not write it) into a
temp dir. ONNX and ExecuTorch files are compared byte for byte (sha256); a Core ML package by its parsed
spec (the Model protobuf serialized deterministically) plus its weight files, since the package's
Manifest.json carries fresh identifiers on every save. manifest.json is compared with its time and tool
versions left out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

TARGETS = ("onnx", "executorch", "coreml")
PRECISIONS = ("fp32", "fp16", "int8", "int4")
VOLATILE = {"created", "deltaship_version", "tool_versions", "git_commit", "export_seconds"}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _strip(value):
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _raw_varies(rel: str) -> bool:
    """A Core ML package file whose bytes differ between two saves of the same model: the spec's protobuf bytes (not
    deterministic; its parsed spec is compared) and the package's Manifest.json (fresh identifiers)."""
    return ".mlpackage" in rel and (rel.endswith(".mlmodel") or rel.endswith("Manifest.json"))


def digest(bundle: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for path in sorted(p for p in bundle.rglob("*") if p.is_file()):
        rel = path.relative_to(bundle).as_posix()
        if rel == "manifest.json":
            manifest = _strip(json.loads(path.read_text()))
            for name in [f for f in manifest.get("files", {}) if _raw_varies(f)]:
                del manifest["files"][name]  # compared below by parsed spec, or left out
            out[rel] = _sha(json.dumps(manifest, sort_keys=True).encode())
        elif rel.endswith(".mlmodel"):
            from coremltools.proto import Model_pb2  # lazy: coremltools only for Core ML bundles

            spec = Model_pb2.Model()
            spec.ParseFromString(path.read_bytes())
            out[rel] = _sha(spec.SerializeToString(deterministic=True))
        elif rel.endswith("Manifest.json") and ".mlpackage" in rel:
            continue
        else:
            out[rel] = _sha(path.read_bytes())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where to write the digests")
    ap.add_argument("--compare", help="digests from another commit to compare with")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    args = ap.parse_args()
    result: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory(prefix="deltaship-digests-") as tmp:
        for target in args.targets.split(","):
            for precision in args.precisions.split(","):
                out = Path(tmp) / f"{target}-{precision}"
                cmd = [
                    sys.executable,
                    "-m",
                    "deltaship",
                    "export",
                    "--model",
                    "qwen3.5-tiny",
                    "--target",
                    target,
                    "--precision",
                    precision,
                    "--out",
                    str(out),
                    "--no-verify",
                    "--quiet",
                ]
                run = subprocess.run(cmd, capture_output=True, text=True)
                key = f"{target}/{precision}"
                if run.returncode:
                    print(f"{key}: export failed\n{run.stderr[-2000:]}", file=sys.stderr)
                    result[key] = {"error": run.stderr[-500:]}
                    continue
                result[key] = digest(out)
                print(f"{key}: {len(result[key])} files", flush=True)
    Path(args.json).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    if not args.compare:
        return 0
    before = json.loads(Path(args.compare).read_text())
    differ = 0
    for key in sorted(set(before) | set(result)):
        a, b = before.get(key, {}), result.get(key, {})
        changed = sorted(f for f in set(a) | set(b) if a.get(f) != b.get(f))
        print(f"{key}: {'identical' if not changed else 'DIFFERS: ' + ', '.join(changed)}")
        differ += bool(changed)
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
