"""Same job, two runners: the device runner and Flink (real PyFlink MiniCluster) emit the same rows.

Both tests run in this pytest process, so they share one JVM (PyFlink starts it once).
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import duckdb
import pytest

pytest.importorskip("pyflink", reason="needs the flink extra: pip install 'streamflow[flink]'", exc_type=ImportError)
if shutil.which("java") is None:
    pytest.skip("the Flink runner needs a Java runtime", allow_module_level=True)

from connectors.storage import CollectiveStorage  # noqa: E402
from streamflow.flink.runner import run_flink  # noqa: E402
from streamflow.job import load_job  # noqa: E402
from streamflow.runners.device import DeviceRunner  # noqa: E402
from streamflow.sources import open_source  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "jobs" / "data" / "taobao_user_behavior_10k.csv"
ACTIVITY = ROOT / "tests" / "data" / "activity.jsonl"


def run_device(job_file: Path, events: Path, db: Path):
    job = load_job(job_file)
    with CollectiveStorage(db) as storage:
        runner = DeviceRunner(job, storage)
        summary = runner.run(open_source(events))
        runner.close()
    return summary


def table(db: Path, name: str) -> list[tuple]:
    with duckdb.connect(str(db), read_only=True) as con:
        return sorted(con.sql(f"SELECT * FROM {name}").fetchall(), key=repr)


def test_ipv_job_gives_the_same_rows_on_both_runners(tmp_path):
    events = tmp_path / "sample_with_bad_lines.csv"
    lines = SAMPLE.read_text(encoding="utf-8").splitlines()
    lines[100:100] = ["999477,1,2,pv", "999477,1,2,teleport,1511848894", "999477,1,2,pv,1e9"]  # malformed
    lines.insert(5000, lines[4999].rsplit(",", 1)[0] + ",1511000000")  # goes back in time for that user
    events.write_text("\n".join(lines) + "\n", encoding="utf-8")

    device = run_device(ROOT / "jobs" / "ipv.py", events, tmp_path / "device.duckdb")
    flink = run_flink(load_job(ROOT / "jobs" / "ipv.py"), events, db=tmp_path / "flink.duckdb")

    device_rows, flink_rows = table(tmp_path / "device.duckdb", "ipv"), table(tmp_path / "flink.duckdb", "ipv")
    assert len(device_rows) == 10_000
    assert flink_rows == device_rows
    assert table(tmp_path / "flink.duckdb", "dead_letter") == table(tmp_path / "device.duckdb", "dead_letter")
    assert device.rejected_total == flink.rejected_total == 4
    assert flink.events_in == device.events_in and flink.tasks_fired == device.tasks_fired


def test_sliding_window_job_with_out_of_order_and_late_events(tmp_path):
    """Events of user u3 arrive 8 s after their time (beyond the 5 s watermark bound, within the 10 s
    allowed lateness: late firings), u4's 90 s after (too late for every window: late_events)."""
    job_file = ROOT / "jobs" / "activity_windows.py"
    run_device(job_file, ACTIVITY, tmp_path / "device.duckdb")
    run_flink(load_job(job_file), ACTIVITY, db=tmp_path / "flink.duckdb", pace_ms=150)

    device_rows = table(tmp_path / "device.duckdb", "activity")
    assert table(tmp_path / "flink.duckdb", "activity") == device_rows
    assert table(tmp_path / "flink.duckdb", "late_events") == table(tmp_path / "device.duckdb", "late_events")
    assert table(tmp_path / "flink.duckdb", "dead_letter") == table(tmp_path / "device.duckdb", "dead_letter")

    # The input really exercises lateness: u3 has windows fired twice, u4 has events no window took.
    fired = Counter((row[0], row[1]) for row in device_rows)
    assert any(n > 1 for (user, _), n in fired.items() if user == "u3")
    late = table(tmp_path / "device.duckdb", "late_events")
    assert late and all('"user_id": "u4"' in row[2] for row in late)


def test_session_count_and_process_tasks_give_the_same_rows_on_both_runners(tmp_path):
    """jobs/sessions.py: session windows (merging, late events), count windows and a user's keyed process
    function with state, TTL and event-time timers, all on the keyed-state primitive on both runners."""
    job_file = ROOT / "jobs" / "sessions.py"
    run_device(job_file, ACTIVITY, tmp_path / "device.duckdb")
    run_flink(load_job(job_file), ACTIVITY, db=tmp_path / "flink.duckdb", pace_ms=150)
    for name in ("sessions", "every_3_items", "cart_abandoned", "late_events"):
        device_rows = table(tmp_path / "device.duckdb", name)
        assert device_rows, name  # the input exercises every task
        assert table(tmp_path / "flink.duckdb", name) == device_rows, name
