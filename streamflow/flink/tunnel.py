"""The cloud side of the tunnel as a Flink job: the features topic into DuckDB, verified and de-duplicated.

::

    features topic ─ kafka_records      (topic, partition, offset, key, value); parallelism N, each
                                        partition read by one reader in offset order
      ─ OpenEnvelopes    parallelism N, chained: verify and decode (``open_message``, the same checks as
                         the Kafka consumer), a refused message becomes a DeadLetter; each knows the
                         schemas stored when the job started and learns those its envelopes carry
      ─ TunnelWriter     parallelism 1: ``CloudStore.apply`` per group of messages, one transaction each
      ─ discarding sink

De-duplication by (device, seq) is done against what is stored, so it needs one writer that sees every
batch: the decoding (HMAC, payload) runs in parallel, the storing in one place. A device's messages share
a partition (the sink picks it from the device id), so they reach one decoder and the writer in the order it
sent them; an envelope whose schema no decoder knew is parked by the writer and stored once the schema is
(``CloudStore.recover``), as the Kafka consumer does.

The job reads up to the offsets that are the latest when it starts, then ends. It starts where the rows
stored in ``db_path`` end (``tunnel.offsets``, written in the same transaction as the rows, as the Kafka
consumer does), or at the earliest offset: running it again reads only what arrived since, and a batch a
device sent twice is stored once (de-duplication by (device, seq) covers what offsets cannot).

Receipts (:mod:`connectors.tunnel.receipts`): when the job has ended, the driver publishes a receipt for every
device the store holds (what it has, the holes it lacks), as the Kafka consumer does after each poll, so devices
trim their spools and resend what is missing; the next run stores the resends. Between runs a device hears
nothing and probes now and then (a resend its receipt timeout paces, dropped as a repeat by the next run).

Example (starts a JVM, so not run as a doctest)::

    summary = run_flink_features("streamflow.features", "out/cloud.duckdb", ".streamflow/keys.json")
    summary.stored, summary.duplicates, summary.dead
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyflink.common import Types
from pyflink.datastream.connectors.base import Sink
from pyflink.datastream.functions import FlatMapFunction, ProcessFunction, RuntimeContext
from pyflink.java_gateway import get_gateway

from connectors.tunnel.cloud import CloudStats, CloudStore, DeadLetter, open_message, publish_receipts
from connectors.tunnel.envelope import Batch
from connectors.tunnel.keys import KeyRegistry
from connectors.tunnel.registry import Registration, Registry
from streamflow.flink.kafka_source import kafka_records
from streamflow.flink.runner import flink_environment
from streamflow.settings import settings

log = logging.getLogger("streamflow.flink.tunnel")

_PICKLED = Types.PICKLED_BYTE_ARRAY()
#: Messages stored per ``CloudStore.apply`` (one transaction); the last group is stored when the input ends.
DEFAULT_GROUP_SIZE = 100
_PROGRESS_EVERY_S = 10.0


@dataclass
class FeaturesSummary:
    """What a features job did: messages read, rows stored and skipped as duplicates, dead letters by reason."""

    db_path: str
    topic: str
    messages: int = 0
    stored: int = 0
    duplicates: int = 0
    dead_reasons: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def dead(self) -> int:
        return sum(self.dead_reasons.values())


class OpenEnvelopes(FlatMapFunction):
    """A Kafka record as ``((topic, partition), offset, Batch | DeadLetter)``; nothing is trusted before it is
    verified."""

    def __init__(self, registry_path: str, schemas: list[tuple[str, int, bytes, bytes]]):
        self.registry_path = registry_path
        self.schemas = schemas  # (device, kind, id, body) stored when the job started

    def open(self, runtime_context: RuntimeContext) -> None:
        self.registry = KeyRegistry(self.registry_path)  # re-read when an unknown device shows up
        self.known = Registry((d, Registration(kind, id_, body)) for d, kind, id_, body in self.schemas)

    def flat_map(self, record: Any) -> Iterator[tuple[tuple[str, int], int, Batch | DeadLetter]]:
        topic, partition, offset, key, value = record[0], record[1], record[2], record[3], record[4]
        yield (topic, partition), offset, open_message(topic, partition, offset, value, self.registry, key,
                                                       self.known)


class TunnelWriter(ProcessFunction):
    """Stores opened messages with ``CloudStore.apply``, ``group_size`` messages per transaction, with the next
    offset of every partition they came from; writes the run's counts to ``report_path`` when the input ends."""

    def __init__(self, db_path: str, report_path: str, online_key: Sequence[str], group_size: int,
                 registry_path: str, schemas: dict[str, dict[str, str]] | None = None):
        self.registry_path = registry_path
        self.schemas = schemas
        self.db_path = db_path
        self.report_path = report_path
        self.online_key = tuple(online_key)
        self.group_size = group_size

    def open(self, runtime_context: RuntimeContext) -> None:
        self.store = CloudStore(self.db_path, online_key=self.online_key, schemas=self.schemas)
        self.keys = KeyRegistry(self.registry_path)
        self.batches: list[Batch] = []
        self.dead: list[DeadLetter] = []
        self.offsets: dict[tuple[str, int], int] = {}
        self.pending_messages = 0
        self.stats = CloudStats()
        self.logged = time.monotonic()

    def process_element(self, value: tuple[tuple[str, int], int, Batch | DeadLetter], ctx: ProcessFunction.Context
                        ) -> list[Any]:
        where, offset, opened = value
        self.pending_messages += 1
        if isinstance(opened, Batch):
            self.batches.append(opened)
        else:
            self.dead.append(opened)
        self.offsets[where] = max(self.offsets.get(where, 0), offset + 1)
        if len(self.batches) + len(self.dead) >= self.group_size:
            self._flush()
        return []

    def _flush(self) -> None:
        if not (self.batches or self.dead or self.offsets):
            return
        # refused batches become dead letters
        result = self.store.apply(self.batches, self.dead, self.offsets)
        self.stats.count(self.pending_messages, result)
        if result.registered:  # envelopes parked for want of these schemas can be stored now
            self.stats.count(0, self.store.recover(self.keys))
        self.batches, self.dead, self.offsets, self.pending_messages = [], [], {}, 0
        if time.monotonic() - self.logged >= _PROGRESS_EVERY_S:
            self.logged = time.monotonic()
            s = self.stats
            log.info("flink tunnel: %d messages, %d rows stored, %d duplicates, %d dead letters", s.messages,
                     s.stored, s.duplicates, s.dead_total)

    def close(self) -> None:
        self._flush()
        self.stats.count(0, self.store.recover(self.keys))  # parked by an earlier run, resolvable now
        self.store.close()
        s = self.stats
        report = {"messages": s.messages, "stored": s.stored, "duplicates": s.duplicates, "dead_reasons": dict(s.dead)}
        Path(self.report_path).write_text(json.dumps(report), encoding="utf-8")


def run_flink_features(topic: str, db_path: str | os.PathLike[str],
                       registry_path: str | os.PathLike[str] | None = None, bootstrap: str | None = None,
                       group_id: str = "streamflow-flink-features", *, cluster: str | None = None,
                       parallelism: int = 1, online_key: Sequence[str] = ("user_id",),
                       group_size: int = DEFAULT_GROUP_SIZE,
                       schemas: dict[str, dict[str, str]] | None = None, receipts: bool = True) -> FeaturesSummary:
    """Consume ``topic`` on Flink into the DuckDB ``db_path``: from where the rows stored there end (else the
    earliest offset) to the latest offsets at job start. The tunnel's topic is
    ``connectors.tunnel.kafka.DEFAULT_TOPIC``.

    ``registry_path``: the device key registry (default ``$STREAMFLOW_KEY_REGISTRY`` or
    ``.streamflow/keys.json``); ``bootstrap``: default ``$STREAMFLOW_KAFKA_BOOTSTRAP`` or
    ``127.0.0.1:9092``; ``cluster``: ``HOST:PORT`` of a JobManager (default: a local MiniCluster);
    ``parallelism``: readers and decoders (the writer is always one). Rows go to ``<table>`` and
    ``<table>_online`` (keyed by device and ``online_key``), refused messages to ``tunnel.dead_letter``;
    ``schemas``: declared tables, columns and types (see :class:`~connectors.tunnel.cloud.CloudStore`);
    ``receipts``: publish every device's receipt to ``<topic>.receipts`` once the job ended (see the module docstring).
    """
    started = time.perf_counter()
    db = Path(db_path).resolve()
    resolved = settings(key_registry=registry_path, kafka_bootstrap=bootstrap)
    registry = resolved.key_registry.resolve()
    if not registry.is_file():
        raise FileNotFoundError(f"key registry not found: {registry} (every message would be an unknown device)")
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    report = db.with_name(db.name + ".flink-tunnel.json")
    report.unlink(missing_ok=True)
    # also creates the tables before the job starts
    with CloudStore(db, online_key=online_key, schemas=schemas) as store:
        start_offsets = store.offsets(topic)
        known = [(d, r.kind, r.id, r.body) for d, r in store.registry.entries()]
    env = flink_environment(cluster, parallelism)
    (kafka_records(env, topic, resolved.kafka_bootstrap, group_id, start_offsets)
     .flat_map(OpenEnvelopes(str(registry), known), output_type=_PICKLED)
     .process(TunnelWriter(str(db), str(report), online_key, group_size, str(registry), schemas),
              output_type=_PICKLED)
     .set_parallelism(1)
     .sink_to(Sink(get_gateway().jvm.org.apache.flink.streaming.api.functions.sink.v2.DiscardingSink())))
    env.execute(f"streamflow tunnel {topic}")
    if receipts:
        with CloudStore(db, online_key=online_key, schemas=schemas) as store:
            published = publish_receipts(store, topic, KeyRegistry(registry), resolved.kafka_bootstrap)
        log.info("flink tunnel: the receipts of %d devices published", published)
    counts = json.loads(report.read_text(encoding="utf-8"))
    return FeaturesSummary(db_path=str(db), topic=topic, messages=counts["messages"], stored=counts["stored"],
                           duplicates=counts["duplicates"], dead_reasons=counts["dead_reasons"],
                           elapsed_s=time.perf_counter() - started)

