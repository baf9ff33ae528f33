"""Collective storage: every task's feature rows in a DuckDB table, written in Arrow batches.

Durability window: a row handed to :meth:`CollectiveStorage.write` is visible to every read of this
storage at once (reads flush first), and is durable in the DuckDB file after the next flush, which
happens when a table's buffer reaches ``flush_rows`` rows, when the oldest buffered row is
``flush_interval_s`` seconds old (checked on every write), on any read, on :meth:`close`, and on
SIGTERM/SIGINT once :func:`flush_on_signals` is installed. A hard crash (SIGKILL, power loss)
loses at most the buffered rows: fewer than ``flush_rows`` per table, at most ``flush_interval_s``
seconds old while writes keep coming.

**Background writer** (``background=True``): a full or old buffer is handed to a writer thread that
stores it (the batch, the INSERT, the COMMIT and its fsync) while the caller goes on; buffers are
stored in the order they were handed over; one is being stored and at most two wait, and a write
blocks while the writer is that far behind. Every read, :meth:`CollectiveStorage.flush`,
:meth:`~CollectiveStorage.commit` and :meth:`~CollectiveStorage.close` first waits until the writer
has stored what it was given, so reads and checkpoints see the same rows as without it. A hard crash
then loses at most the buffered rows plus the (at most three) buffers handed to the writer and not
yet committed. Refused rows are counted and go to the dead letter as without it, once the caller's
thread next writes or flushes.

Rows a table cannot take (a value whose type clashes with the column's, or that no column type
holds) are not dropped: the rest of the batch is stored and each refused row goes to the
``dead_letter`` table with the reason (naming the task that wrote it, see
:meth:`CollectiveStorage.name_writer`) and the row as JSON (:func:`to_json`); ``refused`` counts them.

**Held for checkpoints**: a runner that checkpoints (:mod:`streamflow.checkpoint`) calls
:meth:`CollectiveStorage.hold`. From then on nothing is flushed on its own: a full or old buffer
calls the runner's ``on_due`` instead, and rows become durable only through
:meth:`CollectiveStorage.commit`, which stores them and the runner's checkpoint in one transaction,
so the tables never hold a row the stored checkpoint does not cover. Reads then see the committed
rows only, and :meth:`CollectiveStorage.close` drops the rows no checkpoint covers (a resumed run
computes them again).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import reprlib
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa

DEAD_LETTER_TABLE = "dead_letter"
log = logging.getLogger("streamflow.storage")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_ENCODING_ERRORS = (duckdb.Error, TypeError, ValueError, OverflowError, RecursionError)


def row_encoding_errors() -> tuple[type[BaseException], ...]:
    """What turning rows into Arrow and inserting them raises for a value the table cannot take.

    pyarrow is imported only when a segment needs Arrow (it costs start-up time, and it imports pandas
    when pandas is installed); before that, no ``ArrowException`` can have been raised.
    """
    pa = sys.modules.get("pyarrow")
    return (pa.ArrowException, *_ENCODING_ERRORS) if pa is not None else _ENCODING_ERRORS


def __getattr__(name: str) -> Any:
    if name == "ROW_ENCODING_ERRORS":  # the constant, for modules that use Arrow anyway (the tunnel sink)
        import pyarrow  # noqa: F401

        return row_encoding_errors()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
_SAFE_REPR = reprlib.Repr()  # bounded depth and size: safe on cycles and deep nesting
_SAFE_REPR.maxlevel, _SAFE_REPR.maxstring, _SAFE_REPR.maxother = 20, 2000, 2000
_SAFE_REPR.maxlist = _SAFE_REPR.maxdict = _SAFE_REPR.maxtuple = _SAFE_REPR.maxset = 1000


def to_json(value: Any, sort_keys: bool = False) -> str:
    """``value`` as JSON text for a text column (dead letters, late events, task errors); never raises.

    A value JSON has no type for is written as its ``str``; dict keys JSON cannot take (a tuple; mixed
    types when sorting) become their ``str``; what still cannot be encoded (a cycle, nesting deeper
    than the recursion limit) is kept as a JSON string of its (bounded) ``repr``.

    Example:
        >>> print(to_json({"n": 2**70, "tags": {"a"}, "pair": {(1, 2): "x"}}))
        {"n": 1180591620717411303424, "tags": "{'a'}", "pair": {"(1, 2)": "x"}}
    """
    encode = _SORTED_JSON if sort_keys else _JSON
    for prepare in (_same, _string_keys):
        try:
            return encode(prepare(value))
        except JSON_ERRORS:
            pass
    return json.dumps(_SAFE_REPR.repr(value))


def encode_json(value: Any, sort_keys: bool = False) -> str:
    """``json.dumps(value, default=str, sort_keys=sort_keys)``, or one of :data:`JSON_ERRORS` (where
    :func:`to_json` tries further); the encoder is built once.

    Example:
        >>> encode_json({"b": 1, "a": {2}}, sort_keys=True)
        '{"a": "{2}", "b": 1}'
    """
    return (_SORTED_JSON if sort_keys else _JSON)(value)


JSON_ERRORS = (TypeError, ValueError, RecursionError)


def _encoder(sort_keys: bool) -> Callable[[Any], str]:
    """``json.JSONEncoder(default=str, sort_keys=sort_keys).encode``, built once: ``JSONEncoder.encode``
    builds its C encoder again at every call (~2.5 us of a late event's ~7). Without the C accelerator,
    the encoder's own ``encode``. No circular-reference markers: a cycle ends in ``RecursionError``, which
    :func:`to_json` handles."""
    encoder = json.JSONEncoder(default=str, sort_keys=sort_keys)
    make = json.encoder.c_make_encoder
    if make is None:
        return encoder.encode
    chunks = make(None, str, json.encoder.encode_basestring_ascii, None, encoder.key_separator,
                  encoder.item_separator, sort_keys, False, True)
    return lambda value: "".join(chunks(value, 0))


_JSON = _encoder(sort_keys=False)
_SORTED_JSON = _encoder(sort_keys=True)


def _same(value: Any) -> Any:
    return value


def _string_keys(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _string_keys(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_string_keys(v) for v in value]
    return value


def is_identifier(name: object) -> bool:
    """True if ``name`` is a plain SQL identifier: letters, digits, underscores, not starting with a digit, ≤ 63."""
    return isinstance(name, str) and _IDENTIFIER.fullmatch(name) is not None


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


def resolve_db_path(path: str | os.PathLike[str] | None = None) -> Path:
    """Explicit path first, then ``STREAMFLOW_DB``, then ``./streamflow.duckdb`` (:mod:`streamflow.settings`)."""
    from streamflow.settings import settings  # not at import: streamflow's package imports this module

    return settings(db=path).db


_NO_FIELDS = (None,)
#: With a background writer, the WAL size (MiB) at which a COMMIT checkpoints it into the file (see __init__).
BACKGROUND_CHECKPOINT_MB = 4


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


def _column_names(batch: pa.Table | dict[str, np.ndarray]) -> list[str]:
    return list(batch) if isinstance(batch, dict) else batch.column_names


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


def number_shape(column_type: str) -> str | None:
    """The shape of a number, or of a list or array of numbers (``""`` for ``BIGINT`` or ``DECIMAL(9,2)``,
    ``"[]"`` for ``DOUBLE[]``, ``"[768]"`` for ``FLOAT[768]``); ``None`` for any other type."""
    shape = re.search(r"(\[\d*\])*$", column_type).group()
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
            wider = con.execute(f"SELECT typeof(x) FROM (SELECT NULL::{old} AS x UNION ALL SELECT NULL::{new})"
                                ).fetchone()[0]
            if wider != old:
                con.execute(f"ALTER TABLE {quoted_table} ALTER COLUMN {quote_identifier(name)} SET DATA TYPE {wider}")
                known.types[name] = wider
                known.shapes.clear()  # a batch shaped as before now needs the cast it did not need then
    if shape is not None:
        known.shapes.add(shape)


class CollectiveStorage:
    """Buffered DuckDB tables for feature rows (see the module docstring for durability).

    Example:
        >>> import tempfile, os
        >>> db = os.path.join(tempfile.mkdtemp(), "features.duckdb")
        >>> with CollectiveStorage(db, flush_rows=100) as store:
        ...     store.write("ipv", [{"user_id": "u1", "dwell_s": 12.0}])
        ...     store.query("SELECT user_id, dwell_s FROM ipv")
        [('u1', 12.0)]
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, flush_rows: int = 4096,
                 flush_interval_s: float = 5.0, background: bool = False):
        if flush_rows < 1:
            raise ValueError(f"flush_rows must be >= 1, got {flush_rows}")
        self.path = resolve_db_path(path)
        if self.path.parent != Path(""):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.flush_rows = flush_rows
        self.flush_interval_s = flush_interval_s
        self.rows_written: dict[str, int] = {}
        #: Rows each table refused (they are in the dead-letter table).
        self.refused: dict[str, int] = {}
        self.flushes = 0
        self._con = duckdb.connect(str(self.path))
        # The NumPy batches hold one Python type per object column (_numpy_columns checks it), so DuckDB
        # need not sample 1,000 values of each to infer it, at every flush.
        self._con.execute("SET pandas_analyze_sample = 1")
        if background:
            # The writer thread's COMMITs checkpoint the WAL into the file once it holds this much (DuckDB's
            # default is 16 MiB), so the checkpoint is mostly done beside the run, not all at close(). And DuckDB
            # works on the writer's thread alone (its default: a thread per core), leaving the other cores to the
            # run: 200k IPV rows stored with ~8% less CPU, in no more time.
            self._con.execute(f"SET checkpoint_threshold = '{BACKGROUND_CHECKPOINT_MB}MB'")
            self._con.execute("SET threads = 1")
        self._buffers: dict[str, RowBuffer] = {}
        self._oldest: float | None = None
        self._lock = threading.RLock()
        self._columns: dict[str, KnownColumns] = {}
        self._writers: dict[str, list[str]] = {}
        self._closed = False
        self._on_due: Callable[[], None] | None = None  # set by hold(): flushes wait for commit()
        #: With ``background``, full or old buffers are stored by a writer thread (see the module docstring).
        self._writer: _BackgroundWriter | None = _BackgroundWriter(self._store) if background else None

    def name_writer(self, table: str, writer: str) -> None:
        """Say who writes ``table`` (e.g. ``"task ipv"``): the reason of a row it refuses names them."""
        writers = self._writers.setdefault(check_table_name(table), [])
        if writer not in writers:
            writers.append(writer)

    # -- writing -----------------------------------------------------------------------------
    def write(self, table: str, rows: Iterable[Mapping[str, Any]]) -> None:
        """Buffer ``rows`` for ``table``; flush that table when its buffer is full."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"storage {self.path} is closed")
            buffer = self._buffers.get(table)
            if buffer is None:
                buffer = self._buffers[check_table_name(table)] = RowBuffer()
            added = buffer.extend(rows)
            self.rows_written[table] = self.rows_written.get(table, 0) + added
            now = time.monotonic()
            if self._oldest is None and added:
                self._oldest = now
            if buffer.n >= self.flush_rows:
                if self._on_due is not None:
                    self._on_due()
                else:
                    self._flush_table(table)
            elif self._oldest is not None and now - self._oldest >= self.flush_interval_s:
                if self._on_due is not None:
                    self._on_due()
                else:
                    self._flush_buffers()
            if self._writer is not None and self._writer.outcomes:
                self._settle()

    def write_table(self, table: str, data: dict[str, np.ndarray]) -> None:
        """Store ``data`` (NumPy columns of one length; text as object arrays of ``str``) in ``table`` now,
        after the rows buffered for it: one insert; rows the table refuses go to the dead letter, as
        :meth:`write`'s do (the device runner's batch mode writes so).
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(f"storage {self.path} is closed")
            check_table_name(table)
            self._flush_table(table)
            self._drain()
            names = list(data)
            self.rows_written[table] = self.rows_written.get(table, 0) + (len(data[names[0]]) if names else 0)

            def rows() -> list[dict[str, Any]]:
                columns = [data[name].tolist() for name in names]
                return [dict(zip(names, row, strict=True)) for row in zip(*columns, strict=True)]

            self._account_refusals(table, self._store_batches(table, lambda: [data], rows))
            self.flushes += 1

    def flush(self) -> None:
        """Store every buffered row in the DuckDB file (held storage: nothing, rows wait for :meth:`commit`).

        With a background writer, it returns once the writer has stored them."""
        with self._lock:
            if self._on_due is not None:
                return
            self._flush_buffers()
            self._drain()

    def _flush_buffers(self) -> None:
        for table in list(self._buffers):
            self._flush_table(table)
        self._oldest = None

    def _drain(self) -> None:
        """Wait until the background writer (if any) has stored everything handed to it; count its refusals."""
        writer = self._writer
        while writer is not None:
            writer.wait()
            if not writer.outcomes:
                return
            self._settle()  # refused rows become dead letters, handed to the writer in turn

    def hold(self, on_due: Callable[[], None]) -> None:
        """Make rows durable only through :meth:`commit`; call ``on_due()`` when a flush would be due.

        Rows buffered so far are flushed first (no checkpoint is about them).
        """
        with self._lock:
            self.flush()
            self._on_due = on_due

    def release(self) -> None:
        """End :meth:`hold`: flushes happen on their own again."""
        with self._lock:
            self._on_due = None

    def commit(self, also: Callable[[duckdb.DuckDBPyConnection], None]) -> None:
        """Store every buffered row and run ``also(connection)`` in one transaction: all or nothing.

        Rows a table refuses go to the dead letter in the same transaction (see the module docstring).
        """
        with self._lock:
            self._drain()
            buffers = {table: buffer for table, buffer in self._buffers.items() if buffer}
            try:
                self._transaction([(table, buffer.to_batches()) for table, buffer in buffers.items()], also)
            except row_encoding_errors():
                self._transaction(self._row_by_row_batches(buffers), also)
            self._buffers = {}
            self._oldest = None
            self.flushes += 1

    def _row_by_row_batches(self, buffers: dict[str, RowBuffer]) -> list[tuple[str, list[Any]]]:
        """Find the rows the tables refuse, in a transaction that is rolled back (and replays the rows
        accepted so far after each refusal); the others as one-row batches, the refusals as dead letters."""
        accepted: list[tuple[str, list[Any]]] = []
        refused: list[dict[str, Any]] = []
        con = self._con
        con.execute("BEGIN")
        try:
            for table, buffer in buffers.items():
                for index, row in enumerate(buffer.rows()):
                    try:
                        single = RowBuffer()
                        single.extend([row])
                        batch = (table, single.to_batches())
                        self._insert_batches(*batch)
                        accepted.append(batch)
                    except row_encoding_errors() as exc:
                        refused.append(self._refusal(table, index, row, exc))
                        self.rows_written[table] -= 1
                        self.refused[table] = self.refused.get(table, 0) + 1
                        con.execute("ROLLBACK")  # a failed statement aborts the transaction: start again
                        self._columns.clear()
                        con.execute("BEGIN")
                        for done in accepted:
                            self._insert_batches(*done)
        finally:
            con.execute("ROLLBACK")
            self._columns.clear()
        if refused:
            if any(r["source"] == f"storage:{DEAD_LETTER_TABLE}" for r in refused):
                raise RuntimeError(f"dead-letter rows could not be stored: {refused[0]['reason']}")
            dead = RowBuffer()
            dead.extend(refused)
            accepted.append((DEAD_LETTER_TABLE, dead.to_batches()))
            self.rows_written[DEAD_LETTER_TABLE] = self.rows_written.get(DEAD_LETTER_TABLE, 0) + len(refused)
        return accepted

    def _transaction(self, batches: list[tuple[str, list[Any]]],
                     also: Callable[[duckdb.DuckDBPyConnection], None] | None) -> None:
        self._con.execute("BEGIN")
        try:
            for table, tables in batches:
                self._insert_batches(table, tables)
            if also is not None:
                also(self._con)
        except BaseException:
            self._con.execute("ROLLBACK")
            self._columns.clear()  # re-read after a rolled-back CREATE/ALTER
            raise
        self._con.execute("COMMIT")

    def pending(self) -> int:
        """Rows buffered and not yet in the file (with a background writer: also those it is storing)."""
        with self._lock:
            return sum(b.n for b in self._buffers.values()) + (self._writer.rows() if self._writer else 0)

    def _flush_table(self, table: str) -> None:
        buffer = self._buffers.get(table)
        if not buffer:
            return
        self._buffers[table] = RowBuffer()
        if not any(self._buffers.values()):
            self._oldest = None
        if self._writer is not None:
            self._writer.submit(table, buffer)
        else:
            self._account_refusals(table, self._store(table, buffer))
        self.flushes += 1

    def _store(self, table: str, buffer: RowBuffer) -> list[dict[str, Any]]:
        """Insert ``buffer`` into ``table`` (row by row if the batch is refused); the refused rows' dead letters.

        It touches only the connection and the column cache, never the counters or buffers: a background
        writer runs it, and the caller's thread counts the refusals (:meth:`_account_refusals`)."""
        return self._store_batches(table, buffer.to_batches, buffer.rows)

    def _store_batches(self, table: str, batches: Callable[[], list[pa.Table | dict[str, np.ndarray]]],
                       rows: Callable[[], list[Mapping[str, Any]]]) -> list[dict[str, Any]]:
        """Insert ``batches()`` in one transaction, or, if they cannot be made or are refused, ``rows()`` one
        by one; the refused rows' dead letters."""
        try:
            self._insert(table, *batches())
            return []
        except row_encoding_errors():
            return self._insert_row_by_row(table, rows())

    def _settle(self) -> None:
        """Count what the background writer refused, and hand the dead letters to it."""
        outcomes = self._writer.outcomes
        while outcomes:
            table, refused = outcomes.popleft()
            self._account_refusals(table, refused)

    def _insert(self, table: str, *batches: pa.Table | dict[str, np.ndarray]) -> None:
        """Insert the batches in one transaction: all of them or none."""
        self._transaction([(table, list(batches))], None)

    def _insert_batches(self, table: str, batches: Iterable[pa.Table | dict[str, np.ndarray]]) -> None:
        for batch in batches:
            with registered(self._con, "_sf_batch", batch):
                columns = _column_names(batch)
                ensure_columns(self._con, table, "_sf_batch", columns, self._columns.setdefault(table, KnownColumns()),
                               batch_shape(batch))
                names = quoted_list(columns)
                self._con.execute(f"INSERT INTO {quote_identifier(table)} ({names}) SELECT {names} FROM _sf_batch")

    def _refusal(self, table: str, index: int, row: Mapping[str, Any], exc: BaseException) -> dict[str, Any]:
        """The dead-letter row of a row ``table`` refused (naming who wrote it, see :meth:`name_writer`)."""
        writers = self._writers.get(table)
        whose = f"row of {', '.join(writers)}" if writers else "row"
        return {"source": f"storage:{table}", "line": index,
                "reason": f"{whose} refused by table {table}: {type(exc).__name__}: {exc}".strip()[:2000],
                "raw": to_json(row)}

    def _insert_row_by_row(self, table: str, rows: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Insert ``rows`` one by one; the dead-letter rows of those ``table`` refused."""
        refused = []
        for index, row in enumerate(rows):
            try:
                single = RowBuffer()
                single.extend([row])
                self._insert(table, *single.to_batches())
            except row_encoding_errors() as exc:
                refused.append(self._refusal(table, index, row, exc))
        return refused

    def _account_refusals(self, table: str, refused: list[dict[str, Any]]) -> None:
        """Count the rows ``table`` refused and store their dead letters."""
        if refused:
            self.rows_written[table] -= len(refused)
            self.refused[table] = self.refused.get(table, 0) + len(refused)
            if table == DEAD_LETTER_TABLE:
                raise RuntimeError(f"dead-letter rows could not be stored: {refused[0]['reason']}")
            self._buffers.setdefault(DEAD_LETTER_TABLE, RowBuffer()).extend(refused)
            self.rows_written[DEAD_LETTER_TABLE] = self.rows_written.get(DEAD_LETTER_TABLE, 0) + len(refused)
            self._flush_table(DEAD_LETTER_TABLE)

    # -- reading -----------------------------------------------------------------------------
    def query(self, sql: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
        """Run SQL over the tables after flushing, returning the rows as tuples."""
        with self._lock:
            self.flush()
            return self._con.execute(sql, params or []).fetchall()

    def read(self, table: str) -> pa.Table:
        """A whole table as Arrow, after flushing."""
        with self._lock:
            self.flush()
            return self._con.sql(f"SELECT * FROM {quote_identifier(check_table_name(table))}").to_arrow_table()

    def tables(self) -> list[str]:
        """Names of the tables in the file (after flushing)."""
        return [row[0] for row in self.query("SELECT table_name FROM information_schema.tables ORDER BY 1")]

    def drop(self, tables: Iterable[str]) -> None:
        """Drop ``tables`` (and their buffered rows) if they exist."""
        with self._lock:
            self._drain()
            for table in tables:
                self._buffers.pop(check_table_name(table), None)
                self._columns.pop(table, None)
                self._con.execute(f"DROP TABLE IF EXISTS {quote_identifier(table)}")

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (a device run's ``/readyz`` asks)."""
        return self._closed

    def close(self) -> None:
        """Flush and close; safe to call twice. Held storage drops the rows no :meth:`commit` stored."""
        with self._lock:
            if self._closed:
                return
            try:
                if self._on_due is not None and self.pending():
                    log.info("%s: %d rows after the last checkpoint not stored (a resumed run computes them "
                             "again)", self.path, self.pending())
                self.flush()
            finally:
                self._closed = True
                try:
                    if self._writer is not None:
                        self._writer.stop()
                finally:
                    self._con.close()

    def __enter__(self) -> CollectiveStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _BackgroundWriter:
    """A thread that stores the buffers handed to it, in order (``CollectiveStorage(background=True)``).

    ``store(table, buffer)`` does the storing and returns the dead letters of refused rows, which wait in
    :attr:`outcomes` for the storage's own thread to count. At most ``depth`` buffers wait: ``submit``
    blocks while the writer is behind. An exception of ``store`` is raised on the next ``submit``/``wait``.
    """

    def __init__(self, store: Callable[[str, RowBuffer], list[dict[str, Any]]], depth: int = 2):
        self._store = store
        self._queue: queue.Queue[tuple[str, RowBuffer] | None] = queue.Queue(maxsize=depth)
        self._inflight: deque[RowBuffer] = deque()
        self.outcomes: deque[tuple[str, list[dict[str, Any]]]] = deque()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="streamflow-storage-writer", daemon=True)
        self._thread.start()

    def submit(self, table: str, buffer: RowBuffer) -> None:
        self._raise()
        self._inflight.append(buffer)
        self._queue.put((table, buffer))

    def rows(self) -> int:
        """Rows handed over and not stored yet."""
        return sum(buffer.n for buffer in list(self._inflight))

    def wait(self) -> None:
        """Until every buffer handed over is stored."""
        self._queue.join()
        self._raise()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                refused = self._store(*item)
                if refused:
                    self.outcomes.append((item[0], refused))
            except BaseException as exc:  # the storage's thread raises it
                self._error = exc
            finally:
                self._inflight.popleft()
                self._queue.task_done()
        self._queue.task_done()


def flush_on_signals() -> None:
    """Turn SIGTERM into ``SystemExit`` (SIGINT already raises ``KeyboardInterrupt``).

    Either way the stack unwinds through the ``with``/``finally`` blocks that close the storage,
    so buffered rows are flushed on the main thread, never from inside a signal handler in the
    middle of a write.
    """
    def _terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _terminate)
