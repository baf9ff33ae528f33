"""Per-row Map and Filter functions run over whole columns (the device runner's batch mode).

A Map or Filter function is written for one row. In batch mode it is called once, with a
:class:`ColumnRow` whose values are :class:`Column` s: arithmetic and comparisons on them compute
every row at once, as ``torch.func.vmap`` runs a per-example function over a batch. What a column
cannot follow raises :class:`NotColumnar`, and the caller runs the rows the streaming way instead:
a branch on a value (``if``, ``and``, ``min``), a conversion (``int()``, ``str()``, an f-string,
``math.log``), a key some rows lack, a division where some divisor is 0 (a per-row error), integers
past 2**53 (where NumPy's int64 and float64 part ways with Python's int and float).

Example:
    >>> import numpy as np
    >>> row = ColumnRow({"a": Column(np.array([1, 2])), "b": Column(np.array([0.5, 4.0]))})
    >>> out = (lambda r: {"total": r["a"] + r["b"], "big": r["b"] > 1})(row)
    >>> out["total"].values.tolist(), out["big"].values.tolist()
    ([1.5, 6.0], [False, True])
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from operators.base import ElementStep

#: Magnitudes up to which int64 and float64 arithmetic give what Python's int and float give.
_EXACT = 2.0 ** 53


class NotColumnar(Exception):
    """The function does something per row that a column cannot stand for."""


def _refuse(what: str) -> Callable[..., Any]:
    def refuse(self: Any, *args: Any) -> Any:
        raise NotColumnar(f"{what} of a column")
    return refuse


class _Opaque:
    """What a column is not: a single value to branch on, convert, format, hash or iterate."""

    __bool__ = _refuse("truth value")
    __int__ = _refuse("int()")
    __float__ = _refuse("float()")
    __index__ = _refuse("index")
    __complex__ = _refuse("complex()")
    __round__ = _refuse("round()")
    __trunc__ = _refuse("trunc()")
    __floor__ = _refuse("floor()")
    __ceil__ = _refuse("ceil()")
    __str__ = _refuse("str()")
    __repr__ = _refuse("repr()")
    __format__ = _refuse("format()")
    __hash__ = _refuse("hash()")
    __iter__ = _refuse("iteration")
    __len__ = _refuse("len()")
    __contains__ = _refuse("'in'")
    __getitem__ = _refuse("indexing")
    __eq__ = _refuse("==")
    __ne__ = _refuse("!=")
    __lt__ = _refuse("<")
    __le__ = _refuse("<=")
    __gt__ = _refuse(">")
    __ge__ = _refuse(">=")


def _numeric(values: np.ndarray) -> np.ndarray:
    """``values`` as Python arithmetic sees them: a bool is the int 0 or 1."""
    if values.dtype.kind == "b":
        return values.astype(np.int64)
    return values


def _operand(value: Any) -> np.ndarray | int | float:
    if isinstance(value, Column):
        return _numeric(value.values)
    if type(value) in (int, float, bool):
        if type(value) is int and abs(value) > _EXACT:
            raise NotColumnar(f"integer {value} past 2**53")
        return int(value) if type(value) is bool else value
    raise NotColumnar(f"arithmetic between a column and {type(value).__name__}")


def _within_exact(values: np.ndarray) -> None:
    if values.size and not np.abs(values.astype(np.float64)).max() <= _EXACT:  # NaN, inf: not within either
        raise NotColumnar("integers past 2**53")


def _exact(result: np.ndarray) -> Column:
    """The column of an arithmetic result, if every value is what Python would have computed."""
    if result.dtype.kind == "i":
        _within_exact(result)
    return Column(result)


def _no_zero(divisor: np.ndarray | int | float) -> None:
    if np.any(np.asarray(divisor) == 0):
        raise NotColumnar("division by zero in some rows")


def _arithmetic(op: Callable[[Any, Any], np.ndarray], check: Callable[[Any, Any], None] | None = None,
                reflected: bool = False, may_grow: bool = True) -> Callable[[Column, Any], Column]:
    def method(self: Column, other: Any) -> Column:
        a, b = _operand(self), _operand(other)
        if reflected:
            a, b = b, a
        if check is not None:
            check(a, b)
        with np.errstate(all="raise"):
            try:
                result = np.asarray(op(a, b))
                if may_grow and result.dtype.kind == "i":  # int64 wraps where Python's int grows; float64 tells
                    _within_exact(np.asarray(op(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64))))
                return _exact(result)
            except (FloatingPointError, ValueError, TypeError) as exc:
                raise NotColumnar(f"{exc}") from None
    return method


def _divisor_checked(a: Any, b: Any) -> None:
    _no_zero(b)


def _power_checked(a: Any, b: Any) -> None:
    base, exponent = np.asarray(a), np.asarray(b)
    if np.any((base == 0) & (exponent < 0)):
        raise NotColumnar("0 to a negative power in some rows")
    if base.dtype.kind == "i" and exponent.dtype.kind == "i" and np.any(exponent < 0):
        raise NotColumnar("an integer to a negative power (a float in Python) in some rows")
    if np.any((base < 0) & (exponent != np.floor(exponent))):
        raise NotColumnar("a negative number to a fractional power (complex in Python) in some rows")


def _bitwise(op: Callable[[Any, Any], np.ndarray]) -> Callable[[Column, Any], Column]:
    integers = _arithmetic(op, may_grow=False)

    def method(self: Column, other: Any) -> Column:
        other_bool = other.values.dtype.kind == "b" if isinstance(other, Column) else type(other) is bool
        if self.values.dtype.kind == "b" and other_bool:  # bool & bool is a bool, bool & int an int
            return Column(np.asarray(op(self.values, other.values if isinstance(other, Column) else other)))
        return integers(self, other)
    return method


def _compare(op: Callable[[Any, Any], Any]) -> Callable[[Column, Any], Column]:
    def method(self: Column, other: Any) -> Column:
        if isinstance(other, Column):
            other = other.values
        elif type(other) not in (int, float, bool):
            raise NotColumnar(f"comparing numbers with {type(other).__name__}")
        return Column(np.asarray(op(self.values, other), dtype=bool))
    return method


class Column(_Opaque):
    """One number per row: int64, float64 or bool (text: :class:`TextColumn`)."""

    __slots__ = ("values",)

    def __init__(self, values: np.ndarray):
        self.values = values

    __add__ = _arithmetic(np.add)
    __radd__ = _arithmetic(np.add, reflected=True)
    __sub__ = _arithmetic(np.subtract)
    __rsub__ = _arithmetic(np.subtract, reflected=True)
    __mul__ = _arithmetic(np.multiply)
    __rmul__ = _arithmetic(np.multiply, reflected=True)
    __truediv__ = _arithmetic(lambda a, b: np.true_divide(a, b, dtype=np.float64), _divisor_checked)
    __rtruediv__ = _arithmetic(lambda a, b: np.true_divide(a, b, dtype=np.float64), _divisor_checked, reflected=True)
    __floordiv__ = _arithmetic(np.floor_divide, _divisor_checked)
    __rfloordiv__ = _arithmetic(np.floor_divide, _divisor_checked, reflected=True)
    __mod__ = _arithmetic(np.remainder, _divisor_checked)
    __rmod__ = _arithmetic(np.remainder, _divisor_checked, reflected=True)
    __pow__ = _arithmetic(np.power, _power_checked)
    __rpow__ = _arithmetic(np.power, _power_checked, reflected=True)
    __and__ = _bitwise(np.bitwise_and)
    __or__ = _bitwise(np.bitwise_or)
    __xor__ = _bitwise(np.bitwise_xor)
    __eq__ = _compare(np.equal)
    __ne__ = _compare(np.not_equal)
    __lt__ = _compare(np.less)
    __le__ = _compare(np.less_equal)
    __gt__ = _compare(np.greater)
    __ge__ = _compare(np.greater_equal)
    __hash__ = _Opaque.__hash__  # defining __eq__ would have unset it

    def __neg__(self) -> Column:
        return _exact(-_numeric(self.values))

    def __pos__(self) -> Column:
        return Column(_numeric(self.values))

    def __abs__(self) -> Column:
        return _exact(np.abs(_numeric(self.values)))

    def __invert__(self) -> Column:
        values = _numeric(self.values)  # ~True is -2 in Python, as ~1
        if values.dtype.kind != "i":
            raise NotColumnar("~ of a float column")
        return Column(~values)


class TextColumn(_Opaque):
    """Text per row, dictionary-coded: ``codes`` index ``dictionary`` (an object array of ``str``).

    Only ``==`` and ``!=`` with a string work on it; it passes through to the output as it is.
    """

    __slots__ = ("codes", "dictionary", "_index")

    def __init__(self, codes: np.ndarray, dictionary: np.ndarray):
        self.codes = codes
        self.dictionary = dictionary
        self._index: dict[str, int] | None = None

    def _equal(self, other: Any) -> np.ndarray:
        if type(other) is not str:
            raise NotColumnar(f"comparing text with {type(other).__name__}")
        if self._index is None:
            self._index = {value: code for code, value in enumerate(self.dictionary.tolist())}
        code = self._index.get(other)
        return np.zeros(len(self.codes), dtype=bool) if code is None else self.codes == code

    def __eq__(self, other: Any) -> Column:  # type: ignore[override]
        return Column(self._equal(other))

    def __ne__(self, other: Any) -> Column:  # type: ignore[override]
        return Column(~self._equal(other))

    __hash__ = _Opaque.__hash__  # defining __eq__ would have unset it


class CountsColumn(_Opaque):
    """A ``{value: count}`` per row (:class:`~operators.CountBy`), as one count array per value.

    A count of 0 means the value is not a key of that row's dict.
    """

    __slots__ = ("counts", "size")

    def __init__(self, counts: dict[Any, np.ndarray], size: int):
        self.counts = counts
        self.size = size

    def get(self, key: Any, default: Any = None) -> Column:
        """``row_dict.get(key, default)`` for every row."""
        counts = self.counts.get(key)
        if counts is not None and counts.size and counts.min() > 0:
            return Column(counts)
        if type(default) is not int or abs(default) > _EXACT:
            # A row without the key would give a value of another type than the rows with it.
            raise NotColumnar(f".get({key!r}, {default!r}) where some rows lack the key")
        if counts is None:
            return Column(np.full(self.size, default, dtype=np.int64))
        return Column(np.where(counts > 0, counts, default))

    def __getitem__(self, key: Any) -> Column:
        counts = self.counts.get(key)
        if counts is None or (counts.size and counts.min() == 0):
            raise NotColumnar(f"[{key!r}] where some rows lack the key")  # a KeyError in those rows
        return Column(counts)


class ColumnRow(Mapping):
    """A row whose every value is a column: what a per-row function sees in batch mode."""

    def __init__(self, columns: dict[str, Any]):
        self.columns = columns

    def __getitem__(self, name: str) -> Any:
        try:
            return self.columns[name]
        except KeyError:
            raise NotColumnar(f"no field {name!r} (a KeyError in every row)") from None

    def get(self, name: str, default: Any = None) -> Any:
        """``row.get(name, default)``: the same for every row, as every row has the same fields."""
        return self.columns.get(name, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self.columns)

    def __len__(self) -> int:
        return len(self.columns)

    def __contains__(self, name: object) -> bool:
        return name in self.columns

    def __eq__(self, other: object) -> bool:
        raise NotColumnar("comparing a whole row")

    __hash__ = None  # type: ignore[assignment]


def constant(value: Any, size: int) -> Column | TextColumn:
    """A column holding ``value`` in every row (a Map's constant output), or :class:`NotColumnar`."""
    if type(value) is bool:
        return Column(np.full(size, value, dtype=bool))
    if type(value) is int:
        if abs(value) > _EXACT:
            raise NotColumnar(f"integer {value} past 2**53")
        return Column(np.full(size, value, dtype=np.int64))
    if type(value) is float:
        return Column(np.full(size, value, dtype=np.float64))
    if type(value) is str:
        return TextColumn(np.zeros(size, dtype=np.int32), np.array([value], dtype=object))
    raise NotColumnar(f"a constant {type(value).__name__} output")


def run_row_steps(steps: Sequence[ElementStep], columns: dict[str, Any], size: int
                  ) -> tuple[dict[str, Column | TextColumn], np.ndarray | None]:
    """Run a pipeline's element steps (its Map and Filter operators lowered, :class:`~operators.base.ElementStep`,
    as every runner takes them) over ``columns`` of ``size`` rows: each step's function is called once, with a
    row of columns.

    Returns the output columns and the indices of the rows kept (``None``: all), or raises
    :class:`NotColumnar`. Every output value is a :class:`Column` (constants broadcast).

    Example:
        >>> from operators import Filter, Map
        >>> steps = [Filter(lambda r: r["n"] > 1).element_step, Map(lambda r: {"m": r["n"] * 2}).element_step]
        >>> out, kept = run_row_steps(steps, {"n": Column(np.array([1, 2, 3]))}, 3)
        >>> out["m"].values.tolist(), kept.tolist()
        ([4, 6], [1, 2])
    """
    kept: np.ndarray | None = None
    for step in steps:
        fn = step.fn
        if step.maps:
            out = fn(ColumnRow(columns))
            if not isinstance(out, Mapping):
                raise NotColumnar(f"the Map returned {type(out).__name__}, not a dict")
            columns = {name: out[name] for name in out}
        else:
            verdict = fn(ColumnRow(columns))
            keep = _truth(verdict, size)
            if keep is None:
                continue
            indices = np.flatnonzero(keep)
            columns = {name: select_rows(value, indices) for name, value in columns.items()}
            kept = indices if kept is None else kept[indices]
            size = len(indices)
    result: dict[str, Column | TextColumn] = {}
    for name, value in columns.items():
        if not isinstance(name, str):
            raise NotColumnar(f"a column named {name!r}")
        if isinstance(value, Column | TextColumn):
            result[name] = value
        elif isinstance(value, CountsColumn):
            raise NotColumnar("a dict per row as an output column")
        else:
            result[name] = constant(value, size)
    return result, kept


def _truth(verdict: Any, size: int) -> np.ndarray | None:
    """Which rows a Filter keeps (``None``: every row)."""
    if isinstance(verdict, Column):
        values = verdict.values
        if values.dtype.kind == "b":
            return values
        if values.dtype.kind in "if":
            return values != 0  # NaN is true, as bool(nan) is
        raise NotColumnar("the truth of a text column")
    if type(verdict) in (bool, int, float):
        return None if verdict else np.zeros(size, dtype=bool)
    raise NotColumnar(f"a Filter verdict of type {type(verdict).__name__}")


def prepend_text(strings: np.ndarray, column: TextColumn) -> TextColumn:
    """``strings`` (an object array of ``str``) then ``column``'s rows, as one text column (rows carried over from
    an earlier chunk, then this chunk's)."""
    if not len(strings):
        return column
    codes, dictionary = _codes_in(column, strings.tolist())
    return TextColumn(np.concatenate([codes, column.codes]), dictionary)


def append_text(column: TextColumn, strings: list[str]) -> TextColumn:
    """``column``'s rows then ``strings``, as one text column."""
    codes, dictionary = _codes_in(column, strings)
    return TextColumn(np.concatenate([column.codes, codes]), dictionary)


def _codes_in(column: TextColumn, strings: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The codes of ``strings`` in ``column``'s dictionary, extended by the values it lacks, and that dictionary."""
    dictionary = column.dictionary.tolist()
    index = {value: code for code, value in enumerate(dictionary)}
    codes = np.fromiter((index.setdefault(value, len(index)) for value in strings), np.int64, len(strings))
    if len(index) > len(dictionary):
        dictionary = list(index)
    return codes, np.array(dictionary, dtype=object)


def select_rows(value: Any, indices: np.ndarray) -> Any:
    """The rows ``indices`` of a column (any other value, a constant, as it is)."""
    if isinstance(value, Column):
        return Column(value.values[indices])
    if isinstance(value, TextColumn):
        return TextColumn(value.codes[indices], value.dictionary)
    if isinstance(value, CountsColumn):
        return CountsColumn({key: counts[indices] for key, counts in value.counts.items()}, len(indices))
    return value


def to_numpy(column: Column | TextColumn) -> np.ndarray:
    """The column as storage takes it (NumPy; text as an object array of ``str``), or :class:`NotColumnar`."""
    if isinstance(column, TextColumn):
        return column.dictionary[column.codes]
    if column.values.dtype.kind == "f" and np.isnan(column.values).any():
        raise NotColumnar("NaN (DuckDB reads NaN in a NumPy column as NULL)")
    return column.values


__all__ = ["Column", "ColumnRow", "CountsColumn", "NotColumnar", "TextColumn", "constant", "run_row_steps",
           "select_rows", "to_numpy"]
