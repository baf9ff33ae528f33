"""Bounded user state on the device runner: a TTL on the stream clock and a cap on users held."""

from __future__ import annotations

from pathlib import Path

import pytest

from connectors.storage import CollectiveStorage
from streamflow.events import Event, TimestampGuard
from streamflow.job import load_job
from streamflow.runners.device import DeviceRunner
from streamflow.sources import TaobaoBehaviorSource

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "jobs" / "data" / "taobao_user_behavior_10k.csv"


def _time_ordered_lines() -> list[str]:
    lines = [line for line in SAMPLE.read_text(encoding="utf-8").splitlines() if line.strip()]
    return sorted(lines, key=lambda line: int(line.rsplit(",", 1)[1]))


def _ipv_rows(tmp_path: Path, name: str, state_ttl_s: float | None, max_users: int | None = None):
    source = TaobaoBehaviorSource.from_lines(_time_ordered_lines(), state_ttl_s=state_ttl_s)
    with CollectiveStorage(tmp_path / f"{name}.duckdb") as storage:
        runner = DeviceRunner(load_job(ROOT / "jobs" / "ipv.py"), storage, state_ttl_s=state_ttl_s,
                              max_users=max_users)
        summary = runner.run(source)
        runner.close()
        rows = sorted(storage.query("SELECT * FROM ipv"), key=repr)
    return rows, summary, runner


def test_a_ttl_of_the_inactivity_gap_keeps_the_ipv_rows_exact_and_reclaims_idle_users(tmp_path):
    plain, _, _ = _ipv_rows(tmp_path, "plain", None)
    bounded, summary, runner = _ipv_rows(tmp_path, "ttl", 1800)
    assert len(plain) > 9000 and bounded == plain
    assert runner.guard.users_held < 100  # idle users' last timestamps were dropped on the way (114 users)
    assert runner.triggers.keys_held < 10  # a page's state lives from its enter to its exit
    assert summary.evicted_users == 0


def test_a_ttl_below_the_page_gap_is_refused():
    with pytest.raises(ValueError, match="inactivity gap"):
        TaobaoBehaviorSource.from_lines([], state_ttl_s=60)


def test_the_cap_on_users_evicts_and_counts(tmp_path):
    _, summary, runner = _ipv_rows(tmp_path, "capped", None, max_users=10)
    assert summary.evicted_users > 0 and runner.triggers.keys_held <= 10
    assert "evicted users" in str(summary)


def test_the_guard_forgets_idle_users_on_the_stream_clock():
    guard = TimestampGuard(state_ttl_s=10)
    assert guard.check("a", 1_600_000_000.0) is None
    assert guard.check("a", 1_599_999_999.0).startswith("timestamp goes backwards")
    assert guard.check("b", 1_600_000_020.0) is None  # a's last timestamp is now 20 s old: forgotten
    assert guard.users_held == 1
    assert guard.check("a", 1_599_999_999.0) is None
    assert TimestampGuard().check("x", 1_600_000_000.0) is None


def test_bounded_runner_over_events_fed_directly(tmp_path):
    with CollectiveStorage(tmp_path / "d.duckdb") as storage:
        runner = DeviceRunner(load_job(ROOT / "jobs" / "ipv.py"), storage, max_users=1)
        for user in ("a", "b", "a"):
            runner.process(Event(user, "page_enter", "item", 1.6e9, {"item_id": "1", "category_id": "2"}))
        assert runner.triggers.evicted == 2
