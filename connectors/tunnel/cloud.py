"""The cloud side of the tunnel: verify, de-duplicate and store the features devices send.

:class:`CloudStore` is the DuckDB side. One :meth:`CloudStore.apply` is one transaction that

- drops rows already stored, by (device, seq) (a device resends a batch it has no ack for);
- appends the new rows to the offline table ``<table>`` (``device_id, seq, ingested_at`` then the
  row's columns; append-only, the training-data history);
- upserts them into the online table ``<table>_online``: the newest row (highest seq) per
  (device_id, *online_key), the serving view;
- stores refused messages in ``tunnel_dead_letter`` with the reason;
- records, per topic partition, the offset to consume next (``tunnel_offsets``).

:class:`CloudConsumer` is a Kafka consumer group around it. Offsets live in DuckDB, in the same
transaction as the rows, and a consumer seeks to them when it is assigned a partition, so a crash
between storing and committing to Kafka neither loses nor repeats a row: the effect is exactly
once. (It also commits to Kafka, for lag monitoring.) Refused messages also go, with their reason
in the headers, to the dead-letter topic ``<topic>.dlq``; the consumer counts them and goes on.

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
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from connectors.storage import check_table_name, ensure_columns
from connectors.tunnel.envelope import Batch, EnvelopeError, decode
from connectors.tunnel.kafka import CLIENT_TIMEOUTS, DEFAULT_TOPIC, bootstrap_servers, dead_letter_topic, ensure_topic
from connectors.tunnel.keys import KeyRegistry

log = logging.getLogger("streamflow.cloud")

DEAD_LETTER_TABLE = "tunnel_dead_letter"
_META_COLUMNS = ("device_id", "seq", "ingested_at")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS tunnel_batches (device_id VARCHAR, first_seq BIGINT, n_rows INTEGER, table_name VARCHAR,
                                           ingested_at TIMESTAMP);
CREATE TABLE IF NOT EXISTS tunnel_offsets (topic VARCHAR, kafka_partition INTEGER, next_offset BIGINT,
                                           PRIMARY KEY (topic, kafka_partition));
CREATE TABLE IF NOT EXISTS tunnel_dead_letter (topic VARCHAR, kafka_partition INTEGER, kafka_offset BIGINT,
                                               device_id VARCHAR, reason VARCHAR, detail VARCHAR, raw BLOB,
                                               refused_at TIMESTAMP);
"""


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


@dataclass
class ApplyResult:
    stored: int = 0
    duplicates: int = 0
    dead: int = 0


@dataclass
class CloudStats:
    """Running totals of a consumer (``dead`` by reason)."""

    messages: int = 0
    stored: int = 0
    duplicates: int = 0
    dead: Counter = field(default_factory=Counter)

    @property
    def dead_total(self) -> int:
        return sum(self.dead.values())


class CloudStore:
    """The cloud's DuckDB tables for tunnelled features (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str], online_key: Sequence[str] = ("user_id",)):
        self.path = Path(path)
        if self.path.parent != Path(""):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.online_key = tuple(online_key)
        self._con = duckdb.connect(str(self.path))
        self._con.execute(_SCHEMA)
        self._columns: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def apply(self, batches: Sequence[Batch], dead: Sequence[DeadLetter],
              offsets: dict[tuple[str, int], int] | None = None) -> ApplyResult:
        """Store ``batches`` (minus rows already stored), ``dead`` and ``offsets`` in one transaction."""
        result = ApplyResult(dead=len(dead))
        now = datetime.now(UTC).replace(tzinfo=None)
        with self._lock:
            con = self._con
            con.execute("BEGIN")
            try:
                for batch, keep in self._new_rows(batches):
                    rows = batch.rows if keep is None else batch.rows.filter(keep)
                    result.duplicates += batch.rows.num_rows - rows.num_rows
                    if rows.num_rows:
                        seqs = batch.seqs if keep is None else [s for s, k in zip(batch.seqs, keep, strict=True) if k]
                        self._store(batch, rows, seqs, now)
                        result.stored += rows.num_rows
                    con.execute("INSERT INTO tunnel_batches VALUES (?, ?, ?, ?, ?)",
                                [batch.device, batch.first_seq, batch.rows.num_rows, batch.table, now])
                if dead:
                    con.executemany("INSERT INTO tunnel_dead_letter VALUES (?, ?, ?, ?, ?, ?, ?, ?)", [
                        [d.topic, d.partition, d.offset, d.device, d.reason, d.detail[:2000], d.raw, now]
                        for d in dead])
                if offsets:
                    con.executemany("INSERT OR REPLACE INTO tunnel_offsets VALUES (?, ?, ?)",
                                    [[t, p, o] for (t, p), o in offsets.items()])
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                self._columns.clear()  # a rolled-back CREATE/ALTER: re-read the tables next time
                raise
        return result

    def _new_rows(self, batches: Sequence[Batch]) -> list[tuple[Batch, list[bool] | None]]:
        """Each batch with a keep-mask of the rows not stored yet (None: keep all)."""
        if not batches:
            return []
        ranges = pa.table({"i": list(range(len(batches))), "device_id": [b.device for b in batches],
                           "f": [b.first_seq for b in batches], "l": [b.last_seq for b in batches]})
        self._con.register("_sf_ranges", ranges)
        try:
            overlaps = self._con.execute(
                "SELECT r.i, b.first_seq, b.n_rows FROM _sf_ranges r JOIN tunnel_batches b "
                "ON b.device_id = r.device_id AND b.first_seq <= r.l AND b.first_seq + b.n_rows - 1 >= r.f").fetchall()
        finally:
            self._con.unregister("_sf_ranges")
        stored: dict[int, list[tuple[int, int]]] = {}
        for i, first, n in overlaps:
            stored.setdefault(i, []).append((first, first + n - 1))
        seen: dict[str, list[tuple[int, int]]] = {}  # within this call: a batch repeated in one poll
        out = []
        for i, batch in enumerate(batches):
            taken = stored.get(i, []) + seen.setdefault(batch.device, [])
            if taken:
                keep = [not any(a <= s <= b for a, b in taken) for s in batch.seqs]
                out.append((batch, None if all(keep) else keep))
            else:
                out.append((batch, None))
            seen[batch.device].append((batch.first_seq, batch.last_seq))
        return out

    def _store(self, batch: Batch, rows: pa.Table, seqs: Sequence[int], now: datetime) -> None:
        table = check_table_name(batch.table)
        if table.startswith("tunnel_") or table.endswith("_online"):
            raise ValueError(f"table name {table!r} is reserved for the tunnel's own tables")
        rows = rows.drop_columns([c for c in _META_COLUMNS if c in rows.column_names])
        n = rows.num_rows
        meta = pa.table({"device_id": pa.array([batch.device] * n, pa.string()), "seq": pa.array(seqs, pa.int64()),
                         "ingested_at": pa.array([now] * n, pa.timestamp("us"))})
        full = pa.Table.from_arrays(meta.columns + rows.columns, names=meta.column_names + rows.column_names)
        con = self._con
        con.register("_sf_rows", full)
        try:
            names = ", ".join(f'"{c}"' for c in full.column_names)
            ensure_columns(con, table, "_sf_rows", full.column_names, self._columns.setdefault(table, set()))
            con.execute(f'INSERT INTO "{table}" ({names}) SELECT {names} FROM _sf_rows')
            online = f"{table}_online"
            ensure_columns(con, online, "_sf_rows", full.column_names, self._columns.setdefault(online, set()))
            key = ["device_id"] + [k for k in self.online_key if k in rows.column_names]
            partition = ", ".join(f'"{k}"' for k in key)
            same = " AND ".join(f'o."{k}" IS NOT DISTINCT FROM l."{k}"' for k in key)
            con.execute(f"CREATE OR REPLACE TEMP VIEW _sf_latest AS SELECT * FROM _sf_rows "
                        f"QUALIFY row_number() OVER (PARTITION BY {partition} ORDER BY seq DESC) = 1")
            con.execute(f'DELETE FROM "{online}" o USING _sf_latest l WHERE {same} AND o.seq < l.seq')
            con.execute(f'INSERT INTO "{online}" ({names}) SELECT {names} FROM _sf_latest l '
                        f'WHERE NOT EXISTS (SELECT 1 FROM "{online}" o WHERE {same})')
        finally:
            con.execute("DROP VIEW IF EXISTS _sf_latest")
            con.unregister("_sf_rows")

    def offsets(self, topic: str) -> dict[int, int]:
        """Partition → next offset to consume, as stored with the rows."""
        with self._lock:
            return dict(self._con.execute("SELECT kafka_partition, next_offset FROM tunnel_offsets WHERE topic = ?",
                                          [topic]).fetchall())

    def query(self, sql: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._con.execute(sql, params or []).fetchall()

    def close(self) -> None:
        with self._lock:
            self._con.close()

    def __enter__(self) -> CloudStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_message(topic: str, partition: int, offset: int, value: bytes | None, key_for: Any,
                 message_key: bytes | None = None) -> Batch | DeadLetter:
    """A Kafka message as a verified :class:`Batch`, or as a :class:`DeadLetter` saying why not."""
    try:
        batch = decode(value, key_for)
    except EnvelopeError as exc:
        return DeadLetter(topic, partition, offset, exc.reason, str(exc), exc.device, bytes(value or b""))
    if message_key is not None and message_key != batch.device.encode():
        return DeadLetter(topic, partition, offset, "bad_key", f"message key {message_key!r} is not the signed "
                          f"device {batch.device!r}", batch.device, bytes(value))
    if batch.table.startswith("tunnel_") or batch.table.endswith("_online"):
        return DeadLetter(topic, partition, offset, "bad_payload", f"reserved table name {batch.table!r}",
                          batch.device, bytes(value))
    return batch


class CloudConsumer:
    """A consumer-group member storing the tunnel's features in a :class:`CloudStore` (see the module docstring).

    Example (needs a broker)::

        consumer = CloudConsumer("out/cloud.duckdb", KeyRegistry(".streamflow/keys.json"))
        consumer.run(idle_timeout_s=5)   # until nothing arrived for 5 s; run() alone runs until stop()
    """

    def __init__(self, db: str | os.PathLike[str], registry: KeyRegistry, *, topic: str = DEFAULT_TOPIC,
                 bootstrap: str | None = None, group_id: str = "streamflow-cloud",
                 online_key: Sequence[str] = ("user_id",), max_records: int = 500, partitions: int = 4):
        self.topic = topic
        self.dlq_topic = dead_letter_topic(topic)
        self.bootstrap = bootstrap_servers(bootstrap)
        self.group_id = group_id
        self.registry = registry
        self.store = CloudStore(db, online_key=online_key)
        self.stats = CloudStats()
        self.max_records = max_records
        self.partitions = partitions
        self._stop = threading.Event()
        self._consumer: Any = None
        self._dlq_producer: Any = None

    def _connect(self) -> Any:
        from kafka import ConsumerRebalanceListener, KafkaConsumer, KafkaProducer

        store, topic = self.store, self.topic

        class SeekToStored(ConsumerRebalanceListener):
            """Start each assigned partition where the stored rows end (the offsets in DuckDB)."""

            def on_partitions_revoked(self, revoked: Any) -> None:
                pass

            def on_partitions_assigned(self, assigned: Any) -> None:
                stored = store.offsets(topic)
                for tp in assigned:
                    if tp.partition in stored:
                        consumer.seek(tp, stored[tp.partition])

        ensure_topic(self.bootstrap, self.topic, self.partitions)
        ensure_topic(self.bootstrap, self.dlq_topic, 1)
        consumer = KafkaConsumer(bootstrap_servers=self.bootstrap, group_id=self.group_id,
                                 client_id=f"streamflow-cloud-{os.getpid()}", enable_auto_commit=False,
                                 auto_offset_reset="earliest", max_poll_records=self.max_records,
                                 isolation_level="read_committed", **CLIENT_TIMEOUTS)
        consumer.subscribe([self.topic], listener=SeekToStored())
        self._dlq_producer = KafkaProducer(bootstrap_servers=self.bootstrap, acks="all", enable_idempotence=True,
                                           compression_type="zstd", **CLIENT_TIMEOUTS)
        return consumer

    def poll_once(self, timeout_s: float = 0.2) -> ApplyResult:
        """Consume what one poll returns and store it; returns what was stored."""
        if self._consumer is None:
            self._consumer = self._connect()
        records = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=self.max_records)
        if not records:
            return ApplyResult()
        batches: list[tuple[Batch, DeadLetter]] = []  # with what it becomes if the store cannot take it
        dead: list[DeadLetter] = []
        offsets: dict[tuple[str, int], int] = {}
        key_for = self.registry.key_for
        for tp, messages in records.items():
            for m in messages:
                opened = open_message(tp.topic, tp.partition, m.offset, m.value, key_for, m.key)
                if isinstance(opened, Batch):
                    batches.append((opened, DeadLetter(tp.topic, tp.partition, m.offset, "unstorable", "",
                                                       opened.device, m.value)))
                else:
                    dead.append(opened)
            offsets[(tp.topic, tp.partition)] = messages[-1].offset + 1
        try:
            result = self.store.apply([b for b, _ in batches], dead, offsets)
        except (duckdb.Error, pa.ArrowException, ValueError, TypeError):
            result = self._apply_one_by_one(batches, dead, offsets)
        self._after_store(records, dead, offsets, result)
        return result

    def _apply_one_by_one(self, batches: list[tuple[Batch, DeadLetter]], dead: list[DeadLetter],
                          offsets: dict[tuple[str, int], int]) -> ApplyResult:
        """A poll the store refused as a whole: store its batches alone, dead-letter those it refuses."""
        total = ApplyResult()
        for batch, as_dead in batches:
            try:
                result = self.store.apply([batch], [])
            except (duckdb.Error, pa.ArrowException, ValueError, TypeError) as exc:
                dead.append(replace(as_dead, detail=f"table {batch.table} refused the batch: "
                                                    f"{type(exc).__name__}: {exc}"))
                continue
            total.stored += result.stored
            total.duplicates += result.duplicates
        self.store.apply([], dead, offsets)
        total.dead = len(dead)
        return total

    def _after_store(self, records: dict, dead: list[DeadLetter], offsets: dict[tuple[str, int], int],
                     result: ApplyResult) -> None:
        from kafka import TopicPartition
        from kafka.structs import OffsetAndMetadata

        stats = self.stats
        stats.messages += sum(len(m) for m in records.values())
        stats.stored += result.stored
        stats.duplicates += result.duplicates
        for d in dead:
            stats.dead[d.reason] += 1
            log.warning("dead letter %s[%d]@%d from %s: %s", d.topic, d.partition, d.offset, d.device or "?", d.detail)
            # d.raw, never None: an empty or null message has no key either, and kafka-python refuses to send
            # a record with neither (the ValueError escaped poll_once after the rows and offsets were stored)
            self._dlq_producer.send(self.dlq_topic, value=d.raw, headers=[
                ("reason", d.reason.encode()), ("detail", d.detail[:1000].encode()),
                ("source", f"{d.topic}/{d.partition}/{d.offset}".encode())])
        if dead:
            self._dlq_producer.flush(timeout=10)
        try:  # only for lag monitoring: the offsets that count are the ones stored with the rows
            self._consumer.commit({TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in offsets.items()})
        except Exception as exc:  # noqa: BLE001 - a rebalance or a broker hiccup must not stop consuming
            log.debug("kafka offset commit skipped: %s", exc)

    def run(self, idle_timeout_s: float | None = None, max_s: float | None = None) -> CloudStats:
        """Consume until :meth:`stop`, or until nothing arrived for ``idle_timeout_s``, or ``max_s`` passed."""
        started = last = time.monotonic()
        while not self._stop.is_set():
            try:
                result = self.poll_once()
            except Exception as exc:  # noqa: BLE001 - broker gone: say so, wait, reconnect
                log.warning("cloud consumer: %s; retrying in 1 s", exc)
                self._reset()
                self._stop.wait(1.0)
                continue
            now = time.monotonic()
            if result.stored or result.duplicates or result.dead:
                last = now
            if idle_timeout_s is not None and now - last >= idle_timeout_s:
                break
            if max_s is not None and now - started >= max_s:
                break
        return self.stats

    def stop(self) -> None:
        self._stop.set()

    def _reset(self) -> None:
        for client in (self._consumer, self._dlq_producer):
            if client is not None:
                with contextlib.suppress(Exception):  # closing a client of a dead broker may fail too
                    client.close(timeout=2) if client is self._dlq_producer else client.close()
        self._consumer = self._dlq_producer = None

    def close(self) -> None:
        self._reset()
        self.store.close()
