"""Issue 31: a command that needs an extra, a JVM, a broker or a Flink cluster fails in one line naming the fix.

The "missing" cases run the real command in a subprocess whose interpreter has the extra's modules blocked
(``sys.modules[name] = None``: ``import name`` raises ``ImportError``, as in a core-only install).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "jobs" / "data" / "taobao_user_behavior_10k.csv"


def run_blocked(code: str, blocked: tuple[str, ...], cwd: Path, timeout: float = 30.0,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Python ``code`` in a fresh interpreter where the ``blocked`` modules cannot be imported."""
    prelude = f"import sys\nfor _name in {blocked!r}:\n    sys.modules[_name] = None\n"
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def cli(args: list[str], cwd: Path, blocked: tuple[str, ...] = (), timeout: float = 30.0,
        env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """``streamflow ARGS`` with ``blocked`` modules: (exit code, stderr, seconds taken)."""
    started = time.monotonic()
    done = run_blocked(f"from streamflow.cli import main\nsys.exit(main({args!r}))", blocked, cwd, timeout, env)
    return done.returncode, done.stderr, time.monotonic() - started


def assert_one_line(stderr: str, *needles: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("streamflow: error: "), stderr
    for needle in needles:
        assert needle in lines[0], stderr


def test_cloud_consumer_does_not_retry_a_missing_kafka_python(tmp_path):
    code = ("from pathlib import Path\nfrom connectors.tunnel.cloud import CloudConsumer\n"
            "from connectors.tunnel.keys import KeyRegistry\n"
            f"c = CloudConsumer(Path({str(tmp_path / 'c.duckdb')!r}), KeyRegistry({str(tmp_path / 'k.json')!r}))\n"
            "c.run(idle_timeout_s=1, retry_for_s=None)\n")
    done = run_blocked(code, ("kafka",), tmp_path, timeout=60)
    assert done.returncode == 1 and "ModuleNotFoundError: import of kafka halted" in done.stderr, done.stderr
