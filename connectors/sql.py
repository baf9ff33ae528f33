"""SQL built from names the input gave: identifiers checked and quoted, relations registered for a block, and a
table's columns created or widened to take a batch (DuckDB).

Example:
    >>> quote_identifier("clicks"), quoted_list(["a", "b"])
    ('"clicks"', '"a", "b"')
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def is_identifier(name: object) -> bool:
    """True if ``name`` is a plain SQL identifier: letters, digits, underscores, not starting with a digit, ≤ 63."""
    return isinstance(name, str) and _IDENTIFIER.fullmatch(name) is not None


def scalar(con: duckdb.DuckDBPyConnection, sql: str, parameters: list[Any] | None = None) -> Any:
    """The one value a query of one row gives (``SELECT count(*) ...``)."""
    row = con.execute(sql, parameters).fetchone()
    if row is None:
        raise LookupError(f"no row: {sql}")
    return row[0]


def check_table_name(name: str) -> str:
    """``name`` if it is a plain SQL identifier (letters, digits, underscore), else ``ValueError``."""
    if not is_identifier(name):
        raise ValueError(f"table name {name!r} must be letters, digits and underscores, not starting with a digit")
    return name


def quote_identifier(name: str) -> str:
    """``name`` as a quoted SQL identifier: in double quotes, each ``"`` in it doubled (safe for any string).

    Example:
        >>> quote_identifier('dwell_s'), quote_identifier('a"; DROP TABLE t; --')
        ('"dwell_s"', '"a""; DROP TABLE t; --"')
    """
    return '"' + str(name).replace('"', '""') + '"'


def quoted_list(names: Iterable[str]) -> str:
    """``names`` quoted and comma-separated, for a column list."""
    return ", ".join(quote_identifier(n) for n in names)


@contextmanager
def registered(con: duckdb.DuckDBPyConnection, name: str, relation: Any) -> Iterator[str]:
    """``relation`` (an Arrow table, NumPy columns) readable as ``name`` in SQL within the block.

    A statement that fails inside a transaction aborts it, and DuckDB then refuses the unregister too:
    that second error must not replace the first, which is the reason a dead letter gives.

    Example:
        >>> con = duckdb.connect()
        >>> with registered(con, "_rows", {"a": np.arange(3)}):
        ...     con.sql("SELECT sum(a) FROM _rows").fetchall()
        [(3,)]
    """
    con.register(name, relation)
    try:
        yield name
    except BaseException:
        with suppress(duckdb.Error):
            con.unregister(name)
        raise
    con.unregister(name)


class KnownColumns(set):
    """A table's column names as :func:`ensure_columns` last saw them, with their DuckDB types and the batch
    shapes (:func:`batch_shape`) already checked against them."""

    def __init__(self) -> None:
        super().__init__()
        self.types: dict[str, str] = {}
        self.shapes: set[Any] = set()


_NUMERIC = {"TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT", "USMALLINT", "UINTEGER", "UBIGINT",
            "UHUGEINT", "FLOAT", "DOUBLE"}


_SHAPE = re.compile(r"(\[\d*\])*$")


def number_shape(column_type: str) -> str | None:
    """The shape of a number, or of a list or array of numbers (``""`` for ``BIGINT`` or ``DECIMAL(9,2)``,
    ``"[]"`` for ``DOUBLE[]``, ``"[768]"`` for ``FLOAT[768]``); ``None`` for any other type."""
    match = _SHAPE.search(column_type)  # it matches every string (at least at its end)
    shape = match[0] if match else ""
    base = column_type[:len(column_type) - len(shape)]
    return shape if base in _NUMERIC or base.startswith("DECIMAL(") else None


def batch_shape(batch: pa.Table | dict[str, np.ndarray]) -> Any:
    """What a batch's column types are decided by: its Arrow schema, or its NumPy columns' dtypes and shapes."""
    if isinstance(batch, dict):
        return tuple((name, array.dtype.str, array.shape[1:]) for name, array in batch.items())
    return batch.schema


def ensure_columns(con: duckdb.DuckDBPyConnection, table: str, relation: str, columns: Iterable[str],
                   known: KnownColumns, shape: Any = None) -> None:
    """Create ``table`` shaped like the registered ``relation``, add the ``columns`` it lacks, and widen a
    numeric column the relation brings wider values for (a ``BIGINT`` column made by a first batch of
    integers becomes ``DOUBLE`` when floats come: DuckDB's INSERT would otherwise cast 0.1 to 0, silently).

    ``known`` caches the table's columns between calls (pass a new :class:`KnownColumns` the first time);
    a batch of a ``shape`` (:func:`batch_shape`) checked before is not described again.

    Example:
        >>> con, known = duckdb.connect(), KnownColumns()
        >>> for batch in ({"n": np.array([1])}, {"n": np.array([0.1])}):
        ...     with registered(con, "_rows", batch):
        ...         ensure_columns(con, "t", "_rows", ["n"], known, batch_shape(batch))
        ...         _ = con.execute("INSERT INTO t SELECT * FROM _rows")
        >>> con.sql("SELECT n FROM t").fetchall(), known.types
        ([(1.0,), (0.1,)], {'n': 'DOUBLE'})
    """
    quoted_table, source = quote_identifier(table), quote_identifier(relation)
    if not known:
        con.execute(f"CREATE TABLE IF NOT EXISTS {quoted_table} AS SELECT * FROM {source} WHERE false")
        known.types = dict(con.execute(f"SELECT column_name, column_type FROM (DESCRIBE {quoted_table})").fetchall())
        known.update(known.types)
    columns = list(columns)
    if shape is not None and shape in known.shapes and known.issuperset(columns):
        return
    # the relation's own types (DuckDB quotes the field names inside nested types itself)
    types = dict(con.execute(f"SELECT column_name, column_type FROM (DESCRIBE SELECT * FROM {source})").fetchall())
    for name in columns:
        new, old = types[name], known.types.get(name)
        if old is None:
            con.execute(f"ALTER TABLE {quoted_table} ADD COLUMN {quote_identifier(name)} {new}")
            known.add(name)
            known.types[name] = new
        elif new != old and number_shape(new) is not None and number_shape(new) == number_shape(old):
            wider = scalar(con, f"SELECT typeof(x) FROM (SELECT NULL::{old} AS x UNION ALL SELECT NULL::{new})")
            if wider != old:
                con.execute(f"ALTER TABLE {quoted_table} ALTER COLUMN {quote_identifier(name)} SET DATA TYPE {wider}")
                known.types[name] = wider
                known.shapes.clear()  # a batch shaped as before now needs the cast it did not need then
    if shape is not None:
        known.shapes.add(shape)
