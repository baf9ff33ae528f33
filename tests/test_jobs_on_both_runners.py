"""Every job in jobs/ runs on both runners with the same rows (on the shared in-process MiniCluster)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("pyflink", reason="needs the flink extra: pip install 'streamflow[flink]'", exc_type=ImportError)
if shutil.which("java") is None:
    pytest.skip("the Flink runner needs a Java runtime", allow_module_level=True)

from streamflow.job import load_job  # noqa: E402
from streamflow.testing import assert_same_on_runners  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JOBS = sorted((ROOT / "jobs").glob("*.py"))
SAMPLE = ROOT / "jobs" / "data" / "taobao_user_behavior_10k.csv"
ACTIVITY = ROOT / "tests" / "data" / "activity.jsonl"


@pytest.fixture(scope="module")
def taobao_slice(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("jobs") / "taobao_300.csv"
    path.write_text("\n".join(SAMPLE.read_text(encoding="utf-8").splitlines()[:300]) + "\n", encoding="utf-8")
    return path


def test_every_job_file_is_tested():
    assert {p.name for p in JOBS} >= {"ipv.py", "ipv_encoder.py", "activity_windows.py", "sessions.py"}


@pytest.mark.parametrize("job_file", JOBS, ids=[p.stem for p in JOBS])
def test_job_gives_the_same_rows_on_both_runners(job_file, taobao_slice):
    job = load_job(job_file)
    if job.trigger_tasks:
        rows = assert_same_on_runners(job, taobao_slice)
    else:  # stream jobs: paced, so Flink's periodic watermarks decide lateness per event as the device does
        rows = assert_same_on_runners(job, ACTIVITY, pace_ms=150)
    assert any(rows[task.sink] for task in job.tasks if task.sink in rows), rows.keys()  # it produced rows
