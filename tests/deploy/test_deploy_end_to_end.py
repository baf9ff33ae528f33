"""End to end: bundles built from git, released through the real server over real HTTP to running devices.

v1 is provisioned on four device runtimes (each a DeviceRunner in its own thread, events flowing);
v2 goes through simulation, beta and gray steps to every device; a bad v3 fails on its first events,
every device rolls it back locally, the server's guardrail rolls the release back and blocks its
digest. Every device ends on v2 and every event is accounted for: a row of some version, or (for v3's
failing runs) a task error — none lost.
"""

from __future__ import annotations

import json
import queue
import threading
import time

import pytest
from deploy_helpers import counter_job

from connectors.storage import CollectiveStorage
from operators import Aggregate, Count, KeyBy, TimeWindow
from streamflow.deploy.build import build_bundle
from streamflow.deploy.directory import DirectoryClient
from streamflow.deploy.updater import Updater
from streamflow.events import Event
from streamflow.job import Job, Task
from streamflow.runners.device import DeviceRunner

server_module = pytest.importorskip("streamflow.deploy.server")  # the release server (helper `release`'s part)
from streamflow.deploy.admin import AdminClient  # noqa: E402
from streamflow.deploy.client import DeployClient  # noqa: E402
from streamflow.deploy.simulation import ReplaySimulator  # noqa: E402

DEVICES = 4
T0 = 1_600_000_000.0


class Device:
    """A device runtime: a runner fed from a queue in its own thread, an updater on its app requests."""

    def __init__(self, index: int, base_url: str, trusted, tmp_path, bundles):
        self.id = f"phone-{index}"
        self.users = [f"{self.id}-u{i}" for i in range(3)]
        self.storage = CollectiveStorage(tmp_path / f"{self.id}.duckdb", flush_rows=20)
        app = Job("app", [Task("per_user", None, [KeyBy("user_id"), TimeWindow(10**7), Aggregate(n=Count())],
                               input="stream")])
        self.runner = DeviceRunner(app, self.storage)
        self.updater = Updater(self.runner, DeployClient(base_url, self.id), trusted, tmp_path / f"{self.id}-store")
        provisioned = self.updater.apply([{"task": "counter", "version": "1"}], source=DirectoryClient(bundles))
        assert [o.status for o in provisioned] == ["installed"]
        self.events: queue.Queue[Event | None] = queue.Queue()
        self.sent = 0
        self.thread = threading.Thread(target=self.runner.run, args=(self._source(),), name=self.id)
        self.thread.start()

    def _source(self):
        while (event := self.events.get()) is not None:
            yield event

    def use_app(self, n: int = 3) -> None:
        """The user does n things, then the app calls its API (the request carries the task versions)."""
        for _ in range(n):
            self.events.put(Event(self.users[self.sent % 3], "fav", "item", T0 + self.sent, {"item_id": "i"}))
            self.sent += 1
        response, _ = self.updater.request("/app/ping")
        assert response.status == 200

    def stop(self) -> None:
        self.events.put(None)
        self.thread.join(30)
        self.runner.close()


def _until(condition, devices, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        for device in devices:
            device.use_app()
        time.sleep(0.05)


def test_release_v2_through_the_stages_and_roll_a_bad_v3_back(counter_repo, signing_key, trusted, tmp_path):
    counter_repo.commit({"job.py": counter_job("3").replace('"v": VERSION', '"v": 1 / 0')}, tag="v3")
    bundles = tmp_path / "bundles"
    for tag in ("v1", "v2", "v3"):
        build_bundle(counter_repo.path, tag, signing_key=signing_key, out=bundles)
    recorded = tmp_path / "recorded.jsonl"
    recorded.write_text("".join(json.dumps({"user_id": f"r{i % 5}", "event_id": "fav", "page_id": "item",
                                            "ts": T0 + i, "contents": {"item_id": "i"}}) + "\n" for i in range(50)))
    server = server_module.DeployServer(tmp_path / "server", trusted, tick_s=0.1,
                                        simulator=ReplaySimulator(recorded, tmp_path / "simulation", trusted))
    with server_module.serve_in_thread(server) as base_url:
        admin = AdminClient(base_url, server.admin_token)
        for tag in ("v1", "v2", "v3"):
            admin.publish(bundles / "counter" / tag[1:])
        admin.pin("counter", "1")
        devices = [Device(i, base_url, trusted, tmp_path, bundles) for i in range(DEVICES)]
        try:
            def on(version):
                return lambda: all(d.updater.versions() == {"counter": version} for d in devices)

            def release(version):
                return next(r for r in admin.status()["releases"] if r["version"] == version)

            # v2: simulation on recorded events, beta (phone-0), gray 50 % then 100 %, advanced by command
            started = admin.start("counter", "2", {"beta": ["phone-0"], "steps": [0.5, 1.0], "simulate": True,
                                                   "min_samples": 1, "max_failure_rate": 0.2,
                                                   "step_interval_s": None})
            assert started["stage"] == "beta" and started["simulation"]["ok"], started
            _until(lambda: devices[0].updater.versions() == {"counter": "2"}, devices)
            assert [d.updater.versions()["counter"] for d in devices[1:]] == ["1"] * (DEVICES - 1)
            while release("2")["status"] != "complete":
                admin.advance("counter")
                for device in devices:
                    device.use_app()
            _until(on("2"), devices)

            # v3 fails on its first events on every device: local rollbacks, reports, guardrail rollback
            admin.start("counter", "3", {"steps": [1.0], "simulate": False, "min_samples": 2,
                                         "max_failure_rate": 0.2, "step_interval_s": None})
            _until(lambda: release("3")["status"] == "rolled_back", devices)
            _until(on("2"), devices)
            status = admin.status()
            assert release("3")["reason"].startswith("guardrail:")
            assert release("3")["digest"] in {b["digest"] for b in status["blocked"]}
            assert status["tasks"]["counter"]["stable"] == "2"
            for device in devices:
                device.use_app()
        finally:
            for device in devices:
                device.stop()
    server.store.close()

    ran_v3 = 0
    for device in devices:
        rows = dict(device.storage.query("SELECT v, count(*) FROM counter GROUP BY v"))
        errors = device.storage.query("SELECT count(*) FROM task_errors WHERE task = 'counter'")[0][0]
        assert set(rows) <= {"1", "2"} and rows["2"] > 0
        assert sum(rows.values()) + errors == device.sent, (device.id, rows, errors, device.sent)
        assert errors in (0, 3)  # v3's three failing runs before its probation swapped v2 back (0: never got v3)
        ran_v3 += errors == 3
        # the app's own stream task kept its state through four swaps: one window per user, every event in it
        assert sum(n for (n,) in device.storage.query("SELECT n FROM per_user")) == device.sent
        assert device.updater.versions() == {"counter": "2"}
        device.storage.close()
    assert ran_v3 >= 2  # the guardrail needed two failure reports (min_samples) before it rolled v3 back
