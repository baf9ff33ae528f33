"""The simulation stage: a new version replayed on recorded events beside the stable one; rows diffed; a version
that raises (or does not load) is refused before any device sees it."""

from __future__ import annotations

import json

import pytest

from streamflow.deploy.bundle import read_signed
from streamflow.deploy.layout import FILES
from streamflow.deploy.release.build import build_bundle
from streamflow.deploy.release.server import DeployServer
from streamflow.deploy.release.simulation import ReplaySimulator
from streamflow.deploy.release.stages import ReleasePlan

RAISING_JOB = '''
from operators import Aggregate, Count, Map
from streamflow import Job, Task

def boom(row):
    raise ValueError("v3 cannot handle " + str(row["n"]))

job = Job("counter", [Task("counter", ["fav"], [Aggregate(n=Count()), Map(boom)], input="recent")])
'''


@pytest.fixture
def server(tmp_path, trusted, counter_repo, signing_key):
    events = tmp_path / "recorded.jsonl"
    events.write_text("".join(json.dumps({"user_id": f"u{i % 3}", "event_id": "fav", "page_id": "item",
                                          "ts": 1.6e9 + i}) + "\n" for i in range(30)))
    counter_repo.commit({"job.py": RAISING_JOB}, tag="v3")
    counter_repo.commit({"job.py": "this is not python"}, tag="v4")
    server = DeployServer(tmp_path / "server", trusted,
                          simulator=ReplaySimulator(events, tmp_path / "simulation", trusted))
    for tag in ("v1", "v2", "v3", "v4"):
        bundle = build_bundle(counter_repo.path, tag, signing_key=signing_key, out=tmp_path / "out")
        server.publish(*read_signed(bundle), {p.relative_to(bundle / FILES).as_posix(): p.read_bytes()
                                              for p in (bundle / FILES).rglob("*") if p.is_file()})
    yield server
    server.store.close()


def test_a_new_version_is_replayed_beside_the_old_and_its_diff_reported(server):
    release = server.manager.start("counter", "2", ReleasePlan(step_interval_s=None))
    report = release.simulation
    assert release.status == "active" and report["ok"] is True
    assert report["tables"] == {"counter": {"old": 30, "new": 30}}
    # the counts are the same, the version column differs: every row changed, and the diff says so
    assert report["summary"] == "counter@2: no task error; 1 of 1 tables differ (30 of 30 old rows not reproduced)"
    assert report["diff"][0] == "table counter: 30 rows only on the old version, 30 only on the new version"
    assert report["diff"][1].startswith("  old only: {'user_id': 'u0'") and "'v': '1'" in report["diff"][1]
    events = [e[2] for e in server.store.events(release.release_id)]
    assert events == ["start", "simulation", "gray"]


def test_a_version_that_raises_or_does_not_load_is_refused(server):
    server.manager.set_stable("counter", "2")
    release = server.manager.start("counter", "3", ReleasePlan(step_interval_s=None))
    assert release.status == "refused" and "counter" not in server.manager.active  # quarantined after 5 errors
    assert release.reason == ("simulation: counter@3 raised: 5 task errors (first: counter: ValueError: v3 cannot "
                              "handle 1)")
    assert server.manager.decide_header("phone-1", "counter=2") is None  # nobody is told about v3
    release = server.manager.start("counter", "4", ReleasePlan(step_interval_s=None))
    assert release.status == "refused" and release.reason.startswith("simulation: simulation raised LoadFailed: ")
    # refusing is not blocking: a fixed plan can skip the simulation, an operator's explicit choice
    assert server.manager.start("counter", "3", ReleasePlan(simulate=False, step_interval_s=None)).status == "active"
