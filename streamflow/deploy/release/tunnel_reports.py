"""Deploy reports over the Kafka tunnel: a device's success/failure rows in, the release manager's reports out.

A device with a tunnel (:class:`~connectors.tunnel.sink.TunnelSink`) reports through it instead of
HTTP (:class:`~streamflow.deploy.device.client.DeployClient` with ``tunnel=``): one row of the table
``deploy_reports`` (``task``, ``version``, ``ok``, ``reason``, ``reported_at``) per report, sealed and
signed with the device's key like its feature rows, spooled durably while the broker is away.

:class:`TunnelReportReader` is the cloud side: a Kafka consumer of the tunnel's topic in a group of its
own (the :class:`~connectors.tunnel.cloud.CloudConsumer` stores the same rows in the cloud DuckDB
independently). Every message is opened and verified exactly as the cloud consumer does
(:func:`~connectors.tunnel.cloud.open_message`: the device's HMAC, the key, the schema); refused ones
are counted and logged with their reason, never believed. A verified ``deploy_reports`` row becomes a
report of the *signed* device id (a row cannot speak for another device); rows with a missing or
ill-typed field are counted as refused, with the reason. Other tables are skipped.

Example (needs a broker)::

    reader = TunnelReportReader(server.report_threadsafe, KeyRegistry(".streamflow/keys.json"))
    reader.start()            # a thread; reader.stop() ends it
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import Counter
from typing import Any

from connectors.tunnel.cloud import DeadLetter, open_message
from connectors.tunnel.kafka import (
    CLIENT_TIMEOUTS,
    DEFAULT_TOPIC,
    Retry,
    TunnelUnavailable,
    ensure_topic,
)
from connectors.tunnel.keys import KeyRegistry
from connectors.tunnel.registry import Registry
from streamflow.deploy.protocol import REPORTS_TABLE, Report, row_problem
from streamflow.settings import settings

log = logging.getLogger("streamflow.deploy.release.tunnel_reports")

class TunnelReportReader:
    """Reads ``deploy_reports`` rows off the tunnel's topic and hands them to ``report`` (see the module docstring)."""

    def __init__(self, report: Report, registry: KeyRegistry, *, topic: str = DEFAULT_TOPIC,
                 bootstrap: str | None = None, group_id: str = "streamflow-deploy-reports", partitions: int = 4,
                 retry_for_s: float | None = None):
        self.report = report
        #: how long a broker that went away is retried before the reader gives up (the server's /readyz then says
        #: so; the reports wait on the topic for the next reader); None: ``settings().consumer_retry_s``
        self.retry_for_s = retry_for_s
        self.registry = registry
        self.topic = topic
        self.bootstrap = settings(kafka_bootstrap=bootstrap).kafka_bootstrap  # None: $STREAMFLOW_KAFKA_BOOTSTRAP
        self.group_id = group_id
        self.partitions = partitions
        self.stats: Counter[str] = Counter()  # reports, refused (by reason), other tables' batches skipped
        self.schemas = Registry()  # the schemas and dictionaries devices announced (each once, inline)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._consumer: Any = None

    def _connect(self) -> Any:
        from kafka import KafkaConsumer, TopicPartition

        ensure_topic(self.bootstrap, self.topic, self.partitions)
        consumer = KafkaConsumer(bootstrap_servers=self.bootstrap, group_id=self.group_id,
                                 client_id=f"streamflow-deploy-reports-{os.getpid()}", enable_auto_commit=True,
                                 auto_offset_reset="earliest", isolation_level="read_committed", **CLIENT_TIMEOUTS)
        # every partition by hand, as the cloud consumer does (see CloudConsumer._connect for why)
        consumer.assign(sorted(TopicPartition(self.topic, p) for p in consumer.partitions_for_topic(self.topic)))
        return consumer

    def poll_once(self, timeout_s: float = 0.2) -> int:
        """Read what one poll returns; returns the reports handed on."""
        if self._consumer is None:
            self._consumer = self._connect()
        records = self._consumer.poll(timeout_ms=int(timeout_s * 1000))
        handed = 0
        for tp, messages in records.items():
            for m in messages:
                opened = open_message(tp.topic, tp.partition, m.offset, m.value, self.registry, m.key,
                                      self.schemas)
                if isinstance(opened, DeadLetter):
                    self.stats[f"refused:{opened.reason}"] += 1
                    log.warning("deploy report message %s[%d]@%d refused: %s", tp.topic, tp.partition, m.offset,
                                opened.detail)
                    continue
                if opened.table != REPORTS_TABLE:
                    self.stats["other_tables"] += 1
                    continue
                for row in opened.rows.to_pylist():
                    problem = row_problem(row)
                    if problem is not None:
                        self.stats["refused:bad_report"] += 1
                        log.warning("deploy report row from device %s refused: %s", opened.device, problem)
                        continue
                    self.report(opened.device, row["task"], row["version"], row["ok"], row.get("reason") or "")
                    self.stats["reports"] += 1
                    handed += 1
        return handed

    def start(self) -> None:
        """Read in a daemon thread until :meth:`stop` (reconnecting with backoff while the broker is away)."""
        self._thread = threading.Thread(target=self._run, name="deploy-tunnel-reports", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        give_up = self.retry_for_s if self.retry_for_s is not None else settings().consumer_retry_s
        retry = Retry(f"deploy reports from {self.topic} on {self.bootstrap}", give_up_after_s=give_up)
        while not self._stop.is_set():
            try:
                self.poll_once()
                retry.succeeded()
            except Exception as exc:  # noqa: BLE001 - the broker went away: back off, reconnect
                self._close()
                try:
                    delay = retry.failed(exc)
                except TunnelUnavailable as gave_up:
                    log.error("deploy report reader stopped: %s; the reports wait on the topic for the next reader "
                              "(restart the server once the broker is back; /readyz says not ready meanwhile)",
                              gave_up)
                    return
                log.warning("deploy report reader: %s; retrying in %.1f s (for up to %g s)", exc, delay, give_up)
                self._stop.wait(delay)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self._close()

    def _close(self) -> None:
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                self._consumer.close()
            self._consumer = None
