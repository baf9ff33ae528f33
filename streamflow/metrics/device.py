"""The device runner's metrics, for a long run (``streamflow run --metrics-port PORT``; off by default, 127.0.0.1).

Everything is read at each scrape from what the run counts anyway: its :class:`~streamflow.summary.RunSummary`
(events in, rejected records by reason, each task's firings, errors and quarantine), the storage's rows written
per table, refused rows and flushes, and the tunnel sink's stats and spool. Nothing is counted on the record path.

=====================================================  =========  ================================================
name                                                   type       what
=====================================================  =========  ================================================
``streamflow_device_events_total``                     counter    events accepted into the run
``streamflow_device_rejected_records_total{reason}``   counter    records rejected (dead letters), by reason
``streamflow_device_task_firings_total{task}``         counter    a task's firings
``streamflow_device_task_errors_total{task}``          counter    a task's failures (``task_errors`` rows)
``streamflow_device_task_quarantined{task}``           gauge      1 while the task is quarantined
``streamflow_device_rows_written_total{table}``        counter    rows handed to storage, per table
``streamflow_device_rows_refused_total{table}``        counter    rows a table refused (in ``dead_letter``)
``streamflow_device_storage_flushes_total``            counter    buffer flushes to the DuckDB file
``streamflow_device_evicted_users_total``              counter    users whose state was dropped over the cap
``streamflow_device_tunnel_rows_acked_total``          counter    tunnelled rows the broker acknowledged
``streamflow_device_tunnel_backlog_rows``              gauge      spooled rows the broker has not acknowledged
=====================================================  =========  ================================================

Labels are the job's own names (tasks, tables) and the rejection's kind (the reason up to its first colon, as the
summary groups them; at most :data:`MAX_REASONS` of them, the rest ``other``), never a user.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

#: distinct rejection reasons labelled; any further one is counted as ``other``
MAX_REASONS = 20


class DeviceMetrics:
    """A Prometheus collector of one :class:`~streamflow.runners.device.DeviceRunner`."""

    def __init__(self, runner: Any, registry: Any):
        self.runner = runner
        registry.register(self)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        runner = self.runner
        summary, storage, tunnel = runner.summary, runner.storage, runner.tunnel
        tasks = list(summary.task_stats.items())  # a copy: tasks may be swapped in meanwhile
        yield CounterMetricFamily("streamflow_device_events", "Events accepted into the run", value=summary.events_in)
        rejected = CounterMetricFamily("streamflow_device_rejected_records", "Records rejected (dead letters), by "
                                       "reason", labels=["reason"])
        for reason, n in _bounded(dict(summary.rejected)).items():
            rejected.add_metric([reason], n)
        yield rejected
        for name, doc, value in (("task_firings", "Task firings", lambda s: s.fired),
                                 ("task_errors", "Task failures (rows of task_errors)", lambda s: s.errors)):
            family = CounterMetricFamily(f"streamflow_device_{name}", doc, labels=["task"])
            for task, stats in tasks:
                family.add_metric([task], value(stats))
            yield family
        quarantined = GaugeMetricFamily("streamflow_device_task_quarantined", "1 while the task is quarantined",
                                        labels=["task"])
        for task, stats in tasks:
            quarantined.add_metric([task], int(stats.quarantined))
        yield quarantined
        for name, doc, counts in (("rows_written", "Rows handed to storage, per table", storage.rows_written),
                                  ("rows_refused", "Rows a table refused (in dead_letter)", storage.refused)):
            family = CounterMetricFamily(f"streamflow_device_{name}", doc, labels=["table"])
            for table, n in sorted(dict(counts).items()):
                family.add_metric([table], n)
            yield family
        yield CounterMetricFamily("streamflow_device_storage_flushes", "Buffer flushes to the DuckDB file",
                                  value=storage.flushes)
        yield CounterMetricFamily("streamflow_device_evicted_users", "Users whose state was dropped over the cap",
                                  value=runner.evicted_users)
        if tunnel is not None:
            yield CounterMetricFamily("streamflow_device_tunnel_rows_acked", "Tunnelled rows the broker acknowledged",
                                      value=tunnel.stats.rows_acked)
            yield GaugeMetricFamily("streamflow_device_tunnel_backlog_rows", "Spooled rows the broker has not "
                                    "acknowledged yet", value=tunnel.spool.rows_pending)

    def ready(self) -> str | None:
        """None while the storage is open (for ``/readyz``)."""
        return "the storage is closed" if self.runner.storage.closed else None


def _bounded(counts: dict[str, int]) -> dict[str, int]:
    """``counts`` with at most :data:`MAX_REASONS` keys (the first met), the rest summed as ``other``.

    >>> len(_bounded({f"reason {i}": 1 for i in range(30)})), _bounded({f"r{i}": 1 for i in range(30)})["other"]
    (21, 10)
    """
    if len(counts) <= MAX_REASONS:
        return counts
    kept = dict(list(counts.items())[:MAX_REASONS])
    kept["other"] = kept.get("other", 0) + sum(n for r, n in counts.items() if r not in kept)
    return kept


def serve_device_metrics(runner: Any, port: int, host: str = "127.0.0.1") -> Any:
    """Serve ``runner``'s metrics with ``/healthz`` and ``/readyz`` on ``host:port``; the
    :class:`~streamflow.metrics.MetricsServer` (close it when the run ended)."""
    from prometheus_client import CollectorRegistry

    from streamflow.metrics import MetricsServer

    registry = CollectorRegistry()
    metrics = DeviceMetrics(runner, registry)
    return MetricsServer(registry, port, metrics.ready, host)
