"""The serving worker as the tests start it: ``streamflow serve`` in a subprocess, ready once it answers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from connectors.tunnel.keys import KeyRegistry
from streamflow.serve.zoo import Zoo

ROOT = Path(__file__).resolve().parents[2]
WORKER_START_S = 300.0  # a loaded 2-core machine: faust start-up plus warming the models


@dataclass
class Worker:
    process: subprocess.Popen
    app_id: str
    bootstrap: str
    log: Path
    metrics_port: int  # /metrics, /healthz, /readyz on 127.0.0.1 (streamflow.metrics.serve)

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-5000:]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_worker(bootstrap: str, zoo: Zoo, keys: KeyRegistry, log: Path, probe: np.ndarray,
                 loglevel: str = "info") -> Worker:
    """``streamflow serve`` against ``bootstrap``, returned once it answers a real request."""
    from streamflow.serve.client import ServeClient

    app_id = f"serve-test-{uuid.uuid4().hex[:8]}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    env = {**os.environ, "STREAMFLOW_KAFKA_BOOTSTRAP": bootstrap, "STREAMFLOW_KEY_REGISTRY": str(keys.path),
           "PYTHONPATH": str(ROOT)}
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "streamflow.cli", "serve", "--app-id", app_id,
                                    "--zoo", str(zoo.path), "--loglevel", loglevel, "--metrics-port",
                                    str(metrics_port)],
                                   cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    worker = Worker(process, app_id, bootstrap, log, metrics_port)
    try:
        with ServeClient("phone-1", keys.key_for("phone-1"), bootstrap=bootstrap, zoo=zoo) as c:
            deadline = time.monotonic() + WORKER_START_S
            while c.infer(probe, sla_ms=3000).answered_by != "cloud":
                assert worker.alive(), f"the serving worker exited:\n{worker.log_text()}"
                assert time.monotonic() < deadline, f"no cloud answer in {WORKER_START_S}s:\n{worker.log_text()}"
    except BaseException:
        worker.stop()
        raise
    return worker
