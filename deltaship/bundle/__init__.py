"""The bundle format, apart from the compiler: constants, reader, writer, schema check.

Importable without torch or any toolchain, so an app's tooling (or a server that receives bundles)
can read and check one: `read_manifest(dir)`, `check_files(dir, manifest)`, `schema_problems(manifest)`;
`deltaship.check.inspect.inspect(dir)` adds the artifact's own check (its target's).
The manifest's JSON Schema is `schema.json` here; docs/bundle-format.md explains it.
"""

from deltaship.bundle.format import MANIFEST, SCHEMA, SCHEMA_FILE, SCHEMA_VERSION
from deltaship.bundle.reader import check_files, read_manifest, require_intact
from deltaship.bundle.validate import schema_problems

__all__ = [
    "MANIFEST",
    "SCHEMA",
    "SCHEMA_FILE",
    "SCHEMA_VERSION",
    "read_manifest",
    "check_files",
    "require_intact",
    "schema_problems",
]
