"""``streamflow serve --metrics-port``: the session's worker scraped over HTTP while it serves, parsed with
prometheus_client's parser; its counters equal the worker's ``serve-counters`` table (its summary), the latency
histograms saw every answer, faust's own sensors are there; ``/healthz`` and ``/readyz`` answer."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from streamflow.serve.app import COUNTERS_TABLE  # noqa: E402
from streamflow.serve.messages import REQUEST_TOPIC  # noqa: E402

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.read().decode()


def scrape(worker) -> Samples:
    status, text = get(f"http://127.0.0.1:{worker.metrics_port}/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def counters_table(worker) -> dict[str, int]:
    """The worker's serve-counters table as its changelog on the broker has it (the newest value per key)."""
    consumer = KafkaConsumer(bootstrap_servers=worker.bootstrap, group_id=None, enable_auto_commit=False,
                             consumer_timeout_ms=1500)
    tp = TopicPartition(f"{worker.app_id}-{COUNTERS_TABLE}-changelog", 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    table = {json.loads(r.key): json.loads(r.value) for r in consumer}
    consumer.close()
    return table


def family(samples: Samples, name: str) -> dict[str, float]:
    return {labels[0][1] if labels else "": v for (n, labels), v in samples.items() if n == name}


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def test_worker_metrics_equal_its_counters_table(serve_worker, client, pages):
    base = f"http://127.0.0.1:{serve_worker.metrics_port}"
    assert get(base + "/healthz") == (200, "ok\n")
    assert get(base + "/readyz") == (200, "ready\n")
    before = scrape(serve_worker)
    images, _ = pages
    answers = [client.infer(images[i], sla_ms=5000) for i in range(5)]
    assert {a.answered_by for a in answers} == {"cloud"}
    producer = KafkaProducer(bootstrap_servers=serve_worker.bootstrap)
    producer.send(REQUEST_TOPIC, value=b"not a request").get(timeout=10)  # one dead letter
    producer.close()
    requests_before = before[("streamflow_serve_requests_total", ())]
    wait_for(lambda: scrape(serve_worker)[("streamflow_serve_requests_total", ())] == requests_before + 6,
             "6 more requests on /metrics")
    after = scrape(serve_worker)
    served = sum(family(after, "streamflow_serve_replies_total").values())
    wait_for(lambda: counters_table(serve_worker).get("served", 0) == served, "the counters' changelog")
    table = counters_table(serve_worker)
    assert family(after, "streamflow_serve_replies_total") == {
        k.removeprefix("model."): v for k, v in table.items() if k.startswith("model.")}
    assert after[("streamflow_serve_replies_in_time_total", ())] == table.get("in_time", 0)
    assert after[("streamflow_serve_expired_requests_total", ())] == table.get("expired", 0)
    assert family(after, "streamflow_serve_dead_letters_total") == {
        k.removeprefix("dead_letter."): v for k, v in table.items() if k.startswith("dead_letter.")}
    assert family(after, "streamflow_serve_errors_total") == {
        k.removeprefix("error."): v for k, v in table.items() if k.startswith("error.")}
    # this test's five answers were all in time (a generous SLA), the bad request a dead letter
    delta = {name: after[(name, ())] - before.get((name, ()), 0.0) for name in (
        "streamflow_serve_replies_in_time_total", "streamflow_serve_request_latency_seconds_count",
        "streamflow_serve_device_fallbacks_total")}
    assert delta == {"streamflow_serve_replies_in_time_total": 5, "streamflow_serve_request_latency_seconds_count": 5,
                     "streamflow_serve_device_fallbacks_total": 0}
    inferences = [sum(v for (n, _), v in samples.items() if n == "streamflow_serve_inference_seconds_count")
                  for samples in (before, after)]
    assert inferences[1] - inferences[0] == 5  # each answer's model run
    assert after[("faust_messages_received_total", ())] >= 6  # faust's own sensors, wired in
    assert not any("phone-" in v for (_, labels) in after for _, v in labels)  # never a device id as a label
