"""One op-lowering registry, shared by every target's lowering.

A target keeps one `OpLowerings` table: op (a torch op overload, aten or canonical) -> the function
that lowers it. ONNX and Core ML lower the captured graph node by node and look each node's target
up here; ExecuTorch lowers the canonical ops at module level and registers the kernel methods that
replace them. `missing()` is what the every-op-has-a-lowering test asks.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator


class OpLowerings:
    """op -> lowering function for one target."""

    def __init__(self, target: str):
        self.target = target
        self._fns: dict[Any, Callable] = {}

    def register(self, *ops: Any) -> Callable[[Callable], Callable]:
        """Decorator: `@LOWERINGS.register(aten.add.Tensor, aten.sub.Tensor)`."""

        def deco(fn: Callable) -> Callable:
            for op in ops:
                self.add(op, fn)
            return fn

        return deco

    def add(self, op: Any, fn: Callable) -> None:
        if op in self._fns:
            raise ValueError(f"{self.target}: {op} already has a lowering ({self._fns[op].__name__})")
        self._fns[op] = fn

    def include(self, other: "OpLowerings") -> "OpLowerings":
        """Add every lowering of `other` (a shared table, e.g. deltaship/lowering/aten.py GENERIC); returns self."""
        for op in other:
            self.add(op, other._fns[op])
        return self

    def get(self, op: Any) -> Callable | None:
        return self._fns.get(op)

    def pop(self, op: Any) -> Callable:
        return self._fns.pop(op)

    def missing(self, ops: Iterable[Any]) -> list[Any]:
        """The ops of `ops` this target cannot lower."""
        return [op for op in ops if op not in self._fns]

    def __contains__(self, op: Any) -> bool:
        return op in self._fns

    def __iter__(self) -> Iterator[Any]:
        return iter(self._fns)

    def __len__(self) -> int:
        return len(self._fns)
