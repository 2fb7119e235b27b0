"""WeightPlan: how each tensor of the canonical model is made from checkpoint tensors.

Passes never touch weight values. They record recipes (a source tensor, a fix-up, a fusion of
several tensors, a computed constant); a lowering asks the plan for one tensor at a time, so
no full copy of the model is ever held. A fix-up applied twice to one tensor is an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from deltaship.models.weights import WeightSource

SPAN_GAP = 4096  # rows: a selection of source rows is read as spans split at gaps wider than this


class PlanError(ValueError):
    """A pass asked for something the plan cannot do (a bug in a pass, never user input)."""


@dataclass
class Recipe:
    """sources -> fix-ups (in order) -> one tensor. `concat` fuses several sources along axis 0."""

    sources: tuple[str, ...]
    shape: tuple[int, ...]
    fixups: list[tuple[str, Callable[[np.ndarray], np.ndarray]]] = field(default_factory=list)
    compute: Callable[[], np.ndarray] | None = None  # for constants made from the spec alone
    dtype: str = "model"  # "model": the export's float dtype; "float32": always fp32
    rows: np.ndarray | None = None  # a selection of rows of the (fixed-up) sources, in this order

    @property
    def row_local(self) -> bool:
        """Whether a range of rows can be produced from the same rows of one source."""
        return self.compute is None and len(self.sources) == 1 and not self.fixups and self.rows is None


class WeightPlan:
    def __init__(self) -> None:
        self.recipes: dict[str, Recipe] = {}

    def add_source(self, name: str, source: str, shape: tuple[int, ...], dtype: str = "model") -> None:
        self.recipes[name] = Recipe((source,), tuple(shape), dtype=dtype)

    def add_constant(
        self, name: str, fn: Callable[[], np.ndarray], shape: tuple[int, ...], dtype: str = "float32"
    ) -> None:
        self.recipes[name] = Recipe((), tuple(shape), compute=fn, dtype=dtype)

    def add_fixup(
        self,
        name: str,
        fixup: str,
        fn: Callable[[np.ndarray], np.ndarray],
        shape: tuple[int, ...] | None = None,
        dtype: str | None = None,
    ) -> None:
        r = self._get(name)
        if any(f == fixup for f, _ in r.fixups):
            raise PlanError(
                f"fix-up {fixup!r} is already applied to {name}; applying it twice would corrupt the weight"
            )
        r.fixups.append((fixup, fn))
        if shape is not None:
            r.shape = tuple(shape)
        if dtype is not None:
            r.dtype = dtype

    def rename(self, old: str, new: str) -> None:
        self.recipes[new] = self.recipes.pop(old)

    def fuse(self, names: list[str], new: str) -> None:
        """Concatenate several plain (fix-up free) tensors along axis 0 into one."""
        parts = [self._get(n) for n in names]
        if any(p.fixups or p.compute for p in parts):
            raise PlanError(f"cannot fuse {names}: only plain source tensors can be fused")
        rows = sum(p.shape[0] for p in parts)
        self.recipes[new] = Recipe(
            tuple(s for p in parts for s in p.sources), (rows, *parts[0].shape[1:]), dtype=parts[0].dtype
        )
        for n in names:
            del self.recipes[n]

    def select_rows(self, name: str, parts: dict[str, np.ndarray]) -> None:
        """Replace `name` by several tensors, each a selection of its rows (e.g. q and gate rows of q_proj)."""
        for new, idx in parts.items():
            self.take_rows(new, name, idx)
        del self.recipes[name]

    def take_rows(self, new: str, name: str, idx: np.ndarray) -> None:
        """A new tensor `new` made of rows `idx` of `name`, which stays (e.g. the reduced-vocabulary draft head: some
        rows of the LM head). Fix-ups added to `name` later do not reach `new`."""
        r = self._get(name)
        if r.compute is not None or r.rows is not None:
            raise PlanError(f"cannot select rows of {name}: only source tensors can be selected by rows")
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= r.shape[0]):
            raise PlanError(f"rows of {name} out of range 0 .. {r.shape[0] - 1}")
        self.recipes[new] = Recipe(r.sources, (len(idx), *r.shape[1:]), list(r.fixups), dtype=r.dtype, rows=idx)

    def alias(self, name: str, target: str) -> None:
        """`name` is the very same tensor as `target` (tied embeddings)."""
        self.recipes[name] = self._get(target)

    def aliases(self, name: str) -> list[str]:
        """Every name under which the same tensor is known (tied weights), `name` included."""
        r = self._get(name)
        return [n for n, other in self.recipes.items() if other is r]

    def _get(self, name: str) -> Recipe:
        if name not in self.recipes:
            raise PlanError(f"no tensor {name!r} in the weight plan")
        return self.recipes[name]

    def names(self) -> list[str]:
        return list(self.recipes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._get(name).shape

    def tensor(self, name: str, weights: WeightSource, rows: slice | None = None) -> np.ndarray:
        """Materialise one tensor (float32), or a range of its rows when the recipe allows it."""
        r = self._get(name)
        if r.compute is not None:
            out = np.asarray(r.compute(), dtype=np.float32)
            return out[rows] if rows is not None else out
        if rows is not None and r.row_local:
            return weights.read(r.sources[0], rows)
        if rows is not None and r.rows is not None and len(r.sources) == 1 and not r.fixups:
            # a block of a row selection (a draft head's rows of the LM head): read only the spans of source rows it
            # needs, split where ascending ids jump far (e.g. to the special ids at the end of the vocabulary)
            sel = r.rows[rows]
            if not sel.size:
                return np.zeros((0, *r.shape[1:]), np.float32)
            if np.any(np.diff(sel) < 0):
                lo = int(sel.min())
                part = weights.read(r.sources[0], slice(lo, int(sel.max()) + 1))
                return np.ascontiguousarray(part[sel - lo], dtype=np.float32)
            out = []
            for run in np.split(sel, np.flatnonzero(np.diff(sel) > SPAN_GAP) + 1):
                part = weights.read(r.sources[0], slice(int(run[0]), int(run[-1]) + 1))
                out.append(part[run - run[0]])
            return np.ascontiguousarray(np.concatenate(out), dtype=np.float32)
        arr = (
            weights.read(r.sources[0])
            if len(r.sources) == 1
            else np.concatenate([weights.read(s) for s in r.sources], axis=0)
        )
        for _, fn in r.fixups:
            arr = fn(arr)
        if r.rows is not None:
            arr = arr[r.rows]
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        return arr[rows] if rows is not None else arr
