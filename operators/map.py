"""Map: transform every item."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from operators.base import ElementOperator, ElementStep


class Map(ElementOperator):
    """Replace every item by ``fn(item)``, within every group.

    Map after an aggregation reshapes feature rows (derive, rename, drop fields); Map on events
    turns them into rows. It is lowered once to its :attr:`element_step` (``ElementStep("map", fn)``),
    which every runner executes.

    Example:
        >>> from operators import run_pipeline
        >>> run_pipeline([Map(lambda r: {"total": r["a"] + r["b"]})], [{"a": 1, "b": 2}])
        [{'total': 3}]
    """

    def __init__(self, fn: Callable[[Any], Any]):
        if not callable(fn):
            raise TypeError(f"Map needs a function of the item, got {fn!r}")
        self.fn = fn
        self.element_step = ElementStep("map", fn)

    def __repr__(self) -> str:
        return f"Map(fn={self.fn!r})"
