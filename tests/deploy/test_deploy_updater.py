"""The device side: directives in, bundles verified and installed, tasks hot-swapped in a running DeviceRunner.

Bundles come from a bundles directory (DirectoryClient: the same bytes the release server serves);
every refusal leaves the old version running, which the rows written after it prove.
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
from deploy_helpers import counter_job, resign

from connectors.storage import CollectiveStorage
from operators import Aggregate, Count, KeyBy, TimeWindow
from streamflow.deploy.device.directory import DirectoryClient
from streamflow.deploy.device.updater import Updater
from streamflow.deploy.layout import FILES, MANIFEST, SIGNATURE
from streamflow.deploy.manifest import Limits
from streamflow.deploy.release.build import build_bundle
from streamflow.deploy.signing import generate_key
from streamflow.events import Event
from streamflow.job import Job, Task
from streamflow.runners.device import DeviceRunner

T0 = 1_600_000_000.0
USERS = ("u0", "u1", "u2", "u3")


def directive(version: str, action: str = "update", task: str = "counter") -> dict:
    base = f"/deploy/bundles/{task}/{version}"
    return {"task": task, "version": version, "manifest": f"{base}/manifest.json",
            "signature": f"{base}/manifest.sig", "action": action}


def events(start: int, stop: int) -> list[Event]:
    """Event i: user USERS[i % 4] favs at T0 + i seconds."""
    return [Event(USERS[i % len(USERS)], "fav", "item", T0 + i, {"item_id": f"i{i}"}) for i in range(start, stop)]


def app_job() -> Job:
    """The app's own job, never deployed: a stream task whose windows must survive every swap."""
    return Job("device", [Task("per_user", None, [KeyBy("user_id"), TimeWindow(10**6), Aggregate(n=Count())],
                               input="stream")])


@pytest.fixture
def bundles(counter_repo, signing_key, tmp_path):
    out = tmp_path / "bundles"
    for tag in ("v1", "v2"):
        build_bundle(counter_repo.path, tag, signing_key=signing_key, out=out)
    return out


@pytest.fixture
def device(tmp_path, trusted, bundles):
    storage = CollectiveStorage(tmp_path / "device.duckdb", flush_rows=50)
    runner = DeviceRunner(app_job(), storage)
    client = DirectoryClient(bundles)
    updater = Updater(runner, client, trusted, tmp_path / "store", swap_timeout_s=10.0)
    yield runner, updater, client, storage
    storage.close()


def counter_rows(storage) -> list[tuple]:
    return storage.query("SELECT user_id, trigger_ts, n, v FROM counter ORDER BY trigger_ts")


def test_hot_swap_in_a_running_runner_loses_no_event_and_keeps_other_state(device):
    runner, updater, client, storage = device
    [installed] = updater.apply([directive("1")])
    assert (installed.status, updater.versions(), updater.tasks_header()) == ("installed", {"counter": "1"},
                                                                            "counter=1")
    total, swap_after = 1200, 400
    paced = threading.Event()

    def source():
        for i, event in enumerate(events(0, total)):
            if i >= swap_after:
                paced.set()
                time.sleep(0.0005)  # a live stream: the swap lands somewhere in the middle of it
            yield event

    run = threading.Thread(target=runner.run, args=(source(),))
    run.start()
    assert paced.wait(30)
    [swapped] = updater.apply([directive("2")])  # from another thread while events flow
    run.join(60)
    runner.close()
    assert swapped.status == "installed" and updater.versions() == {"counter": "2"}
    assert updater.check() == [] and runner.safe_point.hooks == ()  # v2 passed its probation: nothing watches it now

    rows = counter_rows(storage)
    assert len(rows) == total  # every fav fired exactly once: by v1 or by v2, none lost, none twice
    versions = [v for *_, v in rows]
    first_v2 = versions.index("2")
    assert swap_after <= first_v2 < total and set(versions[:first_v2]) == {"1"} and set(versions[first_v2:]) == {"2"}
    # the users' sequences were kept: v2's first firing counts the events of before the swap
    seen: dict[str, int] = {}
    for user, _, n, _ in rows:
        seen[user] = seen.get(user, 0) + 1
        assert n == seen[user]
    # the app's stream task never noticed: one window per user holding all of its events
    assert storage.query("SELECT user_id, n FROM per_user ORDER BY user_id") == [(u, total // 4) for u in USERS]
    assert client.tasks == {"counter": "2"}  # the client's next request carries the new version
    assert client.reports == [{"task": "counter", "version": "1", "ok": True, "reason": ""},
                              {"task": "counter", "version": "2", "ok": True, "reason": ""}]


def test_shared_files_are_fetched_once_and_n_minus_1_is_kept(device, bundles, trusted):
    runner, updater, client, storage = device
    updater.apply([directive("1")])
    updater.apply([directive("2")])
    weights = json.loads((bundles / "counter" / "1" / MANIFEST).read_bytes())["files"]
    sha = {f["name"]: f["sha256"] for f in weights}
    assert client.fetched[sha["models/weights.bin"]] == 1  # v2 took it from the device's cache
    assert client.fetched[sha["config/device.json"]] == 1
    store = updater.store
    assert store.state("counter").current == "2" and store.state("counter").previous == "1"
    assert store.installed("counter") == ["1", "2"]
    # the model is on the disk once: both installs are hard links to the cache's copy
    inodes = {(store.bundle_dir("counter", v) / FILES / "models/weights.bin").stat().st_ino for v in ("1", "2")}
    assert inodes == {store.cache.path(sha["models/weights.bin"]).stat().st_ino}
    runner.run(events(0, 4))
    runner.close()
    assert {v for *_, v in counter_rows(storage)} == {"2"}


def test_a_server_rollback_uses_the_kept_version_from_disk(device, bundles):
    runner, updater, client, storage = device
    updater.apply([directive("1")])
    updater.apply([directive("2")])
    shutil.rmtree(bundles / "counter" / "1")  # not downloadable any more: the kept N-1 is enough
    [outcome] = updater.apply([directive("1", "rollback")])
    assert outcome.status == "rolled_back" and updater.versions() == {"counter": "1"}
    runner.run(events(0, 8))
    runner.close()
    assert {v for *_, v in counter_rows(storage)} == {"1"}


def test_a_restarted_device_resumes_its_versions_without_fetching(device, tmp_path, trusted, bundles):
    runner, updater, client, storage = device
    updater.apply([directive("1")])
    updater.apply([directive("2")])
    runner.close()
    again = DeviceRunner(app_job(), storage)
    fresh = DirectoryClient(bundles)
    resumed = Updater(again, fresh, trusted, tmp_path / "store")
    assert [(o.task, o.version, o.status) for o in resumed.resume()] == [("counter", "2", "resumed")]
    assert not fresh.fetched and resumed.versions() == {"counter": "2"}
    # a file changed on disk while the device was off: the current version is refused, N-1 runs
    job = resumed.store.bundle_dir("counter", "2") / FILES / "job.py"
    job.chmod(0o644)
    job.write_text(job.read_text() + "\nimport os  # injected\n")
    third = Updater(DeviceRunner(app_job(), storage), fresh, trusted, tmp_path / "store")
    outcomes = third.resume()
    assert [(o.version, o.status) for o in outcomes] == [("2", "refused"), ("1", "resumed")]
    assert outcomes[0].reason == "tampered: counter@2: file 'job.py' is 267 bytes, the manifest says 266"
    assert third.versions() == {"counter": "1"}


# -- bad input: refused with a reason, reported, and the old version still running --------------------------
def _tamper_file(bundles, signing_key, tmp_path):
    job = bundles / "counter" / "2" / FILES / "job.py"
    job.write_text(job.read_text().replace("Count()", "Count(#"))


def _wrong_signature(bundles, signing_key, tmp_path):
    sig = bundles / "counter" / "2" / SIGNATURE
    data = bytearray(sig.read_bytes())
    data[0] ^= 0xFF
    sig.write_bytes(bytes(data))


def _unknown_key(bundles, signing_key, tmp_path):
    other = tmp_path / "rogue.key"
    generate_key(other)
    value = json.loads((bundles / "counter" / "2" / MANIFEST).read_bytes())
    from streamflow.deploy.signing import key_id, load_signing_key
    value["key_id"] = key_id(load_signing_key(other).public_key())
    manifest, sig = resign(value, other)
    (bundles / "counter" / "2" / MANIFEST).write_bytes(manifest)
    (bundles / "counter" / "2" / SIGNATURE).write_bytes(sig)


def _escaping_name(bundles, signing_key, tmp_path):
    value = json.loads((bundles / "counter" / "2" / MANIFEST).read_bytes())
    value["files"][0]["name"] = "../../../../escaped.py"
    value["files"].sort(key=lambda f: f["name"])
    manifest, sig = resign(value, signing_key)  # even signed by the trusted key
    (bundles / "counter" / "2" / MANIFEST).write_bytes(manifest)
    (bundles / "counter" / "2" / SIGNATURE).write_bytes(sig)


def _not_json(bundles, signing_key, tmp_path):
    (bundles / "counter" / "2" / MANIFEST).write_bytes(b'{"task": "counter", "version": "2", ')


def _oversized(bundles, signing_key, tmp_path):
    value = json.loads((bundles / "counter" / "2" / MANIFEST).read_bytes())
    value["files"][0]["size"] = 10**12  # a terabyte promised: refused before a byte is fetched
    manifest, sig = resign(value, signing_key)
    (bundles / "counter" / "2" / MANIFEST).write_bytes(manifest)
    (bundles / "counter" / "2" / SIGNATURE).write_bytes(sig)


def _mismatched(bundles, signing_key, tmp_path):
    shutil.rmtree(bundles / "counter" / "2")
    shutil.copytree(bundles / "counter" / "1", bundles / "counter" / "2")  # v1's bundle served as v2


@pytest.mark.parametrize("attack, reason", [
    (_tamper_file, "tampered: counter@2: sha256 of 'job.py' is"),
    (_wrong_signature, "bad_signature: counter@2: signature does not verify"),
    (_unknown_key, "unknown_key: counter@2: signed by key"),
    (_escaping_name, "unsafe_path: counter@2: file name '../../../../escaped.py' has a '..' component"),
    (_not_json, "bad_manifest: manifest is not valid JSON"),
    (_oversized, "too_large: counter@2: 1000000"),
    (_mismatched, "bad_directive: counter@1: the directive names counter@2 but its manifest is counter@1"),
])
def test_a_bad_bundle_is_refused_reported_and_the_old_version_keeps_running(device, bundles, signing_key, tmp_path,
                                                                            attack, reason):
    runner, updater, client, storage = device
    updater.apply([directive("1")])
    runner.run(events(0, 8))
    attack(bundles, signing_key, tmp_path)
    [outcome] = updater.apply([directive("2")])
    assert outcome.status == "refused" and outcome.reason.startswith(reason), outcome.reason
    assert client.reports[-1] == {"task": "counter", "version": "2", "ok": False, "reason": outcome.reason}
    assert updater.versions() == {"counter": "1"} and updater.store.state("counter").current == "1"
    assert updater.store.installed("counter") == ["1"]  # nothing of v2 was installed
    assert not (tmp_path / "escaped.py").exists()
    runner.run(events(8, 16))
    runner.close()
    rows = counter_rows(storage)
    assert len(rows) == 16 and {v for *_, v in rows} == {"1"}


def test_a_downgrade_that_is_not_a_rollback_is_refused(device):
    runner, updater, client, storage = device
    updater.apply([directive("2")])  # a device may skip versions
    [outcome] = updater.apply([directive("1")])
    assert outcome.status == "refused"
    assert outcome.reason == ("downgrade: counter@1: version 1 is older than the running 2 and the server did not "
                              "mark it a rollback")
    assert updater.versions() == {"counter": "2"}
    [rolled] = updater.apply([directive("1", "rollback")])  # 1 is v2's signed `previous`, but never ran here
    assert rolled.status == "refused" and "not its kept N-1 (none)" in rolled.reason
    assert updater.versions() == {"counter": "2"}


def test_a_limit_below_the_bundle_refuses_it(tmp_path, trusted, bundles):
    storage = CollectiveStorage(tmp_path / "d.duckdb")
    runner = DeviceRunner(app_job(), storage)
    client = DirectoryClient(bundles)
    updater = Updater(runner, client, trusted, tmp_path / "store", limits=Limits(max_files=3))
    [outcome] = updater.apply([directive("1")])
    assert outcome.reason == "too_large: counter@1: 4 files, more than the limit of 3"
    assert not client.fetched and updater.versions() == {}
    runner.close()
    storage.close()


@pytest.mark.parametrize("bad", [
    "not a dict", {"task": "../etc", "version": "1"}, {"task": "counter", "version": "1; rm"},
    {"task": "counter", "version": "2", "action": "reinstall"},
])
def test_a_malformed_directive_is_refused(device, bad):
    runner, updater, client, storage = device
    [outcome] = updater.apply([bad])
    assert outcome.status == "refused" and outcome.reason.startswith("bad_directive: ")
    assert updater.versions() == {}


# -- local rollback ----------------------------------------------------------------------------------------
def _add_version(counter_repo, bundles, signing_key, tag, job_text):
    counter_repo.commit({"job.py": job_text}, tag=tag)
    build_bundle(counter_repo.path, tag, signing_key=signing_key, out=bundles)


def test_a_version_that_does_not_import_is_refused_and_never_replaces_the_old(device, counter_repo, bundles,
                                                                              signing_key):
    runner, updater, client, storage = device
    updater.apply([directive("2")])
    _add_version(counter_repo, bundles, signing_key, "v3", counter_job("3") + "\nraise RuntimeError('boom')\n")
    [outcome] = updater.apply([directive("3")])
    assert outcome.status == "refused"
    assert outcome.reason.startswith("load_failed: counter@3: cannot load job file ") and "RuntimeError" in \
        outcome.reason and "boom" in outcome.reason
    assert updater.versions() == {"counter": "2"}
    again = updater.apply([directive("3")])[0]  # blocked on this device: not installed again, reported once
    assert again.reason.startswith("locally_blocked: counter@3") and updater.apply([directive("3")])[0].status == \
        "refused"
    assert [r["reason"].split(":")[0] for r in client.reports if not r["ok"]] == ["load_failed", "locally_blocked"]
    runner.run(events(0, 8))
    runner.close()
    assert {v for *_, v in counter_rows(storage)} == {"2"}


def test_a_version_failing_on_its_first_events_is_rolled_back_locally(device, counter_repo, bundles, signing_key):
    runner, updater, client, storage = device
    updater.apply([directive("2")])
    broken = counter_job("3").replace('Map(lambda r: {**r, "v": VERSION})', 'Map(lambda r: {**r, "v": 1 / 0})')
    _add_version(counter_repo, bundles, signing_key, "v3", broken)
    [installed] = updater.apply([directive("3")])
    assert installed.status == "installed" and updater.versions() == {"counter": "3"}
    runner.run(events(0, 2))
    assert updater.check() == []  # two failures: still on probation (3 runs)
    runner.run(events(2, 6))
    # judged at the runner's safe point after the third failure: the fourth event already ran on v2
    [rolled] = updater.check()
    assert rolled.status == "local_rollback" and rolled.version == "3"
    assert rolled.reason == "failed_on_first_events: counter@3: task counter raised on each of its first 3 runs"
    assert updater.versions() == {"counter": "2"} and client.tasks == {"counter": "2"}
    assert client.reports[-1] == {"task": "counter", "version": "3", "ok": False, "reason": rolled.reason}
    state = updater.store.state("counter")
    assert (state.current, state.previous) == ("2", None) and updater.store.installed("counter") == ["2"]
    assert updater.apply([directive("3")])[0].reason.startswith("locally_blocked")
    runner.run(events(6, 12))
    runner.close()
    # no event lost: the three v3 failures are in task_errors with their events, every other event ran on v2
    rows = counter_rows(storage)
    errors = storage.query("SELECT trigger_ts FROM task_errors WHERE task = 'counter' ORDER BY trigger_ts")
    assert [v for *_, v in rows] == ["2"] * 9 and [ts for ts, in errors] == [T0, T0 + 1, T0 + 2]
    assert sorted([ts for _, ts, _, _ in rows] + [ts for ts, in errors]) == [T0 + i for i in range(12)]
    assert not runner.summary.task_stats["counter"].quarantined


def test_a_version_failing_in_a_running_runner_is_rolled_back_before_the_next_event(device, counter_repo, bundles,
                                                                                     signing_key):
    """The rollback does not wait for an app request: the runner's safe point does it, mid-run."""
    runner, updater, client, storage = device
    updater.apply([directive("2")])
    broken = counter_job("3").replace('Map(lambda r: {**r, "v": VERSION})', 'Map(lambda r: {**r, "v": 1 / 0})')
    _add_version(counter_repo, bundles, signing_key, "v3", broken)
    updater.apply([directive("3")])
    runner.run(events(0, 200))  # no request in between: the quarantine (5 failures) never comes
    [rolled] = updater.check()
    runner.close()
    assert rolled.status == "local_rollback"
    assert storage.query("SELECT count(*) FROM task_errors") == [(3,)]
    assert storage.query("SELECT count(*), min(v), max(v) FROM counter") == [(197, "2", "2")]


def test_a_first_install_that_fails_is_removed(device, counter_repo, bundles, signing_key):
    runner, updater, client, storage = device
    broken = counter_job("3").replace('Map(lambda r: {**r, "v": VERSION})', 'Map(lambda r: {**r, "v": 1 / 0})')
    _add_version(counter_repo, bundles, signing_key, "v3", broken)
    updater.apply([directive("3")])
    runner.run(events(0, 4))
    [rolled] = updater.check()
    assert rolled.status == "local_rollback" and updater.versions() == {} and "counter" not in runner.tasks
    runner.close()


def test_a_job_whose_task_names_clash_is_refused(device, make_repo, signing_key, bundles):
    runner, updater, client, storage = device
    repo = make_repo("intruder")
    repo.commit({"job.py": counter_job("1", task="per_user")}, tag="v1")  # the app's own task name
    build_bundle(repo.path, "v1", signing_key=signing_key, out=bundles, task="intruder")
    [outcome] = updater.apply([directive("1", task="intruder")])
    assert outcome.reason == "load_failed: intruder@1: task names already in use: per_user (run by the app)"
    assert list(runner.tasks) == ["per_user"]
