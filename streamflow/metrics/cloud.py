"""The cloud consumer's metrics (``streamflow tunnel consume --metrics-port PORT``).

Counts are the consumer's own :class:`~connectors.tunnel.cloud.CloudStats` (what its summary line prints), read
at each scrape; only what it does not keep is measured here, told by the consumer after every poll
(``CloudConsumer.metrics``): the store transaction's time, each envelope's age when its transaction committed
(seal on the device → stored; the Kafka record's timestamp is the seal time, see
:func:`connectors.tunnel.sink._record_time_ms`) and the lag per partition (the partition's high watermark from
the last fetch less the next offset to store).

========================================================  =========  ===========================================
name                                                      type       what
========================================================  =========  ===========================================
``streamflow_cloud_messages_total``                       counter    Kafka messages read
``streamflow_cloud_rows_stored_total``                    counter    rows stored
``streamflow_cloud_duplicate_rows_total``                 counter    rows dropped as repeats (a resend)
``streamflow_cloud_dead_letters_total{reason}``           counter    messages refused, by reason
``streamflow_cloud_sequence_gaps_total{outcome}``         counter    per-device gaps noticed, filled, lost
``streamflow_cloud_lost_numbers_total``                   counter    sequence numbers of the lost gaps
``streamflow_cloud_registrations_total``                  counter    schemas and dictionaries registered
``streamflow_cloud_parked_resolved_total``                counter    parked envelopes stored once registered
``streamflow_cloud_receipts_published_total``             counter    receipts published to the devices
``streamflow_cloud_online_upsert_errors_total``           counter    deferred online upserts refused
``streamflow_cloud_consumer_lag_messages{partition}``     gauge      messages on the broker not stored yet
``streamflow_cloud_end_to_end_latency_seconds``           histogram  device seal → stored, per envelope
``streamflow_cloud_store_transaction_seconds``            histogram  one poll's store transaction
========================================================  =========  ===========================================
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

#: seal → stored: a few ms on loopback, seconds behind a backlog, hours for a device that was offline
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0)
TRANSACTION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
GAP_OUTCOMES = ("noticed", "filled", "lost")


class CloudMetrics:
    """A Prometheus collector of one :class:`~connectors.tunnel.cloud.CloudConsumer`, registered in
    ``registry`` and hooked to the consumer (``consumer.metrics``)."""

    def __init__(self, consumer: Any, registry: Any):
        from prometheus_client import Histogram

        self.consumer = consumer
        self.latency = Histogram("streamflow_cloud_end_to_end_latency_seconds", "Envelope sealed on the device to "
                                 "its rows stored in the cloud (by the Kafka record timestamp)",
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.transaction = Histogram("streamflow_cloud_store_transaction_seconds", "One poll's store transaction "
                                     "(rows, dead letters, offsets)", buckets=TRANSACTION_BUCKETS, registry=registry)
        self._next: dict[int, int] | None = None  # partition → next offset to store (None: not read yet)
        self._lag: dict[int, int] = {}
        registry.register(self)
        consumer.metrics = self

    def polled(self, kafka: Any, records: Mapping[Any, Sequence[Any]], offsets: Mapping[tuple[str, int], int],
               batches: Sequence[Any], transaction_s: float) -> None:
        """After a poll (on the consumer's thread): what its records and its store transaction took."""
        if batches:
            stored_at = time.time()
            self.transaction.observe(transaction_s)
            stamps = {(tp.partition, m.offset): m.timestamp for tp, messages in records.items() for m in messages
                      if m.timestamp_type == 0 and m.timestamp > 0}  # CreateTime: the device's seal time
            for batch in batches:
                stamp = stamps.get((batch.origin.partition, batch.origin.offset)) if batch.origin else None
                if stamp is not None:
                    self.latency.observe(max(stored_at - stamp / 1000.0, 0.0))
        if self._next is None:
            self._next = dict(self.consumer.store.offsets(self.consumer.topic))
        for (_, partition), offset in offsets.items():
            self._next[partition] = offset
        if kafka is None:
            return
        lag = {}
        for tp in kafka.assignment():
            high = kafka.highwater(tp)
            if high is not None:
                lag[tp.partition] = max(high - self._next.get(tp.partition, 0), 0)
        self._lag = lag

    def ready(self) -> str | None:
        """None once the consumer holds its partitions on a broker, else why not (for ``/readyz``)."""
        consumer = self.consumer
        if consumer._consumer is None:
            return f"not connected to the broker at {consumer.bootstrap}"
        if not consumer._assigned:
            return f"no partition of {consumer.topic} assigned yet"
        return None

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.consumer.stats
        receipts = self.consumer.receipts
        for name, doc, value in (
                ("messages", "Kafka messages read", stats.messages),
                ("rows_stored", "Rows stored", stats.stored),
                ("duplicate_rows", "Rows dropped as repeats of stored ones (a device's resend)", stats.duplicates),
                ("lost_numbers", "Sequence numbers of gaps given up as lost", stats.rows_lost),
                ("registrations", "Schemas and dictionaries registered", stats.registered),
                ("parked_resolved", "Parked envelopes stored once their registration arrived", stats.resolved),
                ("receipts_published", "Receipts published to the devices",
                 receipts.published if receipts is not None else 0),
                ("online_upsert_errors", "Deferred online upserts the online table refused",
                 self.consumer.store.online_errors)):
            yield CounterMetricFamily(f"streamflow_cloud_{name}", doc, value=value)
        dead = CounterMetricFamily("streamflow_cloud_dead_letters", "Messages refused, by reason", labels=["reason"])
        for reason, n in sorted(dict(stats.dead).items()):
            dead.add_metric([reason], n)
        yield dead
        gaps = CounterMetricFamily("streamflow_cloud_sequence_gaps", "Per-device sequence gaps noticed, filled "
                                   "(the numbers arrived) and lost (given up)", labels=["outcome"])
        counted = dict(stats.gaps)
        for outcome in GAP_OUTCOMES:
            gaps.add_metric([outcome], counted.get(outcome, 0))
        yield gaps
        lag = GaugeMetricFamily("streamflow_cloud_consumer_lag_messages", "Messages on the broker not stored yet "
                                "(high watermark of the last fetch less the next offset to store)",
                                labels=["partition"])
        for partition, n in sorted(self._lag.items()):
            lag.add_metric([str(partition)], n)
        yield lag


def serve_cloud_metrics(consumer: Any, port: int, host: str = "127.0.0.1") -> Any:
    """Hook metrics to ``consumer`` and serve them with ``/healthz`` and ``/readyz`` on ``host:port``; the
    :class:`~streamflow.metrics.MetricsServer` (close it after the consumer)."""
    from prometheus_client import CollectorRegistry

    from streamflow.metrics import MetricsServer

    registry = CollectorRegistry()
    metrics = CloudMetrics(consumer, registry)
    return MetricsServer(registry, port, metrics.ready, host)
