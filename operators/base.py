"""What every operator shares: the data a pipeline passes along and how fields are read.

A pipeline passes a list of *groups*. A group is ``(key, items)``: ``key`` is a dict of the fields
that define it (empty at the start, filled by :class:`~operators.KeyBy` and
:class:`~operators.TimeWindow`) and ``items`` are events or rows (dicts). Every operator maps groups
to groups, so operators compose in any order and none knows which runner executes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Literal

Group = tuple[dict[str, Any], list[Any]]
#: A field is named (an event attribute, a key of ``Event.contents`` or of a row) or computed.
FieldSpec = str | Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class ElementStep:
    """An element-wise operator lowered once: the one plan every runner reads for a :class:`~operators.Map`
    (``kind="map"``: an item becomes ``fn(item)``) or a :class:`~operators.Filter` (``kind="filter"``: an item
    stays when ``fn(item)`` is true).

    Nothing else interprets a Map or a Filter: a trigger task's compiled pipeline (:func:`compile_pipeline`,
    ``Aggregate.fold_rows``), a stream task's generated steps before and after its keyed step
    (``streamflow.windowing``, which the Flink runner's operators call too), the columnar runner
    (``streamflow.columnar.run_row_steps``) and :meth:`over` (the groups of :func:`run_pipeline`) all take these.

    Example:
        >>> from operators import Filter, Map
        >>> Map(abs).element_step.over([-1, 2]), Filter(bool).element_step.over([0, 3])
        ([1, 2], [3])
        >>> element_steps([Filter(bool), Map(abs)]) == (ElementStep("filter", bool), ElementStep("map", abs))
        True
    """

    kind: Literal["map", "filter"]
    fn: Callable[[Any], Any]

    def __post_init__(self) -> None:
        if self.kind not in ("map", "filter"):
            raise ValueError(f"an element step is a 'map' or a 'filter', got {self.kind!r}")
        if not callable(self.fn):
            raise TypeError(f"{self.label} needs a function of the item, got {self.fn!r}")

    @property
    def maps(self) -> bool:
        """True for a map, False for a filter."""
        return self.kind == "map"

    @property
    def label(self) -> str:
        """The operator's name in messages: ``Map`` or ``Filter``."""
        return "Map" if self.kind == "map" else "Filter"

    def over(self, items: list[Any]) -> list[Any]:
        """The step over a list of items: each mapped, or those the predicate keeps, in order."""
        fn = self.fn
        if self.kind == "map":
            return [fn(item) for item in items]
        return [item for item in items if fn(item)]


def element_steps(operators: Iterable[Operator]) -> tuple[ElementStep, ...]:
    """The :class:`ElementStep` of each operator, or ``TypeError`` naming one that is not element-wise.

    Example:
        >>> from operators import Aggregate, Count, Map
        >>> [step.kind for step in element_steps([Map(abs)])]
        ['map']
        >>> element_steps([Aggregate(n=Count())])
        Traceback (most recent call last):
        ...
        TypeError: Aggregate(aggregations={'n': Count()}) is not an element-wise step (Filter or Map)
    """
    steps = []
    for op in operators:
        step = getattr(op, "element_step", None)
        if step is None:
            raise TypeError(f"{op!r} is not an element-wise step (Filter or Map)")
        steps.append(step)
    return tuple(steps)


class Operator:
    """Base class: an operator turns the groups of a pipeline into new groups."""

    #: Whether it keeps state from one run of its pipeline to the next (device checkpoints do not cover it).
    keeps_state: bool = False

    def apply(self, groups: list[Group]) -> list[Group]:
        raise NotImplementedError

    #: ``apply_one(items) -> items``: what ``apply`` makes of the one keyless group ``({}, items)``, for
    #: operators that keep such a group keyless (Filter, Map, Aggregate); ``None`` for the others.
    apply_one: Callable[[list[Any]], list[Any]] | None = None
    #: ``fold_one(items) -> row``: an operator that makes one row of the one keyless group (Aggregate).
    fold_one: Callable[[list[Any]], Any] | None = None
    #: The operator lowered to its :class:`ElementStep` when it maps or filters items one by one (Map,
    #: Filter: :class:`ElementOperator`), what every runner reads of it; ``None`` for the others.
    element_step: ElementStep | None = None

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


class ElementOperator(Operator):
    """An operator that maps or filters items one by one (Map, Filter), lowered once, when it is made, to its
    :attr:`element_step`; what it does to groups is that step's.

    Example:
        >>> from operators import Filter
        >>> Filter(lambda n: n > 1).apply([({"k": 1}, [1, 2])])
        [({'k': 1}, [2])]
    """

    element_step: ElementStep

    def apply(self, groups: list[Group]) -> list[Group]:
        over = self.element_step.over
        return [(key, over(items)) for key, items in groups]

    @property
    def apply_one(self) -> Callable[[list[Any]], list[Any]]:  # type: ignore[override]
        """What :meth:`apply` makes of the one keyless group's items: the step over them."""
        return self.element_step.over


def get_field(item: Any, name: str) -> Any:
    """Read field ``name`` of an item: a row (dict key) or an event (attribute or ``contents`` key).

    Items are read with ``item[name]``: rows are mappings and events support item access.
    """
    try:
        return item[name]
    except KeyError:
        if isinstance(item, Mapping):
            raise KeyError(f"row has no field {name!r} (fields: {', '.join(map(str, item))})") from None
        raise


def field_reader(spec: FieldSpec) -> Callable[[Any], Any]:
    """A one-argument function reading ``spec`` from an item (``item[spec]`` for a name)."""
    if callable(spec):
        return spec
    if isinstance(spec, str) and spec:
        return itemgetter(spec)
    raise TypeError(f"a field is a non-empty name or a function of the item, got {spec!r}")


def field_name(spec: FieldSpec, default: str) -> str:
    """The column name a field spec produces: its own name, or ``default`` for a function."""
    return spec if isinstance(spec, str) else default


def run_pipeline(operators: Sequence[Operator], items: Iterable[Any]) -> list[dict[str, Any]]:
    """Run ``operators`` over ``items`` and return the resulting rows.

    Group keys are merged into the rows, so a row of a keyed, windowed aggregation carries its key
    and window bounds (a row without a group key is returned as the pipeline made it, not copied).
    The pipeline must end in rows (dicts): end it with an aggregation or a :class:`~operators.Map`
    that returns dicts.

    Example:
        >>> from operators import Aggregate, Count, KeyBy
        >>> run_pipeline([KeyBy("kind"), Aggregate(n=Count())], [{"kind": "a"}, {"kind": "b"}, {"kind": "a"}])
        [{'kind': 'a', 'n': 2}, {'kind': 'b', 'n': 1}]
    """
    groups: list[Group] = [({}, items if type(items) is list else list(items))]
    for op in operators:
        groups = op.apply(groups)
    if len(groups) == 1 and not groups[0][0]:  # no group key (the usual single group): rows as they are
        rows = groups[0][1]
        for item in rows:
            if type(item) is not dict and not isinstance(item, Mapping):
                _not_a_row(item)
        return list(rows)  # never the caller's own list (a pipeline without operators passes it through)
    rows = []
    for key, group_items in groups:
        for item in group_items:
            if type(item) is not dict and not isinstance(item, Mapping):
                _not_a_row(item)
            rows.append({**key, **item} if key else item)
    return rows


def compile_pipeline(operators: Sequence[Operator]) -> Callable[[list[Any]], list[dict[str, Any]]]:
    """A function of ``items`` giving what ``run_pipeline(operators, items)`` gives, faster when every
    operator keeps the one keyless group keyless (``apply_one``: Filter, Map, Aggregate): a chain of those
    calls, without building groups. A task's pipeline is compiled once and run at every firing.

    Example:
        >>> from operators import Aggregate, Count, Map
        >>> run = compile_pipeline([Aggregate(n=Count()), Map(lambda r: {"twice": 2 * r["n"]})])
        >>> run([{"a": 1}, {"a": 2}])
        [{'twice': 4}]
    """
    ops = list(operators)
    fold_one = getattr(ops[0], "fold_one", None) if ops else None
    if fold_one is not None and all(getattr(op, "element_step", None) is not None for op in ops[1:]):
        steps = element_steps(ops[1:])
        fold_rows = getattr(ops[0], "fold_rows", None)  # the fold and the steps as one function (Aggregate)
        return fold_rows(steps) if fold_rows is not None else _one_row(fold_one, steps)
    calls = [op.apply_one for op in ops]
    if any(call is None for call in calls):
        return lambda items: run_pipeline(ops, items)
    chain = [call for call in calls if call is not None]

    def run(items: list[Any]) -> list[dict[str, Any]]:
        rows = items if type(items) is list else list(items)
        for call in chain:
            rows = call(rows)
        for row in rows:
            if type(row) is not dict and not isinstance(row, Mapping):
                _not_a_row(row)
        return rows if rows is not items else list(rows)

    return run


def _one_row(fold: Callable[[list[Any]], Any], steps: Sequence[ElementStep]
             ) -> Callable[[list[Any]], list[dict[str, Any]]]:
    """An aggregation (one row from the items) then element steps (maps and filters)."""
    if len(steps) == 1 and steps[0].maps:
        fn = steps[0].fn

        def fold_map(items: list[Any]) -> list[dict[str, Any]]:
            row = fn(fold(items if type(items) is list else list(items)))
            if type(row) is not dict and not isinstance(row, Mapping):
                _not_a_row(row)
            return [row]

        return fold_map

    plan = [(step.maps, step.fn) for step in steps]

    def run(items: list[Any]) -> list[dict[str, Any]]:
        row = fold(items if type(items) is list else list(items))
        for maps, fn in plan:
            if maps:
                row = fn(row)
            elif not fn(row):
                return []
        if type(row) is not dict and not isinstance(row, Mapping):
            _not_a_row(row)
        return [row]

    return run


def _not_a_row(item: Any) -> None:
    raise TypeError(f"the pipeline must end in rows (dicts), but it produced {item!r}; "
                    "end it with Aggregate(...) or a Map that returns a dict")


#: The attributes of an app event (``streamflow.events.Event``, defined there; operators read them without
#: importing streamflow, which sits above them).
EVENT_ATTRIBUTES = frozenset(("user_id", "event_id", "page_id", "ts", "contents"))

#: The file name of every generated function's code (:func:`generated`): a failure's traceback skips its
#: frames, as it skips the runner's, so that it starts in the user's function.
GENERATED_CODE = "<generated by streamflow>"


def generated(name: str, lines: list[str], namespace: dict[str, Any]) -> Callable[..., Any]:
    """The function ``name`` that the source ``lines`` define, with ``namespace`` as its globals.

    The source must hold only indices, operators' own names and ``repr()``'d values, never text from input.

    Example:
        >>> generated("twice", ["def twice(x):", "    return f(x) * 2"], {"f": abs})(-3)
        6
    """
    exec(compile("\n".join(lines), GENERATED_CODE, "exec"), namespace)
    function: Callable[..., Any] = namespace[name]
    return function
