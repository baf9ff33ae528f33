"""Values stored as sent: which rows of a batch a table's column types would change, and why.

A column's type is the one the cloud declared for it (``CloudStore(schemas={table: {column: type}})``), else the
type the table already has, else the type of the first batch that brings the column. A batch whose column has
another type is looked at value by value (DuckDB's INSERT would cast them all silently):

- numbers into numbers (integers, floats, decimals, either way): a value is stored only if it survives the
  cast and the cast back unchanged (-32.7 into BIGINT, 2**53 + 1 into DOUBLE, 300 into TINYINT, 0.1 into
  FLOAT: refused);
- a column of no declared type whose table type is narrower than the batch's (BIGINT, DOUBLE values coming) is
  widened first, as the device's own storage widens it (``connectors.sql.ensure_columns``): integers then
  go into DOUBLE, exactly up to 2**53;
- other types (vectors, timestamps) only if DuckDB's common type of the two is the column's own (``FLOAT[4]``
  into ``DOUBLE[4]``): a widening that loses nothing;
- anything else (a string into a number, a number into a string, a boolean, a vector of another length): every
  non-null value is refused. A NULL needs no cast.

Each refused row leaves the batch, with the reason (the cloud makes it a ``bad_value`` dead letter); the rows
beside it are stored.

Example:
    >>> import duckdb, pyarrow as pa
    >>> con = duckdb.connect()
    >>> rows = pa.table({"rid": ["-31", None], "x": [-32.7, 4.0]})
    >>> con.register("r", rows)  # doctest: +ELLIPSIS
    <...>
    >>> checks = plan({"rid": "VARCHAR", "x": "DOUBLE"}, {"rid": "BIGINT", "x": "BIGINT"})
    >>> refused(con, "r", checks)
    [(0, 'rid', "'-31' (VARCHAR) is not a BIGINT"), (0, 'x', '-32.7 (DOUBLE) is not a BIGINT without loss')]
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import duckdb

from connectors.sql import quote_identifier, scalar

_INTEGERS = {"TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT", "USMALLINT", "UINTEGER", "UBIGINT",
             "UHUGEINT"}
_FLOATS = {"FLOAT", "DOUBLE"}
#: what a declared type may be written with (it reaches SQL: the operator's, but checked all the same)
_TYPE_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9_ ,()\[\]]{0,200}")
_REPR_CHARS = 80


@dataclass(frozen=True)
class Check:
    """One column of a batch whose type is not its table column's: how its values are looked at."""

    column: str
    source: str  # the batch's DuckDB type
    target: str  # the column's
    kind: str  # "round_trip" (numbers), "refuse" (every non-null value), "widen" (nothing to refuse)


def family(duck_type: str) -> str:
    """``int``, ``float``, ``decimal``, ``string``, ``bool``, ``null`` or ``other`` for a DuckDB type name."""
    if duck_type in _INTEGERS:
        return "int"
    if duck_type in _FLOATS:
        return "float"
    if duck_type.startswith("DECIMAL"):
        return "decimal"
    return {"VARCHAR": "string", "BOOLEAN": "bool", '"NULL"': "null", "NULL": "null"}.get(duck_type, "other")


def normalize(con: duckdb.DuckDBPyConnection, declared: str) -> str:
    """A declared type as DuckDB names it (``int`` → ``INTEGER``); ``ValueError`` if it is no type."""
    if not isinstance(declared, str) or not _TYPE_TEXT.fullmatch(declared):
        raise ValueError(f"{declared!r} is not a type name")
    try:
        return str(scalar(con, f"SELECT typeof(NULL::{declared})"))
    except duckdb.Error as exc:
        raise ValueError(f"{declared!r} is not a DuckDB type: {exc}") from exc


def plan(batch_types: dict[str, str], targets: dict[str, str]) -> list[Check]:
    """The checks a batch of ``batch_types`` needs against the column types ``targets`` (columns it lacks there
    take the batch's type: nothing to check)."""
    checks = []
    for column, source in batch_types.items():
        target = targets.get(column)
        if target is None or target == source or family(source) == "null":
            continue
        numbers = ("int", "float", "decimal")
        if family(source) in numbers and family(target) in numbers:
            kind = "round_trip"
        elif family(source) == "other" and family(target) == "other":
            kind = "widen" if common(source, target) == target else "refuse"
        else:
            kind = "refuse"
        checks.append(Check(column, source, target, kind))
    return checks


def refused(con: duckdb.DuckDBPyConnection, relation: str, checks: list[Check]) -> list[tuple[int, str, str]]:
    """(row index, column, why) for each value of the registered ``relation`` its column cannot take as it is."""
    tests = [(c, _bad(c)) for c in checks if c.kind != "widen"]
    if not tests:
        return []
    flags = ", ".join(f"{condition} AS b{i}" for i, (_, condition) in enumerate(tests))
    values = ", ".join(quote_identifier(c.column) for c, _ in tests)
    # a plain projection keeps the relation's row order (DuckDB preserves insertion order)
    rows = con.execute(f"SELECT {flags}, {values} FROM {quote_identifier(relation)}").fetchall()
    out = []
    n = len(tests)
    for index, row in enumerate(rows):
        for i, (check, _) in enumerate(tests):
            if row[i]:
                out.append((index, check.column, _why(check, row[n + i])))
    return out


def _bad(check: Check) -> str:
    x = quote_identifier(check.column)
    if check.kind == "refuse":
        return f"{x} IS NOT NULL"
    cast = f"TRY_CAST({x} AS {check.target})"
    return f"({x} IS NOT NULL AND ({cast} IS NULL OR TRY_CAST({cast} AS {check.source}) IS DISTINCT FROM {x}))"


def _why(check: Check, value: Any) -> str:
    text = repr(value)
    if len(text) > _REPR_CHARS:
        text = text[:_REPR_CHARS] + "..."
    loss = " without loss" if check.kind == "round_trip" else ""
    return f"{text} ({check.source}) is not a {check.target}{loss}"


@lru_cache(maxsize=256)
def common(source: str, target: str) -> str | None:
    """DuckDB's common type of two types (what a UNION of both would be), None if it has none."""
    con = duckdb.connect()
    try:
        return str(scalar(con, f"SELECT typeof(x) FROM (SELECT NULL::{target} AS x UNION ALL SELECT NULL::{source})"))
    except duckdb.Error:
        return None
    finally:
        con.close()
