"""Filter: keep the items a predicate accepts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from operators.base import Group, Operator


class Filter(Operator):
    """Keep the items for which ``predicate(item)`` is true, within every group.

    Example:
        >>> from operators import run_pipeline
        >>> run_pipeline([Filter(lambda r: r["n"] > 1)], [{"n": 1}, {"n": 2}])
        [{'n': 2}]
    """

    def __init__(self, predicate: Callable[[Any], bool]):
        if not callable(predicate):
            raise TypeError(f"Filter needs a function of the item, got {predicate!r}")
        self.predicate = predicate

    @property
    def row_step(self) -> tuple[bool, Callable[[Any], Any]]:  # type: ignore[override]
        return (False, self.predicate)

    def apply(self, groups: list[Group]) -> list[Group]:
        pred = self.predicate
        return [(key, [item for item in items if pred(item)]) for key, items in groups]

    def apply_one(self, items: list[Any]) -> list[Any]:
        pred = self.predicate
        return [item for item in items if pred(item)]
