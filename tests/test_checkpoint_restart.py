"""State survives a restart: a real runner process killed mid-file (SIGKILL, SIGTERM) and restarted
over the same file and DuckDB file stores exactly the rows of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from connectors.storage import CollectiveStorage
from streamflow.checkpoint import load_checkpoint
from streamflow.job import load_job
from streamflow.runners.device import DeviceRunner
from streamflow.sources import open_source
from streamflow.summary import SYSTEM_TABLES

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "jobs" / "data" / "taobao_user_behavior_10k.csv"
INTERVAL_S = 0.2

SESSIONS_JOB = '''
from operators import Aggregate, Count, CountDistinct, CountWindow, KeyBy, Max, SessionWindow
from streamflow import Job, Task

sessions = Task("sessions", None, [KeyBy("user_id"), SessionWindow(600, allowed_lateness=60),
                Aggregate(events=Count(), items=CountDistinct("item_id"), last_ts=Max("ts"))], input="stream")
per_five = Task("per_five", None, [KeyBy("user_id"), CountWindow(5, slide=2), Aggregate(events=Count())],
                input="stream")
job = Job("sessions", [sessions, per_five])
'''

# The runner as the CLI runs it, over a paced source (so that it can be killed mid-file), with buffers that
# fill many times between checkpoints (a flush outside a checkpoint would duplicate rows); it logs each
# checkpoint on stderr.
DRIVER = textwrap.dedent('''
    import logging, sys, time
    from connectors.storage import CollectiveStorage, flush_on_signals
    from streamflow.job import load_job
    from streamflow.runners.device import DeviceRunner
    from streamflow.sources import open_source

    job_file, events, db = sys.argv[1:4]
    interval, pause = float(sys.argv[4]), float(sys.argv[5])
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(message)s")

    def paced(records):
        for n, record in enumerate(records):
            if pause and n % 20 == 0:
                time.sleep(pause)
            yield record

    flush_on_signals()
    with CollectiveStorage(db, flush_rows=100) as storage:
        runner = DeviceRunner(load_job(job_file), storage, checkpoint_interval_s=interval)
        try:
            summary = runner.run(open_source(events), progress=paced)
        finally:
            runner.close()
    print("done", summary.events_in, flush=True)
''')


def _job_file(name: str, tmp_path: Path) -> Path:
    if name == "sessions":
        path = tmp_path / "sessions_job.py"
        path.write_text(SESSIONS_JOB)
        return path
    return ROOT / "jobs" / f"{name}.py"


def _tables(db: Path, job_file: Path) -> dict[str, list[tuple]]:
    job = load_job(job_file)
    with CollectiveStorage(db) as storage:
        present = set(storage.tables())
        return {table: sorted(storage.query(f'SELECT * FROM "{table}"'), key=repr)
                for table in [task.sink for task in job.tasks] + list(SYSTEM_TABLES) if table in present}


def _start(job_file: Path, db: Path, pause: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", DRIVER, str(job_file), str(SAMPLE), str(db), str(INTERVAL_S), str(pause)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _stop_after_checkpoints(proc: subprocess.Popen, n: int, sig: int) -> list[str]:
    """Send ``sig`` half a checkpoint interval after the process has logged ``n`` checkpoints (so that
    rows computed since the last checkpoint are lost with the process); its stderr lines."""
    lines: list[str] = []
    seen = 0
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("checkpoint "):
            seen += 1
            if seen == n:
                time.sleep(INTERVAL_S / 2)
                proc.send_signal(sig)
                break
    drain = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    drain.start()
    proc.wait(timeout=60)
    drain.join(timeout=10)
    return lines


def _reference(job_file: Path, db: Path) -> dict[str, list[tuple]]:
    with CollectiveStorage(db) as storage:
        runner = DeviceRunner(load_job(job_file), storage)
        runner.run(open_source(SAMPLE))
        runner.close()
    return _tables(db, job_file)


@pytest.mark.parametrize("job_name", ["ipv", "activity_windows", "sessions"])
def test_sigkill_mid_file_then_restart_stores_the_rows_of_an_uninterrupted_run(job_name, tmp_path):
    job_file = _job_file(job_name, tmp_path)
    expected = _reference(job_file, tmp_path / "reference.duckdb")
    assert any(expected.get(task.sink) for task in load_job(job_file).tasks)
    db = tmp_path / "run.duckdb"

    lines_at_kill = []
    for checkpoints in (3, 6):  # killed twice, each time some checkpoints into the (resumed) run
        proc = _start(job_file, db, pause=0.004)
        log = _stop_after_checkpoints(proc, checkpoints, signal.SIGKILL)
        assert proc.returncode == -signal.SIGKILL, "".join(log[-20:])
        with CollectiveStorage(db) as storage:
            saved = load_checkpoint(storage, load_job(job_file).name)
        assert saved is not None and not saved.complete
        lines_at_kill.append(saved.line)
    assert 0 < lines_at_kill[0] < lines_at_kill[1] < 10_000  # the second run resumed, and neither finished

    proc = _start(job_file, db, pause=0)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "resumes from its checkpoint" in err
    got = _tables(db, job_file)
    assert got.keys() == expected.keys()
    for table, rows in expected.items():
        assert len(got[table]) == len(rows), f"{table}: {len(got[table])} rows, uninterrupted {len(rows)}"
        assert got[table] == rows, table
    with CollectiveStorage(db) as storage:
        assert load_checkpoint(storage, load_job(job_file).name).complete


def test_sigterm_checkpoints_and_stops_then_the_restart_completes(tmp_path):
    job_file = _job_file("ipv", tmp_path)
    expected = _reference(job_file, tmp_path / "reference.duckdb")
    db = tmp_path / "run.duckdb"
    proc = _start(job_file, db, pause=0.004)
    log = _stop_after_checkpoints(proc, 2, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, "".join(log[-20:])
    assert any("stopped by signal" in line for line in log)
    with CollectiveStorage(db) as storage:
        saved = load_checkpoint(storage, "ipv")
        assert not saved.complete and 0 < saved.line < 10_000
    proc = _start(job_file, db, pause=0)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert _tables(db, job_file) == expected
