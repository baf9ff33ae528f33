"""The release server's metrics: ``GET /metrics``, ``/healthz`` and ``/readyz`` on the server's own port.

Read at each scrape from the :class:`~streamflow.deploy.release.stages.ReleaseManager`'s state (releases, their cohorts'
samples, the versions devices run) and the server's request counts (``DeployServer.stats``); only the decision's
time is measured here, per request that carries the devices' tasks header.

==================================================================  =========  ======================================
name                                                                type       what
==================================================================  =========  ======================================
``streamflow_release_stage{task,version,stage}``                    gauge      1 for the stage a release is in
``streamflow_release_fraction{task,version}``                       gauge      the gray fraction it is offered to
``streamflow_release_coverage_ratio{task,version}``                 gauge      devices of the task on its version
``streamflow_release_cohort_samples{task,version,cohort}``          gauge      devices that reported, per cohort
``streamflow_release_cohort_failure_ratio{task,version,cohort}``    gauge      failed / reported, per cohort
``streamflow_release_rollbacks_total{task}``                        counter    releases rolled back
``streamflow_release_task_devices{task,version}``                   gauge      devices running each version
``streamflow_release_decision_seconds``                             histogram  one request's deploy decision
``streamflow_release_server_requests_total{outcome}``               counter    the server's request counts
==================================================================  =========  ======================================

Releases in the gauges: each task's release in progress and its latest ended one (a bounded set); the cohorts
are the plan's (``beta`` and the gray bands).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

#: a decision is a few µs; the request around it, a millisecond
DECISION_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 1e-2)
STAGES = ("simulation", "beta", "gray", "complete", "rolled_back", "refused")


class DeployMetrics:
    """The release server's collector, in a registry of its own; ``decision`` times each decision."""

    def __init__(self, server: Any):
        from prometheus_client import CollectorRegistry, Histogram

        self.server = server
        self.registry = CollectorRegistry()
        self.decision = Histogram("streamflow_release_decision_seconds", "One request's deploy decision (the "
                                  "policy snapshot's answer and the device's versions noted)",
                                  buckets=DECISION_BUCKETS, registry=self.registry)
        self.registry.register(self)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        manager = self.server.manager
        with manager._lock:
            releases = list(manager.releases.values())
            counts = {task: dict(c) for task, c in manager.counts.items()}
            shown = self._shown(releases)
            rows = [(r.task, r.version, r.status if r.status in ("rolled_back", "refused") else r.stage, r.fraction,
                     [(name, c.samples, c.failure_rate) for name, c in r.cohorts.items()]) for r in shown]
        stage = GaugeMetricFamily("streamflow_release_stage", "1 for the stage the release is in (rolled_back, "
                                  "refused: ended so)", labels=["task", "version", "stage"])
        fraction = GaugeMetricFamily("streamflow_release_fraction", "The fraction of the fleet it is offered to",
                                     labels=["task", "version"])
        coverage = GaugeMetricFamily("streamflow_release_coverage_ratio", "Devices of the task that run its version",
                                     labels=["task", "version"])
        samples = GaugeMetricFamily("streamflow_release_cohort_samples", "Devices of a cohort that reported on it",
                                    labels=["task", "version", "cohort"])
        failures = GaugeMetricFamily("streamflow_release_cohort_failure_ratio", "Failed / reported devices of a "
                                     "cohort", labels=["task", "version", "cohort"])
        for task, version, where, offered, cohorts in rows:
            for name in STAGES:
                stage.add_metric([task, version, name], int(name == where))
            fraction.add_metric([task, version], offered)
            on_task = counts.get(task, {})
            seen = sum(on_task.values())
            coverage.add_metric([task, version], on_task.get(version, 0) / seen if seen else 0.0)
            for cohort, n, rate in cohorts:
                samples.add_metric([task, version, cohort], n)
                failures.add_metric([task, version, cohort], rate)
        yield from (stage, fraction, coverage, samples, failures)
        rollbacks = CounterMetricFamily("streamflow_release_rollbacks", "Releases rolled back", labels=["task"])
        for task in sorted({r.task for r in releases}):
            rollbacks.add_metric([task], sum(1 for r in releases if r.task == task and r.status == "rolled_back"))
        yield rollbacks
        devices = GaugeMetricFamily("streamflow_release_task_devices", "Devices running each version of a task",
                                    labels=["task", "version"])
        for task, on_task in sorted(counts.items()):
            for version, n in sorted(on_task.items()):
                if n:
                    devices.add_metric([task, version], n)
        yield devices
        requests = CounterMetricFamily("streamflow_release_server_requests", "The server's requests by outcome "
                                       "(requests: all of them)", labels=["outcome"])
        for outcome, n in sorted(dict(self.server.stats).items()):
            requests.add_metric([outcome], n)
        yield requests

    @staticmethod
    def _shown(releases: list[Any]) -> list[Any]:
        """Each task's releases in progress and its latest ended one."""
        latest: dict[str, Any] = {}
        for release in sorted(releases, key=lambda r: r.seq):
            if release.status != "active":
                latest[release.task] = release
        return [r for r in releases if r.status == "active"] + [
            r for r in latest.values() if r.status != "active"]

    def ready(self) -> str | None:
        """None while the release state answers and the tunnel report reader (if any) runs, else why not."""
        try:
            self.server.store.stable_versions()
        except Exception as exc:  # noqa: BLE001 - any failure of the state is "not ready", said
            return f"the release state does not answer: {exc}"
        reader = self.server.tunnel_reader
        if reader is not None and (reader._thread is None or not reader._thread.is_alive()):
            return "the tunnel report reader is not running"
        return None

    def exposition(self) -> tuple[bytes, str]:
        """The body and content type of ``/metrics``."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
