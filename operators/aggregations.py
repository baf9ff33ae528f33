"""Aggregation functions, shaped like Flink's ``AggregateFunction``.

Each has ``create() -> acc``, ``add(acc, item) -> acc``, ``merge(a, b) -> acc`` and
``result(acc)``, so the same object folds a triggered sequence on the device and a Flink window in
the cloud. ``where=`` restricts an aggregation to the items a predicate accepts.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

from operators.base import FieldSpec, field_reader


class Aggregation:
    """Base class. Subclasses define ``create``, ``add``, ``merge`` and ``result``."""

    needs_field = True
    #: Set (to ``field``) where the items are known to be events, so that a generated fold may read the field
    #: inline (``streamflow.execution``; :func:`operators.aggregate._generated_fold`).
    _event_field: str | None = None

    def __init__(self, field: FieldSpec | None = None, where: Callable[[Any], bool] | None = None):
        if field is None and self.needs_field:
            raise TypeError(f"{type(self).__name__} needs the field to aggregate, e.g. {type(self).__name__}('ts')")
        if where is not None and not callable(where):
            raise TypeError(f"where= must be a function of the item, got {where!r}")
        self.field = field
        self.where = where
        self._read: Callable[[Any], Any] = field_reader(field) if field is not None else _no_field
        if where is None:
            self.fold = self._fold  # type: ignore[method-assign]  # skip the filtering layer on the hot path

    def create(self) -> Any:
        raise NotImplementedError

    def add(self, acc: Any, item: Any) -> Any:
        raise NotImplementedError

    def merge(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def result(self, acc: Any) -> Any:
        return acc

    def check(self, item: Any) -> None:
        """Raise what ``add`` raises for ``item`` whatever the accumulator holds (a missing field, a value of the
        wrong kind): a stream task checks each event once, before any window takes it. By default ``add`` to a
        new accumulator; the built-in aggregations only read (and check) the value."""
        self.add(self.create(), item)

    def fold(self, items: list[Any]) -> Any:
        """The result over ``items`` (honouring ``where``): what ``create``/``add``/``result`` give."""
        if self.where is not None:
            items = [item for item in items if self.where(item)]
        return self._fold(items)

    def _fold(self, items: list[Any]) -> Any:
        # Subclasses replace this with the same result computed by builtins over the whole list,
        # which is several times faster than one ``add`` call per item.
        acc = self.create()
        for item in items:
            acc = self.add(acc, item)
        return self.result(acc)

    def __repr__(self) -> str:
        parts = [repr(self.field)] if self.field is not None else []
        if self.where is not None:
            parts.append("where=...")
        return f"{type(self).__name__}({', '.join(parts)})"


def _no_field(item: Any) -> Any:
    """The reader of an aggregation without a field (``Count()``), which reads none."""
    raise TypeError("this aggregation reads no field")


def _read_check(self: Aggregation, item: Any) -> None:
    """``check`` of an aggregation whose ``add`` fails only where reading the value does."""
    self._read(item)


def _hash_check(self: Aggregation, item: Any) -> None:
    """``check`` of an aggregation that keys a dict by the value: it must be hashable."""
    hash(self._read(item))


def checked_field(check: Callable[[Any], None]) -> tuple[str, bool] | None:
    """``(field name, hashed)`` when ``check`` (an aggregation's bound ``check``) only reads a named field,
    and hashes it when ``hashed``: a runner may read it inline. ``None`` for any other check.

    Example:
        >>> checked_field(Max("ts").check), checked_field(Distinct("item_id").check), checked_field(Count().check)
        (('ts', False), ('item_id', True), None)
    """
    function, owner = getattr(check, "__func__", None), getattr(check, "__self__", None)
    field = getattr(owner, "field", None)
    if function in (_read_check, _hash_check) and isinstance(field, str) and field:
        return field, function is _hash_check
    return None


class Count(Aggregation):
    """Number of items. ``Count(where=lambda e: e.event_id == "buy")`` counts buys."""

    needs_field = False

    def __init__(self, where: Callable[[Any], bool] | None = None):
        super().__init__(None, where)

    def create(self) -> int:
        return 0

    def add(self, acc: int, item: Any) -> int:
        return acc + 1

    def check(self, item: Any) -> None:
        pass

    def merge(self, a: int, b: int) -> int:
        return a + b

    def _fold(self, items: list[Any]) -> int:
        return len(items)


class Sum(Aggregation):
    """Sum of a numeric field (0 over no items), exact: integers add as integers, and once a float is
    among the values the sum is the correctly rounded sum of all of them (as ``math.fsum``), kept as
    Shewchuk's partials (:class:`FloatSum`). So the result does not depend on the order the values
    came in or on how they were split before a ``merge``: a sliding window that merges its slices, a
    late event, either runner, all give the same float.

    Example:
        >>> total = Sum("v")
        >>> acc = total.create()
        >>> for v in [0.1, 0.2, 0.3]:
        ...     acc = total.add(acc, {"v": v})
        >>> total.result(acc), 0.1 + 0.2 + 0.3
        (0.6, 0.6000000000000001)
    """

    def create(self) -> int:
        return 0

    def add(self, acc: Any, item: Any) -> Any:
        value = self._read(item)
        if type(acc) is int and type(value) is int:
            return acc + value
        return (acc if type(acc) is FloatSum else FloatSum(acc)).add(value)  # an accumulator may change in place

    def merge(self, a: Any, b: Any) -> Any:
        if type(a) is int and type(b) is int:
            return a + b
        return FloatSum.of(a).merge(b)

    def result(self, acc: Any) -> Any:
        return acc.value() if type(acc) is FloatSum else acc

    def check(self, item: Any) -> None:
        value = self._read(item)
        if type(value) is not int:
            FloatSum.check(value)

    def _fold(self, items: list[Any]) -> Any:
        values = list(map(self._read, items))
        if all(type(value) is int for value in values):
            return sum(values)
        acc = FloatSum(0.0)
        for value in values:
            acc.add(value)
        return acc.value()


class FloatSum:
    """An exact running sum of floats: non-overlapping partials whose sum is exact (Shewchuk, as
    ``math.fsum`` keeps them); infinities and NaN add up separately, as IEEE arithmetic would.

    Example:
        >>> acc = FloatSum(1e16)
        >>> acc.add(1.0).add(-1e16).value()
        1.0
    """

    __slots__ = ("partials", "special")

    def __init__(self, start: float = 0.0):
        self.partials: list[float] = []
        self.special = 0.0  # the sum of the non-finite values
        self.add(start)

    @classmethod
    def of(cls, acc: Any) -> FloatSum:
        """``acc`` (an int or a FloatSum) as a FloatSum of its own (``acc`` itself is not changed)."""
        if type(acc) is FloatSum:
            copy = cls.__new__(cls)
            copy.partials, copy.special = list(acc.partials), acc.special
            return copy
        return cls(acc)

    @staticmethod
    def check(value: Any) -> None:
        """Raise ``TypeError`` unless ``value`` is a real number."""
        if not isinstance(value, numbers.Real):
            raise TypeError(f"Sum adds numbers, got {value!r} ({type(value).__name__})")

    def add(self, value: Any) -> FloatSum:
        self.check(value)
        x = float(value)
        if not math.isfinite(x):
            self.special += x
            return self
        partials, i = self.partials, 0
        for y in partials:
            if abs(x) < abs(y):
                x, y = y, x
            high = x + y
            low = y - (high - x)
            if low:
                partials[i] = low
                i += 1
            x = high
        partials[i:] = [x]
        return self

    def merge(self, other: Any) -> FloatSum:
        if type(other) is FloatSum:
            for partial in other.partials:
                self.add(partial)
            self.special += other.special
            return self
        return self.add(other)

    def value(self) -> float:
        return self.special + math.fsum(self.partials) if self.special else math.fsum(self.partials)

    def __eq__(self, other: object) -> bool:
        return type(other) is FloatSum and self.value() == other.value()

    def __repr__(self) -> str:
        return f"FloatSum({self.value()!r})"


class Min(Aggregation):
    """Smallest value of a field (``None`` over no items)."""

    check = _read_check

    def create(self) -> Any:
        return None

    def add(self, acc: Any, item: Any) -> Any:
        value = self._read(item)
        return value if acc is None or value < acc else acc

    def merge(self, a: Any, b: Any) -> Any:
        return b if a is None else a if b is None else min(a, b)

    def _fold(self, items: list[Any]) -> Any:
        return min(map(self._read, items), default=None)


class Max(Aggregation):
    """Largest value of a field (``None`` over no items)."""

    check = _read_check

    def create(self) -> Any:
        return None

    def add(self, acc: Any, item: Any) -> Any:
        value = self._read(item)
        return value if acc is None or value > acc else acc

    def merge(self, a: Any, b: Any) -> Any:
        return b if a is None else a if b is None else max(a, b)

    def _fold(self, items: list[Any]) -> Any:
        return max(map(self._read, items), default=None)


class First(Aggregation):
    """Value of a field on the first item (``None`` over no items)."""

    check = _read_check

    def create(self) -> tuple[bool, Any]:
        return (False, None)

    def add(self, acc: tuple[bool, Any], item: Any) -> tuple[bool, Any]:
        return acc if acc[0] else (True, self._read(item))

    def merge(self, a: tuple[bool, Any], b: tuple[bool, Any]) -> tuple[bool, Any]:
        return a if a[0] else b

    def _fold(self, items: list[Any]) -> Any:
        return self._read(items[0]) if items else None

    def result(self, acc: tuple[bool, Any]) -> Any:
        return acc[1]


class Last(Aggregation):
    """Value of a field on the last item (``None`` over no items)."""

    check = _read_check

    def create(self) -> tuple[bool, Any]:
        return (False, None)

    def add(self, acc: tuple[bool, Any], item: Any) -> tuple[bool, Any]:
        return (True, self._read(item))

    def merge(self, a: tuple[bool, Any], b: tuple[bool, Any]) -> tuple[bool, Any]:
        return b if b[0] else a

    def _fold(self, items: list[Any]) -> Any:
        return self._read(items[-1]) if items else None

    def result(self, acc: tuple[bool, Any]) -> Any:
        return acc[1]


class LastN(Aggregation):
    """The last ``n`` values of a field, oldest first."""

    check = _read_check

    def __init__(self, field: FieldSpec, n: int, where: Callable[[Any], bool] | None = None):
        if n < 1:
            raise ValueError(f"LastN needs n >= 1, got {n}")
        super().__init__(field, where)
        self.n = n

    def create(self) -> list[Any]:
        return []

    def add(self, acc: list[Any], item: Any) -> list[Any]:
        acc.append(self._read(item))
        if len(acc) > self.n:
            del acc[0]
        return acc

    def merge(self, a: list[Any], b: list[Any]) -> list[Any]:
        return (a + b)[-self.n:]

    def _fold(self, items: list[Any]) -> list[Any]:
        return list(map(self._read, items[-self.n:]))

    def result(self, acc: list[Any]) -> list[Any]:
        return list(acc)


class _DistinctValues(Aggregation):
    """What :class:`Distinct` and :class:`CountDistinct` share: the distinct values in first-seen order (a dict's
    keys); each gives its own result of them."""

    check = _hash_check

    def create(self) -> dict[Any, None]:
        return {}

    def add(self, acc: dict[Any, None], item: Any) -> dict[Any, None]:
        acc[self._read(item)] = None
        return acc

    def merge(self, a: dict[Any, None], b: dict[Any, None]) -> dict[Any, None]:
        return {**a, **b}

    def _fold(self, items: list[Any]) -> Any:
        return self.result(dict.fromkeys(map(self._read, items)))


class Distinct(_DistinctValues):
    """The distinct values of a field, in first-seen order."""

    def result(self, acc: dict[Any, None]) -> list[Any]:
        return list(acc)


class CountBy(Aggregation):
    """How many items have each value of a field: ``{value: count}`` in first-seen order.

    One pass instead of one ``Count(where=...)`` per value: ``CountBy("event_id")`` over a page
    visit gives ``{"page_enter": 1, "fav": 2, "page_exit": 1}``.
    """

    check = _hash_check

    def create(self) -> dict[Any, int]:
        return {}

    def add(self, acc: dict[Any, int], item: Any) -> dict[Any, int]:
        value = self._read(item)
        acc[value] = acc.get(value, 0) + 1
        return acc

    def merge(self, a: dict[Any, int], b: dict[Any, int]) -> dict[Any, int]:
        merged = dict(a)
        for value, n in b.items():
            merged[value] = merged.get(value, 0) + n
        return merged

    def result(self, acc: dict[Any, int]) -> dict[Any, int]:
        return dict(acc)

    def _fold(self, items: list[Any]) -> dict[Any, int]:
        counts: dict[Any, int] = {}
        get = counts.get
        for value in map(self._read, items):
            counts[value] = get(value, 0) + 1
        return counts


class CountDistinct(_DistinctValues):
    """Number of distinct values of a field."""

    def result(self, acc: dict[Any, None]) -> int:
        return len(acc)
