"""Aggregate: fold every group into one feature row."""

from __future__ import annotations

from typing import Any

from operators.aggregations import Aggregation
from operators.base import Group, Operator


class Aggregate(Operator):
    """Fold each group into one row: the group key plus one column per named aggregation.

    After Aggregate the pipeline carries rows, so Filter and Map can post-process features.

    Example:
        >>> from operators import Count, KeyBy, Max, run_pipeline
        >>> run_pipeline([KeyBy("user"), Aggregate(n=Count(), last_ts=Max("ts"))],
        ...              [{"user": "a", "ts": 1}, {"user": "a", "ts": 5}])
        [{'user': 'a', 'n': 2, 'last_ts': 5}]
    """

    def __init__(self, **aggregations: Aggregation):
        if not aggregations:
            raise ValueError("Aggregate needs at least one named aggregation, e.g. Aggregate(n=Count())")
        for name, agg in aggregations.items():
            if not isinstance(agg, Aggregation):
                raise TypeError(f"Aggregate({name}=...) needs an aggregation such as Count(), got {agg!r}")
        self.aggregations = aggregations
        self._folds = tuple((name, agg.fold) for name, agg in aggregations.items())  # the per-group loop

    def apply(self, groups: list[Group]) -> list[Group]:
        fold = self.fold
        return [({}, [fold(items, dict(key)) for key, items in groups])]

    def apply_one(self, items: list[Any]) -> list[Any]:
        return [self.fold(items, {})]

    def fold_one(self, items: list[Any]) -> dict[str, Any]:
        return self.fold(items, {})

    def fold(self, items: list[Any], row: dict[str, Any]) -> dict[str, Any]:
        """``row`` with one column per aggregation over ``items``."""
        try:
            for name, fold in self._folds:
                row[name] = fold(items)
        except Exception as exc:
            exc.add_note(f"in Aggregate({name}={self.aggregations[name]!r}) over {len(items)} items")
            raise
        return row
