"""Map: transform every item."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from operators.base import Group, Operator


class Map(Operator):
    """Replace every item by ``fn(item)``, within every group.

    Map after an aggregation reshapes feature rows (derive, rename, drop fields); Map on events
    turns them into rows.

    Example:
        >>> from operators import run_pipeline
        >>> run_pipeline([Map(lambda r: {"total": r["a"] + r["b"]})], [{"a": 1, "b": 2}])
        [{'total': 3}]
    """

    def __init__(self, fn: Callable[[Any], Any]):
        if not callable(fn):
            raise TypeError(f"Map needs a function of the item, got {fn!r}")
        self.fn = fn

    @property
    def row_step(self) -> tuple[bool, Callable[[Any], Any]]:  # type: ignore[override]
        return (True, self.fn)

    def apply(self, groups: list[Group]) -> list[Group]:
        fn = self.fn
        return [(key, [fn(item) for item in items]) for key, items in groups]

    def apply_one(self, items: list[Any]) -> list[Any]:
        fn = self.fn
        return [fn(item) for item in items]
