"""The device side of the tunnel: a sink any task can write feature rows to, shipped to Kafka.

    rows ─ write(table, rows) ─ batch (≤ batch_rows rows, ≤ linger_s old)
         ─ seal (on write, or by the sealer thread at linger_s): sequence numbers, a compact envelope
           (envelope.py: schema and dictionary by id, the codebook announcing them once; zstd; HMAC)
         ─ spool (durable, bounded, locked to this process)
         ─ sender thread: one persistent idempotent producer, the device's partition, acks=all
         ─ broker ack ─ batch kept (acknowledged) ─ the cloud's receipt covers it ─ batch leaves the spool
                                                  └ a receipt shows it missing, or none comes in time ─ sent again

Guarantees:

- **Ordered.** Sequence numbers are per device, across its tables; a table's rows are numbered in
  the order they were written. Every message goes to the partition Kafka's default partitioner
  gives the device id (the message itself has no key: the envelope names its device), so one
  device's batches share a partition; the sender has one batch in flight and sends the spool oldest first, so the
  topic holds them in sequence order (a resend after an unanswered request can repeat a batch; the cloud drops the
  repeat by (device, seq)).
- **Never lost once sealed.** A batch is on disk before it is sent and leaves the spool only after
  the broker acknowledged it (``acks=all``) and, with ``receipts`` (the default), the cloud said it stored it: a
  receipt thread reads the cloud's signed receipts for this device (``<topic>.receipts``, :mod:`.receipts`),
  forgets what they cover, resends what they show missing (a broker that lost acknowledged records, a topic
  deleted and made again; once the broker acknowledged it a second ago, doubling per resend), and, when batches
  acknowledged more than ``receipt_timeout_s`` ago are not covered, sends the newest of them again as a probe
  (stored past what is missing it makes a receipt show the rest missing; dropped as a repeat it makes the cloud
  publish its receipt again), one probe per wait, the wait doubling up to 60 s while no receipt brings progress.
  When the broker answers again after the sender failed (it restarted, and may have lost what it acknowledged
  last), or acknowledges a batch at an offset it gave before (it lost records, or the topic was made again), the
  receipt thread reads the receipts again from the start with a new consumer that looks its partition up again (a
  receipts topic lost and made again may have other partitions; each probe does the same), probes at once with
  the newest batch acknowledged before and polls often for a few seconds: a loss is resent within about a second.
  A receipt that says ``announce`` (the cloud parked envelopes it cannot open: the broker lost the one that
  announced their schema) makes the sender announce every registration again at once, in zero-row envelopes
  (:meth:`~.codebook.Codebook.announcements`), then again after 1 s, doubling to 60 s while the receipts still ask.
  Probes start once a receipt was seen (kept in the spool): against a cloud that publishes none, acknowledged
  batches stay until the spool bound evicts them. While the broker is unreachable, batches pile up in the
  spool and are resent in order when it answers again; a restarted device resends what its spool
  still holds. Rows not yet sealed (younger than ``linger_s``, fewer than ``batch_rows``) are in
  memory only: that is the durability window, as in the storage's. Sealing never waits on the
  broker: a sealer thread of its own seals by age while the sender waits for an acknowledgement.
- **Gives up loudly.** The sender retries a failed batch with exponential backoff (0.1 s doubling
  to 1 s); after ``retry_for_s`` of failures without a success it stops, logs an ERROR and
  :meth:`TunnelSink.write` raises :class:`~connectors.tunnel.kafka.TunnelUnavailable`. What was
  sealed stays in the spool for the next run.
- **Bounded.** The spool holds at most ``spool_max_bytes``; rows that would pass it are refused,
  logged at WARNING (the first time and at every doubling) and handed to ``on_refused`` (the device
  runner's ``dead_letter`` table) with the reason. Nothing is silently dropped: before refusing, the spool
  evicts batches the broker acknowledged that no receipt covers yet, oldest first (``spool.rows_evicted``,
  logged at WARNING).

Example (needs a broker; see the README's tunnel section)::

    sink = TunnelSink("phone-1", key, spool_path="out/tunnel.spool")
    sink.write("ipv", [{"user_id": "u1", "item_id": 7, "dwell_s": 12.0}])
    sink.wait_receipted(30)    # the cloud stored every sealed row (a consumer runs somewhere)
    sink.close(timeout_s=10)   # waits until the broker has every sealed row, or until the timeout
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from connectors.json_values import to_json
from connectors.row_buffer import RowBuffer, row_encoding_errors
from connectors.sql import check_table_name
from connectors.tunnel.budget import MAX_ROWS_PER_ENVELOPE
from connectors.tunnel.codebook import Codebook
from connectors.tunnel.kafka import (
    CLIENT_TIMEOUTS,
    COMPRESSION,
    DEFAULT_BOOTSTRAP,
    DEFAULT_TOPIC,
    KAFKA_CODECS,
    ClientTimeouts,
    Retry,
    TunnelUnavailable,
    ensure_topic,
)
from connectors.tunnel.keys import check_device_id
from connectors.tunnel.receipts import Receipt, decode_receipt, receipts_topic
from connectors.tunnel.spool import Acked, Spool, SpoolEntry, SpoolFull

#: what encoding rows into Arrow and storing them raises for a value (pyarrow is imported above)
ROW_ENCODING_ERRORS = row_encoding_errors()

log = logging.getLogger("streamflow.tunnel")

#: Envelopes stay under Kafka's default 1 MB message limit; a bigger batch is split in halves.
MAX_ENVELOPE_BYTES = 900_000

Refused = Callable[[str, list[dict[str, Any]], str], None]
#: how often the receipt thread polls (without blocking: noida-db answers an empty fetch at once, and a
#: blocking poll would spin): often for a while after an acknowledgement, then less (~0.7 % of a core instead of
#: ~5 %); and how often it looks for batches whose receipt is overdue
RECEIPT_POLL_S = 0.2
RECEIPT_POLL_IDLE_S = 0.5
#: and for a short while after the broker answered again following an outage (when a receipt shows what it lost)
RECEIPT_POLL_RECOVERING_S = 0.02
_RECOVERING_S = 3.0
_RECEIPT_BUSY_S = 2.0
_TIMEOUT_CHECK_S = 0.25
#: the longest wait between two probes (the wait doubles while no receipt brings progress)
MAX_RECEIPT_TIMEOUT_S = 60.0
#: a receipt's hole sends a batch again once the broker acknowledged it this long ago (doubling per resend)
HOLE_GRACE_S = 1.0
#: the first wait before announcing again while the receipts still ask for it (doubling up to the probes' longest)
ANNOUNCE_AGAIN_S = 1.0
#: a batch sealed longer ago than this is sent with the time of sending as its Kafka timestamp (see _record_time_ms)
SEAL_TIME_MAX_AGE_S = 3600.0


@dataclass
class TunnelStats:
    """What the sink did so far; ``rows_acked`` counts rows the broker acknowledged."""

    rows_written: int = 0
    rows_sealed: int = 0
    rows_acked: int = 0
    batches_acked: int = 0
    bytes_acked: int = 0  # envelope bytes (before Kafka's compression)
    rows_refused: int = 0
    send_failures: int = 0
    offsets_reused: int = 0  # acknowledgements at an offset the broker had given before: it lost records
    rows_receipted: int = 0  # rows the cloud's receipts said it stored (they left the spool)
    rows_resent: int = 0  # rows sent again: a receipt showed them missing, or none came in time
    batches_resent: int = 0
    receipts: int = 0  # receipts for this device read
    announcements: int = 0  # zero-row envelopes sent because a receipt asked for the registrations again


def _record_time_ms(sealed_at: float) -> int | None:
    """The Kafka timestamp of a batch's record: its seal time (the cloud measures seal → stored by it, a resend
    included), unless it was sealed over :data:`SEAL_TIME_MAX_AGE_S` ago (None: the time of sending), so that a
    long-spooled batch does not reach the broker already past a time-based retention."""
    return round(sealed_at * 1000) if 0 <= time.time() - sealed_at < SEAL_TIME_MAX_AGE_S else None


class TunnelSink:
    """Batches, signs, spools and sends feature rows of one device (see the module docstring).

    ``bootstrap``: the broker(s), ``host:port[,...]`` (default :data:`~connectors.tunnel.kafka.DEFAULT_BOOTSTRAP`).
    ``on_refused(table, rows, reason)`` receives rows the sink will not send (default: appended as JSON
    lines to ``<spool>.refused.jsonl``); ``on_ack(entry)`` is called
    when the broker has a batch (at least once: a batch resent after a crash is reported again).
    ``compression``: Kafka's record-batch codec on top of the envelope's own zstd (default none: it would
    only add a frame); ``dictionary_rows``: rows per table a zstd dictionary is trained on (0: never);
    ``announce_every_s``: how often a schema or dictionary in use is announced again (see :mod:`.codebook`);
    ``receipts`` (default on): keep batches until the cloud's receipt covers them and resend what it lacks
    (see the module docstring), ``receipt_timeout_s``: the first wait for a receipt before a resend.
    """

    def __init__(self, device: str, key: bytes, spool_path: str | os.PathLike[str], *,
                 topic: str = DEFAULT_TOPIC, bootstrap: str | None = None, compression: str = "none",
                 batch_rows: int = 1000, linger_s: float = 0.002, spool_max_bytes: int = 256 << 20,
                 on_refused: Refused | None = None, on_ack: Callable[[SpoolEntry], None] | None = None,
                 send_timeout_s: float = 30.0, partitions: int = 4, retry_for_s: float | None = 600.0,
                 dictionary_rows: int = 1000, announce_every_s: float = 600.0, receipts: bool = True,
                 receipt_timeout_s: float = 5.0):
        if compression not in COMPRESSION:
            raise ValueError(f"compression must be one of {', '.join(COMPRESSION)}, got {compression!r}")
        if not 1 <= batch_rows <= MAX_ROWS_PER_ENVELOPE or linger_s < 0:
            raise ValueError(f"batch_rows must be 1..{MAX_ROWS_PER_ENVELOPE} (the cloud's budget) and linger_s >= 0")
        self.device = check_device_id(device)
        self.topic = topic
        self.bootstrap = bootstrap or DEFAULT_BOOTSTRAP
        self.compression = compression
        self.batch_rows = batch_rows
        self.linger_s = linger_s
        self.send_timeout_s = send_timeout_s
        self.partitions = partitions
        self.retry_for_s = retry_for_s
        #: set when the sender gave up (see the module docstring); write() raises it from then on
        self.error: TunnelUnavailable | None = None
        self.stats = TunnelStats()
        self.spool = Spool(spool_path, max_bytes=spool_max_bytes, keep_acked=receipts)
        self.receipts = receipts
        self.receipt_timeout_s = receipt_timeout_s
        #: the newest receipt read for this device (None before the first)
        self.receipt: Receipt | None = None
        self._key = key
        self._receipts_seen = bool(self.spool.get("receipts_seen"))
        self._resends: dict[int, int] = {}  # first_seq → times sent again
        self._timeouts_checked = 0.0
        self._probe_at = 0.0  # monotonic time before which no probe is sent
        self._probe_wait = receipt_timeout_s  # the wait after the next probe (doubles while nothing progresses)
        self._announce_due = False  # a receipt asked for the registrations again; the sender sends them
        self._announce_at = 0.0  # monotonic time before which no receipt asks again
        self._announce_wait = ANNOUNCE_AGAIN_S
        self._stop_receipts = threading.Event()
        self._acked = threading.Event()  # set when the broker acknowledged a batch (wakes the receipt thread)
        self._acked_at = 0.0  # monotonic time of the last acknowledgement
        # set by the sender when the broker answers again after failures: what it acknowledged before may be lost
        self._broker_back = threading.Event()
        self._failing_since = 0.0  # time.time() of the first of the sender's current run of failures
        self._recovering_until = 0.0  # monotonic time until which receipts are polled often (after an outage)
        self._receipts_looked_up = float("-inf")
        self._offsets: dict[int, int] = {}  # partition → the offset of the newest record the broker acknowledged
        self.codebook = Codebook(device, key, self.spool, dictionary_rows=dictionary_rows,
                                 announce_every_s=announce_every_s)
        self._device_key = device.encode()
        self.refused_path = Path(f"{self.spool.path}.refused.jsonl")
        self._on_refused = on_refused or self._refused_to_file
        self._on_ack = on_ack
        self._pending: dict[str, RowBuffer] = {}  # the open batch, per table
        self._pending_rows = 0
        self._pending_since = 0.0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closing = False
        self._producer: Any = None
        self._refused_warned_at = 0
        if self.spool.batches_pending:
            log.info("tunnel spool %s holds %d rows in %d batches from an earlier run; resending them first",
                     self.spool.path, self.spool.rows_pending, self.spool.batches_pending)
        if self.spool.batches_held > self.spool.batches_pending:
            log.info("tunnel spool %s holds %d rows the broker acknowledged and the cloud has not confirmed; kept "
                     "until its receipt", self.spool.path, self.spool.rows_held - self.spool.rows_pending)
        self._seal_thread = threading.Thread(target=self._seal_loop, name=f"tunnel-seal-{device}", daemon=True)
        self._send_thread = threading.Thread(target=self._send_loop, name=f"tunnel-send-{device}", daemon=True)
        self._receipt_thread = threading.Thread(target=self._receipt_loop, name=f"tunnel-receipts-{device}",
                                                daemon=True)
        self._seal_thread.start()
        self._send_thread.start()
        if receipts:
            self._receipt_thread.start()

    # -- the device side -------------------------------------------------------------------------
    def write(self, table: str, rows: Iterable[Mapping[str, Any]]) -> None:
        """Queue ``rows`` of ``table``; they are sealed within ``linger_s`` or when ``batch_rows`` are queued."""
        with self._lock:
            if self._closing:
                raise RuntimeError("tunnel sink is closed")
            if self.error is not None:
                raise self.error
            buffer = self._pending.get(table)
            if buffer is None:
                buffer = self._pending[check_table_name(table)] = RowBuffer()
            added = buffer.extend(rows)
            if not added:
                return
            self.stats.rows_written += added
            first = not self._pending_rows
            self._pending_rows += added
            if first:
                self._pending_since = time.monotonic()
            if self._pending_rows >= self.batch_rows or time.monotonic() - self._pending_since >= self.linger_s:
                self._seal_locked()
                self._wake.notify_all()
            elif first:  # the sealer times the linger from now on
                self._wake.notify_all()

    def flush(self) -> None:
        """Seal what is queued now (it is then durable in the spool)."""
        with self._lock:
            self._seal_locked()
            self._wake.notify_all()

    def wait_delivered(self, timeout_s: float) -> bool:
        """Seal, then wait until the broker acknowledged every spooled row; False on timeout."""
        self.flush()
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self.spool.batches_pending and self.error is None and time.monotonic() < deadline:
                self._wake.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            return not self.spool.batches_pending

    def wait_receipted(self, timeout_s: float) -> bool:
        """Seal, then wait until the cloud's receipts covered every spooled row; False on timeout (or without
        ``receipts``, when anything is still spooled)."""
        self.flush()
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while (self.spool.batches_held and self.receipts and self.error is None
                   and time.monotonic() < deadline):
                self._wake.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            return not self.spool.batches_held

    def close(self, timeout_s: float = 10.0) -> bool:
        """Seal, wait up to ``timeout_s`` for delivery, stop; returns True if nothing is left in the spool.

        Batches still unacknowledged stay in the spool and are sent by the next sink on the same spool.
        """
        delivered = self.wait_delivered(timeout_s)
        with self._lock:
            self._seal_locked()  # rows another thread wrote meanwhile: spooled for the next run, never dropped
            self._closing = True
            self._wake.notify_all()
        self._stop_receipts.set()
        self._acked.set()
        self._seal_thread.join(timeout=5)
        self._send_thread.join(timeout=self.send_timeout_s + 5)
        if self.receipts:
            self._receipt_thread.join(timeout=10)
        delivered = delivered and not self.spool.batches_pending
        self._drop_producer()
        if not delivered:
            log.warning("tunnel: %d rows in %d batches not yet acknowledged by %s; they stay in %s for the next run",
                        self.spool.rows_pending, self.spool.batches_pending, self.bootstrap, self.spool.path)
        unconfirmed = self.spool.rows_held - self.spool.rows_pending
        if unconfirmed:
            log.info("tunnel: %d rows acknowledged by the broker are not confirmed by the cloud yet; they stay in %s "
                     "until its receipt (the next run reads it)", unconfirmed, self.spool.path)
        self.spool.close()
        return delivered

    # -- sealing ---------------------------------------------------------------------------------
    def _seal_locked(self) -> None:
        pending, self._pending, self._pending_rows = self._pending, {}, 0
        for table, buffer in pending.items():
            try:
                tables = buffer.to_arrow()
            except ROW_ENCODING_ERRORS:
                tables = self._rows_one_by_one(table, buffer)  # values whose types clash within a column
            for rows in tables:
                self._seal_table(table, rows)

    def _rows_one_by_one(self, table: str, buffer: RowBuffer) -> list[pa.Table]:
        """Each row as a table of its own; a row Arrow cannot take at all is refused with the reason."""
        tables = []
        for row in buffer.rows():
            single = RowBuffer()
            single.extend([row])
            try:
                tables += single.to_arrow()
            except ROW_ENCODING_ERRORS as exc:
                self._refuse(table, [row], f"row cannot be encoded: {type(exc).__name__}: {exc}")
        return tables

    def _seal_table(self, table: str, rows: pa.Table) -> None:
        sealed_at = time.time()
        try:
            self.spool.seal(table, rows.num_rows, lambda seq: self._envelope(table, seq, rows), sealed_at=sealed_at)
        except _TooBig:
            if rows.num_rows > 1:
                half = rows.num_rows // 2
                self._seal_table(table, rows.slice(0, half))
                self._seal_table(table, rows.slice(half))
            else:
                self._refuse(table, rows.to_pylist(), f"row is larger than the {MAX_ENVELOPE_BYTES}-byte message limit")
            return
        except SpoolFull as exc:
            self._refuse(table, rows.to_pylist(), f"tunnel spool full: {exc}")
            return
        except sqlite3.Error as exc:  # the disk is full or the spool file is damaged
            self._refuse(table, rows.to_pylist(), f"tunnel spool {self.spool.path} write failed: {exc}")
            return
        self.codebook.sealed(table, rows)
        self.stats.rows_sealed += rows.num_rows

    def _envelope(self, table: str, first_seq: int, rows: pa.Table) -> bytes:
        value = self.codebook.envelope(table, first_seq, rows)
        if len(value) > MAX_ENVELOPE_BYTES:
            raise _TooBig
        return value

    def _refuse(self, table: str, rows: list[dict[str, Any]], reason: str) -> None:
        self.stats.rows_refused += len(rows)
        if self.stats.rows_refused >= 2 * self._refused_warned_at:
            self._refused_warned_at = self.stats.rows_refused
            log.warning("TUNNEL IS REFUSING ROWS (%d so far): %s; they go to the dead-letter place, not to the cloud",
                        self.stats.rows_refused, reason)
        self._on_refused(table, rows, reason)

    def _refused_to_file(self, table: str, rows: list[dict[str, Any]], reason: str) -> None:
        """The default dead-letter place: JSON lines next to the spool."""
        with open(self.refused_path, "a", encoding="utf-8") as out:
            for row in rows:
                out.write(to_json({"table": table, "reason": reason, "row": row}) + "\n")

    # -- sending ---------------------------------------------------------------------------------
    def _seal_loop(self) -> None:
        """Seal the open batch when it is ``linger_s`` old; never touches the broker, so a slow one cannot hold it."""
        with self._lock:
            while not self._closing:
                if not self._pending_rows:
                    self._wake.wait()
                    continue
                due = self._pending_since + self.linger_s - time.monotonic()
                if due > 0:
                    self._wake.wait(due)
                    continue
                self._seal_locked()
                self._wake.notify_all()

    def _send_loop(self) -> None:
        retry = Retry(f"tunnel sender to {self.bootstrap}", give_up_after_s=self.retry_for_s)
        while True:
            with self._lock:
                while not self.spool.batches_pending and not self._announce_due and not self._closing:
                    self._wake.wait()
                if self._closing:
                    return  # close() waited for delivery; what is left stays spooled for the next run
                announce, self._announce_due = self._announce_due, False
            entry = None
            try:
                if announce:
                    self._announce()
                else:
                    oldest = self.spool.oldest(1)
                    if not oldest:  # a receipt covered it meanwhile (the cloud had it already)
                        continue
                    entry = oldest[0]
                    self._deliver(entry)
                if retry.failures:
                    self._broker_back.set()
                retry.succeeded()
            except Exception as exc:  # noqa: BLE001 - any failure: keep the batch, back off, retry in order
                self.stats.send_failures += 1
                if not retry.failures:
                    self._failing_since = time.time()
                if entry is None:
                    self._announce_due = True
                self._drop_producer()  # the retry gets a fresh producer (see _drop_producer)
                try:
                    delay = retry.failed(exc)
                except TunnelUnavailable as gave_up:
                    self._give_up(gave_up)
                    return
                if retry.failures == 1 or delay >= 2.0:
                    what = "the announcements" if entry is None else f"batch {entry.first_seq}"
                    log.warning("tunnel: broker %s did not take %s (%s); %d rows wait in the spool, retrying in "
                                "%.1f s", self.bootstrap, what, exc, self.spool.rows_pending, delay)
                with self._lock:
                    if self._closing:
                        return
                    self._wake.wait(delay)

    def _give_up(self, gave_up: TunnelUnavailable) -> None:
        error = TunnelUnavailable(f"{gave_up}; {self.spool.rows_pending} rows in {self.spool.batches_pending} "
                                  f"batches stay in the spool {self.spool.path} and are sent by the next run")
        log.error("TUNNEL GAVE UP: %s", error)
        with self._lock:
            self.error = error
            self._wake.notify_all()

    def _deliver(self, entry: SpoolEntry) -> None:
        producer = self._connect()
        future = producer.send(self.topic, value=entry.value, partition=self._partition(producer),
                               timestamp_ms=_record_time_ms(entry.sealed_at))
        # the producer fails the batch itself at delivery_timeout_ms (= send_timeout_s); waiting a little longer
        # leaves it no record pending, so _drop_producer can close it at once
        metadata = future.get(timeout=self.send_timeout_s + 2.0)
        self._check_offset(metadata.partition, metadata.offset)
        if self._on_ack is not None:  # before the spool forgets the batch: a crash in between repeats the call
            self._on_ack(entry)
        self.spool.ack(entry.first_seq)
        self._acked_at = time.monotonic()
        self._acked.set()
        stats = self.stats
        stats.rows_acked += entry.n_rows
        stats.batches_acked += 1
        stats.bytes_acked += len(entry.value)
        with self._lock:
            self._wake.notify_all()

    def _check_offset(self, partition: int, offset: int) -> None:
        """An offset at or below one the broker gave this device before on the same partition means the partition
        lost records it had acknowledged (a broker that restarted without them, a topic deleted and made again) and
        hands their offsets to new ones, whether or not a send failed meanwhile: recover as after an outage."""
        last = self._offsets.get(partition, -1)
        self._offsets[partition] = offset
        if offset <= last:
            self.stats.offsets_reused += 1
            log.warning("tunnel: the broker gave offset %d of partition %d again (it acknowledged offset %d before): "
                        "it lost records; reading the receipts again", offset, partition, last)
            self._failing_since = time.time()  # every batch acknowledged before this one may be lost
            self._broker_back.set()

    def _announce(self) -> None:
        """Send every registration in use again, in zero-row envelopes on the device's partition (a receipt asked)."""
        producer = self._connect()
        with self._lock:
            values = self.codebook.announcements(self.spool.next_seq)
        for value in values:
            producer.send(self.topic, value=value, partition=self._partition(producer)).get(
                timeout=self.send_timeout_s + 2.0)
        self.stats.announcements += len(values)
        log.warning("tunnel: the cloud cannot open some envelopes of %s (their schema's announcement was lost): "
                    "announced %d schemas again", self.device, len(values))

    def _partition(self, producer: Any) -> int:
        """The device's partition: as Kafka's default partitioner would pick it for the device id as key."""
        return _partition_of(self._device_key, producer.partitions_for(self.topic))

    # -- receipts --------------------------------------------------------------------------------
    def _receipt_loop(self) -> None:
        """Read this device's receipts, trim the spool by them, resend what the cloud lacks (module docstring)."""
        consumer = None
        while not self._stop_receipts.is_set():
            try:
                if consumer is None:
                    consumer = self._receipt_consumer()
                if self.spool.batches_held == self.spool.batches_pending:  # nothing acknowledged awaits a receipt
                    self._acked.wait(1.0)  # costs nothing while idle (polling would: ~5 % of a core)
                    self._acked.clear()
                    continue
                if self._broker_back.is_set():
                    consumer = self._after_outage(consumer)
                if consumer.assignment() or self._assign_receipts(consumer):
                    self._read_receipts(consumer)
                if time.monotonic() - self._timeouts_checked >= _TIMEOUT_CHECK_S:
                    self._timeouts_checked = time.monotonic()
                    if self._resend_overdue():
                        consumer = self._read_receipts_afresh(consumer)
            except Exception as exc:  # noqa: BLE001 - a broker away: the receipts wait, the spool keeps everything
                log.debug("tunnel: receipts of %s not read (%s); trying again", self.device, exc)
                _close_quietly(consumer)
                consumer = None
                self._stop_receipts.wait(1.0)
            now = time.monotonic()
            wait = (RECEIPT_POLL_RECOVERING_S if now < self._recovering_until
                    else RECEIPT_POLL_S if now - self._acked_at < _RECEIPT_BUSY_S else RECEIPT_POLL_IDLE_S)
            self._stop_receipts.wait(wait)
        _close_quietly(consumer)

    def _receipt_consumer(self) -> Any:
        from kafka import KafkaConsumer

        return KafkaConsumer(bootstrap_servers=self.bootstrap, client_id=f"streamflow-{self.device}-receipts",
                             group_id=None, enable_auto_commit=False, auto_offset_reset="earliest", **CLIENT_TIMEOUTS)

    def _assign_receipts(self, consumer: Any) -> bool:
        """Read this device's partition of the receipts topic from its start; False while there is no such topic
        (no cloud consumer published one yet: looked for again at most every second)."""
        from kafka import TopicPartition

        if time.monotonic() - self._receipts_looked_up < 1.0:
            return False
        self._receipts_looked_up = time.monotonic()
        topic = receipts_topic(self.topic)
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            return False
        tp = TopicPartition(topic, _partition_of(self._device_key, partitions))
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)  # compacted: the newest receipt of each device of the partition
        return True

    def _read_receipts(self, consumer: Any) -> None:
        newest = None
        for messages in consumer.poll(timeout_ms=0).values():
            for m in messages:
                if m.key == self._device_key:
                    newest = decode_receipt(m.value, self.device, self._key) or newest
        if newest is not None:
            self._on_receipt(newest)

    def _on_receipt(self, receipt: Receipt) -> None:
        self.receipt = receipt
        self.stats.receipts += 1
        if not self._receipts_seen:
            self._receipts_seen = True
            self.spool.put("receipts_seen", 1)
        rows, _ = self.spool.trim(receipt.covers)
        self.stats.rows_receipted += rows
        if rows:  # the cloud is there and storing: a later silence gets the first probe wait again
            self._probe_wait = self.receipt_timeout_s
        acked, wall = self.spool.acked(), time.time()
        live = {a.first_seq for a in acked}
        for first_seq in [f for f in self._resends if f not in live]:  # forget batches gone from the spool
            del self._resends[first_seq]
        lacking = [a for a in acked if receipt.lacks(a.first_seq, a.end) and wall - a.acked_at >= self._grace(a)]
        if lacking:
            self._resend(lacking, f"the cloud's receipt shows them missing (it has all below {receipt.stored_mark}, "
                                  f"and up to {receipt.seen_end})")
        now = time.monotonic()
        with self._lock:
            if not receipt.announce:
                self._announce_wait = ANNOUNCE_AGAIN_S
            elif now >= self._announce_at:
                self._announce_due = True
                self._announce_at = now + self._announce_wait
                self._announce_wait = min(MAX_RECEIPT_TIMEOUT_S, 2 * self._announce_wait)
            self._wake.notify_all()

    def _after_outage(self, consumer: Any) -> Any:
        """The broker answers again after failing: read the receipts afresh, and probe at once; the new consumer.

        A broker that restarted may have lost what it acknowledged last (receipts and batches alike) and handed their
        offsets to new records: a receipt consumer whose position lies past the lost ones skips the new receipts
        until the log grows past it, and a loss at the tail of what this device sent shows in no receipt until a
        later batch of it is stored. It may also have lost the receipts topic itself, made again (by the cloud's
        next receipt) with other partitions: the device's receipts then land on another partition. So the receipts
        are read again from the start, by a new consumer that looks the partition up again (compacted: little to
        read), and the newest batch acknowledged before the outage that no receipt covers is sent again: stored
        past a hole it makes the next receipt show the hole; dropped as a repeat it makes the cloud publish its
        receipt again.
        """
        self._broker_back.clear()
        self._recovering_until = time.monotonic() + _RECOVERING_S
        consumer = self._read_receipts_afresh(consumer)
        before = [a for a in self.spool.acked() if a.acked_at < self._failing_since]
        if self._receipts_seen and before:
            self._resend(before[-1:], "the broker answers again after an outage and may have lost what it "
                                      "acknowledged last")
        return consumer

    def _read_receipts_afresh(self, consumer: Any) -> Any:
        """A new receipt consumer in place of ``consumer``, assigned this device's partition as the broker has the
        topic now and reading it from the start (after an outage, and with each probe: a topic deleted and made
        again, with another number of partitions or offsets that restart, is followed)."""
        _close_quietly(consumer)
        consumer = self._receipt_consumer()
        self._receipts_looked_up = float("-inf")
        self._assign_receipts(consumer)
        return consumer

    def _resend_overdue(self) -> bool:
        """Send again the newest acknowledged batch no receipt covered within ``receipt_timeout_s`` (a probe; see
        the module docstring), one probe per wait, the wait doubling up to 60 s while no receipt brings progress;
        whether one was sent."""
        now = time.monotonic()
        if not self._receipts_seen or now < self._probe_at:
            return False
        acked, wall = self.spool.acked(), time.time()
        overdue = [a for a in acked if wall - a.acked_at >= self.receipt_timeout_s]
        if not overdue:
            return False
        self._resend(overdue[-1:], f"no receipt covers the {len(overdue)} batches acknowledged more than "
                                   f"{self.receipt_timeout_s:g} s ago (next probe in {self._probe_wait:g} s)")
        self._probe_at = now + self._probe_wait
        self._probe_wait = min(MAX_RECEIPT_TIMEOUT_S, 2 * self._probe_wait)
        return True

    def _grace(self, batch: Acked) -> float:
        """How long after the broker acknowledged ``batch`` a receipt's hole may send it again: time for the cloud
        to read it (a receipt older than the batch's last send still shows the hole), doubling per resend (a
        resend lost again, to the next kill of the broker say, is sent again within seconds, not in a storm)."""
        return min(MAX_RECEIPT_TIMEOUT_S / 2, HOLE_GRACE_S * (1 << self._resends.get(batch.first_seq, 0)))

    def _resend(self, batches: list[Acked], why: str) -> None:
        for a in batches:
            self._resends[a.first_seq] = self._resends.get(a.first_seq, 0) + 1
        self.spool.resend(a.first_seq for a in batches)
        rows = sum(a.n_rows for a in batches)
        self.stats.rows_resent += rows
        self.stats.batches_resent += len(batches)
        log.warning("tunnel: sending %d rows again (seq %d..%d, %d batches): %s", rows, batches[0].first_seq,
                    batches[-1].end - 1, len(batches), why)
        with self._lock:
            self._wake.notify_all()

    def _connect(self) -> Any:
        if self._producer is None:
            from kafka import KafkaProducer

            ensure_topic(self.bootstrap, self.topic, self.partitions)
            # kafka-python refuses delivery_timeout_ms <= linger_ms + request_timeout_ms (a config error the
            # send loop would retry forever): a send timeout under 5 s shortens the request timeout instead.
            delivery_ms = max(2, int(self.send_timeout_s * 1000))
            timeouts: ClientTimeouts = {**CLIENT_TIMEOUTS, "request_timeout_ms": min(
                CLIENT_TIMEOUTS["request_timeout_ms"], delivery_ms - 1)}
            self._producer = KafkaProducer(
                bootstrap_servers=self.bootstrap, client_id=f"streamflow-{self.device}",
                enable_idempotence=True, acks="all",
                compression_type=KAFKA_CODECS[self.compression],
                linger_ms=0, max_in_flight_requests_per_connection=1, delivery_timeout_ms=delivery_ms,
                max_request_size=MAX_ENVELOPE_BYTES + 100_000, **timeouts)
            log.info("tunnel: connected to %s, topic %s, %s compression", self.bootstrap, self.topic, self.compression)
        return self._producer

    def _drop_producer(self) -> None:
        """Close the producer (the next send makes a new one) without ever raising.

        After a failed delivery the producer may be wedged: when a batch it had already sent expires, kafka-python
        (3.0) resets its idempotent producer id but never asks for a new one, so it sends nothing again, even once
        the broker is back. So it is closed and replaced, with public calls only: ``close(timeout=0)`` stops its
        I/O thread at once, but raises while a record is pending (:meth:`_deliver` waits past the delivery
        timeout, so that is rare); then the record is left to expire (``flush``) and it is closed again. The
        records it holds are in the spool, so dropping them is safe.
        """
        producer, self._producer = self._producer, None
        if producer is None:
            return
        with self._lock:  # a new connection may reach a cloud that lost its registry: announce everything again
            self.codebook.forget_announced()
        try:
            producer.close(timeout=0)
            return
        except Exception as exc:  # noqa: BLE001 - a record still pending: let it expire, then close again
            log.debug("tunnel: the old producer still holds a record (%s); waiting for it to expire", exc)
        try:
            with contextlib.suppress(Exception):
                producer.flush(timeout=self.send_timeout_s + 2.0)  # its delivery timeout fails the record
            producer.close(timeout=0)
        except Exception as exc:  # noqa: BLE001 - a producer we throw away must not stop the sink
            log.warning("tunnel: the old producer did not close (%s); its I/O thread ends with the process", exc)


class _TooBig(Exception):
    """An envelope over MAX_ENVELOPE_BYTES (raised before anything is numbered or stored)."""


def _partition_of(key: bytes, partitions: Iterable[int]) -> int:
    """The partition Kafka's default partitioner gives ``key`` among ``partitions``."""
    from kafka.partitioner import murmur2

    ordered = sorted(partitions)
    return ordered[(murmur2(key) & 0x7FFFFFFF) % len(ordered)]


def _close_quietly(client: Any) -> None:
    if client is not None:
        with contextlib.suppress(Exception):
            client.close()
