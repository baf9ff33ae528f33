"""Filter: keep the items a predicate accepts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from operators.base import ElementOperator, ElementStep


class Filter(ElementOperator):
    """Keep the items for which ``predicate(item)`` is true, within every group.

    It is lowered once to its :attr:`element_step` (``ElementStep("filter", predicate)``), which every
    runner executes.

    Example:
        >>> from operators import run_pipeline
        >>> run_pipeline([Filter(lambda r: r["n"] > 1)], [{"n": 1}, {"n": 2}])
        [{'n': 2}]
    """

    def __init__(self, predicate: Callable[[Any], bool]):
        if not callable(predicate):
            raise TypeError(f"Filter needs a function of the item, got {predicate!r}")
        self.predicate = predicate
        self.element_step = ElementStep("filter", predicate)

    def __repr__(self) -> str:
        return f"Filter(predicate={self.predicate!r})"
