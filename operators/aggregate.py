"""Aggregate: fold every group into one feature row."""

from __future__ import annotations

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
        rows = []
        folds = self._folds
        for key, items in groups:
            row = dict(key)
            try:
                for name, fold in folds:
                    row[name] = fold(items)
            except Exception as exc:
                exc.add_note(f"in Aggregate({name}={self.aggregations[name]!r}) over {len(items)} items")
                raise
            rows.append(row)
        return [({}, rows)]
