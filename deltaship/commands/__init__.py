"""The commands layer: one public function per `deltaship` subcommand, with the CLI's keyword arguments.

The CLI (deltaship/cli.py) parses flags and prints; the work is these functions, which are the Python
API too. Each imports its toolchain only when called.
"""

from __future__ import annotations

from deltaship.check.evaluate import evaluate
from deltaship.check.inspect import describe, inspect
from deltaship.commands.chat import chat
from deltaship.commands.generate import generate
from deltaship.commands.plan import plan
from deltaship.commands.serve import serve
from deltaship.compile import export
from deltaship.fleet import fleet_run
from deltaship.profiling.profile import profile

__all__ = ["export", "generate", "chat", "inspect", "describe", "plan", "profile", "evaluate", "serve", "fleet_run"]
