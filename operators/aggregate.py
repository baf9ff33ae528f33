"""Aggregate: fold every group into one feature row."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from operators.aggregations import Aggregation, Count, First, Last, Max, Min
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

    @property
    def fold_one(self) -> Callable[[list[Any]], dict[str, Any]]:  # type: ignore[override]
        """``items -> row``: :meth:`fold` of a new row as one generated function (see :func:`_generated_fold`)."""
        return _generated_fold(self)

    def fold(self, items: list[Any], row: dict[str, Any]) -> dict[str, Any]:
        """``row`` with one column per aggregation over ``items``."""
        try:
            for name, fold in self._folds:
                row[name] = fold(items)
        except Exception as exc:
            exc.add_note(f"in Aggregate({name}={self.aggregations[name]!r}) over {len(items)} items")
            raise
        return row


# Aggregations a generated fold computes inline, as their own _fold does (exact classes, no where=).
_INLINE = {
    First: "{read}(items[0]) if items else None",
    Last: "{read}(items[-1]) if items else None",
    Count: "len(items)",
    Min: "min(map({read}, items), default=None)",
    Max: "max(map({read}, items), default=None)",
}


def _generated_fold(aggregate: Aggregate) -> Callable[[list[Any]], dict[str, Any]]:
    """``items -> row``, what ``aggregate.fold(items, {})`` gives (the same values, the same exception with
    the same note), as one generated function: the builtin aggregations inline with the readers they
    have now, the others through their own ``fold``. It saves a call or two per aggregation per firing.

    Example:
        >>> from operators import Count, First, Last
        >>> fold = Aggregate(a=First("x"), b=Last("x"), n=Count()).fold_one
        >>> fold([{"x": 1}, {"x": 2}]), fold([])
        ({'a': 1, 'b': 2, 'n': 2}, {'a': None, 'b': None, 'n': 0})
    """
    names = list(aggregate.aggregations)
    namespace: dict[str, Any] = {"names": names, "aggregations": aggregate.aggregations}
    lines = ["def fold(items):", "    row = {}", "    k = 0", "    try:"]
    for k, (name, agg) in enumerate(aggregate.aggregations.items()):
        template = _INLINE.get(type(agg)) if agg.where is None else None
        if template is not None and "{read}" in template and not callable(getattr(agg, "_read", None)):
            template = None
        if template is None:
            namespace[f"f{k}"] = agg.fold
            expression = f"f{k}(items)"
        else:
            namespace[f"r{k}"] = getattr(agg, "_read", None)
            expression = template.format(read=f"r{k}")
        lines += [f"        k = {k}", f"        row[{name!r}] = {expression}"]
    lines += ["    except Exception as exc:",
              "        name = names[k]",
              "        exc.add_note(f'in Aggregate({name}={aggregations[name]!r}) over {len(items)} items')",
              "        raise",
              "    return row"]
    exec("\n".join(lines), namespace)  # the source holds only repr()'d names and indices
    return namespace["fold"]
