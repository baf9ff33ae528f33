"""A real Kafka-protocol broker for the tests: noida-db on 127.0.0.1, started and stopped by the suite.

``make test`` starts one for the whole run and exports ``STREAMFLOW_KAFKA_BOOTSTRAP``; the
``kafka_bootstrap`` fixture uses it, or starts one itself when pytest runs alone. Fault tests that
take a broker down and up again get a private one (``private_broker``), so the others never see it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def noida_db() -> str | None:
    """The noida-db executable of this interpreter's environment, or on PATH."""
    local = Path(sys.executable).with_name("noida-db")
    return str(local) if local.exists() else shutil.which("noida-db")


class LocalBroker:
    """noida-db's Kafka service in ``data_dir`` on ``127.0.0.1:port``; data survives :meth:`down`/:meth:`up`."""

    def __init__(self, data_dir: str | Path, port: int | None = None):
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.exe = noida_db()
        if self.exe is None:
            raise RuntimeError("noida-db is not installed (pip install 'streamflow[dev]')")

    def up(self, timeout_s: float = 30.0) -> LocalBroker:
        subprocess.run([self.exe, "up", "--data-dir", str(self.data_dir), "--only", "kafka",
                        "--kafka-port", str(self.port), "--host", "127.0.0.1"],
                       check=True, capture_output=True, timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        while not self.listening():
            if time.monotonic() > deadline:
                raise RuntimeError(f"noida-db did not listen on {self.bootstrap} within {timeout_s}s")
            time.sleep(0.05)
        return self

    def down(self, timeout_s: float = 30.0) -> None:
        subprocess.run([self.exe, "down", "--data-dir", str(self.data_dir)], capture_output=True, timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        while self.listening() and time.monotonic() < deadline:
            time.sleep(0.05)

    def listening(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def pid(self) -> int:
        """The process listening on this broker's port (to stall it with SIGSTOP, say)."""
        inodes = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as lines:
                for line in list(lines)[1:]:
                    fields = line.split()
                    if int(fields[1].rsplit(":", 1)[1], 16) == self.port and fields[3] == "0A":  # 0A: LISTEN
                        inodes.add(f"socket:[{fields[9]}]")
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                        return int(proc.name)
                except OSError:
                    continue
        raise RuntimeError(f"no process of ours listens on {self.bootstrap}")


def publish_lines(bootstrap: str, topic: str, lines: list[str]) -> None:
    """Each of ``lines`` a record of ``topic`` (made with one partition), in order, acknowledged by the broker."""
    from kafka import KafkaProducer

    from connectors.tunnel.kafka import ensure_topic

    ensure_topic(bootstrap, topic, partitions=1)
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=20)
    for line in lines:
        producer.send(topic, value=line.encode())
    producer.flush()
    producer.close()
