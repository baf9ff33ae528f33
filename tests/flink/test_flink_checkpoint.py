"""Flink checkpoints: a run killed (SIGKILL) after some checkpoints, restarted from its last one, goes on
from the restored state and source position: the rows it stores are rows of an uninterrupted run, and
fewer of them (those before the checkpoint are not computed again)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("pyflink", reason="needs the flink extra: pip install 'streamflow[flink]'", exc_type=ImportError)
if shutil.which("java") is None:
    pytest.skip("the Flink runner needs a Java runtime", allow_module_level=True)

from connectors.storage import CollectiveStorage  # noqa: E402
from streamflow.job import load_job  # noqa: E402
from streamflow.runners.device import DeviceRunner  # noqa: E402
from streamflow.sources import open_source  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "jobs" / "data" / "taobao_user_behavior_10k.csv"
COLUMNS = "user_id, trigger_ts, item_id, enter_ts, dwell_s, n_reload, n_fav, n_cart, n_buy"
DRIVER = """
import sys
from streamflow.job import load_job
from streamflow.flink.runner import run_flink
events, db, checkpoints, restore = sys.argv[1], sys.argv[2], sys.argv[3], (sys.argv[4:] or [None])[0]
run_flink(load_job("jobs/ipv.py"), events, db=db, pace_ms=10, checkpoint_dir=checkpoints,
          checkpoint_interval_ms=300, restore_from=restore)
"""


def _flink(events: Path, db: Path, checkpoints: Path, restore: Path | None = None) -> subprocess.Popen:
    argv = [sys.executable, "-c", DRIVER, str(events), str(db), str(checkpoints)] + ([str(restore)] if restore else [])
    # a session of its own: the kill takes the driver and its JVM (PyFlink's gateway, which runs the MiniCluster)
    # together; killed alone, the driver leaves the JVM a moment to complete a checkpoint and delete the one found
    return subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _completed_checkpoints(checkpoints: Path) -> list[Path]:
    done = [path for path in checkpoints.glob("*/chk-*") if (path / "_metadata").is_file()]
    return sorted(done, key=lambda path: int(path.name.split("-")[1]))


@pytest.mark.slow
def test_a_killed_flink_run_restores_from_its_checkpoint(tmp_path):
    events = tmp_path / "events.csv"
    events.write_text("\n".join(SAMPLE.read_text().splitlines()[:1500]) + "\n")
    with CollectiveStorage(tmp_path / "reference.duckdb") as storage:
        DeviceRunner(load_job(ROOT / "jobs" / "ipv.py"), storage).run(open_source(events))
        reference = Counter(storage.query(f"SELECT {COLUMNS} FROM ipv"))

    checkpoints = tmp_path / "checkpoints"
    first = _flink(events, tmp_path / "first.duckdb", checkpoints)
    deadline = time.monotonic() + 240
    # Flink keeps only the latest completed checkpoint: wait for the third one (numbered chk-3 or later)
    while first.poll() is None and time.monotonic() < deadline:
        done = _completed_checkpoints(checkpoints)
        if done and int(done[-1].name.split("-")[1]) >= 3:
            break
        time.sleep(0.2)
    assert first.poll() is None, f"the paced run ended before 3 checkpoints: {first.stderr.read()[-2000:]}"
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    last = _completed_checkpoints(checkpoints)[-1]

    second = _flink(events, tmp_path / "second.duckdb", checkpoints, restore=last)
    _, err = second.communicate(timeout=300)
    assert second.returncode == 0, err[-3000:]
    with CollectiveStorage(tmp_path / "second.duckdb") as storage:
        restored = Counter(storage.query(f"SELECT {COLUMNS} FROM ipv"))
    assert not restored - reference  # every row is one an uninterrupted run stores (state restored right)
    assert 0 < sum(restored.values()) < sum(reference.values())  # and it went on from the checkpoint
