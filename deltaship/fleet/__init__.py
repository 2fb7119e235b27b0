"""Fleets: a matrix of exports and profiles run across machines and attached devices, on Ray (docs/fleet.md).

`deltaship fleet run MATRIX --out DIR` is `fleet_run()`; Ray (the `fleet` extra) is imported only when a run starts.
"""

from __future__ import annotations

from deltaship.fleet.matrix import Matrix, load_matrix, parse_matrix
from deltaship.fleet.run import fleet_run

__all__ = ["fleet_run", "load_matrix", "parse_matrix", "Matrix"]
