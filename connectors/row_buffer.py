"""Rows of one table buffered as flat value lists, turned into Arrow or NumPy batches for an insert.

Example:
    >>> buf = RowBuffer()
    >>> buf.extend([{"a": 1}, {"a": 2}])
    2
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa

_ENCODING_ERRORS = (duckdb.Error, TypeError, ValueError, OverflowError, RecursionError)
_NO_FIELDS = (None,)


def row_encoding_errors() -> tuple[type[BaseException], ...]:
    """What turning rows into Arrow and inserting them raises for a value the table cannot take.

    pyarrow is imported only when a segment needs Arrow (it costs start-up time, and it imports pandas
    when pandas is installed); before that, no ``ArrowException`` can have been raised.
    """
    pa = sys.modules.get("pyarrow")
    return (pa.ArrowException, *_ENCODING_ERRORS) if pa is not None else _ENCODING_ERRORS


class RowBuffer:
    """Rows of one table, kept as their values grouped by field names, ready to become Arrow.

    Rows of a task usually share their fields, so a row costs its values appended to one flat list;
    a row with other fields starts a new segment. Columns are slices of that list (``values[i::n]``),
    which is much cheaper than transposing per-row tuples. Each segment becomes one Arrow table
    (all-null columns left out: they read as NULL until a value types them).

    Example:
        >>> buf = RowBuffer()
        >>> buf.extend([{"a": 1}, {"a": 2, "b": "x"}])
        2
        >>> [t.to_pylist() for t in buf.to_arrow()]
        [[{'a': 1}], [{'a': 2, 'b': 'x'}]]
    """

    __slots__ = ("segments", "n", "_keys", "_values")

    def __init__(self) -> None:
        #: ``(field names, their values row after row)`` per segment
        self.segments: list[tuple[tuple[str, ...], list[Any]]] = []
        self.n = 0
        self._keys: tuple[str, ...] | None = None  # the current segment's field names
        self._values: list[Any] = []

    def __len__(self) -> int:
        return self.n

    def extend(self, rows: Iterable[Mapping[str, Any]]) -> int:
        """Add ``rows``; how many were added."""
        before = self.n
        keys, values = self._keys, self._values
        add = values.extend
        n = 0
        for row in rows:
            names = tuple(row)  # in order: the same fields in another order start a new segment
            if names != keys:
                self.n += n
                n = 0
                keys = self._keys = names
                values = self._values = []
                add = values.extend
                self.segments.append((keys, values))
            add(row.values() or _NO_FIELDS)  # a row without fields still counts: one placeholder
            n += 1
        self.n += n
        return self.n - before

    def columns(self) -> list[tuple[tuple[str, ...], list[list[Any]]]]:
        """Each segment's field names and columns."""
        out = []
        for names, values in self.segments:
            width = len(names)
            out.append((names, [values[i::width] for i in range(width)] if width else []))
        return out

    def to_arrow(self) -> list[pa.Table]:
        return [_arrow_table(names, columns) for names, columns in self.columns()]

    def to_batches(self) -> list[pa.Table | dict[str, np.ndarray]]:
        """One batch per segment for DuckDB to scan: NumPy columns when every column holds values of
        one plain type (``str``, ``int``, ``float`` but NaN or ``bool``; no ``None``), else an Arrow table.

        NumPy columns give DuckDB the same column types Arrow would (VARCHAR, BIGINT, DOUBLE,
        BOOLEAN) without building Arrow arrays from Python objects, which makes pyarrow import
        pandas (over a second of start-up) when pandas is installed.

        Example:
            >>> buf = RowBuffer()
            >>> buf.extend([{"a": 1, "s": "x"}, {"a": 2, "s": "y"}, {"a": None}])
            3
            >>> [type(b).__name__ for b in buf.to_batches()]
            ['dict', 'Table']
        """
        batches: list[pa.Table | dict[str, np.ndarray]] = []
        for names, columns in self.columns():
            arrays = _numpy_columns(names, columns)
            batches.append(arrays if arrays is not None else _arrow_table(names, columns))
        return batches

    def rows(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for (names, columns), (_, values) in zip(self.columns(), self.segments, strict=True):
            out.extend([dict(zip(names, row, strict=True)) for row in zip(*columns, strict=True)] if names
                       else [{} for _ in values])
        return out


def _arrow_table(names: tuple[str, ...], columns: list[list[Any]]) -> pa.Table:
    import pyarrow as pa

    arrays = [_arrow_array(column) for column in columns]
    return pa.table({n: a for n, a in zip(names, arrays, strict=True) if not pa.types.is_null(a.type)})


def _arrow_array(column: list[Any]) -> pa.Array:
    """``column`` as Arrow; NumPy vectors of one length and numeric dtype (an embedding, a model's output)
    as a fixed-size list, which DuckDB stores as an ARRAY (``FLOAT[768]``).

    Why not a plain list: DuckDB (2.0) appends to a variable-length LIST column at a cost that now and
    then grows with the table (measured, one 768-float row per transaction: every ~105th commit took
    8 ms after 100 rows, 35 ms after 2,000), while an ARRAY column's commits stay flat (p99 1 ms).

    Example:
        >>> _arrow_array([np.zeros(3, np.float32), np.ones(3, np.float32)]).type
        FixedSizeListType(fixed_size_list<item: float>[3])
        >>> _arrow_array([np.zeros(3), np.ones(2)]).type  # lengths differ: a list
        ListType(list<item: double>)
    """
    import pyarrow as pa

    first = column[0] if column else None
    if type(first) is np.ndarray and first.ndim == 1 and first.size and first.dtype.kind in "biuf":
        shape, dtype = first.shape, first.dtype
        if all(type(v) is np.ndarray and v.shape == shape and v.dtype == dtype for v in column):
            return pa.FixedSizeListArray.from_arrays(pa.array(np.concatenate(column)), shape[0])
    return pa.array(column)


_NUMPY_DTYPES: dict[type, Any] = {str: object, int: np.int64, float: np.float64, bool: np.bool_}


def _numpy_columns(names: tuple[str, ...], columns: list[list[Any]]) -> dict[str, np.ndarray] | None:
    """The segment as NumPy columns if each column holds one plain type (see RowBuffer.to_batches)."""
    if not columns or not columns[0]:
        return None
    arrays = {}
    for name, column in zip(names, columns, strict=True):
        kinds = set(map(type, column))
        dtype = _NUMPY_DTYPES.get(kinds.pop()) if len(kinds) == 1 else None
        if dtype is None:
            return None
        try:
            array = np.array(column, dtype=dtype)
        except OverflowError:  # an int beyond int64: Arrow's error path names it
            return None
        if dtype is np.float64 and np.isnan(array).any():  # DuckDB's NumPy scan reads NaN as NULL, Arrow as NaN
            return None
        arrays[name] = array
    return arrays


def column_names(batch: pa.Table | dict[str, np.ndarray]) -> list[str]:
    return list(batch) if isinstance(batch, dict) else batch.column_names
