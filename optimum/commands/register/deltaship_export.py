"""`optimum-cli export deltaship`: deltaship's export through optimum's command registration.

optimum-cli imports every module of the PEP 420 namespace `optimum.commands.register` (no `__init__.py` here)
and registers the commands in its `REGISTER_COMMANDS`. This module is imported on every `optimum-cli` start,
so it imports only optimum's command base classes; deltaship's options come from deltaship.cli (the same
function that builds `deltaship export`), and the export itself is imported when the command runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo
from optimum.commands.export.base import ExportCommand

if TYPE_CHECKING:
    from argparse import ArgumentParser


class DeltashipExportCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(
        name="deltaship",
        help="Export a Qwen3.5 hybrid model to an on-device deltaship bundle "
        "(ONNX, ExecuTorch .pte or Core ML), verified against transformers.",
    )

    @staticmethod
    def parse_args(parser: "ArgumentParser") -> None:
        from deltaship.cli import add_export_arguments

        add_export_arguments(parser, out_positional=True)  # optimum-cli's convention: `export <name> ... OUT`

    def run(self) -> None:
        import sys

        from deltaship.cli import run_export
        from deltaship.errors import DeltashipError

        try:
            run_export(self.args)
        except DeltashipError as e:
            print(f"optimum-cli export deltaship: error: {e.message}", file=sys.stderr)
            if e.fix:
                print(f"  fix: {e.fix}", file=sys.stderr)
            sys.exit(2)


REGISTER_COMMANDS = [(DeltashipExportCommand, ExportCommand)]
