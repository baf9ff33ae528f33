"""The Kafka tunnel on loopback: device sink → broker → cloud consumer → DuckDB, vs a naive per-row JSON producer.

``python -m bench.tunnel [--quick]``

Broker: ``STREAMFLOW_KAFKA_BOOTSTRAP`` if set, else a noida-db :class:`LocalBroker` on 127.0.0.1 in a
temp dir, stopped at the end. The device side (:class:`TunnelSink`, default settings: compact envelopes,
``batch_rows=1000``, ``linger_s=0.002``, SQLite spool in the temp dir) runs in this process; each
cloud side runs in a process of its own (``multiprocessing`` spawn), so device and cloud never share
a GIL, as on a real device and cloud. Both sides read the same wall clock. A cloud process polls only
while its rows are being measured: noida-db answers an empty fetch at once (a real broker holds it
for ``fetch_max_wait_ms``), so an idle consumer still costs CPU (~0.17 core polling 5 ms apart, see
:meth:`CloudConsumer._poll`), which on 2 cores would slow the side being measured.

Measured side by side in one run:

- **Latency** (``p50_ms_3kb`` … ``p99_ms_30kb``): rows paced at 100 rows/s (absolute schedule, one
  ``sink.write`` per row) carrying a float32 vector of 768 (3,072 B) or 7,680 (30,720 B) random
  normal values (embedding-like: zstd cannot shrink it much, unlike zero padding) and a
  ``produced_at = time.time()`` taken just before ``write``. Per row, latency = the moment the
  cloud's DuckDB ``COMMIT`` returned for the transaction holding the row, minus ``produced_at``. The
  consumer process wraps its :meth:`CloudStore.apply` to record ``time.time()`` right after each
  commit (nothing else is added to its loop); at the end the i-th commit is paired with the i-th
  distinct ``ingested_at`` of ``tunnel.batches`` (each transaction stamps its own) and rows are
  matched through their stored ``ingested_at``. So the figure includes: the sink's linger (the open
  batch is sealed once its oldest row is ``linger_s`` old, by the sealer thread), sealing (the compact
  envelope, zstd, HMAC, the spool's SQLite insert with ``synchronous=FULL``, i.e. an fsync), the
  one-in-flight produce (``acks=all``) and its ack, the consumer's fetch, HMAC and decode, and the
  whole DuckDB transaction (de-duplication, offline append, online upsert, offsets). It excludes the
  consumer's later Kafka offset commit (lag monitoring only). ``p*_ms_*_ingested_at`` report the
  same rows up to the stored ``ingested_at`` (naive UTC, taken at the *start* of the transaction).
  ``stages_ms_*`` splits each row's time ([p50, p99] per stage): produced → sealed (linger, lock; the
  batch's ``sealed_at``), sealed → sent (envelope, spool insert and fsync, waiting for the batch in
  flight before it; the sender's hand-over to the producer, timed by wrapping the sink's ``_deliver``),
  sent → acked (produce, ``acks=all``; the sink's ``on_ack``), acked → opened (the consumer's fetch,
  verify, decode, and waiting for its previous transaction; can be slightly negative, the consumer may
  fetch before the sink has processed the ack), opened → transaction start, transaction start → commit.
  Each round is one continuous paced run; percentiles are over all rows
  of all rounds (``p99_ms_*_rounds`` lists each round's p99). Before the first round each sink sends
  untimed warm-up rows (producer connect, topic metadata). The latency rounds run after the
  throughput rounds, all 3 KB rounds before the 30 KB ones, on a broker and a cloud process (with its
  DuckDB file) of their own: noida-db rewrites its whole state (every stored record batch, as JSON) to
  ``kafka.json`` every few seconds, so its CPU and disk load grows with what it holds (measured: the
  throughput phase leaves 27 MB of JSON, the 3 KB rounds grow it to 79 MB, the 30 KB ones to 570 MB),
  which Apache Kafka, appending to segment files, does not do; on the shared broker the throughput
  phase's records slowed every 3 KB round. So once the cloud has stored a round, the latency topic's records
  are deleted up to its end (:func:`trim_topic`: Kafka's DeleteRecords, what retention does to records
  consumed long ago), and the broker holds about one round's records, as an appending broker's costs would
  stay flat. Measured without that trim, same code, quiet machine: 5 rounds' p99 49.7, 61.5, 61.5, 58.7, 67.3
  ms (pooled 61.1); with the same paced rows through a broker holding 60 MB of other records, p99 222 ms against
  57 ms on an empty one. The cloud's DuckDB file still grows and the machine is shared; read the rounds, not
  only the pooled figure. With ``STREAMFLOW_KAFKA_BOOTSTRAP``
  every phase uses that broker.
  ``cloud_consumer_gc``: the garbage collector's pauses in the latency phase's cloud process (the
  consumer freezes what is alive once it is connected: ``CloudConsumer(freeze_gc=True)``).
- **Throughput** (``rows_per_s``): IPV rows from the job (~100 B each) written one per
  ``sink.write`` as fast as possible, from the first write until the consumer's commit that makes
  the cloud hold all of them; median over rounds. ``device_acked_rows_per_s`` stops the clock at the
  broker's last ack instead. Naive baseline in the same rounds: the same rows, one Kafka message per
  row, unsigned JSON, uncompressed, each row its own record batch (``batch_size=1``, so the client
  cannot batch rows), ``acks=all``, async sends then ``flush``; a naive consumer process stores each
  poll in one DuckDB transaction (no signature check, no de-duplication, no online table).
- **Bytes** (``bytes_saved_fraction``): the IPV job (``jobs/ipv.py``) on the device runner over
  the sample, its feature rows through a TunnelSink as the runner's ``tunnel=`` (compact envelopes, format 2).
  Wire bytes = the Kafka record batches (v2 header, records) of the topic. With our own broker they are read
  from the broker's log (a second, private noida-db used only for this phase, so its log is small;
  its state file lists every stored record batch): ``wire_bytes_method = "broker_log"``. They are
  also rebuilt from every acknowledged envelope with kafka-python's own record-batch builder (the
  sink sends one envelope per produce request, so one envelope per record batch), which is the only
  method on an external broker (``"rebuilt"``) and a cross-check otherwise (``rebuilt_vs_broker_log``).
  Produce-request framing (~100 B per request) and TCP/IP headers are in neither figure. Baselines:
  the raw CSV lines (with newline) of the events the job consumed, uncompressed, as shipping every
  raw event would (``bytes_saved_fraction = 1 - feature_wire_bytes / raw_bytes``), and
  ``bytes_saved_fraction_vs_app_events_json``: the same input as an app logs it, the app events the runtime
  consumed (page enters and exits, clicks; the CSV has no page events, the source derives them) as
  uncompressed JSON lines in the JSON-lines source's format. Side by side in the same run: the same batches
  as format-1 envelopes (Arrow IPC with the schema, names and HMAC in each; keyed messages, Kafka zstd, as
  the previous sink sent them: ``*_previous_format``), the naive producer's wire bytes, the envelopes with
  Kafka's gzip, lz4 and zstd on top, and the raw CSV zstd-compressed in one piece.
  ``one_row_per_envelope_wire_bytes_per_row``: the run's last 1,000 rows, each in an envelope of its own (a
  device producing a row less often than every ``linger_s``: what a phone does), with their own sequence
  numbers, encoded by the run's codebook once a first envelope announced the schema (its dictionary if it
  kept one: ``dictionary_used``, ``dictionary_gain_one_row``), as one record batch each; beside it the same
  rows in format 1.

- **End-to-end acknowledgement** (``e2e_lost_rows_broker_kill``, ``gap_recovery_s``; only with our own noida-db,
  which this phase kills): a device (receipts on, the default) writes ``KILL_ROWS`` rows, 50 a write, paced over
  ~8 s, to a broker of its own, SIGKILLed three times mid-run and restarted after ``KILL_DOWN_S`` (noida-db loses
  the records it acknowledged since it last wrote its state, ~1 s, and hands their offsets to new ones); a cloud
  consumer process (``CloudConsumer.run``, receipts on, ``gap_wait_s`` long enough never to give up) stores them.
  The cloud stops reading ``KILL_LAG_S`` before each kill and goes on after the restart (a consumer behind by a
  second, as a loaded one is): so each kill costs records the cloud never read, every run (with a consumer that
  keeps up, whether a kill costs any is a race the issue saw lost 3 times in 4).
  ``e2e_lost_rows_broker_kill``: rows the broker acknowledged to the application (``on_ack``) missing from the
  cloud once the device's spool is empty (every batch covered by a receipt) or ``WAIT_S`` passed.
  ``gap_recovery_s``: per kill, from the broker's restart to the moment the cloud stored the last missing row (the
  ``closed_at`` of the gaps it noticed after that restart, in ``tunnel.gaps``: filled by the device's resends; 0
  when the kill cost no record), the largest over the kills (None if a gap never filled). ``e2e_rows_resent`` and
  ``e2e_gaps_noticed`` say whether the kills cost records this time (it is a race); the full run repeats the
  phase with receipts off (``e2e_lost_rows_broker_kill_receipts_off``: Kafka's guarantee alone, as before
  issue 25).

- **Metrics** (``metrics_overhead_fraction``, issue 30): the throughput and latency clouds run with their
  Prometheus metrics served (:mod:`streamflow.metrics.cloud`) and scraped over HTTP every ``SCRAPE_EVERY_S`` (1 s)
  by a thread of the bench's process, so every figure above is with metrics on. Beside the throughput cloud, a
  second one without metrics (its own topic, sink and DuckDB file) stores the same rows in the same rounds, the two
  taking turns to go first. ``metrics_overhead_fraction``: the cloud process's CPU per row stored with metrics over
  without, less 1 (medians over the rounds): the throughput cost for a consumer that keeps a core busy;
  ``metrics_overhead_fraction_wall``: 1 - rows/s stored with metrics / without (the device and the broker share
  the two cores with it, so this one is noisier). ``cloud_cpu_us_per_row`` gives both. On a loaded machine both
  A/B figures vary by more than the metrics cost; ``metrics_overhead_fraction_direct`` measures that cost itself, per
  round with metrics: the consumer thread's CPU in the metrics' per-poll hook (``CloudMetrics.polled``) plus the
  scrapes of the round × one exposition's CPU (``metrics_scrape_cpu_ms``, timed in the cloud process at the end;
  the HTTP exchange around it is not in it), over the process's CPU in the round.

Timings are reported, never asserted; ``loadavg_1m_start_end`` says how busy the (shared) machine
was. ``--quick`` (under 60 s): 3 latency rounds of 2.5 s per size, 10,000-row tunnel and 1,000-row
naive throughput rounds, and the naive bytes rebuilt instead of sent (the full run sends them and
finds the rebuilt sizes equal to the broker's log, byte for byte).
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from bench.common import TAOBAO_SAMPLE, GcPauses, cpu_count, finish, log, median, parse_args, percentile, progress
from connectors.storage import CollectiveStorage
from connectors.tunnel.envelope import decode, encode_v1
from connectors.tunnel.kafka import CLIENT_TIMEOUTS, ensure_topic
from connectors.tunnel.keys import KeyRegistry
from connectors.tunnel.registry import Registry
from connectors.tunnel.sink import TunnelSink
from streamflow import Event, load_job
from streamflow.runners.device import DeviceRunner
from streamflow.sources import TaobaoBehaviorSource

REPO = Path(__file__).resolve().parent.parent
JOB_FILE = REPO / "jobs" / "ipv.py"
RATE = 100.0  # rows/s for the latency runs
DIMS = {"3kb": 768, "30kb": 7680}  # float32 values per row: 3,072 B and 30,720 B
LATENCY_SECONDS = {False: 10.0, True: 2.5}  # per round and size
WARMUP_ROWS = 30
THROUGHPUT_ROWS = {False: 50_000, True: 10_000}
NAIVE_ROWS = {False: 3_000, True: 1_000}
KILL_ROWS = 10_000
KILL_CHUNK = 50
KILL_AT = (50, 110, 170)  # the write (of KILL_ROWS / KILL_CHUNK) after which the broker is SIGKILLed
KILL_DOWN_S = 3.0  # as in issue 25's measurement
KILL_LAG_S = 1.0  # the cloud stops reading this long before each kill (noida-db writes its state about once a second)
SINGLE_ROW_SAMPLE = 1_000  # rows put each in an envelope of its own: the run's last ones, after the dictionary window
WAIT_S = 120.0
CODECS = {"none": 0, "gzip": 1, "lz4": 3, "zstd": 4}  # Kafka record-batch compression attribute
SCRAPE_EVERY_S = 1.0  # a cloud with metrics is scraped this often (Prometheus: 5-60 s; docker/'s: 5 s)


# -- the cloud side (child processes) -----------------------------------------------------------------
def cloud_process(mode: str, db: str, registry: str, bootstrap: str, topic: str, group: str,
                  out: Any, stop: Any, active: Any) -> None:
    """A cloud consumer process; reports ("stored", commit time, rows stored so far) after every commit.

    It polls only while ``active`` is set: noida-db answers an empty fetch at once instead of holding
    it for ``fetch_max_wait_ms``, so an idle kafka-python consumer spins (~0.5-0.75 of a core here),
    which on 2 cores would slow whatever is being measured next to it.
    """
    logging.basicConfig(level=logging.WARNING, format="cloud %(levelname)s %(name)s: %(message)s")
    try:
        if mode.startswith("tunnel"):
            _tunnel_cloud(db, registry, bootstrap, topic, group, out, stop, active, metrics=mode == "tunnel+metrics")
        else:
            _naive_cloud(db, bootstrap, topic, group, out, stop, active)
    except BaseException as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}"))
        raise


def _tunnel_cloud(db: str, registry: str, bootstrap: str, topic: str, group: str, out: Any, stop: Any,
                  active: Any, metrics: bool = False) -> None:
    from connectors.tunnel.cloud import CloudConsumer

    consumer = CloudConsumer(db, KeyRegistry(registry), topic=topic, bootstrap=bootstrap, group_id=group)
    server = registry_ = None
    polled_cpu = [0.0]  # CPU seconds of the consumer's thread in CloudMetrics.polled (the metrics' share per poll)
    if metrics:  # Prometheus metrics (streamflow.metrics.cloud) on a free port, scraped by the parent (Scraper)
        from prometheus_client import CollectorRegistry

        from streamflow.metrics import MetricsServer
        from streamflow.metrics.cloud import CloudMetrics

        registry_ = CollectorRegistry()
        cloud_metrics = CloudMetrics(consumer, registry_)
        server = MetricsServer(registry_, 0, cloud_metrics.ready)
        polled = cloud_metrics.polled

        def timed_polled(*args: Any) -> None:
            started = time.thread_time()
            polled(*args)
            polled_cpu[0] += time.thread_time() - started

        cloud_metrics.polled = timed_polled  # type: ignore[method-assign]
        out.put(("metrics_url", server.url + "/metrics"))
    store, apply = consumer.store, consumer.store.apply
    committed_at: list[float] = []  # when COMMIT returned, per transaction that stored batches, in order
    called_at: list[float] = []  # when apply was called (the poll returned and its messages were opened)
    stored = 0

    def timed_apply(batches: Any, dead: Any, *args: Any) -> Any:
        nonlocal stored
        called = time.time()
        result = apply(batches, dead, *args)
        committed = time.time()
        if result.stored:  # a transaction of repeats only (resends) stamps no tunnel.batches row
            committed_at.append(committed)
            called_at.append(called)
        if result.stored:
            stored += result.stored
            out.put(("stored", committed, stored, time.process_time(), polled_cpu[0]))
        return result

    store.apply = timed_apply  # type: ignore[method-assign]
    gc_pauses = GcPauses()
    idle = True
    try:
        while not stop.is_set():
            if active.wait(0.2):
                consumer.poll_once()
                idle = False
            elif not idle:  # the receipts of the last rows, before the devices' receipt timeout resends them
                consumer.publish_receipts()
                idle = True
        stats = consumer.stats
        # Every transaction with batches writes tunnel.batches rows stamped with its own ingested_at, and
        # transactions run one after the other: the i-th distinct ingested_at is the i-th commit.
        ingested = [row[0] for row in store.query("SELECT DISTINCT ingested_at FROM tunnel.batches ORDER BY 1")]
        scrape_cpu_s = None
        if registry_ is not None:  # the CPU of one exposition (what a scrape makes the process do, but the HTTP)
            from prometheus_client import generate_latest

            started = time.process_time()
            for _ in range(50):
                generate_latest(registry_)
            scrape_cpu_s = (time.process_time() - started) / 50
    finally:
        consumer.close()
        if server is not None:
            server.close()
    if len(ingested) != len(committed_at):
        raise RuntimeError(f"{len(ingested)} ingested_at stamps for {len(committed_at)} recorded commits")
    out.put(("done", list(zip(ingested, zip(called_at, committed_at, strict=True), strict=True)), {
        "messages": stats.messages, "stored": stats.stored, "duplicates": stats.duplicates, "dead": dict(stats.dead),
        "gc": gc_pauses.summary(), "scrape_cpu_s": scrape_cpu_s}))


class Scraper:
    """Scrapes a cloud's ``/metrics`` over HTTP every :data:`SCRAPE_EVERY_S` from a thread of this process (as a
    Prometheus elsewhere would: the cloud process pays for answering, not for reading the answer)."""

    def __init__(self, url: str):
        import threading

        self.url, self.scrapes, self.last = url, 0, ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scraper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import urllib.request

        while not self._stop.wait(SCRAPE_EVERY_S):
            try:
                with urllib.request.urlopen(self.url, timeout=5) as response:
                    self.last = response.read().decode()
                self.scrapes += 1
            except OSError:  # the cloud process stopping
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _naive_cloud(db: str, bootstrap: str, topic: str, group: str, out: Any, stop: Any, active: Any) -> None:
    from kafka import KafkaConsumer

    ensure_topic(bootstrap, topic)
    con = duckdb.connect(db)
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
                             auto_offset_reset="earliest", max_poll_records=500, **CLIENT_TIMEOUTS)
    stored, created = 0, False
    try:
        while not stop.is_set():
            if not active.wait(0.2):
                continue
            records = consumer.poll(timeout_ms=200)
            rows = [json.loads(m.value) for messages in records.values() for m in messages]
            if not rows:
                continue
            table = pa.Table.from_pylist(rows)
            con.register("_rows", table)
            con.execute("BEGIN")
            if not created:
                con.execute("CREATE TABLE IF NOT EXISTS rows AS SELECT * FROM _rows WHERE false")
                created = True
            con.execute("INSERT INTO rows SELECT * FROM _rows")
            con.execute("COMMIT")
            con.unregister("_rows")
            stored += len(rows)
            out.put(("stored", time.time(), stored))
            consumer.commit()
    finally:
        consumer.close()
        con.close()
    out.put(("done", [], {"stored": stored}))


class Cloud:
    """A cloud consumer process and what it reported."""

    def __init__(self, mode: str, db: Path, registry: Path, bootstrap: str, topic: str, group: str):
        ctx = mp.get_context("spawn")
        self.mode, self.db = mode, db
        self.out, self.stop_event, self.active = ctx.Queue(), ctx.Event(), ctx.Event()
        self.process = ctx.Process(target=cloud_process, name=f"cloud-{mode}", daemon=True, args=(
            mode, str(db), str(registry), bootstrap, topic, group, self.out, self.stop_event, self.active))
        self.process.start()
        self.stored = 0  # rows stored so far, as last reported
        self.cpu_s = 0.0  # the cloud process's CPU time when it last reported (tunnel clouds)
        self.polled_cpu_s = 0.0  # of which in the metrics' per-poll hook (a cloud with metrics)
        self.scraper: Scraper | None = None  # scrapes its /metrics (a cloud with metrics)
        self.expected = 0  # rows sent to it so far
        self.commits: dict[datetime, tuple[float, float]] = {}  # transaction start → (apply called, committed)
        self.stats: dict[str, Any] = {}

    def _take(self, timeout_s: float) -> tuple[Any, ...] | None:
        try:
            message = self.out.get(timeout=timeout_s)
        except Exception:  # noqa: BLE001 - queue.Empty
            return None
        if message[0] == "error":
            raise RuntimeError(f"cloud {self.mode} process failed: {message[1]}")
        if message[0] == "metrics_url":
            self.scraper = Scraper(message[1])
        return message

    def wait_stored(self, n: int) -> float:
        """Count ``n`` more rows as sent; wait until the cloud stored all rows sent; the commit time it did.

        The consumer polls from here on (if :meth:`resume` did not already start it) and stops polling
        once it has them.
        """
        self.resume()
        self.expected += n
        try:
            return self._wait()
        finally:
            self.active.clear()

    def resume(self) -> None:
        self.active.set()

    def _wait(self) -> float:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            message = self._take(0.5)
            if message is None:
                if not self.process.is_alive():
                    raise RuntimeError(f"cloud {self.mode} process died (exit code {self.process.exitcode})")
                continue
            if message[0] == "stored":
                self.stored = message[2]
                if len(message) > 3:
                    self.cpu_s, self.polled_cpu_s = message[3], message[4]
                if self.stored >= self.expected:
                    return message[1]
        raise RuntimeError(f"cloud {self.mode} stored {self.stored} of {self.expected} rows within {WAIT_S:.0f} s")

    def close(self) -> None:
        if self.scraper is not None:
            self.scraper.close()
        self.stop_event.set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            message = self._take(0.5)
            if message is not None and message[0] == "done":
                self.commits = dict(message[1])
                self.stats = message[2]
                break
        self.process.join(timeout=10)
        if self.process.is_alive():
            log(f"cloud {self.mode} process did not stop; terminating it")
            self.process.terminate()
            self.process.join(timeout=5)


# -- end-to-end acknowledgement: the broker killed mid-run ------------------------------------------------------
def kill_cloud_process(db: str, registry: str, bootstrap: str, topic: str, receipts: bool, stop: Any,
                       active: Any) -> None:
    """A cloud consumer riding out broker kills (``CloudConsumer.run`` retries) while ``active`` is set, until
    ``stop`` is."""
    from connectors.tunnel.cloud import CloudConsumer

    logging.basicConfig(level=logging.ERROR, format="kill-cloud %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    consumer = CloudConsumer(db, KeyRegistry(registry), topic=topic, bootstrap=bootstrap,
                             group_id=f"bench-kill-{uuid.uuid4().hex[:8]}", gap_wait_s=3600, receipts=receipts)
    try:
        while not stop.is_set():
            if active.wait(0.1):
                consumer.run(max_s=0.2, retry_for_s=None)
    finally:
        consumer.close()


def measure_broker_kills(tmp: Path, registry: KeyRegistry, receipts: bool) -> dict[str, Any]:
    """KILL_ROWS rows through a tunnel whose broker is SIGKILLed three times mid-run (see the module docstring)."""
    import signal

    from tests.kafka_broker import LocalBroker

    name = f"kill-{'on' if receipts else 'off'}"
    broker = LocalBroker(tmp / f"{name}_broker").up()
    key = registry.add(f"bench-{name}")
    topic, db = f"bench.{name}.{uuid.uuid4().hex[:8]}", tmp / f"{name}.duckdb"
    ensure_topic(broker.bootstrap, topic)
    ctx = mp.get_context("spawn")
    stop, active = ctx.Event(), ctx.Event()
    active.set()
    cloud = ctx.Process(target=kill_cloud_process, name=f"cloud-{name}", daemon=True,
                        args=(str(db), str(registry.path), broker.bootstrap, topic, receipts, stop, active))
    cloud.start()
    acked: set[int] = set()
    kills: list[tuple[float, float]] = []  # (killed, restarted), epoch seconds
    sink = TunnelSink(f"bench-{name}", key, tmp / f"{name}.spool", topic=topic, bootstrap=broker.bootstrap,
                      linger_s=0.01, batch_rows=KILL_CHUNK, send_timeout_s=2.0, receipts=receipts,
                      on_ack=lambda e: acked.update(range(e.first_seq, e.first_seq + e.n_rows)))
    try:
        period = 8.0 * KILL_CHUNK / KILL_ROWS
        for n, first in enumerate(range(0, KILL_ROWS, KILL_CHUNK)):
            sink.write("kill", [{"user_id": f"u{i % 64}", "i": i} for i in range(first, first + KILL_CHUNK)])
            time.sleep(period)
            if n + int(KILL_LAG_S / period) in KILL_AT:
                active.clear()  # the cloud falls behind: what the broker loses at the kill, it never read
            if n in KILL_AT:
                killed = time.time()
                os.kill(broker.pid(), signal.SIGKILL)
                while broker.listening():
                    time.sleep(0.01)
                time.sleep(KILL_DOWN_S)
                broker.up()
                kills.append((killed, time.time()))
                active.set()
        delivered = sink.wait_receipted(WAIT_S) if receipts else sink.wait_delivered(WAIT_S)
        if not receipts:  # no receipt says when the cloud is done (its DuckDB file is its process's alone): wait
            time.sleep(10.0)
        stats = sink.stats
    finally:
        sink.close(timeout_s=5)
        stop.set()
        cloud.join(timeout=30)
        if cloud.is_alive():
            cloud.terminate()
        broker.down(timeout_s=120)
    with duckdb.connect(str(db), read_only=True) as con:
        stored = dict(con.execute("SELECT seq, ingested_at FROM kill").fetchall())
        repeats = con.execute("SELECT count(*) - count(DISTINCT seq) FROM kill").fetchone()[0]
        gaps = [(noticed.replace(tzinfo=UTC).timestamp(), closed and closed.replace(tzinfo=UTC).timestamp())
                for noticed, closed in con.execute("SELECT noticed_at, closed_at FROM tunnel.gaps").fetchall()]
    recovery: list[float | None] = []
    for k, (_, restarted) in enumerate(kills):
        until = kills[k + 1][0] if k + 1 < len(kills) else float("inf")
        closed = [c for noticed, c in gaps if restarted - 1.0 <= noticed < until]
        recovery.append(None if None in closed else round(max(closed) - restarted, 2) if closed else 0.0)
    return {"lost": len(acked - stored.keys()), "acked": len(acked), "stored_twice": repeats, "delivered": delivered,
            "recovery_s": recovery, "resent": stats.rows_resent, "gaps": len(gaps), "kills": len(kills)}


# -- bytes on the wire --------------------------------------------------------------------------------
def record_batch_bytes(value: bytes, key: bytes | None, codec: str) -> int:
    """Size of a Kafka v2 record batch holding one record, as kafka-python's producer builds it."""
    from kafka.record.memory_records import MemoryRecordsBuilder

    builder = MemoryRecordsBuilder(2, CODECS[codec], batch_size=1 << 30)
    builder.append(int(time.time() * 1000), key, value)
    builder.close()
    return builder.size_in_bytes()


def broker_log_bytes(data_dir: Path, topics: list[str]) -> dict[str, tuple[int, int]]:
    """(record batches, bytes) per topic from a stopped noida-db's state file (its stored record batches)."""
    state = json.loads((data_dir / "kafka.json").read_text())
    out = {}
    for name, topic in state["topics"]:
        if name in topics:
            batches = [b for _, part in topic["partitions"] for b in part["record_batches"]]
            out[name] = (len(batches), sum(len(raw) for _, raw in batches))
    return out


def ipv_features(job: Any, sink: TunnelSink, db: Path) -> list[dict[str, Any]]:
    """Run the IPV job over the sample on the device runner with ``sink`` as its tunnel; the feature rows."""
    storage = CollectiveStorage(db)
    runner = DeviceRunner(job, storage, tunnel=sink)
    try:
        runner.run(TaobaoBehaviorSource(TAOBAO_SAMPLE))
    finally:
        runner.close()
    rows = storage.read("ipv").to_pylist()
    storage.close()
    return rows


def naive_producer(bootstrap: str) -> Any:
    """One message per row, no compression, each row its own record batch, acks=all."""
    from kafka import KafkaProducer

    return KafkaProducer(bootstrap_servers=bootstrap, acks="all", compression_type=None, linger_ms=0, batch_size=1,
                         **CLIENT_TIMEOUTS)


def send_naive(producer: Any, topic: str, key: bytes, rows: list[dict[str, Any]]) -> list[bytes]:
    values = [json.dumps(row, separators=(",", ":")).encode() for row in rows]
    for value in values:
        producer.send(topic, key=key, value=value)
    producer.flush(timeout=WAIT_S)
    return values


def measure_bytes(job: Any, bootstrap: str, broker_dir: Path | None, stop_broker: Any, tmp: Path, key: bytes,
                  run_id: str, send_naive_rows: bool) -> dict[str, Any]:
    """The IPV job's features through the tunnel and through the naive producer, against the raw CSV."""
    feature_topic, naive_topic = f"bench.tunnel.bytes.{run_id}", f"bench.naive.bytes.{run_id}"
    acked: list[tuple[bytes, int]] = []
    sink = TunnelSink("bench-bytes", key, tmp / "bytes.spool", topic=feature_topic, bootstrap=bootstrap,
                      on_ack=lambda entry: acked.append((entry.value, entry.n_rows)))
    rows = ipv_features(job, sink, tmp / "bytes_device.duckdb")
    sink.codebook.wait_trained()
    if not sink.close(timeout_s=WAIT_S):
        raise RuntimeError("the tunnel sink did not deliver the IPV rows")
    if sum(n for _, n in acked) != len(rows):
        raise RuntimeError(f"the broker acknowledged {sum(n for _, n in acked)} of {len(rows)} IPV rows")
    if send_naive_rows:
        ensure_topic(bootstrap, naive_topic)
        producer = naive_producer(bootstrap)
        naive_values = send_naive(producer, naive_topic, b"bench-bytes", rows)
        producer.close(timeout=5)
    else:
        naive_values = [json.dumps(row, separators=(",", ":")).encode() for row in rows]

    device_key = b"bench-bytes"  # the message key format 1 had (format 2 messages have none)
    rebuilt = {codec: sum(record_batch_bytes(v, None, codec) for v, _ in acked) for codec in CODECS}
    naive_rebuilt = sum(record_batch_bytes(v, device_key, "none") for v in naive_values)
    # the previous format (1) for the same batches, as its sink sent them: keyed by device, Kafka zstd
    known, keys = Registry(), {"bench-bytes": key}
    opened = [decode(v, keys, known) for v, _ in acked]
    previous = sum(record_batch_bytes(encode_v1(b.device, b.table, b.first_seq, b.rows, key), device_key, "zstd")
                   for b in opened)
    # One row per envelope: the last rows of the run, with their own sequence numbers, as the sink's codebook
    # encodes them (its dictionary if it kept one) once a first envelope of the session announced the schema.
    first_seq = len(rows) - SINGLE_ROW_SAMPLE
    book = sink.codebook
    book.envelope("ipv", first_seq - 1, pa.Table.from_pylist(rows[first_seq - 1:first_seq]))
    book.sealed()
    singles = []
    for i, row in enumerate(rows[first_seq:]):
        singles.append(book.envelope("ipv", first_seq + i, pa.Table.from_pylist([row])))
        book.sealed()
    announcing = sum(bool(v[1] & 0x08) for v in singles)
    single = sum(record_batch_bytes(v, None, sink.compression) for v in singles) / len(singles)
    single_previous = sum(record_batch_bytes(encode_v1("bench-bytes", "ipv", first_seq + i,
                                                       pa.Table.from_pylist([row]), key), device_key, "zstd")
                          for i, row in enumerate(rows[first_seq:])) / len(singles)
    single_envelope = sum(map(len, singles)) / len(singles)
    logged = None
    if broker_dir is not None:
        stop_broker()
        try:
            logged = broker_log_bytes(broker_dir, [feature_topic, naive_topic])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log(f"could not read the broker's log ({type(exc).__name__}: {exc}); using rebuilt batch sizes")
    codec = sink.compression
    method, wire, naive_method, naive_wire, cross_check = "rebuilt", rebuilt[codec], "rebuilt", naive_rebuilt, None
    if logged and feature_topic in logged:
        method, wire = "broker_log", logged[feature_topic][1]
        cross_check = {"feature_rebuilt_bytes": rebuilt[codec], "feature_broker_log_bytes": wire,
                       "feature_broker_log_batches": logged[feature_topic][0]}
        if naive_topic in logged:
            naive_method, naive_wire = "broker_log", logged[naive_topic][1]
            cross_check.update({"naive_rebuilt_bytes": naive_rebuilt, "naive_broker_log_bytes": naive_wire,
                                "naive_broker_log_batches": logged[naive_topic][0]})

    records = list(TaobaoBehaviorSource(TAOBAO_SAMPLE))
    rejected_lines = {r.line for r in records if not isinstance(r, Event)}
    with open(TAOBAO_SAMPLE, "rb") as f:
        raw_lines = [line.rstrip(b"\r\n") for line in f if line.strip()]
    consumed = [line for n, line in enumerate(raw_lines, start=1) if n not in rejected_lines]
    raw = sum(len(line) + 1 for line in consumed)
    import zstandard

    raw_zstd = len(zstandard.ZstdCompressor().compress(b"\n".join(consumed) + b"\n"))
    # The same input as an app would log it: the app events the device runtime consumed (page enters and
    # exits, clicks), one JSON line each, as the JSON-lines source reads them.
    app_events = [json.dumps(r.to_dict(), separators=(",", ":"), default=str).encode() for r in records
                  if isinstance(r, Event)]
    app_bytes = sum(len(line) + 1 for line in app_events)
    return {
        "bytes_saved_fraction": round(1 - wire / raw, 4),
        "raw_csv_bytes": raw,
        "raw_csv_lines": len(consumed),
        "feature_rows": len(rows),
        "feature_wire_bytes": wire,
        "wire_bytes_method": method,
        "feature_batches": len(acked),
        "feature_envelope_bytes": sum(len(v) for v, _ in acked),
        "feature_wire_bytes_by_codec": rebuilt,
        "naive_json_wire_bytes": naive_wire,
        "naive_wire_bytes_method": naive_method,
        "bytes_saved_fraction_naive_json": round(1 - naive_wire / raw, 4),
        "tunnel_vs_naive_bytes_ratio": round(wire / naive_wire, 4),
        "raw_csv_zstd_bytes": raw_zstd,
        "raw_app_events": len(app_events),
        "raw_app_events_json_bytes": app_bytes,
        "bytes_saved_fraction_vs_app_events_json": round(1 - wire / app_bytes, 4),
        "bytes_saved_fraction_vs_raw_zstd": round(1 - wire / raw_zstd, 4),
        "one_row_per_envelope_wire_bytes_per_row": round(single, 1),
        "one_row_per_envelope_wire_bytes_per_row_previous_format": round(single_previous, 1),
        "one_row_per_envelope_envelope_bytes": round(single_envelope, 1),
        "one_row_per_envelope_announcing": announcing,
        "bytes_saved_fraction_one_row_per_envelope": round(1 - single * len(rows) / raw, 4),
        "bytes_saved_fraction_one_row_per_envelope_vs_app_events_json": round(1 - single * len(rows) / app_bytes, 4),
        "feature_wire_bytes_previous_format": previous,
        "bytes_saved_fraction_vs_app_events_json_previous_format": round(1 - previous / app_bytes, 4),
        "dictionary_used": book.dictionaries.get("ipv") is not None,
        "dictionary_gain_one_row": round(book.dictionary_gain.get("ipv", 0.0), 4),
        "rebuilt_vs_broker_log": cross_check,
    }


# -- latency and throughput ---------------------------------------------------------------------------
def paced(sink: TunnelSink, table: str, vectors: np.ndarray, rnd: int) -> float:
    """Write one row per 1/RATE s (absolute schedule); the achieved rows/s."""
    period = 1.0 / RATE
    start = time.perf_counter() + period
    for i, vec in enumerate(vectors):
        delay = start + i * period - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        sink.write(table, [{"user_id": f"u{i % 64}", "rnd": rnd, "i": i, "produced_at": time.time(), "vec": vec}])
    return (len(vectors) - 1) / max(1e-9, time.perf_counter() - start)


#: per row: round, produced, sealed, sent, acked, apply called, transaction start (ingested_at), committed
RowTimes = tuple[int, float, float, float, float, float, float, float]


def row_times(db: Path, table: str, commits: dict[datetime, tuple[float, float]],
              acks: list[tuple[int, int, float, float]], sent: dict[int, float]) -> list[RowTimes]:
    """Per stored row, its :data:`RowTimes` (epoch seconds)."""
    batch_of: dict[int, tuple[int, float, float]] = {}
    for first, n, sealed, acked in acks:  # a batch resent (a receipt came late) is acked again: the first ack counts
        for seq in range(first, first + n):
            batch_of.setdefault(seq, (first, sealed, acked))
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute(f'SELECT seq, rnd, produced_at, ingested_at FROM "{table}"').fetchall()
    out = []
    for seq, rnd, produced_at, ingested_at in rows:
        if ingested_at not in commits or seq not in batch_of:
            raise RuntimeError(f"row {seq} of {table} has no recorded commit or ack time")
        first, sealed, acked = batch_of[seq]
        called, committed = commits[ingested_at]
        out.append((rnd, produced_at, sealed, sent[first], acked, called, ingested_at.replace(tzinfo=UTC).timestamp(),
                    committed))
    return out


def _timed_deliver(deliver: Any, sent: dict[int, float]) -> Any:
    def timed(entry: Any) -> None:
        sent[entry.first_seq] = time.time()
        deliver(entry)
    return timed


def trim_topic(bootstrap: str, topic: str) -> None:
    """Delete ``topic``'s records up to its end (Kafka's DeleteRecords, what retention does to consumed records):
    the latency broker then holds about one round's records (see the module docstring)."""
    from kafka import KafkaConsumer, TopicPartition
    from kafka.admin import KafkaAdminClient

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, **CLIENT_TIMEOUTS)
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="bench-trim", **CLIENT_TIMEOUTS)
    try:
        partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
        ends = {tp: end for tp, end in consumer.end_offsets(partitions).items() if end}
        if ends:
            admin.delete_records(ends)
    finally:
        consumer.close()
        admin.close()


def ms(values: list[float], q: float) -> float:
    return round(percentile(sorted(values), q) * 1e3, 2)


def ipv_like_rows(rows: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    return [rows[i % len(rows)] for i in range(n)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args("The Kafka tunnel on loopback: latency, throughput, bytes on the wire vs raw events.", argv)
    quick = args.quick
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    run_id = uuid.uuid4().hex[:8]
    load_start = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="streamflow-bench-tunnel-"))
    brokers: list[Any] = []
    clouds: list[Cloud] = []
    sinks: list[TunnelSink] = []
    try:
        bootstrap = os.environ.get("STREAMFLOW_KAFKA_BOOTSTRAP")
        bytes_broker_dir = None
        if bootstrap:
            log(f"broker: {bootstrap} (STREAMFLOW_KAFKA_BOOTSTRAP)")
            bytes_bootstrap = lat_bootstrap = bootstrap
        else:
            from tests.kafka_broker import LocalBroker

            brokers.append(LocalBroker(tmp / "broker").up())
            bytes_broker_dir = tmp / "bytes_broker"
            brokers.append(LocalBroker(bytes_broker_dir).up())
            brokers.append(LocalBroker(tmp / "latency_broker").up())
            bootstrap, bytes_bootstrap, lat_bootstrap = (b.bootstrap for b in brokers)
            log(f"broker: noida-db on {bootstrap}; the bytes and latency phases on private ones at {bytes_bootstrap}"
                f" and {lat_bootstrap}")
        registry = KeyRegistry(tmp / "keys.json")
        keys = {d: registry.add(d) for d in ("bench-lat-3kb", "bench-lat-30kb", "bench-tput", "bench-tput-off",
                                             "bench-bytes")}
        tunnel_topic, off_topic, naive_topic, lat_topic = (f"bench.{name}.{run_id}" for name in (
            "tunnel", "nometrics", "naive", "latency"))
        for topic in (tunnel_topic, off_topic, naive_topic):
            ensure_topic(bootstrap, topic)
        ensure_topic(lat_bootstrap, lat_topic)
        # the clouds measured run with their metrics served and scraped; cloud_off, the same without, beside it
        cloud = Cloud("tunnel+metrics", tmp / "cloud.duckdb", registry.path, bootstrap, tunnel_topic,
                      f"bench-cloud-{run_id}")
        cloud_off = Cloud("tunnel", tmp / "cloud_off.duckdb", registry.path, bootstrap, off_topic,
                          f"bench-cloud-off-{run_id}")
        naive_cloud = Cloud("naive", tmp / "naive.duckdb", registry.path, bootstrap, naive_topic,
                            f"bench-naive-{run_id}")
        lat_cloud = Cloud("tunnel+metrics", tmp / "latency_cloud.duckdb", registry.path, lat_bootstrap, lat_topic,
                          f"bench-latency-{run_id}")
        clouds += [cloud, cloud_off, naive_cloud, lat_cloud]

        # bytes (while the cloud processes start)
        job = load_job(JOB_FILE)
        log("bytes: the IPV job over the sample through a tunnel sink and through the naive producer")
        stop_bytes_broker = (lambda: brokers[1].down()) if bytes_broker_dir is not None else None
        byte_metrics = measure_bytes(job, bytes_bootstrap, bytes_broker_dir, stop_bytes_broker, tmp,
                                     keys["bench-bytes"], run_id, send_naive_rows=not quick)
        b = byte_metrics
        log(f"  raw CSV {b['raw_csv_bytes']:,} B, features on the wire {b['feature_wire_bytes']:,} B "
            f"({b['wire_bytes_method']}), naive JSON {b['naive_json_wire_bytes']:,} B: "
            f"saved {b['bytes_saved_fraction']:.1%}")
        with duckdb.connect(str(tmp / "bytes_device.duckdb"), read_only=True) as con:
            ipv_rows = con.sql("SELECT * FROM ipv").to_arrow_table().to_pylist()

        # the broker killed mid-run (our own noida-db only: an external broker is not ours to kill)
        kill_metrics: dict[str, Any] = {}
        if bytes_broker_dir is not None:
            log(f"end-to-end acknowledgement: {KILL_ROWS:,} rows, the broker SIGKILLed {len(KILL_AT)} times")
            kill_metrics["on"] = measure_broker_kills(tmp, registry, receipts=True)
            log(f"  receipts on: {kill_metrics['on']}")
            if not quick:
                kill_metrics["off"] = measure_broker_kills(tmp, registry, receipts=False)
                log(f"  receipts off: {kill_metrics['off']}")

        # sinks and warm-up
        acks: dict[str, list[tuple[int, int, float, float]]] = {kind: [] for kind in DIMS}
        sent: dict[str, dict[int, float]] = {kind: {} for kind in DIMS}  # first seq → last time the sender sent it
        lat_sinks = {kind: TunnelSink(f"bench-lat-{kind}", keys[f"bench-lat-{kind}"], tmp / f"lat_{kind}.spool",
                                      topic=lat_topic, bootstrap=lat_bootstrap,
                                      on_ack=lambda e, k=kind: acks[k].append((e.first_seq, e.n_rows, e.sealed_at,
                                                                               time.time())))
                     for kind in DIMS}
        for kind, sink in lat_sinks.items():  # measurement only: when the sender hands a batch to the producer
            sink._deliver = _timed_deliver(sink._deliver, sent[kind])  # type: ignore[method-assign]
        tput = TunnelSink("bench-tput", keys["bench-tput"], tmp / "tput.spool", topic=tunnel_topic,
                          bootstrap=bootstrap)
        tput_off = TunnelSink("bench-tput-off", keys["bench-tput-off"], tmp / "tput_off.spool", topic=off_topic,
                              bootstrap=bootstrap)
        sinks += [*lat_sinks.values(), tput, tput_off]
        linger_s, batch_rows, tput_compression = tput.linger_s, tput.batch_rows, tput.compression
        rng = np.random.default_rng(args.seed)
        lat_cloud.resume()
        for kind, sink in lat_sinks.items():
            paced(sink, f"warmup_{kind}", rng.standard_normal((WARMUP_ROWS, DIMS[kind]), dtype=np.float32), -1)
        lat_cloud.wait_stored(2 * WARMUP_ROWS)
        for c, sink in ((cloud, tput), (cloud_off, tput_off)):
            c.resume()
            for row in ipv_like_rows(ipv_rows, 1000):
                sink.write("warmup_tput", [row])
            sink.flush()
            c.wait_stored(1000)
        producer = naive_producer(bootstrap)
        naive_cloud.resume()
        send_naive(producer, naive_topic, b"bench-tput", ipv_like_rows(ipv_rows, 1000))
        naive_cloud.wait_stored(1000)
        log(f"warm-up done; sink linger_s={linger_s}, batch_rows={batch_rows}")

        # throughput rounds (tunnel, naive alternating)
        n_rows, n_naive = THROUGHPUT_ROWS[quick], NAIVE_ROWS[quick]
        rows, naive_rows = ipv_like_rows(ipv_rows, n_rows), ipv_like_rows(ipv_rows, n_naive)
        rates, acked_rates, naive_rates = [], [], []
        rates_off: list[float] = []
        cpu_per_row: dict[bool, list[float]] = {True: [], False: []}  # the cloud process's CPU s per row stored
        metered: list[tuple[float, float, int]] = []  # with metrics, per round: CPU, of it in polled(), scrapes
        for rnd in progress(range(args.rounds), f"throughput rounds ({n_rows:,} tunnel with and without metrics / "
                            f"{n_naive:,} naive rows)", total=args.rounds):
            for with_metrics in ((True, False) if rnd % 2 == 0 else (False, True)):  # either goes first in turn
                c, sink = (cloud, tput) if with_metrics else (cloud_off, tput_off)
                cpu_before, polled_before = c.cpu_s, c.polled_cpu_s
                scrapes_before = c.scraper.scrapes if c.scraper is not None else 0
                c.resume()
                started = time.time()
                for row in rows:
                    sink.write("ipv", [row])
                sink.flush()
                if not sink.wait_delivered(WAIT_S):
                    raise RuntimeError("the tunnel sink did not deliver the throughput rows")
                acked = time.time()
                stored = c.wait_stored(n_rows)
                cpu_per_row[with_metrics].append((c.cpu_s - cpu_before) / n_rows)
                if c.scraper is not None:
                    metered.append((c.cpu_s - cpu_before, c.polled_cpu_s - polled_before,
                                    c.scraper.scrapes - scrapes_before))
                if with_metrics:
                    rates.append(n_rows / (stored - started))
                    acked_rates.append(n_rows / (acked - started))
                else:
                    rates_off.append(n_rows / (stored - started))
            naive_cloud.resume()
            started = time.time()
            send_naive(producer, naive_topic, b"bench-tput", naive_rows)
            naive_rates.append(n_naive / (naive_cloud.wait_stored(n_naive) - started))
            log(f"  tunnel {rates[-1]:,.0f} rows/s stored ({acked_rates[-1]:,.0f} acked; without metrics "
                f"{rates_off[-1]:,.0f}), cloud CPU {cpu_per_row[True][-1] * 1e6:.1f} us/row (without metrics "
                f"{cpu_per_row[False][-1] * 1e6:.1f}), naive {naive_rates[-1]:,.0f} rows/s stored")

        # latency rounds: every 3 KB round, then every 30 KB round (see the module docstring for why)
        n_paced = int(LATENCY_SECONDS[quick] * RATE)
        achieved: dict[str, list[float]] = {kind: [] for kind in DIMS}
        for kind, sink in lat_sinks.items():
            for rnd in progress(range(args.rounds), f"{kind} latency rounds ({n_paced} rows at {RATE:.0f}/s)",
                                total=args.rounds):
                vectors = rng.standard_normal((n_paced, DIMS[kind]), dtype=np.float32)
                lat_cloud.resume()
                achieved[kind].append(paced(sink, f"lat_{kind}", vectors, rnd))
                lat_cloud.wait_stored(n_paced)
                trim_topic(lat_bootstrap, lat_topic)  # stored in the cloud: as retention would, sooner
        producer.close(timeout=5)
        tput_batches = tput.stats.batches_acked
        for sink in sinks:
            sink.close(timeout_s=10)
        sinks.clear()
        for c in clouds:
            c.close()
        for c in (cloud, lat_cloud):
            if c.stats.get("duplicates") or c.stats.get("dead"):
                log(f"cloud consumer: {c.stats}")
        lat = {kind: row_times(lat_cloud.db, f"lat_{kind}", lat_cloud.commits, acks[kind], sent[kind]) for kind in DIMS}
        scrapes = sum(c.scraper.scrapes for c in (cloud, lat_cloud) if c.scraper is not None)
        scrape_cpu_s = cloud.stats.get("scrape_cpu_s") or 0.0
        direct = [(polled + n * scrape_cpu_s) / cpu for cpu, polled, n in metered if cpu > 0]
        cloud_gc = lat_cloud.stats.get("gc")
    finally:
        for sink in sinks:
            sink.close(timeout_s=2)
        for c in clouds:
            if c.process.is_alive():
                c.close()
        for broker in brokers:
            if broker.listening():
                try:
                    broker.down(timeout_s=120)
                except subprocess.TimeoutExpired:  # a loaded machine: the measurements stand; say so, go on
                    log(f"noida-db in {broker.data_dir} did not stop within 120 s; stop it with noida-db down")
        shutil.rmtree(tmp, ignore_errors=True)

    metrics: dict[str, Any] = {}
    for kind in DIMS:
        total = [r[7] - r[1] for r in lat[kind]]
        metrics[f"p50_ms_{kind}"] = ms(total, 50)
        metrics[f"p99_ms_{kind}"] = ms(total, 99)
    metrics["one_row_per_envelope_wire_bytes_per_row"] = byte_metrics.pop("one_row_per_envelope_wire_bytes_per_row")
    metrics["bytes_saved_fraction_vs_app_events_json"] = byte_metrics.pop("bytes_saved_fraction_vs_app_events_json")
    metrics["rows_per_s"] = round(median(rates))
    # the consumer's CPU per row stored with its metrics served and scraped vs without (the throughput cost for a
    # consumer that keeps a core busy); the wall-clock rows/s of the two are reported beside it
    metrics["metrics_overhead_fraction"] = round(median(cpu_per_row[True]) / median(cpu_per_row[False]) - 1, 4)
    metrics["target_metrics_overhead_3pct_met"] = metrics["metrics_overhead_fraction"] <= 0.03
    metrics["bytes_saved_fraction"] = byte_metrics.pop("bytes_saved_fraction")
    on = kill_metrics.get("on")
    metrics["e2e_lost_rows_broker_kill"] = on["lost"] if on else None
    recoveries = on["recovery_s"] if on else [None]
    metrics["gap_recovery_s"] = None if None in recoveries else max(recoveries)
    metrics["target_p99_3kb_50ms_met"] = metrics["p99_ms_3kb"] <= 50.0
    metrics["target_e2e_lost_rows_0_met"] = on["lost"] == 0 if on else None
    recovered = metrics["gap_recovery_s"]
    metrics["target_gap_recovery_5s_met"] = None if recovered is None else recovered <= 5.0
    metrics["target_one_row_150_bytes_met"] = metrics["one_row_per_envelope_wire_bytes_per_row"] <= 150.0
    metrics["target_app_events_json_95_met"] = metrics["bytes_saved_fraction_vs_app_events_json"] >= 0.95
    metrics["target_bytes_saved_95_met"] = metrics["bytes_saved_fraction"] >= 0.95
    for kind in DIMS:
        rows_ = lat[kind]
        total = [r[7] - r[1] for r in rows_]
        by_round: dict[int, list[float]] = {}
        for (rnd, *_), seconds in zip(rows_, total, strict=True):
            by_round.setdefault(rnd, []).append(seconds)
        metrics[f"p999_ms_{kind}"] = ms(total, 99.9)
        metrics[f"max_ms_{kind}"] = round(max(total) * 1e3, 2)
        metrics[f"p99_ms_{kind}_rounds"] = [ms(by_round[r], 99) for r in sorted(by_round)]
        ingested = [r[6] - r[1] for r in rows_]
        metrics[f"p50_ms_{kind}_ingested_at"] = ms(ingested, 50)
        metrics[f"p99_ms_{kind}_ingested_at"] = ms(ingested, 99)
        # where the time goes, per row: [p50, p99] of each stage
        stages = {"produced_to_sealed": [r[2] - r[1] for r in rows_],
                  "sealed_to_sent": [r[3] - r[2] for r in rows_],
                  "sent_to_acked": [r[4] - r[3] for r in rows_],
                  "acked_to_opened": [r[5] - r[4] for r in rows_],
                  "opened_to_txn_start": [r[6] - r[5] for r in rows_],
                  "txn_start_to_commit": [r[7] - r[6] for r in rows_]}
        metrics[f"stages_ms_{kind}"] = {name: [ms(v, 50), ms(v, 99)] for name, v in stages.items()}
        metrics[f"latency_samples_{kind}"] = len(total)
        metrics[f"rows_per_batch_{kind}"] = round(len(total) / max(1, len({r[2] for r in rows_})), 2)
        metrics[f"paced_rows_per_s_{kind}"] = round(median(achieved[kind]), 1)
    metrics.update({
        "e2e_gap_recovery_s_per_kill": on["recovery_s"] if on else None,
        "e2e_rows_acked": on["acked"] if on else None,
        "e2e_rows_stored_twice": on["stored_twice"] if on else None,
        "e2e_rows_resent": on["resent"] if on else None,
        "e2e_gaps_noticed": on["gaps"] if on else None,
        "e2e_lost_rows_broker_kill_receipts_off": kill_metrics["off"]["lost"] if "off" in kill_metrics else None,
        "receipts": True,
        "payload_bytes": {kind: dims * 4 for kind, dims in DIMS.items()},
        "device_acked_rows_per_s": round(median(acked_rates)),
        "metrics_overhead_fraction_wall": round(1 - median(rates) / median(rates_off), 4),
        "metrics_overhead_fraction_direct": round(median(direct), 5) if direct else None,
        "metrics_scrape_cpu_ms": round(scrape_cpu_s * 1e3, 3),
        "rows_per_s_without_metrics": round(median(rates_off)),
        "cloud_cpu_us_per_row": {"metrics": round(median(cpu_per_row[True]) * 1e6, 2),
                                 "no_metrics": round(median(cpu_per_row[False]) * 1e6, 2)},
        "metrics_scrapes": scrapes,
        "metrics_scrape_every_s": SCRAPE_EVERY_S,
        "naive_json_rows_per_s": round(median(naive_rates)),
        "tunnel_vs_naive_rows_per_s": round(median(rates) / median(naive_rates), 2),
        "throughput_rows": n_rows,
        "naive_rows": n_naive,
        "throughput_batches": tput_batches,
        **byte_metrics,
        "cloud_consumer_gc": cloud_gc,
        "linger_s": linger_s,
        "batch_rows": batch_rows,
        "envelope_format": 2,
        "compression": tput_compression,
        "broker": "STREAMFLOW_KAFKA_BOOTSTRAP" if os.environ.get("STREAMFLOW_KAFKA_BOOTSTRAP") else "noida-db",
        "rounds": args.rounds,
        "loadavg_1m_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "cpu_count": cpu_count(),
        "quick": quick,
    })
    finish("tunnel", metrics, quick=args.quick)


if __name__ == "__main__":
    main()
