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

import logging
import os
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
from numpy.typing import NDArray

from connectors.json_values import to_json
from connectors.row_buffer import RowBuffer, column_names, row_encoding_errors
from connectors.sql import (
    KnownColumns,
    batch_shape,
    check_table_name,
    ensure_columns,
    quote_identifier,
    quoted_list,
    registered,
)

if TYPE_CHECKING:
    import pyarrow as pa

DEAD_LETTER_TABLE = "dead_letter"
#: The DuckDB file a :class:`CollectiveStorage` given no path writes (in the working directory). The CLI passes
#: ``streamflow.settings``' ``db`` (``--db``, then ``$STREAMFLOW_DB``, then this same name).
DEFAULT_DB_PATH = Path("streamflow.duckdb")
log = logging.getLogger("streamflow.storage")
#: With a background writer, the WAL size (MiB) at which a COMMIT checkpoints it into the file (see __init__).
BACKGROUND_CHECKPOINT_MB = 4


class CollectiveStorage:
    """Buffered DuckDB tables for feature rows (see the module docstring for durability), in the DuckDB file
    ``path`` (default :data:`DEFAULT_DB_PATH`).

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
        self.path = Path(path) if path else DEFAULT_DB_PATH
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

    def write_table(self, table: str, data: dict[str, NDArray[Any]]) -> None:
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

    def _store_batches(self, table: str, batches: Callable[[], list[pa.Table | dict[str, NDArray[Any]]]],
                       rows: Callable[[], Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
        """Insert ``batches()`` in one transaction, or, if they cannot be made or are refused, ``rows()`` one
        by one; the refused rows' dead letters."""
        try:
            self._insert(table, *batches())
            return []
        except row_encoding_errors():
            return self._insert_row_by_row(table, rows())

    def _settle(self) -> None:
        """Count what the background writer refused, and hand the dead letters to it."""
        assert self._writer is not None  # called only when there is one
        outcomes = self._writer.outcomes
        while outcomes:
            table, refused = outcomes.popleft()
            self._account_refusals(table, refused)

    def _insert(self, table: str, *batches: pa.Table | dict[str, NDArray[Any]]) -> None:
        """Insert the batches in one transaction: all of them or none."""
        self._transaction([(table, list(batches))], None)

    def _insert_batches(self, table: str, batches: Iterable[pa.Table | dict[str, NDArray[Any]]]) -> None:
        for batch in batches:
            with registered(self._con, "_sf_batch", batch):
                columns = column_names(batch)
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

    def _insert_row_by_row(self, table: str, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
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
