"""The release server's durable state: one SQLite file (WAL) and a content-addressed file store beside it.

Tables: ``bundles`` (published manifests and signatures) with ``bundle_files``, ``tasks`` (each task's
stable version), ``releases`` (plan, stage, gray fraction, outcome, simulation report) with
``release_events`` (every transition, why), ``reports`` (device success/failure reports), ``blocked``
(digests that may never be released again), ``coverage`` (samples over time, for the status page) and
``devices`` (the last versions each device reported), ``offers`` (the devices each release was offered to,
its only samples). File contents live in ``files/<sha256>``, written
once, atomically (a fresh temporary name, then rename). The directory, ``files/`` and the database are
this user's only (0700, 0600: :mod:`connectors.private`): exclusive files are served per device.

SQLite rather than DuckDB: the writes are many small ones (a report, a transition), which is what
SQLite is for; the status page's few aggregates are cheap on either.

Example:
    >>> import tempfile
    >>> store = ReleaseStore(tempfile.mkdtemp())
    >>> store.put_file(b"print('hi')")
    'c2d0a5e0790d97a015387a995c0d0b5eb3e88138466586fc980787c9b1731eb8'
    >>> store.set_stable("ipv", "2"); store.stable_versions()
    {'ipv': '2'}
    >>> store.close()
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from connectors.private import create_private, private_dir, tighten, write_private

_SCHEMA = """
CREATE TABLE IF NOT EXISTS bundles (task TEXT, version TEXT, digest TEXT UNIQUE, key_id TEXT, previous TEXT,
                                    manifest BLOB, signature BLOB, published_at REAL, PRIMARY KEY (task, version));
CREATE TABLE IF NOT EXISTS bundle_files (digest TEXT, name TEXT, sha256 TEXT, size INTEGER, scope TEXT);
CREATE INDEX IF NOT EXISTS bundle_files_sha ON bundle_files (sha256);
CREATE TABLE IF NOT EXISTS tasks (task TEXT PRIMARY KEY, stable TEXT);
CREATE TABLE IF NOT EXISTS releases (release_id TEXT PRIMARY KEY, seq INTEGER, task TEXT, version TEXT, digest TEXT,
                                     plan TEXT, status TEXT, stage TEXT, step INTEGER, fraction REAL,
                                     started_at REAL, stage_at REAL, ended_at REAL, reason TEXT, simulation TEXT);
CREATE TABLE IF NOT EXISTS release_events (release_id TEXT, at REAL, event TEXT, detail TEXT);
CREATE TABLE IF NOT EXISTS reports (at REAL, device TEXT, task TEXT, version TEXT, release_id TEXT, cohort TEXT,
                                    ok INTEGER, reason TEXT, via TEXT);
CREATE INDEX IF NOT EXISTS reports_release ON reports (release_id);
CREATE TABLE IF NOT EXISTS blocked (digest TEXT PRIMARY KEY, task TEXT, version TEXT, reason TEXT, at REAL);
CREATE TABLE IF NOT EXISTS coverage (release_id TEXT, at REAL, fraction REAL, devices INTEGER, on_version INTEGER,
                                     samples INTEGER, failed INTEGER);
CREATE TABLE IF NOT EXISTS devices (device TEXT, task TEXT, version TEXT, seen_at REAL, PRIMARY KEY (device, task));
CREATE TABLE IF NOT EXISTS offers (release_id TEXT, device TEXT, PRIMARY KEY (release_id, device));
"""

_RELEASE_COLUMNS = ("release_id", "seq", "task", "version", "digest", "plan", "status", "stage", "step", "fraction",
                    "started_at", "stage_at", "ended_at", "reason", "simulation")


@dataclass(frozen=True)
class StoredBundle:
    """A published bundle: its manifest and signature bytes as the publisher signed them."""

    task: str
    version: str
    digest: str
    key_id: str
    previous: str | None
    manifest: bytes
    signature: bytes
    published_at: float


@dataclass(frozen=True)
class StoredFile:
    """Where a file digest is known from: its size and scope (``shared`` or ``exclusive``)."""

    sha256: str
    size: int
    scope: str


class ReleaseStore:
    """The SQLite file ``<dir>/release.sqlite`` and the file store ``<dir>/files/`` (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str]):
        self.dir = private_dir(directory)
        self.files_dir = private_dir(self.dir / "files")
        database = self.dir / "release.sqlite"
        with contextlib.suppress(FileExistsError):
            create_private(database, b"")  # SQLite gives its -wal and -shm files the database's mode
        for path in (database, database.with_name("release.sqlite-wal"), database.with_name("release.sqlite-shm")):
            tighten(path, 0o600)  # an older server's 0644 files
        self._con = sqlite3.connect(database, check_same_thread=False, isolation_level=None)
        self._con.execute("PRAGMA journal_mode=WAL")
        self._con.execute("PRAGMA synchronous=NORMAL")
        self._con.executescript(_SCHEMA)
        self._lock = threading.RLock()

    # -- files -------------------------------------------------------------------------------
    def put_file(self, data: bytes) -> str:
        """Store ``data`` under its sha256 (once); returns the digest."""
        digest = hashlib.sha256(data).hexdigest()
        path = self.files_dir / digest
        if not path.exists():
            write_private(path, data)
        return digest

    def file_path(self, sha256: str) -> Path | None:
        """The stored file of a digest (a 64-hex-digit string, else None), if stored."""
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            return None
        path = self.files_dir / sha256
        return path if path.is_file() else None

    def file_info(self, sha256: str) -> StoredFile | None:
        """The size and scope a published manifest gives ``sha256`` (shared wins if both)."""
        rows = self._query("SELECT size, scope FROM bundle_files WHERE sha256 = ?", [sha256])
        if not rows:
            return None
        scopes = {scope for _, scope in rows}
        return StoredFile(sha256, rows[0][0], "shared" if "shared" in scopes else "exclusive")

    # -- bundles -------------------------------------------------------------------------------
    def add_bundle(self, bundle: StoredBundle, files: Iterable[tuple[str, str, int, str]]) -> None:
        """Record a published bundle and its files (``(name, sha256, size, scope)``), in one transaction."""
        with self._transaction() as con:
            con.execute("INSERT INTO bundles VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        [bundle.task, bundle.version, bundle.digest, bundle.key_id, bundle.previous, bundle.manifest,
                         bundle.signature, bundle.published_at])
            con.executemany("INSERT INTO bundle_files VALUES (?, ?, ?, ?, ?)",
                            [(bundle.digest, *f) for f in files])

    def bundle(self, task: str, version: str) -> StoredBundle | None:
        rows = self._query("SELECT * FROM bundles WHERE task = ? AND version = ?", [task, version])
        return StoredBundle(*rows[0]) if rows else None

    def bundles(self) -> list[StoredBundle]:
        return [StoredBundle(*row) for row in self._query("SELECT * FROM bundles ORDER BY task, published_at")]

    def versions_with_file(self, sha256: str) -> list[tuple[str, str]]:
        """``(task, version)`` of every published bundle that lists the file ``sha256``."""
        return self._query("SELECT DISTINCT b.task, b.version FROM bundle_files f JOIN bundles b USING (digest) "
                           "WHERE f.sha256 = ? ORDER BY 1, 2", [sha256])

    def bundle_files(self, digest: str) -> list[tuple[str, str, int, str]]:
        return self._query("SELECT name, sha256, size, scope FROM bundle_files WHERE digest = ?", [digest])

    # -- tasks, releases, events ----------------------------------------------------------------
    def set_stable(self, task: str, version: str | None) -> None:
        self._execute("INSERT INTO tasks VALUES (?, ?) ON CONFLICT (task) DO UPDATE SET stable = excluded.stable",
                      [task, version])

    def stable_versions(self) -> dict[str, str]:
        return {task: v for task, v in self._query("SELECT task, stable FROM tasks ORDER BY task") if v is not None}

    def save_release(self, release: dict[str, Any]) -> None:
        """Insert or replace one release row (``release`` maps every column of ``releases``)."""
        row = [release[c] if c not in ("plan", "simulation") or release[c] is None or isinstance(release[c], str)
               else json.dumps(release[c], sort_keys=True) for c in _RELEASE_COLUMNS]
        self._execute(f"INSERT OR REPLACE INTO releases VALUES ({', '.join('?' * len(row))})", row)

    def releases(self) -> list[dict[str, Any]]:
        rows = self._query(f"SELECT {', '.join(_RELEASE_COLUMNS)} FROM releases ORDER BY seq")
        out = []
        for row in rows:
            release = dict(zip(_RELEASE_COLUMNS, row, strict=True))
            release["plan"] = json.loads(release["plan"])
            release["simulation"] = json.loads(release["simulation"]) if release["simulation"] else None
            out.append(release)
        return out

    def add_event(self, release_id: str, at: float, event: str, detail: str = "") -> None:
        self._execute("INSERT INTO release_events VALUES (?, ?, ?, ?)", [release_id, at, event, detail])

    def events(self, release_id: str | None = None, limit: int = 200) -> list[tuple[str, float, str, str]]:
        if release_id is None:
            return self._query("SELECT * FROM release_events ORDER BY at DESC, rowid DESC LIMIT ?", [limit])
        return self._query("SELECT * FROM release_events WHERE release_id = ? ORDER BY at, rowid", [release_id])

    # -- reports, coverage, devices, blocked ------------------------------------------------------
    def add_reports(self, rows: Sequence[tuple[Any, ...]]) -> None:
        """``(at, device, task, version, release_id, cohort, ok, reason, via)`` rows, in one transaction."""
        if rows:
            with self._transaction() as con:
                con.executemany("INSERT INTO reports VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)

    def reports(self, release_id: str) -> list[tuple[str, str, int]]:
        """``(device, cohort, ok)`` of every report on a release, oldest first."""
        return self._query("SELECT device, cohort, ok FROM reports WHERE release_id = ? ORDER BY at, rowid",
                           [release_id])

    def add_offers(self, rows: Sequence[tuple[str, str]]) -> None:
        """``(release_id, device)`` rows: a release was offered to a device."""
        if rows:
            with self._transaction() as con:
                con.executemany("INSERT OR IGNORE INTO offers VALUES (?, ?)", rows)

    def offers(self, release_id: str) -> list[str]:
        """The devices a release was offered to."""
        return [device for (device,) in self._query("SELECT device FROM offers WHERE release_id = ?", [release_id])]

    def add_coverage(self, rows: Sequence[tuple[Any, ...]]) -> None:
        if rows:
            with self._transaction() as con:
                con.executemany("INSERT INTO coverage VALUES (?, ?, ?, ?, ?, ?, ?)", rows)

    def coverage(self, release_id: str) -> list[tuple[float, float, int, int, int, int]]:
        """``(at, fraction, devices, on_version, samples, failed)`` samples of a release, oldest first."""
        return self._query("SELECT at, fraction, devices, on_version, samples, failed FROM coverage "
                           "WHERE release_id = ? ORDER BY at", [release_id])

    def save_devices(self, rows: Sequence[tuple[str, str, str, float]]) -> None:
        """Upsert ``(device, task, version, seen_at)`` rows."""
        if rows:
            with self._transaction() as con:
                con.executemany("INSERT INTO devices VALUES (?, ?, ?, ?) ON CONFLICT (device, task) DO UPDATE SET "
                                "version = excluded.version, seen_at = excluded.seen_at", rows)

    def devices(self) -> list[tuple[str, str, str]]:
        return self._query("SELECT device, task, version FROM devices")

    def block(self, digest: str, task: str, version: str, reason: str, at: float) -> None:
        self._execute("INSERT OR IGNORE INTO blocked VALUES (?, ?, ?, ?, ?)", [digest, task, version, reason, at])

    def blocked(self) -> dict[str, tuple[str, str, str, float]]:
        """digest → ``(task, version, reason, at)``."""
        return {row[0]: row[1:] for row in self._query("SELECT * FROM blocked ORDER BY at")}

    # -- plumbing ------------------------------------------------------------------------------
    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._con.execute(sql, params).fetchall()

    def _execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        with self._lock:
            self._con.execute(sql, params)

    def _transaction(self) -> _Transaction:
        return _Transaction(self._con, self._lock)

    def close(self) -> None:
        with self._lock:
            self._con.close()


class _Transaction:
    def __init__(self, con: sqlite3.Connection, lock: threading.RLock):
        self.con, self.lock = con, lock

    def __enter__(self) -> sqlite3.Connection:
        self.lock.acquire()
        self.con.execute("BEGIN")
        return self.con

    def __exit__(self, exc_type: object, *rest: object) -> None:
        try:
            self.con.execute("ROLLBACK" if exc_type is not None else "COMMIT")
        finally:
            self.lock.release()
