"""The device's choice between the cloud's reply and its own result, without processes or a broker: a cloud
reply from a model less accurate than the device's own waits for the local result (and is taken only if that
fails or the deadline comes first); a more accurate one answers at once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from streamflow.serve.client import ServeClient, _Pending
from streamflow.serve.messages import Reply
from streamflow.serve.zoo import Zoo, ZooModel


@pytest.fixture
def client(tmp_path) -> ServeClient:
    models = [ZooModel("small", 48, 0.60, 1.0, 0.1, Path("small.onnx")),
              ZooModel("medium", 96, 0.90, 3.0, 0.1, Path("medium.onnx")),
              ZooModel("large", 160, 0.99, 7.0, 0.1, Path("large.onnx"))]
    return ServeClient("phone-1", b"k" * 32, zoo=Zoo(models, path=tmp_path / "zoo.json"), local_model="medium")


def pending(client: ServeClient, request_id: int, sla_ms: float = 1000.0) -> _Pending:
    p = _Pending(request_id, time.perf_counter(), sla_ms, 0.1 * sla_ms, "mdinference", (8, 8, 3))
    client._pending[request_id] = p
    return p


def reply(request_id: int, model: str, label: int) -> Reply:
    return Reply("phone-1", request_id, "ok", model=model, label=label, budget_ms=50.0, inference_ms=1.0)


def test_a_more_accurate_cloud_answer_is_taken_at_once(client):
    p = pending(client, 1)
    client._on_network("reply", 1, reply(1, "large", 3))
    answer = p.future.result(timeout=0)
    assert (answer.answered_by, answer.model, answer.label) == ("cloud", "large", 3)


def test_a_less_accurate_cloud_answer_waits_for_the_local_result(client):
    p = pending(client, 1)
    client._on_network("reply", 1, reply(1, "small", 3))
    assert not p.future.done()
    client._on_device("label", 1, (2, 2.5))
    answer = p.future.result(timeout=0)
    assert (answer.answered_by, answer.model, answer.label, answer.cloud) == ("device", "medium", 2, "ok")
    assert client.counts["cloud_less_accurate"] == 1


def test_a_less_accurate_cloud_answer_after_the_local_result_is_not_taken(client):
    p = pending(client, 1)
    client._on_device("label", 1, (2, 2.5))  # the race is on: the local result waits for the cloud or the deadline
    assert not p.future.done()
    client._on_network("reply", 1, reply(1, "small", 3))
    assert (p.future.result(timeout=0).answered_by, p.future.result(timeout=0).label) == ("device", 2)


def test_a_less_accurate_cloud_answer_beats_a_failed_local_model(client):
    p = pending(client, 1)
    client._on_network("reply", 1, reply(1, "small", 3))
    client._on_device("error", 1, "the image is too small for the model")
    assert (p.future.result(timeout=0).answered_by, p.future.result(timeout=0).label) == ("cloud", 3)


def test_a_less_accurate_cloud_answer_is_taken_at_the_deadline_if_the_local_result_is_late(client):
    p = pending(client, 1, sla_ms=50.0)
    client._deadlines.append((p.deadline, 1))
    deadlines = threading.Thread(target=client._deadline_loop, daemon=True)
    deadlines.start()
    try:
        with client._lock:
            client._on_reply(reply(1, "small", 3))
            client._lock.notify_all()
        answer = p.future.result(timeout=5)
        assert (answer.answered_by, answer.label, answer.met_sla) == ("cloud", 3, True)
    finally:
        client._stopping.set()
        with client._lock:
            client._lock.notify_all()
        deadlines.join(timeout=5)
