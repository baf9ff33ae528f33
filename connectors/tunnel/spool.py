"""The device's durable send queue: sealed, signed batches waiting for the broker's acknowledgement.

A batch is *sealed* when its rows get their sequence numbers and its envelope is written to the
spool; the sequence counter moves in the same transaction, so after a crash the device neither
reuses nor skips a number. A batch leaves the spool when the broker has acknowledged it
(:meth:`Spool.ack`), or, with ``keep_acked`` (the tunnel's receipts, :mod:`.receipts`), only when the cloud
says it stored it (:meth:`Spool.trim`): until then an acknowledged batch is kept, and sent again if the cloud
lacks it (:meth:`Spool.resend`). Batches are sent oldest first, so a device's rows reach the topic in order.

The spool is a SQLite database in WAL mode with ``synchronous=FULL``: every seal is on disk before
:meth:`Spool.seal` returns, and SIGKILL or power loss cannot tear a batch. An ack's delete is committed
without waiting for the disk (``synchronous=NORMAL`` for that transaction, one fsync less per batch): a
delete lost to a power cut only makes the device send that batch again, which the cloud drops as a repeat.
SQLite, not DuckDB, because this is a small transactional queue with one insert and one delete per
batch, SQLite's home ground. It also keeps the zstd dictionaries the device trained (:mod:`.codebook`),
so a restart goes on with them.

One process at a time: a spool takes an exclusive lock (``flock`` on ``<spool>.lock``, released by
the kernel when the process dies, even by SIGKILL); a second process opening it gets :class:`SpoolLocked`.

Bound: at most ``max_bytes`` of envelopes. Policy when full: batches the broker acknowledged and the cloud has
not confirmed yet are evicted, oldest first, until the new one fits (counted in ``rows_evicted``, logged at
WARNING: the broker has them, only the second line of defence is given up for them); if that is not enough,
the seal is refused with :class:`SpoolFull` and the caller stores the rows elsewhere (the tunnel sink puts
them in the device's ``dead_letter`` table with the reason and counts them). A batch the broker has not
acknowledged is never dropped to make room, because those rows may be the only copy.

Example:
    >>> import os, tempfile
    >>> spool = Spool(os.path.join(tempfile.mkdtemp(), "spool.sqlite"), max_bytes=1 << 20)
    >>> spool.seal("ipv", 2, lambda first_seq: b"envelope of rows %d..%d" % (first_seq, first_seq + 1))
    0
    >>> spool.seal("ipv", 3, lambda first_seq: b"three more rows")
    2
    >>> [(e.first_seq, e.n_rows) for e in spool.oldest(10)], spool.next_seq
    ([(0, 2), (2, 3)], 5)
    >>> spool.ack(0); [e.first_seq for e in spool.oldest(10)], spool.rows_pending
    ([2], 3)
    >>> kept = Spool(os.path.join(tempfile.mkdtemp(), "spool.sqlite"), keep_acked=True)
    >>> for n in (2, 3): _ = kept.seal("ipv", n, lambda first_seq: b"rows")
    >>> kept.ack(0); kept.ack(2); (kept.rows_pending, kept.rows_held), [a.first_seq for a in kept.acked()]
    ((0, 5), [0, 2])
    >>> kept.resend([2]); [e.first_seq for e in kept.oldest(10)]  # the cloud lacks 2..4: sent again
    [2]
    >>> kept.trim(lambda first, end: end <= 2), kept.rows_held  # the cloud has 0..1
    ((2, 1), 3)
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("streamflow.tunnel")


class SpoolFull(Exception):
    """Sealing these rows would pass the spool's byte bound."""


class SpoolLocked(RuntimeError):
    """Another process (or another open Spool) holds this spool."""


@dataclass(frozen=True)
class SpoolEntry:
    first_seq: int
    n_rows: int
    table: str
    value: bytes
    sealed_at: float  # time.time() when sealed


@dataclass(frozen=True)
class Acked:
    """A batch the broker acknowledged and the cloud has not confirmed (kept with ``keep_acked``)."""

    first_seq: int
    n_rows: int
    acked_at: float  # time.time() of the broker's acknowledgement

    @property
    def end(self) -> int:
        return self.first_seq + self.n_rows


class Spool:
    """A bounded, durable FIFO of envelopes keyed by their first sequence number (thread-safe).

    ``rows_pending``/``batches_pending``/``bytes_pending``: what the broker has not acknowledged yet (to send);
    ``rows_held``/``batches_held``/``bytes_held``: everything in the spool (with ``keep_acked``, also what the
    broker has and the cloud has not confirmed); the bound is on ``bytes_held``.
    """

    def __init__(self, path: str | os.PathLike[str], max_bytes: int = 256 << 20, keep_acked: bool = False):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.keep_acked = keep_acked
        self.rows_evicted = 0
        self.batches_evicted = 0
        self._evicted_warned_at = 0
        self._lock_file = _lock_exclusively(Path(f"{self.path}.lock"))
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("CREATE TABLE IF NOT EXISTS batches (first_seq INTEGER PRIMARY KEY, n_rows INTEGER NOT NULL,"
                         " table_name TEXT NOT NULL, value BLOB NOT NULL, sealed_at REAL NOT NULL)")
        self._db.execute("CREATE TABLE IF NOT EXISTS counter (id INTEGER PRIMARY KEY CHECK (id = 0), next_seq INTEGER)")
        self._db.execute("INSERT OR IGNORE INTO counter VALUES (0, 0)")
        self._db.execute("CREATE TABLE IF NOT EXISTS dictionaries (table_name TEXT PRIMARY KEY, body BLOB NOT NULL,"
                         " useful INTEGER NOT NULL)")
        # the batches the broker acknowledged and the cloud has not confirmed: a table of their own, so an ack
        # writes a small row, never the envelope again (SQLite rewrites a whole row on UPDATE)
        self._db.execute("CREATE TABLE IF NOT EXISTS acked (first_seq INTEGER PRIMARY KEY, acked_at REAL NOT NULL)")
        if not keep_acked:  # kept by a run with receipts, opened by one without: send them again (repeats, dropped)
            self._db.execute("DELETE FROM acked")
        self._db.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value)")
        self.next_seq, = self._db.execute("SELECT next_seq FROM counter").fetchone()
        self._count()

    def _count(self) -> None:
        self.bytes_pending, self.rows_pending, self.batches_pending = self._db.execute(
            "SELECT coalesce(sum(length(value)), 0), coalesce(sum(n_rows), 0), count(*) FROM batches "
            "WHERE first_seq NOT IN (SELECT first_seq FROM acked)").fetchone()
        self.bytes_held, self.rows_held, self.batches_held = self._db.execute(
            "SELECT coalesce(sum(length(value)), 0), coalesce(sum(n_rows), 0), count(*) FROM batches").fetchone()

    def seal(self, table: str, n_rows: int, envelope: Callable[[int], bytes], sealed_at: float = 0.0) -> int:
        """Number ``n_rows`` rows from the next sequence number, store ``envelope(first_seq)``, return first_seq.

        Raises :class:`SpoolFull` (and numbers nothing) if the envelope does not fit under ``max_bytes``.
        """
        with self._lock:
            first_seq = self.next_seq
            value = envelope(first_seq)
            if self.bytes_held + len(value) > self.max_bytes:
                self._evict(self.bytes_held + len(value) - self.max_bytes)
            if self.bytes_held + len(value) > self.max_bytes:
                raise SpoolFull(f"spool {self.path} holds {self.bytes_held} bytes; {len(value)} more would pass "
                                f"its bound of {self.max_bytes} bytes")
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute("INSERT INTO batches (first_seq, n_rows, table_name, value, sealed_at) "
                                 "VALUES (?, ?, ?, ?, ?)", (first_seq, n_rows, table, value, sealed_at))
                self._db.execute("UPDATE counter SET next_seq = ?", (first_seq + n_rows,))
            self.next_seq = first_seq + n_rows
            self.bytes_pending += len(value)
            self.rows_pending += n_rows
            self.batches_pending += 1
            self.bytes_held += len(value)
            self.rows_held += n_rows
            self.batches_held += 1
            return first_seq

    def _evict(self, need: int) -> None:
        """Drop acknowledged batches the cloud has not confirmed, oldest first, until ``need`` bytes are free."""
        rows = self._db.execute("SELECT first_seq, n_rows, length(value) FROM batches JOIN acked USING (first_seq) "
                                "ORDER BY first_seq").fetchall()
        drop, freed = [], 0
        for first_seq, n_rows, size in rows:
            if freed >= need:
                break
            drop.append((first_seq, n_rows))
            freed += size
        if not drop:
            return
        with self._db:
            self._db.executemany("DELETE FROM batches WHERE first_seq = ?", [(f,) for f, _ in drop])
            self._db.executemany("DELETE FROM acked WHERE first_seq = ?", [(f,) for f, _ in drop])
        self._count()
        evicted = sum(n for _, n in drop)
        self.rows_evicted += evicted
        self.batches_evicted += len(drop)
        if self.rows_evicted >= 2 * self._evicted_warned_at:
            self._evicted_warned_at = self.rows_evicted
            log.warning("TUNNEL SPOOL FULL: evicted %d rows (seq %d..%d; %d so far) the broker acknowledged and the "
                        "cloud has not confirmed yet, oldest first; should the broker lose them, they are lost",
                        evicted, drop[0][0], drop[-1][0] + drop[-1][1] - 1, self.rows_evicted)

    def oldest(self, limit: int = 1) -> list[SpoolEntry]:
        """Up to ``limit`` batches in sequence order, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT first_seq, n_rows, table_name, value, sealed_at FROM batches "
                                    "WHERE first_seq NOT IN (SELECT first_seq FROM acked) ORDER BY first_seq LIMIT ?",
                                    (limit,)).fetchall()
        return [SpoolEntry(*row) for row in rows]

    def ack(self, first_seq: int) -> None:
        """The broker has the batch starting at ``first_seq``: forget it (with ``keep_acked``: mark it acknowledged)."""
        with self._lock:
            row = self._db.execute("SELECT n_rows, length(value) FROM batches WHERE first_seq = ? AND first_seq NOT IN "
                                   "(SELECT first_seq FROM acked)", (first_seq,)).fetchone()
            if row is None:
                return
            self._db.execute("PRAGMA synchronous=NORMAL")  # see the module docstring: a lost delete is a resend
            try:
                if self.keep_acked:
                    self._db.execute("INSERT INTO acked VALUES (?, ?)", (first_seq, time.time()))
                else:
                    self._db.execute("DELETE FROM batches WHERE first_seq = ?", (first_seq,))
            finally:
                self._db.execute("PRAGMA synchronous=FULL")
            self.rows_pending -= row[0]
            self.bytes_pending -= row[1]
            self.batches_pending -= 1
            if not self.keep_acked:
                self.rows_held -= row[0]
                self.bytes_held -= row[1]
                self.batches_held -= 1

    def acked(self) -> list[Acked]:
        """The batches the broker acknowledged that are still kept, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT first_seq, n_rows, acked_at FROM batches JOIN acked USING (first_seq) "
                                    "ORDER BY first_seq").fetchall()
        return [Acked(*row) for row in rows]

    def trim(self, stored: Callable[[int, int], bool]) -> tuple[int, int]:
        """Forget every batch ``stored(first_seq, end)`` says the cloud has; returns (rows, batches) forgotten."""
        with self._lock:
            spans = self._db.execute("SELECT first_seq, n_rows FROM batches ORDER BY first_seq").fetchall()
            drop = [(first, n) for first, n in spans if stored(first, first + n)]
            if not drop:
                return 0, 0
            self._db.execute("PRAGMA synchronous=NORMAL")  # a lost delete: the next receipt trims it again
            try:
                with self._db:
                    self._db.executemany("DELETE FROM batches WHERE first_seq = ?", [(f,) for f, _ in drop])
                    self._db.executemany("DELETE FROM acked WHERE first_seq = ?", [(f,) for f, _ in drop])
            finally:
                self._db.execute("PRAGMA synchronous=FULL")
            self._count()
            return sum(n for _, n in drop), len(drop)

    def resend(self, first_seqs: Iterable[int]) -> None:
        """Send these acknowledged batches again (the cloud lacks them): they join the batches to send."""
        with self._lock, self._db:
            self._db.executemany("DELETE FROM acked WHERE first_seq = ?", [(f,) for f in first_seqs])
            self._count()

    def get(self, name: str) -> object:
        """A value kept under ``name`` (None if none)."""
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        return None if row is None else row[0]

    def put(self, name: str, value: object) -> None:
        with self._lock, self._db:
            self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (name, value))

    def save_dictionary(self, table: str, body: bytes, useful: bool) -> None:
        """Keep ``table``'s zstd dictionary (and whether it is used) for the next run."""
        with self._lock, self._db:
            self._db.execute("INSERT OR REPLACE INTO dictionaries VALUES (?, ?, ?)", (table, body, int(useful)))

    def dictionaries(self) -> dict[str, tuple[bytes, bool]]:
        """Table → (dictionary body, whether it is used), as saved."""
        with self._lock:
            rows = self._db.execute("SELECT table_name, body, useful FROM dictionaries").fetchall()
        return {table: (body, bool(useful)) for table, body, useful in rows}

    def close(self) -> None:
        with self._lock:
            self._db.close()
            os.close(self._lock_file)  # releases the flock


def _lock_exclusively(path: Path) -> int:
    """An open descriptor of ``path`` holding an exclusive ``flock``, with this process's pid in it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise SpoolLocked(f"tunnel spool {path.with_suffix('')} is in use by another process (pid {holder}); "
                          "one device process per spool: stop it or give this one another spool") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd
