"""Aggregate: fold every group into one feature row."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from operators.aggregations import Aggregation, Count, CountBy, First, Last, Max, Min, Sum
from operators.base import EVENT_ATTRIBUTES, ElementStep, Group, Operator, _not_a_row, generated


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

    def fold_rows(self, steps: Sequence[ElementStep]) -> Callable[[list[Any]], list[Any]]:
        """``items -> rows``: the one row of :attr:`fold_one` through ``steps`` (the
        :attr:`~operators.base.Operator.element_step` of the Filter and Map operators after it), as one generated
        function (see :func:`_generated_fold`)."""
        return _generated_fold(self, steps)

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
# The same, for a field read straight off an event (``_event_field``: an attribute of :class:`Event`).
_INLINE_ATTRIBUTE = {
    First: "items[0].{field} if items else None",
    Last: "items[-1].{field} if items else None",
    Min: "min([x.{field} for x in items], default=None)",
    Max: "max([x.{field} for x in items], default=None)",
}


def _fold_lines(aggregate: Aggregate, namespace: dict[str, Any]) -> list[str]:
    """The statements (inside the generated function's ``try``, 8 spaces in) that compute each aggregation of
    ``items`` into ``v0``, ``v1``, ... as its own ``_fold`` computes it; ``k`` names the one being computed."""
    lines: list[str] = []
    for k, agg in enumerate(aggregate.aggregations.values()):
        lines.append(f"        k = {k}")
        kind = type(agg) if agg.where is None else None
        event_field = getattr(agg, "_event_field", None)  # set where the items are known to be events
        if kind is not None and isinstance(event_field, str):
            if event_field in EVENT_ATTRIBUTES:
                if kind is CountBy:
                    lines += [f"        v{k} = c = {{}}", "        for x in items:", f"            v = x.{event_field}",
                              "            c[v] = c.get(v, 0) + 1"]
                    continue
                template = _INLINE_ATTRIBUTE.get(kind)
                if template is not None:
                    lines.append(f"        v{k} = {template.format(field=event_field)}")
                    continue
            elif kind is First or kind is Last:  # a contents key: what event_reader reads, inline
                index = 0 if kind is First else -1
                lines += ["        if items:", "            try:",
                          f"                v{k} = items[{index}].contents[{event_field!r}]",
                          "            except KeyError:",
                          f"                v{k} = items[{index}].field({event_field!r})",  # the KeyError naming it
                          "        else:", f"            v{k} = None"]
                continue
        template = _INLINE.get(kind) if kind is not None else None
        if template is not None and "{read}" in template and not callable(getattr(agg, "_read", None)):
            template = None
        if template is None:
            namespace[f"f{k}"] = agg.fold
            expression = f"f{k}(items)"
        else:
            namespace[f"r{k}"] = getattr(agg, "_read", None)
            expression = template.format(read=f"r{k}")
        lines.append(f"        v{k} = {expression}")
    return lines


def _generated_fold(aggregate: Aggregate, steps: Sequence[ElementStep] | None = None
                    ) -> Callable[[list[Any]], Any]:
    """``items -> row``, what ``aggregate.fold(items, {})`` gives (the same values, the same exception with
    the same note), as one generated function: the builtin aggregations inline with the readers they
    have now (a field read off an event, ``_event_field``, as plain attribute or ``contents`` access), the
    others through their own ``fold``. It saves a call or two per aggregation per firing.

    With ``steps`` (:class:`~operators.base.ElementStep`: maps and filters), ``items -> rows`` instead: the
    row through those steps, ``[row]`` or ``[]`` if a step dropped it (what
    :func:`~operators.base.compile_pipeline` gives for the Aggregate and those steps), in the same function.

    Example:
        >>> from operators import Count, First, Last
        >>> fold = Aggregate(a=First("x"), b=Last("x"), n=Count()).fold_one
        >>> fold([{"x": 1}, {"x": 2}]), fold([])
        ({'a': 1, 'b': 2, 'n': 2}, {'a': None, 'b': None, 'n': 0})
        >>> _generated_fold(Aggregate(n=Count()), [ElementStep("map", lambda r: {"m": r["n"] + 1}),
        ...                                        ElementStep("filter", bool)])([1, 2])
        [{'m': 3}]
    """
    names = list(aggregate.aggregations)
    namespace: dict[str, Any] = {"names": names, "aggregations": aggregate.aggregations, "Mapping": Mapping,
                                 "not_a_row": _not_a_row}
    lines = ["def fold(items):"]
    if steps is not None:
        lines.append("    items = items if type(items) is list else list(items)")
    lines += ["    k = 0", "    try:", *_fold_lines(aggregate, namespace),
              "    except Exception as exc:",
              "        name = names[k]",
              "        exc.add_note(f'in Aggregate({name}={aggregations[name]!r}) over {len(items)} items')",
              "        raise",
              "    row = {" + ", ".join(f"{name!r}: v{k}" for k, name in enumerate(names)) + "}"]
    if steps is None:
        lines.append("    return row")
    else:
        for i, step in enumerate(steps):
            namespace[f"s{i}"] = step.fn
            lines += [f"    row = s{i}(row)"] if step.maps else [f"    if not s{i}(row):", "        return []"]
        lines += ["    if type(row) is not dict and not isinstance(row, Mapping):", "        not_a_row(row)",
                  "    return [row]"]
    return generated("fold", lines, namespace)


class Accumulators:
    """The accumulators of named aggregations kept as one list (a window's, on every runner): ``create()``,
    ``add(accs, item)`` (in place; returns ``accs``), ``merge(a, b)`` (a new list) and ``results(accs)`` (the
    row's columns), each one generated function with every aggregation's step in turn: what calling each
    aggregation's own method gives (``where`` first for ``add``), with a ``Count``'s and the constant
    ``create`` values inline. Pickles as its aggregations (the functions are generated again).

    Example:
        >>> from operators import CountDistinct
        >>> accumulators = Accumulators({"n": Count(), "top": Max("v"), "kinds": CountDistinct("k")})
        >>> a = accumulators.add(accumulators.add(accumulators.create(), {"v": 3, "k": "x"}), {"v": 5, "k": "x"})
        >>> b = accumulators.add(accumulators.create(), {"v": 4, "k": "y"})
        >>> accumulators.results(a), accumulators.results(accumulators.merge(a, b))
        ({'n': 2, 'top': 5, 'kinds': 1}, {'n': 3, 'top': 5, 'kinds': 2})
    """

    def __init__(self, aggregations: Mapping[str, Aggregation]):
        self.aggregations = dict(aggregations)
        namespace: dict[str, Any] = {}
        create, add, merge, results = [], ["def add(accs, item):"], [], []
        for i, (name, agg) in enumerate(self.aggregations.items()):
            kind = type(agg)
            namespace.update({f"c{i}": agg.create, f"a{i}": agg.add, f"m{i}": agg.merge, f"r{i}": agg.result,
                              f"w{i}": agg.where})
            create.append(_CREATED.get(kind, f"c{i}()"))
            indent = "    "
            if agg.where is not None:
                add.append(f"    if w{i}(item):")
                indent += "    "
            add.append(f"{indent}accs[{i}] += 1" if kind is Count else f"{indent}accs[{i}] = a{i}(accs[{i}], item)")
            merge.append(f"a[{i}] + b[{i}]" if kind is Count else f"m{i}(a[{i}], b[{i}])")
            identity = kind.result is Aggregation.result
            results.append(f"{name!r}: {f'accs[{i}]' if identity else f'r{i}(accs[{i}])'}")
        lines = ["def create():", f"    return [{', '.join(create)}]", *add, "    return accs",
                 "def merge(a, b):", f"    return [{', '.join(merge)}]",
                 "def results(accs):", f"    return {{{', '.join(results)}}}"]
        generated("create", lines, namespace)
        self.create: Callable[[], list[Any]] = namespace["create"]
        self.add: Callable[[list[Any], Any], list[Any]] = namespace["add"]
        self.merge: Callable[[list[Any], list[Any]], list[Any]] = namespace["merge"]
        self.results: Callable[[list[Any]], dict[str, Any]] = namespace["results"]

    def __reduce__(self) -> tuple[Any, ...]:
        return Accumulators, (self.aggregations,)


#: ``create()`` of the aggregations whose new accumulator is an immutable constant, as source.
_CREATED = {Count: "0", Sum: "0", Min: "None", Max: "None", First: "(False, None)", Last: "(False, None)"}
