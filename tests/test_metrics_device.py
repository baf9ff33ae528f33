"""The device runner's metrics (``streamflow run --metrics-port``): scraped over HTTP in the middle of a real run and at
its end, parsed with prometheus_client's parser; the counters equal the run's summary."""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from connectors.storage import DEAD_LETTER_TABLE, CollectiveStorage  # noqa: E402
from operators import Aggregate, Count, Last, Map  # noqa: E402
from streamflow.cli import main  # noqa: E402
from streamflow.events import PAGE_ENTER, PAGE_EXIT, Event, Rejected  # noqa: E402
from streamflow.job import Job, Task  # noqa: E402
from streamflow.metrics.device import serve_device_metrics  # noqa: E402
from streamflow.runners.device import DeviceRunner  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
T0 = 1_600_000_000.0


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def urlopen_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def by_label(got: dict, name: str) -> dict[str, float]:
    return {labels[0][1]: v for (n, labels), v in got.items() if n == name}


def _fail_on_user_3(row):
    if row["item"] % 10 == 3:  # the visits of user-3
        raise ValueError("user-3's rows fail")
    return row


def events(paused: threading.Event, resume: threading.Event):
    """200 visits of 10 users, two bad records and a timestamp going back; pauses halfway until ``resume``."""
    for i in range(200):
        user, t = f"user-{i % 10}", 10.0 * i
        if i == 100:
            paused.set()
            assert resume.wait(30)
        yield Event(user, PAGE_ENTER, "item", T0 + t, {"item_id": i})
        yield Event(user, "fav", "item", T0 + t + 1, {"item_id": i})
        yield Event(user, PAGE_EXIT, "item", T0 + t + 2, {"item_id": i})
        if i in (10, 150):
            yield Rejected("test", i, "malformed line: not an event", "garbage")
    yield Event("user-0", "fav", "item", T0, {})  # backwards for user-0: rejected by the runner's guard


def test_device_metrics_mid_run_and_at_the_end_match_the_summary(tmp_path):
    job = Job("metrics", [
        Task("visits", ["item"], [Aggregate(n=Count())], input="page"),
        Task("favs", ["fav"], [Aggregate(n=Count(), item=Last("item_id")), Map(_fail_on_user_3)], input="recent"),
    ])
    storage = CollectiveStorage(tmp_path / "device.duckdb", flush_rows=50)
    runner = DeviceRunner(job, storage, quarantine_after=100)
    server = serve_device_metrics(runner, 0)
    paused, resume = threading.Event(), threading.Event()
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("summary", runner.run(events(paused, resume))))
    try:
        thread.start()
        assert paused.wait(30)
        middle = scrape(server.url)  # over HTTP while the run waits for its next event
        assert middle[("streamflow_device_events_total", ())] == 300  # 100 visits of 3 events
        assert by_label(middle, "streamflow_device_task_firings_total") == {"visits": 100, "favs": 100}
        assert by_label(middle, "streamflow_device_rejected_records_total") == {"malformed line": 1}
        with urllib.request.urlopen(server.url + "/readyz", timeout=5) as response:
            assert response.status == 200
        resume.set()
        thread.join(30)
        summary = result["summary"]
        end = scrape(server.url)
        runner.close()
        storage.close()
        assert urlopen_status(server.url + "/readyz") == 503  # the run's storage is closed
    finally:
        resume.set()
        server.close()
        runner.close()
        storage.close()
    assert end[("streamflow_device_events_total", ())] == summary.events_in == 600
    firings = by_label(end, "streamflow_device_task_firings_total")
    assert sum(firings.values()) == summary.tasks_fired
    assert firings == {name: s.fired for name, s in summary.task_stats.items()}
    assert by_label(end, "streamflow_device_task_errors_total") == {"visits": 0, "favs": 20}
    assert by_label(end, "streamflow_device_task_quarantined") == {"visits": 0, "favs": 0}
    assert by_label(end, "streamflow_device_rejected_records_total") == dict(summary.rejected)
    assert sum(summary.rejected.values()) == 3
    assert by_label(end, "streamflow_device_rows_written_total") == summary.rows_written
    assert summary.rows_written[DEAD_LETTER_TABLE] == 3
    assert end[("streamflow_device_storage_flushes_total", ())] >= 1
    assert not any("user-" in v for (_, labels), _v in end.items() for _, v in labels)  # never a user as a label


def test_run_serves_metrics_on_the_port_it_is_given(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["run", str(ROOT / "jobs" / "activity_windows.py"), "--events", str(ROOT / "tests" / "data" /
                 "activity.jsonl"), "--db", str(tmp_path / "w.duckdb"), "--metrics-port", str(port), "--show",
                 "0"]) == 0
    assert f"metrics on http://127.0.0.1:{port}/metrics" in capsys.readouterr().err
