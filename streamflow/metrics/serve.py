"""The serving worker's metrics (``streamflow serve --metrics-port PORT``): ``/metrics``, ``/healthz`` and
``/readyz`` on faust's own web server, bound to 127.0.0.1.

Faust's sensors are wired in as they are (``faust.sensors.prometheus``: messages, events, table operations,
sends, commits, rebalances, under the prefix ``faust_``). The worker's own counts are its ``serve-counters``
Faust table (served, expired, ``model.<name>``, ``dead_letter.<reason>``, ``error.<kind>``, ``in_time``), read
at each scrape on the event loop; only the latency histograms are measured here, at each reply.

=====================================================  =========  =================================================
name                                                   type       what
=====================================================  =========  =================================================
``streamflow_serve_requests_total``                    counter    requests handled (answered or dead-lettered)
``streamflow_serve_replies_total{model}``              counter    answers by a model, by model
``streamflow_serve_replies_in_time_total``             counter    answers that left within the device's wait
``streamflow_serve_expired_requests_total``            counter    requests answered ``expired`` (no time left)
``streamflow_serve_device_fallbacks_total``            counter    requests the device answers itself: expired,
                                                                  errors and answers that left too late
``streamflow_serve_errors_total{kind}``                counter    error replies (policy, model, device_removed)
``streamflow_serve_dead_letters_total{reason}``        counter    requests dead-lettered, by reason
``streamflow_serve_request_latency_seconds``           histogram  request sent by the device → its reply sent
``streamflow_serve_inference_seconds{model}``          histogram  a model's inference
=====================================================  =========  =================================================

SLA attainment is ``replies_in_time / requests`` (the worker's side of it: the trip back is the device's).
The counts live in the changelogged table, so they carry on across a worker's restart; the histograms start afresh.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.5, 1.0, 2.5, 5.0)
INFERENCE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
#: error counts that are not a reply of their own: device_removed follows a served or expired request
_NOT_A_REQUEST = ("error.device_removed", "dead_letter.send_failed")


class ServeMetrics:
    """A collector over the worker's counters table, and its latency histograms, in ``registry``."""

    def __init__(self, counters: Any, registry: Any):
        from prometheus_client import Histogram

        self.counters = counters
        self.latency = Histogram("streamflow_serve_request_latency_seconds", "A request sent by the device (its "
                                 "clock) to its reply sent by the worker", buckets=LATENCY_BUCKETS, registry=registry)
        self.inference = Histogram("streamflow_serve_inference_seconds", "A model's inference on one request",
                                   ["model"], buckets=INFERENCE_BUCKETS, registry=registry)
        registry.register(self)

    def replied(self, sent_ms: float, inference_ms: float, model: str) -> None:
        """A reply to a request the device sent at ``sent_ms`` (epoch ms) leaves now."""
        self.latency.observe(max(time.time() * 1000.0 - sent_ms, 0.0) / 1000.0)
        if model and inference_ms == inference_ms:  # NaN: no model ran
            self.inference.labels(model).observe(inference_ms / 1000.0)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        counts: Mapping[str, int] = dict(self.counters.items())

        def under(prefix: str) -> dict[str, int]:
            return {k[len(prefix):]: v for k, v in sorted(counts.items()) if k.startswith(prefix)}

        errors, dead = under("error."), under("dead_letter.")
        requests = counts.get("served", 0) + counts.get("expired", 0) + sum(
            v for k, v in counts.items() if k.startswith(("error.", "dead_letter.")) and k not in _NOT_A_REQUEST)
        replies = counts.get("served", 0) + counts.get("expired", 0) + errors.get("policy", 0) + errors.get("model", 0)
        for name, doc, value in (
                ("requests", "Requests handled (answered or dead-lettered)", requests),
                ("replies_in_time", "Answers that left the worker within the device's wait", counts.get("in_time", 0)),
                ("expired_requests", "Requests answered expired (no time left for a model)", counts.get("expired", 0)),
                ("device_fallbacks", "Requests the device answers itself (expired, errors, answers too late)",
                 max(replies - counts.get("in_time", 0), 0))):
            yield CounterMetricFamily(f"streamflow_serve_{name}", doc, value=value)
        for name, doc, label, values in (("replies", "Answers by a model, by model", "model", under("model.")),
                                         ("errors", "Error replies, by kind", "kind", errors),
                                         ("dead_letters", "Requests dead-lettered, by reason", "reason", dead)):
            family = CounterMetricFamily(f"streamflow_serve_{name}", doc, labels=[label])
            for key, n in values.items():
                family.add_metric([key], n)
            yield family


def wire(app: Any, counters: Any, port: int) -> ServeMetrics:
    """Faust's Prometheus sensors and the worker's metrics on ``app``'s web server (``/metrics``), with
    ``/healthz`` and ``/readyz`` pages; the :class:`ServeMetrics` to tell of replies. ``port`` is the web port."""
    from faust.sensors.prometheus import setup_prometheus_sensors
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    setup_prometheus_sensors(app, pattern="/metrics", registry=registry, name_prefix="faust")
    metrics = ServeMetrics(counters, registry)

    @app.page("/healthz")
    async def healthz(self: Any, request: Any) -> Any:
        return self.text("ok\n")

    @app.page("/readyz")
    async def readyz(self: Any, request: Any) -> Any:
        why = not_ready(app)
        return self.text("ready\n") if why is None else self.text(f"not ready: {why}\n", status=503)

    return metrics


def not_ready(app: Any) -> str | None:
    """None once the worker holds the request topic's partition and is not rebalancing, else why not."""
    if getattr(app, "rebalancing", False):
        return "rebalancing"
    try:
        assigned = app.consumer.assignment()
    except Exception as exc:  # noqa: BLE001 - no consumer yet: not ready, said so
        return f"no consumer yet ({type(exc).__name__})"
    return None if assigned else "no partition assigned yet"
