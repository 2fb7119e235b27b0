"""What `deltaship profile` is asked to do, typed once: built from the CLI's parsed arguments or from `profile()`'s
keyword arguments (the same names), and read by the profile from there."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the CLI options whose names differ from the fields' (--no-breakdown is the negation of breakdown)
CLI_NAMES = {"tiers_file": "tiers", "json_out": "json", "ssh_options": "ssh_option"}


@dataclass(frozen=True)
class ProfileSettings:
    """One profile run's settings; each field is a `profile()` keyword argument and a `deltaship profile` option.

    device: host, ssh://user@host[:port] or adb:SERIAL. prompt_lengths, gen, contexts, warmups, reps, min_seconds:
    the workload (None: profile.DEFAULTS; the default contexts are clipped to the bundle's max context). threads:
    runtime threads (None: the tier's, else the runtime's). tier / tiers_file: run under a tier's limits.
    breakdown: the per-op breakdown where the target times ops. json_out ('-': stdout) / report: where the JSON
    records and the HTML report go. ssh_options / remote_deltaship: an ssh device. runner / runner_args: an adb
    device. provider / runtime: the host's execution provider and runtime. speculative ("mtp[:K]") / acceptance:
    profile speculative decoding instead (profiling/speculative/). image_sizes: a --vision bundle's image sizes.
    prepack_cache: an ONNX bundle's --prepack-cache directory (its entry built first, in a process of its own)."""

    device: str = "host"
    prompt_lengths: list[int] | None = None
    gen: int | None = None
    contexts: list[int] | None = None
    threads: int | None = None
    warmups: int | None = None
    reps: int | None = None
    min_seconds: float | None = None
    tier: str | None = None
    tiers_file: str | None = None
    breakdown: bool = True
    json_out: str | Path | None = None
    report: str | Path | None = None
    ssh_options: list[str] | None = None
    remote_deltaship: str = "deltaship"
    runner: str | None = None
    runner_args: str | None = None
    provider: str = "cpu"
    runtime: str | None = None
    speculative: str | None = None
    acceptance: float | None = None
    image_sizes: str | list[str] | None = None
    prepack_cache: str | Path | None = None

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> ProfileSettings:
        """The settings of `deltaship profile`'s parsed arguments."""
        values: dict[str, Any] = {
            f.name: getattr(a, CLI_NAMES.get(f.name, f.name)) for f in dataclasses.fields(cls) if f.name != "breakdown"
        }
        return cls(breakdown=not a.no_breakdown, **values)
