"""The cloud side of the tunnel: verify, de-duplicate and store the features devices send.

:class:`CloudStore` is the DuckDB side. One :meth:`CloudStore.apply` is one transaction that

- drops rows already stored, by (device, seq) (a device resends a batch it has no ack for);
- appends the new rows to the offline table ``<table>`` (``device_id, seq, ingested_at`` then the
  row's columns; append-only, the training-data history);
- upserts them into the online table ``<table>_online``: the newest row (highest seq) per
  (device_id, *online_key), the serving view (in the same transaction, or with ``online_lag_s`` in a
  later one; see :class:`CloudStore`);
- stores refused messages in ``tunnel.dead_letter`` with the reason;
- stores the schemas and zstd dictionaries envelopes carried in ``tunnel.registry`` (the cloud's
  registry: the envelopes after them name them by id);
- records, per topic partition, the offset to consume next (``tunnel.offsets``).

The store's own tables live in the DuckDB schema ``tunnel`` (:mod:`.cloud_tables`), the devices' in ``main``:
no table name a device can send reaches them.

An envelope naming a schema or dictionary the registry does not have (its registration lost with a
wiped registry or a truncated topic) is a dead letter ``unknown_schema``, counted, and parked: once
that registration arrives (the device announces again after a reconnect, every few minutes, and at once
when the receipt asks it to: a receipt says ``announce`` while the device has envelopes parked),
:meth:`CloudStore.recover` opens it again and stores its rows (or dead-letters it for what else is
wrong with it), marking the parked row ``resolved_at``. The de-duplication by (device, seq) makes a
late batch safe, and the online table keeps the newest row whatever the arrival order.

:class:`CloudConsumer` is a Kafka consumer group around it. Offsets live in DuckDB, in the same
transaction as the rows, and a consumer seeks to them when it is assigned a partition, so a crash
between storing and committing to Kafka neither loses nor repeats a row: the effect is exactly
once. (It also commits to Kafka, for lag monitoring.) It assigns itself every partition of the topic
rather than waiting for a group rebalance (see :meth:`CloudConsumer._connect` for why). Refused
messages also go, with their reason in the headers, to the dead-letter topic ``<topic>.dlq``; the
consumer counts them and goes on.

What may reach SQL: every name built into a statement is quoted (:func:`connectors.sql.quote_identifier`),
and a batch whose table or column names are not plain identifiers, or fall outside the declared
``schemas``, is dead-lettered as ``bad_schema`` before any SQL (:func:`schema_problem`).

Values are stored as sent (:mod:`.strict`): a value its column's type would change (declared in ``schemas``
as ``{table: {column: type}}``, else the type the column already has) sends its row to the dead letter
``bad_value`` with the reason; the rows beside it are stored.

Example (no broker needed for the store):
    >>> import os, tempfile, pyarrow as pa
    >>> from connectors.tunnel.envelope import Batch
    >>> store = CloudStore(os.path.join(tempfile.mkdtemp(), "cloud.duckdb"))
    >>> rows = pa.table({"user_id": ["u1", "u1"], "dwell_s": [3.0, 9.5]})
    >>> store.apply([Batch("phone-1", "ipv", 0, rows)], []).stored
    2
    >>> store.apply([Batch("phone-1", "ipv", 0, rows)], []).duplicates  # the same batch again
    2
    >>> store.query("SELECT device_id, seq, dwell_s FROM ipv ORDER BY seq")
    [('phone-1', 0, 3.0), ('phone-1', 1, 9.5)]
    >>> store.query("SELECT device_id, user_id, seq, dwell_s FROM ipv_online")
    [('phone-1', 'u1', 1, 9.5)]
    >>> store.close()
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from connectors.json_values import to_json
from connectors.sql import (
    KnownColumns,
    batch_shape,
    ensure_columns,
    is_identifier,
    number_shape,
    quote_identifier,
    quoted_list,
    registered,
    scalar,
)
from connectors.tunnel import strict
from connectors.tunnel.budget import DEFAULT as DEFAULT_BUDGET
from connectors.tunnel.budget import Budget
from connectors.tunnel.cloud_tables import Tables
from connectors.tunnel.envelope import Batch, EnvelopeError, Keys, Origin, decode
from connectors.tunnel.kafka import (
    CLIENT_TIMEOUTS,
    DEFAULT_BOOTSTRAP,
    DEFAULT_TOPIC,
    Retry,
    dead_letter_topic,
    ensure_topic,
    probe_broker,
)
from connectors.tunnel.keys import KeyRegistry
from connectors.tunnel.ledger import Gap, Ledger
from connectors.tunnel.receipts import MAX_HOLES, Receipt, ReceiptPublisher
from connectors.tunnel.registry import Registration, RegistrationError, Registry

log = logging.getLogger("streamflow.cloud")

DEAD_LETTER_TABLE = "tunnel.dead_letter"
_META_COLUMNS = ("device_id", "seq", "ingested_at")
#: A consumer that got no record for this long polls without blocking (see CloudConsumer._poll).
IDLE_AFTER_S = 0.5
#: How often a consumer looks for partitions added to its topic (from its cached metadata).
_ASSIGNMENT_CHECK_S = 10.0
#: How often a consumer commits its offsets to Kafka (for lag monitoring only; Kafka's own auto-commit: 5 s).
KAFKA_COMMIT_INTERVAL_S = 1.0
#: While nothing arrives, how often :meth:`CloudConsumer.run` checks that the broker still answers.
IDLE_PROBE_S = 5.0
#: how long the cloud waits for a device's missing sequence numbers before it reports them lost
DEFAULT_GAP_WAIT_S = 30.0
#: the consumer's online tables follow its offline ones within about this (see CloudStore's online_lag_s)
DEFAULT_ONLINE_LAG_S = 0.1
#: What the tables can refuse a batch with (e.g. a value whose type clashes with its column's).
_STORE_ERRORS = (duckdb.Error, pa.ArrowException, ValueError, TypeError)
#: a restart re-applies the rows stored this long before the last mark too (a clock stepped back); the
#: upsert is idempotent (the highest seq wins), so applying a row twice changes nothing
_CATCH_UP_SLACK = timedelta(minutes=1)
PARKED = "unknown_schema"
#: DuckDB checkpoints (writes its WAL into the file) when the WAL passes ``checkpoint_threshold``, inside the commit
#: that passed it: measured, 0.2-0.8 s at its default 16 MB (growing with the table), and 50-290 ms at 1-2 MB (a
#: cost that barely shrinks with the WAL), a stall for every row arriving meanwhile. The consumer checkpoints when a
#: poll finds nothing and no record came for IDLE_AFTER_S (idle) and the WAL holds more than IDLE_CHECKPOINT_BYTES;
#: DuckDB's own checkpoint waits until WAL_CAP_BYTES, for a stream that never pauses (its stall is then longer and
#: rarer, about the same share of the time; a restart replays at most that much WAL).
IDLE_CHECKPOINT_BYTES = 1 << 20
WAL_CAP_BYTES = 64 << 20


@dataclass(frozen=True)
class DeadLetter:
    """A message the cloud refused, where it was, and why."""

    topic: str
    partition: int
    offset: int
    reason: str
    detail: str
    device: str | None
    raw: bytes
    registrations: tuple[Registration, ...] = ()  # those a verified envelope carried
    seqs: tuple[int, int] | None = None  # (first_seq, n_rows) of a verified envelope refused for what it holds


@dataclass
class ApplyResult:
    """What one :meth:`CloudStore.apply` stored: rows, repeated rows dropped, every dead letter it stored, new
    registrations, and parked envelopes it resolved."""

    stored: int = 0
    duplicates: int = 0
    dead_letters: list[DeadLetter] = field(default_factory=list)
    registered: int = 0
    resolved: int = 0
    gaps: list[Gap] = field(default_factory=list)  # gaps noticed, filled or given up (lost) meanwhile

    @property
    def dead(self) -> int:
        return len(self.dead_letters)


@dataclass
class CloudStats:
    """Running totals of a consumer (``dead`` by reason)."""

    messages: int = 0
    stored: int = 0
    duplicates: int = 0
    dead: Counter[str] = field(default_factory=Counter)
    registered: int = 0
    resolved: int = 0  # parked envelopes opened again once their registration arrived
    gaps: Counter[str] = field(default_factory=Counter)  # per-device sequence gaps: noticed, filled, lost
    rows_lost: int = 0  # the numbers of the lost gaps

    @property
    def dead_total(self) -> int:
        return sum(self.dead.values())

    def count(self, messages: int, result: ApplyResult) -> None:
        """Add one stored poll: ``messages`` read, what ``result`` says was stored; each dead letter is logged."""
        self.messages += messages
        self.stored += result.stored
        self.duplicates += result.duplicates
        self.registered += result.registered
        self.resolved += result.resolved
        for d in result.dead_letters:
            self.dead[d.reason] += 1
            log.warning("dead letter %s[%d]@%d from %s: %s", d.topic, d.partition, d.offset, d.device or "?", d.detail)
        for gap in result.gaps:
            self.gaps[gap.outcome or "noticed"] += 1
            if gap.outcome == "lost":
                self.rows_lost += gap.missing_rows
                log.error("GAP LOST: device %s's seqs %d..%d never arrived (%d numbers missing after %.0f s); "
                          "reported in tunnel.gaps", gap.device, gap.start, gap.end - 1, gap.missing_rows,
                          time.monotonic() - gap.noticed)
            elif gap.outcome == "filled":
                log.info("gap filled: device %s's seqs %d..%d arrived after %.1f s", gap.device, gap.start,
                         gap.end - 1, time.monotonic() - gap.noticed)
            else:
                log.warning("gap: device %s's seqs %d..%d are missing (a batch after them arrived); waiting for them",
                            gap.device, gap.start, gap.end - 1)


class CloudStore:
    """The cloud's DuckDB tables for tunnelled features (see the module docstring).

    ``online_lag_s``: 0 upserts the online table in the transaction that stores the rows. Above 0 the
    upsert of the rows stored since is deferred until :meth:`flush_online` runs at least that long after
    the first of them (the consumer calls it every poll), then done in one transaction for all of them:
    on a device shipping rows one by one the upsert is most of a transaction's cost (measured, CPU of one
    :meth:`apply` of a 3 KB row, same machine and load: 10.6 ms with the upsert, 3.3 deferred), and it need
    not hold the rows' arrival. The online table then lags the offline one by about ``online_lag_s``;
    :meth:`query` and :meth:`close` flush first. Each deferred upsert records the newest ``ingested_at`` it
    applied (``tunnel.online_marks``); a store opened after a crash upserts the rows stored since (less
    :data:`_CATCH_UP_SLACK`) before anything else.

    ``online_thread`` (with ``online_lag_s`` above 0; the consumer's choice): the deferred upserts run on a
    thread of their own, on a DuckDB connection of their own (a cursor of the store's), once ``online_lag_s``
    passed, so no transaction storing rows waits for one (:meth:`flush_online` with ``due_only`` then leaves
    it to that thread). The two write different tables (``<table>`` and ``tunnel.*`` here, ``<table>_online``
    and ``tunnel.online_marks`` there); DuckDB lets both transactions run at once and commits them in turn.
    Measured in ``bench.tunnel``'s 3 KB latency phase: an upsert took 12 ms of CPU (35 ms wall at load ~4)
    every ~0.1 s, which every row arriving meanwhile waited for.

    ``threads``: DuckDB's worker threads for this database (None: DuckDB's default, one per core). The consumer
    asks for 1: its transactions hold a poll's rows, too few for a parallel plan, and waking a worker per statement
    cost a one-row transaction ~15% more CPU (3.8 against 4.5 ms, measured) on the cores the devices' rows need.
    """

    def __init__(self, path: str | os.PathLike[str], online_key: Sequence[str] = ("user_id",),
                 schemas: Mapping[str, Collection[str]] | None = None, online_lag_s: float = 0.0,
                 gap_wait_s: float = DEFAULT_GAP_WAIT_S, online_thread: bool = False, threads: int | None = None):
        if online_lag_s < 0:
            raise ValueError(f"online_lag_s must be >= 0, got {online_lag_s}")
        self.online_lag_s = online_lag_s
        self._pending_online: dict[str, list[pa.Table]] = {}  # table → rows stored, not yet upserted online
        self._pending_since: float | None = None
        self._pending_lock = threading.Lock()  # the two above (the online thread takes them)
        self._online_lock = threading.RLock()  # held by a deferred upsert (on the online thread or not)
        self._online_worker: threading.Thread | None = None
        self._online_wake = threading.Event()
        self._online_stop = threading.Event()
        self.online_errors = 0  # deferred upserts the online table refused (logged; the offline rows stand)
        self.path = Path(path)
        #: table → declared columns (names, or a mapping column → DuckDB type); None: any table and columns with
        #: plain names
        self.schemas = schemas
        self._declared = self._declared_types(schemas or {})  # table → column → DuckDB type, where declared
        if self.path.parent != Path(""):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.online_key = tuple(online_key)
        self._con = duckdb.connect(str(self.path))
        self._con.execute(f"SET checkpoint_threshold = '{WAL_CAP_BYTES}B'")
        if threads is not None:
            self._con.execute(f"SET threads = {int(threads)}")
        self._wal = Path(f"{self.path}.wal")
        self._tables = Tables(self._con)
        self._tables.create()
        #: every device's schemas and dictionaries, as stored; decoding with it learns what envelopes carry
        self.registry = Registry()
        self._saved: set[tuple[str, int, bytes]] = set()
        for device, kind, id_, body in self._con.execute(f"SELECT device_id, kind, id, body FROM {self._t('registry')} "
                                                         "ORDER BY registered_at").fetchall():
            self._remember(device, Registration(kind, id_, body))
        self._columns: dict[str, KnownColumns] = {}
        self._online_keys: dict[str, list[str]] = {}
        self._seq_end: dict[str, int] = {}  # device → one past its highest stored seq
        #: per device, the numbers accounted for and the gaps between them (see :mod:`.ledger`)
        self.ledger = Ledger(gap_wait_s)
        self._lock = threading.Lock()
        self._parked_devices: set[str] = set()  # devices with envelopes parked as unknown_schema (see receipt)
        self._find_parked_devices()
        self._online_con = self._con
        self._catch_up_online()
        if online_thread and online_lag_s > 0:
            self._online_con = self._con.cursor()
            self._online_worker = threading.Thread(target=self._online_loop, name="cloud-online", daemon=True)
            self._online_worker.start()

    def apply(self, batches: Sequence[Batch], dead: Sequence[DeadLetter] = (),
              offsets: dict[tuple[str, int], int] | None = None,
              resolved: Sequence[tuple[str, int, int]] = ()) -> ApplyResult:
        """Store ``batches`` (but repeats), ``dead``, the registrations both carried and ``offsets`` in one
        transaction; ``resolved``: parked dead letters (topic, partition, offset) these batches came from.

        If the tables refuse the batches together (a column whose type changed, say), each batch is
        stored alone and those still refused become ``unstorable`` dead letters.
        """
        registrations = self._new_registrations([*batches, *dead])
        # a zero-row envelope only announces registrations (see Codebook.announcements): nothing else to store
        batches, dead = self._checked([b for b in batches if b.rows.num_rows], dead)
        with self._lock:
            try:
                result = self._transaction(batches, dead, offsets, registrations, resolved)
            except _STORE_ERRORS:
                result = ApplyResult()
                refused = []
                for batch in batches:
                    try:
                        one = self._transaction([batch], (), None)
                    except _STORE_ERRORS as exc:
                        refused.append(_dead_letter(batch, "unstorable", f"table {batch.table} refused the batch: "
                                                                         f"{type(exc).__name__}: {exc}"))
                        continue
                    result.stored += one.stored
                    result.duplicates += one.duplicates
                    result.dead_letters += one.dead_letters
                    result.gaps += one.gaps
                rest = self._transaction((), [*dead, *refused], offsets, registrations, resolved)
                result.dead_letters += rest.dead_letters
                result.gaps += rest.gaps
                result.registered, result.resolved = rest.registered, rest.resolved
            for device, registration in registrations:
                self._remember(device, registration)
            return result

    def recover(self, keys: Keys) -> ApplyResult:
        """Open the parked (``unknown_schema``) dead letters again with the registry as it is now; store those
        that open, dead-letter those refused for another reason, mark both ``resolved_at``, in one transaction.

        ``keys``: the device keys (each envelope is verified again). Cheap when nothing is parked.
        """
        with self._lock:
            parked = self._con.execute(f"SELECT topic, kafka_partition, kafka_offset, raw FROM "
                                       f"{self._t('dead_letter')} WHERE reason = ? AND resolved_at IS NULL "
                                       "ORDER BY kafka_partition, kafka_offset", [PARKED]).fetchall()
        batches: list[Batch] = []
        dead: list[DeadLetter] = []
        resolved = []
        for topic, partition, offset, raw in parked:
            opened = open_message(topic, partition, offset, raw, keys, registry=self.registry)
            if isinstance(opened, DeadLetter) and opened.reason == PARKED:
                continue
            if isinstance(opened, Batch):
                batches.append(opened)
            else:
                dead.append(opened)
            resolved.append((topic, partition, offset))
        if not resolved:
            return ApplyResult()
        result = self.apply(batches, dead, None, resolved)
        with self._lock:
            self._find_parked_devices()
        log.info("cloud: %d parked envelopes resolved now that their schemas are registered: %d rows stored, "
                 "%d dead letters", len(resolved), result.stored, len(dead))
        return result

    def _find_parked_devices(self) -> None:
        self._parked_devices = {d for (d,) in self._con.execute(
            f"SELECT DISTINCT device_id FROM {self._t('dead_letter')} WHERE reason = ? AND resolved_at IS NULL "
            "AND device_id IS NOT NULL", [PARKED]).fetchall()}

    @staticmethod
    def _declared_types(schemas: Mapping[str, Collection[str]]) -> dict[str, dict[str, str]]:
        """The column types ``schemas`` declares (a table's columns as a mapping column → type), as DuckDB names
        them; ``ValueError`` for a type DuckDB does not know."""
        con = duckdb.connect()
        try:
            return {table.lower(): {c.lower(): strict.normalize(con, t) for c, t in columns.items()}
                    for table, columns in schemas.items() if isinstance(columns, Mapping)}
        finally:
            con.close()

    def _t(self, table: str) -> str:
        """The full name of the store's own table ``table`` (see :mod:`.cloud_tables`)."""
        return self._tables.name(table)

    def _new_registrations(self, opened: Sequence[Batch | DeadLetter]) -> list[tuple[str, Registration]]:
        """The registrations ``opened`` carried that are not stored yet (each once)."""
        new: dict[tuple[str, int, bytes], tuple[str, Registration]] = {}
        for item in opened:
            for registration in item.registrations:
                key = (item.device or "", registration.kind, registration.id)
                if key not in self._saved:
                    new.setdefault(key, (item.device or "", registration))
        return list(new.values())

    def _remember(self, device: str, registration: Registration) -> None:
        try:
            self.registry.learn(device, registration)
        except RegistrationError as exc:  # decoding refused the envelope already; keep the first body
            log.warning("cloud: %s", exc)
        self._saved.add((device, registration.kind, registration.id))

    def _checked(self, batches: Sequence[Batch], dead: Sequence[DeadLetter]) -> tuple[list[Batch], list[DeadLetter]]:
        """``batches`` whose table and columns may reach SQL; the others join ``dead`` as ``bad_schema``."""
        fit, refused = [], list(dead)
        for batch in batches:
            problem = schema_problem(batch.table, batch.rows.column_names, self.schemas)
            if problem is None:
                fit.append(_folded(batch))
            else:
                refused.append(_dead_letter(batch, "bad_schema", problem))
        return fit, refused

    def _transaction(self, batches: Sequence[Batch], dead: Sequence[DeadLetter],
                     offsets: dict[tuple[str, int], int] | None,
                     registrations: Sequence[tuple[str, Registration]] = (),
                     resolved: Sequence[tuple[str, int, int]] = ()) -> ApplyResult:
        con = self._con
        now = datetime.now(UTC).replace(tzinfo=None)
        con.execute("BEGIN")
        try:
            fresh, repeats, reused = self._classify(batches, now)
            result = ApplyResult(duplicates=sum(b.rows.num_rows for b in repeats), dead_letters=[*dead, *reused])
            by_table: dict[str, list[Batch]] = {}
            for batch in fresh:
                by_table.setdefault(batch.table, []).append(batch)
            stored: list[tuple[str, pa.Table]] = []
            for table, group in by_table.items():
                rows, refused = self._store(table, group, now)
                stored.append((table, rows))
                result.stored += rows.num_rows
                result.dead_letters += refused
            self._record(fresh, now)  # after the rows: a batch is recorded only together with its rows
            refused_spans = self._refused_spans(result.dead_letters)
            self._record_refused(refused_spans, now)
            if result.dead_letters:
                con.executemany(self._tables.insert("dead_letter"), [
                    [d.topic, d.partition, d.offset, d.device, d.reason, d.detail[:2000], d.raw, now, None]
                    for d in result.dead_letters])
            if registrations:
                con.executemany(self._tables.insert("registry"),
                                [[d, r.kind, r.id, r.body, now] for d, r in registrations])
                result.registered = len(registrations)
            if resolved:
                con.executemany(f"UPDATE {self._t('dead_letter')} SET resolved_at = ? WHERE topic = ? AND "
                                "kafka_partition = ? AND kafka_offset = ? AND reason = ? AND resolved_at IS NULL",
                                [[now, t, p, o, PARKED] for t, p, o in resolved])
                result.resolved = len(resolved)
            if offsets:
                con.execute(self._tables.insert("offsets", len(offsets)),
                            [v for (t, p), o in offsets.items() for v in (t, p, o)])
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            self._columns.clear()  # a rolled-back CREATE/ALTER: re-read the tables next time
            self._online_keys.clear()
            self._seq_end.clear()
            raise
        self._parked_devices.update(d.device for d in result.dead_letters if d.reason == PARKED and d.device)
        result.gaps = self._account([(b.device, b.first_seq, b.last_seq + 1) for b in fresh] + refused_spans, now)
        if self.online_lag_s > 0 and stored:
            with self._pending_lock:
                for table, rows in stored:  # only rows whose transaction committed
                    self._pending_online.setdefault(table, []).append(rows)
                if self._pending_since is None:
                    self._pending_since = time.monotonic()
            self._online_wake.set()
        return result

    def _classify(self, batches: Sequence[Batch], now: datetime) -> tuple[list[Batch], list[Batch], list[DeadLetter]]:
        """New batches, exact repeats, and batches reusing stored numbers (nothing is written here).

        A device resends a batch byte for byte (same first seq, rows and signature): that is a repeat,
        dropped. Any other overlap with stored numbers means the device numbered different rows the
        same (its spool was wiped, say): those rows are dead-lettered as ``seq_reused``, never dropped
        as if they were repeats. A batch numbered past everything stored for its device (the usual
        case) is new without a look at ``tunnel.batches``: the store keeps each device's next free
        number in memory (it is the file's only writer: DuckDB lets one process write a file).
        """
        if not batches:
            return [], [], []
        con = self._con
        unknown = sorted({b.device for b in batches} - self._seq_end.keys())
        if unknown:
            found = dict(con.execute(f"SELECT device_id, max(first_seq + n_rows) FROM {self._t('batches')} WHERE "
                                     f"device_id IN ({', '.join('?' * len(unknown))}) GROUP BY ALL",
                                     unknown).fetchall())
            self._seq_end.update({d: found.get(d, 0) for d in unknown})
        fresh, repeats, reused = [], [], []
        for batch in batches:
            end = self._seq_end[batch.device]
            if batch.first_seq >= end:
                fresh.append(batch)
                self._seq_end[batch.device] = batch.last_seq + 1
                continue
            stored = con.execute(f"SELECT first_seq = ? AND n_rows = ? AND mac = ? FROM {self._t('batches')} WHERE "
                                 "outcome = 'stored' AND device_id = ? AND first_seq < ? AND first_seq + n_rows > ?",
                                 [batch.first_seq, batch.rows.num_rows, batch.mac, batch.device,
                                  batch.first_seq + batch.rows.num_rows, batch.first_seq]).fetchall()
            earlier = [(b.first_seq, b.rows.num_rows, b.mac) == (batch.first_seq, batch.rows.num_rows, batch.mac)
                       for b in fresh if b.device == batch.device and b.first_seq <= batch.last_seq
                       and b.last_seq >= batch.first_seq]
            verdicts = [same for (same,) in stored] + earlier
            if verdicts and all(verdicts):
                repeats.append(batch)
            elif verdicts:
                reused.append(_dead_letter(batch, "seq_reused", f"device {batch.device!r} sent other rows under "
                                           f"seq {batch.first_seq}..{batch.last_seq}, already stored"))
            else:  # below the device's highest number but in a gap: new
                fresh.append(batch)
        return fresh, repeats, reused

    @staticmethod
    def _refused_spans(dead: Sequence[DeadLetter]) -> list[tuple[str, int, int]]:
        """(device, first, end) of the verified batches ``dead`` refuses whole: accounted for, as stored ones are
        (a parked one is not: it may still be stored; a ``seq_reused`` one overlaps numbers already accounted)."""
        return [(d.device, d.seqs[0], d.seqs[0] + d.seqs[1]) for d in dead if d.seqs is not None and d.device
                and d.seqs[1] > 0 and d.reason not in (PARKED, "seq_reused")]

    def _record_refused(self, spans: Sequence[tuple[str, int, int]], now: datetime) -> None:
        if spans:
            self._con.executemany(self._tables.insert("batches"), [
                [device, first, end - first, None, None, now, "dead"] for device, first, end in spans])

    def _account(self, spans: Sequence[tuple[str, int, int]], now: datetime) -> list[Gap]:
        """Tell the ledger what a committed transaction accounted for; note the gaps it noticed or closed."""
        if not spans:
            return []
        clock = time.monotonic()
        noticed: list[Gap] = []
        for device in {d for d, _, _ in spans}:
            if not self.ledger.knows(device):
                noticed += self._load_ledger(device, clock)
        for device, first, end in spans:
            noticed += self.ledger.account(device, first, end, clock)
        return self._note_gaps(noticed, self.ledger.closed(), now)

    def _load_ledger(self, device: str, clock: float) -> list[Gap]:
        """Start the ledger of ``device`` from what the store accounted for (its batches and lost gaps); holes
        without an open ``tunnel.gaps`` row are noticed now (the wait restarts with the store)."""
        spans = self._con.execute(f"SELECT first_seq, first_seq + n_rows FROM {self._t('batches')} WHERE device_id = ?",
                                  [device]).fetchall()
        lost = self._con.execute(f"SELECT from_seq, to_seq FROM {self._t('gaps')} WHERE device_id = ? AND "
                                 "outcome = 'lost'", [device]).fetchall()
        holes = self.ledger.load(device, spans, clock, lost)
        known = {s for (s,) in self._con.execute(f"SELECT from_seq FROM {self._t('gaps')} WHERE device_id = ? AND "
                                                 "closed_at IS NULL", [device]).fetchall()}
        return [g for g in holes if g.start not in known]

    def _note_gaps(self, noticed: list[Gap], closed: list[Gap], now: datetime) -> list[Gap]:
        """Write gaps noticed and closed to ``tunnel.gaps`` (reporting: outside the rows' transaction)."""
        if noticed:
            self._con.executemany(self._tables.insert("gaps"), [
                [g.device, g.start, g.end, now, None, None, None] for g in noticed])
        for gap in closed:
            self._con.execute(f"UPDATE {self._t('gaps')} SET closed_at = ?, outcome = ?, missing_rows = ? WHERE "
                              "device_id = ? AND from_seq = ? AND closed_at IS NULL",
                              [now, gap.outcome, gap.missing_rows, gap.device, gap.start])
        return [*noticed, *closed]

    def receipt(self, device: str) -> Receipt:
        """What the store has of ``device``'s numbers, as a receipt for it (see :mod:`.receipts`)."""
        with self._lock:
            if not self.ledger.knows(device):
                self._note_gaps(self._load_ledger(device, time.monotonic()), [], datetime.now(UTC).replace(tzinfo=None))
            holes = self.ledger.holes(device)
            exact_end = holes[MAX_HOLES][0] if len(holes) > MAX_HOLES else self.ledger.seen_end(device)
            return Receipt(device, self.ledger.stored_mark(device), self.ledger.seen_end(device),
                           tuple(holes[:MAX_HOLES]), exact_end, announce=device in self._parked_devices)

    def devices(self) -> list[str]:
        """Every device the store accounted batches of."""
        with self._lock:
            return [d for (d,) in self._con.execute(f"SELECT DISTINCT device_id FROM {self._t('batches')} "
                                                    "ORDER BY 1").fetchall()]

    def expire_gaps(self) -> ApplyResult:
        """Give up the gaps that waited ``gap_wait_s``: reported lost (``tunnel.gaps``), the mark moves past them."""
        with self._lock:
            lost = self.ledger.expire(time.monotonic())
            if not lost:
                return ApplyResult()
            self.ledger.closed()
            now = datetime.now(UTC).replace(tzinfo=None)
            return ApplyResult(gaps=self._note_gaps([], lost, now))

    def _record(self, fresh: Sequence[Batch], now: datetime) -> None:
        """Note ``fresh`` batches in ``tunnel.batches`` (in the transaction that stored their rows)."""
        if fresh:
            self._con.execute(self._tables.insert("batches", len(fresh)), [
                v for b in fresh for v in (b.device, b.first_seq, b.rows.num_rows, b.mac, b.table, now, "stored")])

    def _store(self, table: str, batches: list[Batch], now: datetime) -> tuple[pa.Table, list[DeadLetter]]:
        """Append ``batches`` of one table to ``table`` and upsert them into ``<table>_online`` (unless that is
        deferred); the rows stored, as stored, and a ``bad_value`` dead letter for each row refused because its
        column's type would change a value (:mod:`.strict`)."""
        known = self._known(table)
        parts: list[pa.Table] = []
        refused: list[DeadLetter] = []
        for batch in batches:
            rows = batch.rows
            n = rows.num_rows
            meta = [pa.array([batch.device] * n, pa.string()), pa.array(batch.seqs, pa.int64()),
                    pa.array([now] * n, pa.timestamp("us"))]
            part = pa.Table.from_arrays(meta + rows.columns, names=[*_META_COLUMNS, *rows.column_names])
            if not (known.issuperset(part.column_names) and part.schema in known.shapes):
                part = self._typed(table, batch, part, known, refused)
            parts.append(part)
        full = parts[0] if len(parts) == 1 else pa.concat_tables(parts, promote_options="default")
        con = self._con
        if self.online_lag_s > 0 and known and known.issuperset(full.column_names) and full.schema in known.shapes:
            # the usual case, in one statement: DuckDB reads the local Arrow table by its name (a replacement
            # scan; registering and unregistering a view cost ~0.6 ms of CPU a transaction more). No stored
            # table can take the name: "tunnel_" names are refused to devices.
            tunnel_rows_to_store = full  # noqa: F841 - read by name in the statement below
            names = quoted_list(full.column_names)
            con.execute(f"INSERT INTO {quote_identifier(table)} ({names}) SELECT {names} FROM tunnel_rows_to_store")
            return full, refused
        with registered(con, "_sf_rows", full):
            names = quoted_list(full.column_names)
            ensure_columns(con, table, "_sf_rows", full.column_names, known, batch_shape(full))
            con.execute(f"INSERT INTO {quote_identifier(table)} ({names}) SELECT {names} FROM _sf_rows")
            if self.online_lag_s == 0:
                self._upsert_online(f"{table}_online", full)
        return full, refused

    def _known(self, table: str) -> KnownColumns:
        """What the store knows of ``table``'s columns (read from the table the first time, if it exists); a
        declared type the table's column does not have yet is given to it (a column an earlier first writer typed)."""
        known = self._columns.get(table)
        if known is not None:
            return known
        known = self._columns[table] = KnownColumns()
        con = self._con
        if not con.execute("SELECT count(*) FROM information_schema.tables WHERE table_catalog = current_database() "
                           "AND table_schema = 'main' AND lower(table_name) = ?", [table]).fetchall()[0][0]:
            return known
        known.types = {c.lower(): t for c, t in con.execute(
            f"SELECT column_name, column_type FROM (DESCRIBE {quote_identifier(table)})").fetchall()}
        known.update(known.types)
        for column, declared in self._declared.get(table, {}).items():
            have = known.types.get(column)
            if have is None or have == declared:
                continue
            try:
                con.execute(f"ALTER TABLE {quote_identifier(table)} ALTER COLUMN {quote_identifier(column)} "
                            f"SET DATA TYPE {declared}")
                known.types[column] = declared
                log.warning("cloud: %s.%s was %s, declared %s: changed", table, column, have, declared)
            except duckdb.Error as exc:
                log.error("cloud: %s.%s is %s, declared %s, and cannot be changed (%s): values are checked against "
                          "%s", table, column, have, declared, exc, have)
        return known

    def _typed(self, table: str, batch: Batch, part: pa.Table, known: KnownColumns,
               refused: list[DeadLetter]) -> pa.Table:
        """``part`` (a batch's rows with the store's columns) without the rows whose values its table's column
        types would change, each added to ``refused``, the others cast to those types (:mod:`.strict`)."""
        con = self._con
        with registered(con, "_sf_check", part):
            types = dict(con.execute("SELECT column_name, column_type FROM (DESCRIBE SELECT * FROM _sf_check)")
                         .fetchall())
            checks = strict.plan(types, self._targets(table, known, types))
            if not checks:
                return part
            bad = strict.refused(con, "_sf_check", checks)
            if bad:
                keep = [True] * part.num_rows
                for index, column, why in bad:
                    if keep[index]:
                        row = {k: v for k, v in part.slice(index, 1).to_pylist()[0].items() if k != "ingested_at"}
                        refused.append(replace(_dead_letter(batch, "bad_value", f"seq {batch.first_seq + index}, "
                                                            f"column {column}: {why}"),
                                               raw=to_json(row).encode(), seqs=None))
                    keep[index] = False
                part = part.filter(pa.array(keep))
            casts = {c.column: c.target for c in checks}
            with registered(con, "_sf_kept", part):
                columns = ", ".join(f"CAST({quote_identifier(c)} AS {casts[c]}) AS {quote_identifier(c)}" if c in casts
                                    else quote_identifier(c) for c in part.column_names)
                return con.sql(f"SELECT {columns} FROM _sf_kept").to_arrow_table()

    def _targets(self, table: str, known: KnownColumns, batch_types: Mapping[str, str]) -> dict[str, str]:
        """Column → the type its values must fit: declared, else the table's (widened first when the batch brings
        wider numbers and the column is not declared, as :func:`~connectors.sql.ensure_columns` will)."""
        declared = self._declared.get(table, {})
        targets = {}
        for column, source in batch_types.items():
            if column in declared:
                targets[column] = declared[column]
                continue
            have = known.types.get(column)
            if have is None:
                continue
            wider = strict.common(have, source)
            numbers = number_shape(source)
            if wider not in (None, have) and numbers is not None and numbers == number_shape(have):
                targets[column] = wider
            else:
                targets[column] = have
        return targets

    def checkpoint_if_idle(self) -> bool:
        """Write the WAL into the file now if it holds more than :data:`IDLE_CHECKPOINT_BYTES` (the consumer calls
        this when a poll found nothing: the checkpoint's stall then holds no row back); whether it did."""
        try:
            if self._wal.stat().st_size <= IDLE_CHECKPOINT_BYTES:
                return False
        except FileNotFoundError:
            return False
        with self._lock, self._online_lock:  # no deferred upsert in flight: CHECKPOINT wants no other transaction
            self._flush_online()
            self._con.execute("CHECKPOINT")
        return True

    def online_due_in(self) -> float:
        """Seconds until the deferred online upsert is due (infinity when nothing waits for it)."""
        if self._pending_since is None:
            return float("inf")
        return max(0.0, self._pending_since + self.online_lag_s - time.monotonic())

    def flush_online(self, due_only: bool = False) -> None:
        """Upsert the rows stored since the last time into the online tables (see the class docstring);
        ``due_only``: only once ``online_lag_s`` passed since the first of them was stored (with ``online_thread``,
        that is the thread's job: nothing to do here)."""
        if self._pending_since is None or (due_only and (self._online_worker is not None or self.online_due_in() > 0)):
            return
        with self._lock:
            self._flush_online()

    def _online_loop(self) -> None:
        """The online thread: a deferred upsert once ``online_lag_s`` passed since the first row waiting for it."""
        while not self._online_stop.is_set():
            due = self.online_due_in()
            if due == float("inf"):
                self._online_wake.wait()
                self._online_wake.clear()
                continue
            if due > 0:
                self._online_stop.wait(due)
                continue
            try:
                self._flush_online()
            except Exception:  # noqa: BLE001 - the thread must go on; the offline rows stand, a reopen catches up
                log.exception("cloud: deferred online upsert failed")

    def _stop_online_worker(self) -> None:
        if self._online_worker is not None:
            self._online_stop.set()
            self._online_wake.set()
            self._online_worker.join()
            self._online_worker = None

    def _flush_online(self) -> None:
        with self._online_lock:
            with self._pending_lock:
                pending, self._pending_online, self._pending_since = self._pending_online, {}, None
            self._flush_pending(pending)

    def _flush_pending(self, pending: dict[str, list[pa.Table]]) -> None:
        for table, parts in pending.items():
            try:
                full = parts[0] if len(parts) == 1 else pa.concat_tables(parts, promote_options="default")
                self._online_transaction(table, full)
                continue
            except _STORE_ERRORS as exc:
                if len(parts) == 1:
                    self._online_refused(table, parts[0], exc)
                    continue
            for part in parts:  # together they were refused (a column's type changed between them, say)
                try:
                    self._online_transaction(table, part)
                except _STORE_ERRORS as exc:
                    self._online_refused(table, part, exc)

    def _online_transaction(self, table: str, full: pa.Table) -> None:
        con = self._online_con
        online = f"{table}_online"
        con.execute("BEGIN")
        try:
            with registered(con, "_sf_rows", full):
                self._upsert_online(online, full, con)
            con.execute(self._tables.insert("online_marks"),
                        [table, pc.max(full.column("ingested_at")).as_py()])
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            self._columns.pop(online, None)  # a rolled-back CREATE/ALTER: re-read the table next time
            self._online_keys.pop(online, None)
            raise

    def _online_refused(self, table: str, rows: pa.Table, exc: Exception) -> None:
        self.online_errors += 1
        log.warning("cloud: %s_online refused %d rows stored in %s (they stay offline): %s: %s", table,
                    rows.num_rows, table, type(exc).__name__, exc)

    def _catch_up_online(self) -> None:
        """Upsert online what a deferred upsert left out when the last process stopped without flushing."""
        con = self._con
        tables = {t for (t,) in con.execute(  # the store's tables: those with its own columns
            "SELECT table_name FROM information_schema.columns WHERE table_catalog = current_database() AND "
            "table_schema = 'main' AND column_name IN ('device_id', 'seq', 'ingested_at') GROUP BY ALL "
            "HAVING count(*) = 3").fetchall()}
        marks = dict(con.execute(f"SELECT table_name, max(applied_through) FROM {self._t('online_marks')} "
                                 "GROUP BY ALL").fetchall())
        for table in sorted(tables):
            if _reserved(table):
                continue
            if table in marks:
                rows = con.sql(f"SELECT * FROM {quote_identifier(table)} WHERE ingested_at >= $since",
                               params={"since": marks[table] - _CATCH_UP_SLACK}).to_arrow_table()
            elif f"{table}_online" not in tables:  # rows stored, never upserted online
                rows = con.sql(f"SELECT * FROM {quote_identifier(table)}").to_arrow_table()
            else:  # upserted with the rows (online_lag_s 0): nothing can be missing
                continue
            if rows.num_rows:
                self._pending_online[table] = [rows]
                self._pending_since = time.monotonic()
        if self._pending_online:
            log.info("cloud: upserting online the rows of %s stored since the last deferred upsert",
                     ", ".join(sorted(self._pending_online)))
            self._flush_online()

    def _upsert_online(self, online: str, full: pa.Table, con: duckdb.DuckDBPyConnection | None = None) -> None:
        """The newest row (highest seq) per key wins; rows with a NULL key stay offline only. ``con``: the
        connection whose ``_sf_rows`` holds ``full`` (the store's by default)."""
        con = con or self._con
        key = self._online_keys.get(online)
        if key is None:
            exists = scalar(con, "SELECT count(*) FROM information_schema.tables WHERE table_catalog = "
                            "current_database() AND table_schema = 'main' AND lower(table_name) = ?", [online])
            if not exists:
                key = ["device_id"] + [k for k in self.online_key if k in full.column_names]
                types = dict(con.execute("SELECT column_name, column_type FROM (DESCRIBE SELECT * FROM _sf_rows)")
                             .fetchall())
                columns = ", ".join(f"{quote_identifier(c)} {types[c]}" for c in full.column_names)
                con.execute(f"CREATE TABLE {quote_identifier(online)} ({columns}, PRIMARY KEY ({quoted_list(key)}))")
            else:
                key = [row[0] for row in con.execute(
                    "SELECT unnest(constraint_column_names) FROM duckdb_constraints() WHERE database_name = "
                    "current_database() AND schema_name = 'main' AND lower(table_name) = ? AND constraint_type = "
                    "'PRIMARY KEY'", [online]).fetchall()]
            self._online_keys[online] = key
        known = self._columns.setdefault(online, KnownColumns())
        ensure_columns(con, online, "_sf_rows", full.column_names, known, batch_shape(full))
        if any(k not in full.column_names for k in key):
            return  # these rows lack a key column: offline only
        names, target = quoted_list(full.column_names), quote_identifier(online)
        not_null = " AND ".join(f"{quote_identifier(k)} IS NOT NULL" for k in key)
        updates = ", ".join(f"{quote_identifier(c)} = excluded.{quote_identifier(c)}" if c in full.column_names
                            else f"{quote_identifier(c)} = NULL" for c in sorted(known) if c not in key)
        # the newest row per key within the batch (a window costs ~2 ms a statement: skipped for one row)
        newest = (f"QUALIFY row_number() OVER (PARTITION BY {quoted_list(key)} ORDER BY seq DESC) = 1 "
                  if full.num_rows > 1 else "")
        con.execute(f"INSERT INTO {target} ({names}) SELECT {names} FROM _sf_rows WHERE {not_null} {newest}"
                    f"ON CONFLICT DO UPDATE SET {updates} WHERE excluded.seq > {target}.seq")

    def offsets(self, topic: str) -> dict[int, int]:
        """Partition → next offset to consume, as stored with the rows."""
        with self._lock:
            # the newest row, not the highest offset: a topic deleted and made again starts at 0
            return dict(self._con.execute(f"SELECT kafka_partition, arg_max(next_offset, rowid) FROM "
                                          f"{self._t('offsets')} WHERE topic = ? GROUP BY ALL", [topic]).fetchall())

    def query(self, sql: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
        """Run ``sql`` on the store (deferred online upserts first: reads see every stored row)."""
        with self._lock:
            self._flush_online()
            return self._con.execute(sql, params or []).fetchall()

    def close(self) -> None:
        self._stop_online_worker()
        with self._lock:
            self._flush_online()
            if self._online_con is not self._con:
                self._online_con.close()
            self._con.close()

    def __enter__(self) -> CloudStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def schema_problem(table: str, columns: Sequence[str],
                   schemas: Mapping[str, Collection[str]] | None = None) -> str | None:
    """Why a batch of ``table`` with ``columns`` may not be stored, or None if it may.

    Table and column names must be plain identifiers (letters, digits, underscores), the table no
    ``tunnel_`` or ``_online`` name, the columns unique and none of the store's own (``device_id``,
    ``seq``, ``ingested_at``); with ``schemas`` (table → its declared columns), the table must be
    declared and every column among its declared ones. Names are compared as DuckDB compares them,
    ignoring case.

    Example:
        >>> schema_problem("ipv", ["user_id", "dwell_s"]) is None
        True
        >>> print(schema_problem("ipv", ["x'); DROP TABLE ipv; --"]))
        column name "x'); DROP TABLE ipv; --" of table ipv is not a plain identifier (letters, digits, underscores)
        >>> schema_problem("ipv", ["user_id", "coupon"], {"ipv": ["user_id", "dwell_s"]})
        "column 'coupon' is not in table ipv's declared schema (dwell_s, user_id)"
    """
    if not is_identifier(table):
        return f"table name {table!r} is not a plain identifier (letters, digits, underscores)"
    if _reserved(table):
        return f"reserved table name {table!r}"
    declared = None
    if schemas is not None:
        tables = {t.lower(): t for t in schemas}
        if table.lower() not in tables:
            return f"table {table!r} is not declared (declared: {', '.join(sorted(schemas)) or 'none'})"
        declared = {c.lower() for c in schemas[tables[table.lower()]]}
    seen: set[str] = set()
    for name in columns:
        if not is_identifier(name):
            return f"column name {name!r} of table {table} is not a plain identifier (letters, digits, underscores)"
        folded = name.lower()  # DuckDB's names are case-insensitive: "SEQ" is the column seq
        if folded in _META_COLUMNS:
            return f"column {name!r} of table {table} is the store's own"
        if folded in seen:
            return f"column {name!r} of table {table} appears twice"
        if declared is not None and folded not in declared:
            return f"column {name!r} is not in table {table}'s declared schema ({', '.join(sorted(declared))})"
        seen.add(folded)
    return None


def _reserved(table: str) -> bool:
    """A table name devices may not use, compared as DuckDB compares names (case-insensitively): the online
    tables' ``_online`` and the ``tunnel_`` prefix (the store's own names before they moved to the schema
    ``tunnel``, and its replacement scans)."""
    folded = table.lower()
    return folded.startswith("tunnel_") or folded.endswith("_online")


def _folded(batch: Batch) -> Batch:
    """``batch`` with its table and column names in lower case: DuckDB's names ignore case, so ``IPV`` is the
    table ``ipv``, and the store keys what it knows of a table by one spelling."""
    names = batch.rows.column_names
    folded = [n.lower() for n in names]
    if batch.table.islower() and folded == names:
        return batch
    return replace(batch, table=batch.table.lower(), rows=batch.rows.rename_columns(folded))


def _dead_letter(batch: Batch, reason: str, detail: str) -> DeadLetter:
    origin = batch.origin or Origin("", -1, -1, b"")
    return DeadLetter(origin.topic, origin.partition, origin.offset, reason, detail, batch.device, origin.raw,
                      batch.registrations, (batch.first_seq, batch.rows.num_rows))


def open_message(topic: str, partition: int, offset: int, value: bytes | None, keys: Keys,
                 message_key: bytes | None = None, registry: Registry | None = None,
                 budget: Budget = DEFAULT_BUDGET) -> Batch | DeadLetter:
    """A Kafka message as a verified :class:`Batch` (with its origin), or as a :class:`DeadLetter` saying why not.

    ``keys``: the device keys; ``registry``: the schemas and dictionaries known (it learns those the message
    carries); ``budget``: what opening it may cost (:mod:`.budget`). A message key, if any (format-1 envelopes
    were keyed by device), must be the signed device.
    """
    try:
        batch = replace(decode(value, keys, registry, budget),
                        origin=Origin(topic, partition, offset, bytes(value or b"")))
    except EnvelopeError as exc:
        return DeadLetter(topic, partition, offset, exc.reason, str(exc), exc.device, bytes(value or b""),
                          exc.registrations, exc.seqs)
    if message_key is not None and message_key != batch.device.encode():
        return _dead_letter(batch, "bad_key", f"message key {message_key!r} is not the signed device {batch.device!r}")
    problem = schema_problem(batch.table, batch.rows.column_names)
    return batch if problem is None else _dead_letter(batch, "bad_schema", problem)


def publish_receipts(store: CloudStore, topic: str, keys: KeyRegistry, bootstrap: str | None = None) -> int:
    """Publish the receipt of every device ``store`` holds batches of to ``<topic>.receipts`` (what a reader that
    runs and ends, the Flink job, does when it ended) on the broker ``bootstrap`` (default
    :data:`~connectors.tunnel.kafka.DEFAULT_BOOTSTRAP`); how many were published."""
    publisher = ReceiptPublisher(bootstrap or DEFAULT_BOOTSTRAP, topic, keys)
    try:
        publisher.note(store.devices())
        published = publisher.publish_due(store.receipt, force=True)
        publisher.flush()
    finally:
        publisher.close()
    return published


class CloudConsumer:
    """A consumer storing the tunnel's features in a :class:`CloudStore` (see the module docstring).

    Example (needs a broker)::

        consumer = CloudConsumer("out/cloud.duckdb", KeyRegistry(".streamflow/keys.json"))
        consumer.run(idle_timeout_s=5)   # until nothing arrived for 5 s; run() alone runs until stop()

    ``bootstrap``: the broker(s), ``host:port[,...]`` (default :data:`~connectors.tunnel.kafka.DEFAULT_BOOTSTRAP`).

    ``freeze_gc`` (default on): once connected, the consumer moves the objects alive then (modules, Kafka
    clients, DuckDB) out of the garbage collector's reach (``gc.freeze()``; :meth:`close` undoes it), so that
    a full collection does not walk them all while rows wait.

    ``online_lag_s`` (default :data:`DEFAULT_ONLINE_LAG_S`): how far the online tables may follow the
    offline ones (see :class:`CloudStore`); 0 upserts them in the transaction that stores the rows.
    """

    def __init__(self, db: str | os.PathLike[str], registry: KeyRegistry, *, topic: str = DEFAULT_TOPIC,
                 bootstrap: str | None = None, group_id: str = "streamflow-cloud",
                 online_key: Sequence[str] = ("user_id",), max_records: int = 500, partitions: int = 4,
                 schemas: Mapping[str, Collection[str]] | None = None, idle_poll_s: float | None = 0.005,
                 freeze_gc: bool = True, online_lag_s: float = DEFAULT_ONLINE_LAG_S, budget: Budget = DEFAULT_BUDGET,
                 gap_wait_s: float = DEFAULT_GAP_WAIT_S, receipts: bool = True):
        self.topic = topic
        self.budget = budget
        self.freeze_gc = freeze_gc
        self._frozen = False
        self.idle_poll_s = idle_poll_s
        self.dlq_topic = dead_letter_topic(topic)
        self.bootstrap = bootstrap or DEFAULT_BOOTSTRAP
        self.group_id = group_id
        self.registry = registry
        self.store = CloudStore(db, online_key=online_key, schemas=schemas, online_lag_s=online_lag_s,
                                gap_wait_s=gap_wait_s, online_thread=True, threads=1)
        self.stats = CloudStats()
        self.max_records = max_records
        self.partitions = partitions
        self._stop = threading.Event()
        self._consumer: Any = None
        self._dlq_producer: Any = None
        self._assigned: set[Any] = set()
        self._assignment_checked = 0.0
        self._recovered_once = False  # parked envelopes are looked at once at start, then on new registrations
        self._last_record = float("-inf")
        self._uncommitted: dict[tuple[str, int], int] = {}  # offsets stored in DuckDB, not yet committed to Kafka
        self._kafka_committed_at = float("-inf")
        #: publishes what the store has of each device (``<topic>.receipts``, see :mod:`.receipts`); None: off
        self.receipts = ReceiptPublisher(self.bootstrap, topic, registry, partitions=partitions) if receipts else None
        #: told of every poll, ``polled(consumer, records, offsets stored, batches opened, transaction seconds)``: the
        #: Prometheus metrics (:mod:`streamflow.metrics.cloud`); None: none
        self.metrics: Any = None

    def _connect(self) -> Any:
        """A consumer assigned every partition of the topic (no group rebalance), and the dead-letter producer.

        The partitions are assigned by hand, not by the group coordinator: this consumer is the DuckDB
        file's only writer and its offsets live in that file, so the group has nothing to share out.
        And a coordinator holds a rebalance until a killed member rejoins or is expired; noida-db 0.2.3
        never expires one (measured: with kafka-python's defaults a successor got nothing for 150 s; a
        6 s session timeout changed nothing; an 8 s rebalance timeout let it join, after which its
        SyncGroup timed out every 5 s, the dead member still counted; static membership resumed at once
        but static members never leave, so a closed one would block every other member for good).
        Assigned by hand, a successor resumes at once on any broker. The group id is still used for
        the Kafka offset commits that lag monitoring reads. Partitions added to the topic are picked up
        within ``_ASSIGNMENT_CHECK_S`` once the client's metadata shows them.
        """
        from kafka import KafkaConsumer, KafkaProducer

        ensure_topic(self.bootstrap, self.topic, self.partitions)
        ensure_topic(self.bootstrap, self.dlq_topic, 1)
        consumer = KafkaConsumer(bootstrap_servers=self.bootstrap, group_id=self.group_id,
                                 client_id=f"streamflow-cloud-{os.getpid()}", enable_auto_commit=False,
                                 auto_offset_reset="earliest", max_poll_records=self.max_records,
                                 isolation_level="read_committed", **CLIENT_TIMEOUTS)
        self._assigned = set()
        self._assign(consumer)
        self._dlq_producer = KafkaProducer(bootstrap_servers=self.bootstrap, acks="all", enable_idempotence=True,
                                           compression_type="zstd", **CLIENT_TIMEOUTS)
        if self.freeze_gc and not self._frozen:
            # what is alive now (modules, clients, DuckDB) lives as long as the consumer: a full collection
            # walking it all would stall consuming for tens of ms (66 ms measured in the serving client's
            # process); frozen, collections walk only what was made since
            gc.collect()
            gc.freeze()
            self._frozen = True
        return consumer

    def _assign(self, consumer: Any) -> None:
        """Take every partition the topic has now; each new one starts where the stored rows end (DuckDB's offsets)."""
        from kafka import TopicPartition

        partitions = {TopicPartition(self.topic, p) for p in consumer.partitions_for_topic(self.topic)}
        self._assignment_checked = time.monotonic()
        if partitions <= self._assigned:
            return
        consumer.assign(sorted(partitions))  # positions of partitions already held are kept
        stored = self.store.offsets(self.topic)
        for tp in partitions - self._assigned:
            if tp.partition in stored:
                consumer.seek(tp, stored[tp.partition])
        self._assigned = partitions

    def poll_once(self, timeout_s: float = 0.2) -> ApplyResult:
        """Consume what one poll returns and store it; returns what was stored."""
        if self._consumer is None:
            self._consumer = self._connect()
        elif time.monotonic() - self._assignment_checked >= _ASSIGNMENT_CHECK_S:
            self._assign(self._consumer)  # partitions added to the topic since
        if not self._recovered_once:  # envelopes parked by an earlier run whose registration arrived meanwhile
            self._recover()
        expired = self.store.expire_gaps()
        if expired.gaps:
            self.stats.count(0, expired)
            self._note_receipts(g.device for g in expired.gaps)
        records = self._poll(timeout_s)  # the store's online thread keeps the online tables' lag
        if not records:
            self.store.flush_online(due_only=True)
            self._publish_receipts()
            if time.monotonic() - self._last_record >= IDLE_AFTER_S:  # idle, not between two records of a stream
                self.store.checkpoint_if_idle()
            if self.metrics is not None:
                self.metrics.polled(self._consumer, {}, {}, (), 0.0)
            return ApplyResult()
        batches, dead, offsets, read = self._open(records)
        started = time.perf_counter()
        result = self.store.apply(batches, dead, offsets)
        if self.metrics is not None:
            self.metrics.polled(self._consumer, records, offsets, batches, time.perf_counter() - started)
        self._after_store(read, offsets, result)
        # every device heard from: what it sent was stored, dropped as a repeat (a resend: tell it again) or refused
        self._note_receipts([b.device for b in batches] + [d.device for d in dead if d.device and d.seqs])
        self._publish_receipts()
        self.store.flush_online(due_only=True)
        if result.registered:
            self._recover()
        return result

    def _note_receipts(self, devices: Iterable[str]) -> None:
        if self.receipts is not None:
            self.receipts.note(devices)

    def _publish_receipts(self, force: bool = False) -> None:
        if self.receipts is not None:
            self.receipts.publish_due(self.store.receipt, force)

    def publish_receipts(self) -> None:
        """Publish now the receipts waiting for their rate limit (a consumer about to stop polling for a while)."""
        self._publish_receipts(force=True)

    def _open(self, records: dict[Any, list[Any]]) -> tuple[list[Batch], list[DeadLetter], dict[tuple[str, int], int],
                                                            int]:
        """Open the polled ``records`` until their rows or decoded bytes pass the poll's budget; the consumer is
        moved back to the first message not opened of each partition (the next poll reads it). Returns the
        batches, the dead letters, the next offset per partition and the number of messages opened."""
        batches: list[Batch] = []
        dead: list[DeadLetter] = []
        offsets: dict[tuple[str, int], int] = {}
        rows = size = read = 0
        for tp, messages in records.items():
            for m in messages:
                if rows >= self.budget.max_rows_per_poll or size >= self.budget.max_bytes_per_poll:
                    self._consumer.seek(tp, m.offset)  # the rest of this partition waits for the next poll
                    log.debug("cloud: poll budget spent; %s resumes at %d", tp, m.offset)
                    break
                opened = open_message(tp.topic, tp.partition, m.offset, m.value, self.registry, m.key,
                                      self.store.registry, self.budget)
                if isinstance(opened, Batch):
                    batches.append(opened)
                    rows += opened.rows.num_rows
                    size += opened.rows.nbytes
                else:
                    dead.append(opened)
                offsets[(tp.topic, tp.partition)] = m.offset + 1
                read += 1
        return batches, dead, offsets, read

    def _poll(self, timeout_s: float) -> dict[Any, list[Any]]:
        """What the broker has, waiting up to ``timeout_s``.

        While records flow (one arrived within ``IDLE_AFTER_S``), kafka-python's blocking poll: it keeps a
        fetch in flight while the caller stores the last records, so the next ones are there when it asks
        (measured: a consumer storing for 20 ms a poll saw records 18 ms after they were sent at the median;
        polling without blocking, 35). Once idle, polls without blocking ``idle_poll_s`` apart: kafka-python
        sends the next fetch as soon as the last one returned, and a broker that answers an empty fetch at
        once instead of holding it ``fetch_max_wait_ms`` (noida-db) makes a blocking poll spin (~0.45 of a
        core; polls 5 ms apart: ~0.17). ``idle_poll_s=None`` always blocks, the better choice on a broker
        that holds fetches (Apache Kafka; ``fetch_min_bytes=1``, so a held fetch returns as soon as a record
        arrives).
        """
        flowing = time.monotonic() - self._last_record < IDLE_AFTER_S
        records: dict[Any, list[Any]]
        if self.idle_poll_s is None or flowing:
            records = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=self.max_records)
        else:
            deadline = time.monotonic() + timeout_s
            while True:
                records = self._consumer.poll(timeout_ms=0, max_records=self.max_records)
                if records or time.monotonic() >= deadline:
                    break
                time.sleep(self.idle_poll_s)
        if records:
            self._last_record = time.monotonic()
        return records

    def _recover(self) -> None:
        self._recovered_once = True
        result = self.store.recover(self.registry)
        self.stats.count(0, result)
        self._to_dead_letter_topic(result.dead_letters)

    def _after_store(self, messages: int, offsets: dict[tuple[str, int], int], result: ApplyResult) -> None:
        self.stats.count(messages, result)
        self._to_dead_letter_topic(result.dead_letters)
        self._uncommitted.update(offsets)
        if time.monotonic() - self._kafka_committed_at >= KAFKA_COMMIT_INTERVAL_S:
            self._commit_to_kafka()

    def _commit_to_kafka(self) -> None:
        """Commit the offsets stored since the last time, without waiting: they serve lag monitoring only
        (the offsets that count are stored with the rows), so once per ``KAFKA_COMMIT_INTERVAL_S`` is enough
        and spares a request per poll."""
        self._kafka_committed_at = time.monotonic()
        if not self._uncommitted or self._consumer is None:
            return
        try:
            self._consumer.commit_async(self._kafka_offsets())
            self._uncommitted = {}
        except Exception as exc:  # noqa: BLE001 - a rebalance or a broker hiccup must not stop consuming
            log.debug("kafka offset commit skipped: %s", exc)

    def _to_dead_letter_topic(self, dead_letters: Sequence[DeadLetter]) -> None:
        for d in dead_letters:
            # d.raw, never None: an empty or null message has no key either, and kafka-python refuses to send
            # a record with neither
            self._dlq_producer.send(self.dlq_topic, value=d.raw, headers=[
                ("reason", d.reason.encode()), ("detail", d.detail[:1000].encode()),
                ("source", f"{d.topic}/{d.partition}/{d.offset}".encode())])
        if dead_letters:
            self._dlq_producer.flush(timeout=10)

    def run(self, idle_timeout_s: float | None = None, max_s: float | None = None,
            retry_for_s: float | None = 300.0) -> CloudStats:
        """Consume until :meth:`stop`, until ``idle_timeout_s`` passed without a record, or until ``max_s`` passed.

        Idle time counts from the last record polled (or from when the consumer got its partitions),
        never from the start, so a slow start or a broker outage does not end the run early. While the
        broker fails, the consumer reconnects with exponential backoff (0.1 s doubling to 1 s) and raises
        :class:`~connectors.tunnel.kafka.TunnelUnavailable` once it failed for ``retry_for_s`` on end
        (None: retry forever). A poll of a broker gone away returns nothing rather than failing, so while
        nothing arrives the broker is probed every :data:`IDLE_PROBE_S` seconds, a failed probe counting as a
        failure.
        Records it did not store stay on the topic, and the next consumer starts at DuckDB's offsets.
        """
        started = time.monotonic()
        last_record = None  # set when the consumer holds its partitions
        retry = Retry(f"cloud consumer of {self.topic} on {self.bootstrap}", give_up_after_s=retry_for_s)
        probed = started
        while not self._stop.is_set():
            messages = self.stats.messages
            try:
                self.poll_once()
                if self.stats.messages == messages and time.monotonic() - probed >= IDLE_PROBE_S:
                    probed = time.monotonic()
                    probe_broker(self.bootstrap)  # an idle poll does not notice a broker gone
            except ImportError:  # kafka-python not installed: no retry brings it (issue 31)
                raise
            except Exception as exc:  # noqa: BLE001 - broker gone: say so, back off, reconnect
                self._reset()
                delay = retry.failed(exc)  # raises TunnelUnavailable past the budget
                log.warning("cloud consumer: %s; retrying in %.1f s (attempt %d)", exc, delay, retry.failures)
                last_record = None
                self._stop.wait(delay)
                continue
            retry.succeeded()
            now = time.monotonic()
            if last_record is None or self.stats.messages > messages:
                last_record = now
            if idle_timeout_s is not None and now - last_record >= idle_timeout_s:
                break
            if max_s is not None and now - started >= max_s:
                break
        return self.stats

    def _kafka_offsets(self) -> dict[Any, Any]:
        from kafka import TopicPartition
        from kafka.structs import OffsetAndMetadata

        return {TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in self._uncommitted.items()}

    def stop(self) -> None:
        self._stop.set()

    def _reset(self) -> None:
        for client in (self._consumer, self._dlq_producer):
            if client is not None:
                with contextlib.suppress(Exception):  # closing a client of a dead broker may fail too
                    client.close(timeout=2) if client is self._dlq_producer else client.close()
        self._consumer = self._dlq_producer = None
        if self.receipts is not None:
            self.receipts.close()

    def close(self) -> None:
        if self._consumer is not None and self._uncommitted:  # the last offsets, for lag monitoring
            with contextlib.suppress(Exception):  # best effort: a dead broker must not hold the close
                self._consumer.commit(self._kafka_offsets(), timeout_ms=2000)
        if self.receipts is not None and self._consumer is not None:
            with contextlib.suppress(Exception):  # the last receipts; a broker gone: the devices resend, and ask again
                self._publish_receipts(force=True)
                self.receipts.flush()
        self._reset()
        self.store.close()
        if self._frozen:
            gc.unfreeze()
            self._frozen = False
