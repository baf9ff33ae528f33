"""Issue 26, the release server and the device updater attacked as a device with a key of its own, or as another
process on the same host would: each test drives the real component (a server on 127.0.0.1, real files)."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from deploy_helpers import counter_job, device_client

from connectors.storage import CollectiveStorage
from streamflow.deploy.bundle import (
    directory_fetcher,
    install_bundle,
    load_bundle_job,
    load_installed,
    read_signed,
    verify_manifest,
)
from streamflow.deploy.device.directory import DirectoryClient
from streamflow.deploy.device.updater import Updater
from streamflow.deploy.device_auth import AUTH_HEADER, sign_request
from streamflow.deploy.errors import DigestMismatch
from streamflow.deploy.layout import FILES
from streamflow.deploy.release.admin import AdminClient, AdminError
from streamflow.deploy.release.build import build_bundle
from streamflow.deploy.release.policy import cohort_point
from streamflow.deploy.release.server import DeployServer, serve_in_thread
from streamflow.deploy.release.state import ReleaseStore
from streamflow.deploy.signing import TrustedKeys, public_key_path
from streamflow.events import Event
from streamflow.job import Job
from streamflow.runners.device import DeviceRunner


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def built(counter_repo, signing_key, tmp_path):
    counter_repo.commit({"job.py": counter_job("3")}, tag="v3")
    counter_repo.commit({"job.py": counter_job("4")}, tag="v4")
    out = tmp_path / "bundles"
    return {tag: build_bundle(counter_repo.path, tag, signing_key=signing_key, out=out)
            for tag in ("v1", "v2", "v3", "v4")}


# -- item 10: key and state files ---------------------------------------------------------------------------
def test_release_state_and_files_are_this_users_only(tmp_path, built, trusted):
    directory = tmp_path / "server"
    directory.mkdir(mode=0o755)
    (directory / "release.sqlite").touch(mode=0o644)  # what an older server left: tightened at start
    server = DeployServer(directory, trusted, tick_s=3600)
    with serve_in_thread(server) as base_url:
        AdminClient(base_url, server.admin_token).publish(built["v1"])
    server.store.close()
    stored = list((directory / "files").iterdir())
    assert stored and {_mode(p) for p in stored} == {0o600}  # the exclusive config among them
    assert _mode(directory) == _mode(directory / "files") == 0o700
    for name in ("release.sqlite", "release.sqlite-wal", "release.sqlite-shm", "admin.token"):
        if (directory / name).exists():
            assert _mode(directory / name) == 0o600, name


def test_a_planted_temporary_file_cannot_redirect_a_stored_file(tmp_path):
    store = ReleaseStore(tmp_path / "server")
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    data = b"exclusive config"
    digest = hashlib.sha256(data).hexdigest()
    # another local user guesses the temporary name (pid and thread are public) and plants a symlink there
    planted = store.files_dir / f".{digest}.{os.getpid()}.{threading.get_ident()}.tmp"
    planted.symlink_to(victim)
    store.put_file(data)
    store.close()
    assert victim.read_text() == "mine"
    assert (store.files_dir / digest).read_bytes() == data and _mode(store.files_dir / digest) == 0o600


def test_device_store_state_is_this_users_only(tmp_path, built, trusted):

    storage = CollectiveStorage(tmp_path / "device.duckdb")
    runner = DeviceRunner(Job("device"), storage)
    root = tmp_path / "store"
    updater = Updater(runner, DirectoryClient(tmp_path / "bundles"), trusted, root, swap_timeout_s=10.0)
    [outcome] = updater.apply([{"task": "counter", "version": "1", "action": "update",
                                "manifest": "", "signature": ""}])
    assert outcome.status == "installed", outcome
    updater.store.block("0" * 64, "test")
    runner.close()
    storage.close()
    assert _mode(root) == 0o700
    assert _mode(root / "tasks" / "counter" / "state.json") == 0o600
    assert _mode(root / "blocked.json") == 0o600
    assert {_mode(p) for p in (root / "cache").glob("??/*")} == {0o600}


# -- per-task publisher scope ---------------------------------------------------------------------------------
def test_a_publisher_key_signs_only_its_own_tasks(tmp_path, built, signing_key):

    scoped = TrustedKeys.from_files([f"{public_key_path(signing_key)}=sessions,windows"])
    server = DeployServer(tmp_path / "server", scoped, tick_s=3600)
    refused = "key_scope: counter@1: key [0-9a-f]{16} may sign only sessions, windows, not task counter"
    with serve_in_thread(server) as base_url, pytest.raises(AdminError, match=refused):
        AdminClient(base_url, server.admin_token).publish(built["v1"])
    assert server.store.bundles() == []
    server.store.close()
    # a device holding the same scope refuses the bundle too, whoever serves it

    storage = CollectiveStorage(tmp_path / "device.duckdb")
    runner = DeviceRunner(Job("device"), storage)
    client = DirectoryClient(tmp_path / "bundles")
    updater = Updater(runner, client, scoped, tmp_path / "store")
    [outcome] = updater.apply([{"task": "counter", "version": "1", "action": "update", "manifest": "",
                                "signature": ""}])
    assert outcome.status == "refused" and outcome.reason.startswith("key_scope: counter@1"), outcome
    assert updater.versions() == {} and not client.fetched
    runner.close()
    storage.close()


# -- items 7 and 8: verified bytes run, never the disk again ----------------------------------------------------
_DEVICE_SCRIPT = '''
import json, sys
from pathlib import Path
from connectors.storage import CollectiveStorage
from streamflow.deploy.device_auth import AUTH_HEADER, sign_request
from streamflow.deploy.device.directory import DirectoryClient
from streamflow.deploy.signing import TrustedKeys
from streamflow.deploy.device.updater import Updater
from streamflow.job import Job
from streamflow.runners.device import DeviceRunner

tmp, phase = Path(sys.argv[1]), sys.argv[2]
assert not sys.dont_write_bytecode  # as a user's Python has it
storage = CollectiveStorage(tmp / f"device-{phase}.duckdb")
runner = DeviceRunner(Job("device"), storage)
updater = Updater(runner, DirectoryClient(tmp / "bundles"), TrustedKeys.from_files([sys.argv[3]]), tmp / "store",
                  swap_timeout_s=10.0)
def directive(version, action="update"):
    return {"task": "counter", "version": version, "action": action, "manifest": "", "signature": ""}
if phase == "install":
    outcomes = updater.apply([directive("1")]) + updater.apply([directive("2")])
else:
    outcomes = updater.resume() + updater.apply([directive("1", "rollback")])
print(json.dumps([[o.version, o.status, o.reason] for o in outcomes]))
runner.close()
storage.close()
'''


def test_a_restart_resumes_the_installed_version_with_bytecode_writing_on(tmp_path, built, signing_key):


    script = tmp_path / "device.py"
    script.write_text(_DEVICE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])

    def device(phase: str) -> list[list]:
        done = subprocess.run([sys.executable, str(script), str(tmp_path), phase, str(public_key_path(signing_key))],
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    assert device("install") == [["1", "installed", None], ["2", "installed", None]]
    # after a restart: v2 resumes, and the server's rollback to the kept N-1 loads from disk
    assert device("restart") == [["2", "resumed", None], ["1", "rolled_back", None]]
    assert not list((tmp_path / "store").rglob("__pycache__"))  # nothing was written into a verified bundle


def test_a_job_file_swapped_after_its_check_never_runs(tmp_path, built, trusted):

    manifest_bytes, signature = read_signed(built["v1"])
    manifest = verify_manifest(manifest_bytes, signature, trusted)
    installed = install_bundle(manifest, directory_fetcher(built["v1"]), tmp_path / "device" / "counter" / "1",
                               signature=signature)
    checked = load_installed(installed, trusted)
    # another process wins the window between the check and the import
    marker = tmp_path / "ran"
    job = installed / FILES / "job.py"
    job.chmod(0o600)
    job.write_text(f"open({str(marker)!r}, 'w').write('unverified code ran')\n" + job.read_text())
    with pytest.raises(DigestMismatch, match="job.py"):
        load_bundle_job(installed, checked)
    assert not marker.exists()


def test_a_data_file_changed_on_disk_is_refused_at_run_time(tmp_path, counter_repo, signing_key, trusted):

    reads_config = counter_job("5").replace(
        'Map(lambda r: {{**r, "v": VERSION}})'.replace("{{", "{").replace("}}", "}"),
        'Map(lambda r: {**r, "v": __import__("json").loads(__bundle__.read("config/device.json"))["threshold"]})')
    assert "__bundle__" in reads_config
    counter_repo.commit({"job.py": reads_config}, tag="v5")
    build_bundle(counter_repo.path, "v5", signing_key=signing_key, out=tmp_path / "bundles")
    storage = CollectiveStorage(tmp_path / "device.duckdb")
    runner = DeviceRunner(Job("device"), storage)
    updater = Updater(runner, DirectoryClient(tmp_path / "bundles"), trusted, tmp_path / "store",
                      swap_timeout_s=10.0)
    [outcome] = updater.apply([{"task": "counter", "version": "5", "action": "update", "manifest": "",
                                "signature": ""}])
    assert outcome.status == "installed", outcome
    fav = [Event("u0", "fav", "item", 1_600_000_000.0 + i, {"item_id": f"i{i}"}) for i in range(6)]
    runner.run(fav[:3])
    config = updater.store.bundle_dir("counter", "5") / FILES / "config" / "device.json"
    config.chmod(0o600)
    config.write_text('{"threshold": 9}')  # another process changes the data the job reads
    runner.run(fav[3:])
    runner.close()
    assert [v for (v,) in storage.query("SELECT v FROM counter ORDER BY trigger_ts")] == [1, 1, 1]
    errors = storage.query("SELECT error FROM task_errors")
    assert len(errors) == 3 and all("tampered" in str(e) or "sha256" in str(e) for (e,) in errors), errors
    storage.close()


# -- item 6: rollback only to the kept N-1, once -------------------------------------------------------------
def _directive(version: str, action: str = "update") -> dict:
    return {"task": "counter", "version": version, "action": action, "manifest": "", "signature": ""}


def test_repeated_rollback_directives_take_a_device_back_one_step_only(tmp_path, built, trusted):
    storage = CollectiveStorage(tmp_path / "device.duckdb")
    runner = DeviceRunner(Job("device"), storage)
    client = DirectoryClient(tmp_path / "bundles")  # every old signed bundle is there to be replayed
    updater = Updater(runner, client, trusted, tmp_path / "store", swap_timeout_s=10.0)
    for version in ("3", "4"):
        assert updater.apply([_directive(version)])[0].status == "installed"
    assert updater.apply([_directive("3", "rollback")])[0].status == "rolled_back"  # the kept N-1
    for version in ("2", "1"):  # each one step along the signed `previous` chain
        [outcome] = updater.apply([_directive(version, "rollback")])
        assert outcome.status == "refused" and outcome.reason.startswith("downgrade:"), outcome
    assert updater.versions() == {"counter": "3"}
    # after a restart too: no rollback left, and never below the highest version accepted but for that one step
    runner.close()
    again = Updater(DeviceRunner(Job("device"), storage), client, trusted, tmp_path / "store", swap_timeout_s=10.0)
    assert [(o.version, o.status) for o in again.resume()] == [("3", "resumed")]
    assert again.store.state("counter").highest == "4"
    [outcome] = again.apply([_directive("2", "rollback")])
    assert outcome.status == "refused" and "not its kept N-1 (none)" in outcome.reason
    assert again.versions() == {"counter": "3"}
    storage.close()


def test_a_device_that_lost_its_version_is_not_provisioned_below_its_highest(tmp_path, built, trusted):
    storage = CollectiveStorage(tmp_path / "device.duckdb")
    runner = DeviceRunner(Job("device"), storage)
    client = DirectoryClient(tmp_path / "bundles")
    updater = Updater(runner, client, trusted, tmp_path / "store", swap_timeout_s=10.0)
    assert updater.apply([_directive("3")])[0].status == "installed"
    runner.close()
    # both installed versions damaged on disk while the device was off: it restarts with the task gone
    job = updater.store.bundle_dir("counter", "3") / FILES / "job.py"
    job.chmod(0o600)
    job.write_text("# damaged\n")
    again = Updater(DeviceRunner(Job("device"), storage), client, trusted, tmp_path / "store", swap_timeout_s=10.0)
    assert [o.status for o in again.resume()] == ["refused"]
    [outcome] = again.apply([_directive("1")])  # an old signed bundle offered as a fresh install
    assert outcome.status == "refused" and "older than 3, the highest this device has accepted" in outcome.reason
    assert again.versions() == {}
    storage.close()


# -- items 3 and 4: device identity on every device-facing request; limits at the door ---------------------------
class _Server:
    """A real release server on 127.0.0.1 with counter v1 stable and a release of v3 in progress."""

    def __init__(self, tmp_path, trusted, device_keys, built, plan: dict):
        self.server = DeployServer(tmp_path / "server", trusted, devices=device_keys, tick_s=3600)
        self.keys = device_keys
        self._serving = serve_in_thread(self.server)
        self.base_url = self._serving.__enter__()
        self.admin = AdminClient(self.base_url, self.server.admin_token)
        for tag in ("v1", "v3"):
            self.admin.publish(built[tag])
        self.admin.pin("counter", "1")
        self.release_id = self.admin.start("counter", "3", {"simulate": False, "step_interval_s": None, **plan})[
            "release_id"]

    @property
    def release(self):
        return self.server.manager.releases[self.release_id]

    def raw(self, method: str, path: str, headers: dict | None = None, body: bytes = b"") -> tuple[int, dict, bytes]:
        """A request as any local process can send it: no key."""
        conn = http.client.HTTPConnection(self.base_url.split("//")[1], timeout=30)
        try:
            conn.request(method, path, body=body or None, headers=headers or {})
            response = conn.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            conn.close()

    def close(self) -> None:
        self._serving.__exit__(None, None, None)
        self.server.store.close()


@pytest.fixture
def release_server(tmp_path, trusted, device_keys, built):
    servers = []

    def start(**plan):
        servers.append(_Server(tmp_path, trusted, device_keys, built, plan))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _report(device: str, ok: bool) -> bytes:
    return json.dumps({"device": device, "task": "counter", "version": "3", "ok": ok,
                       "reason": "" if ok else "load_failed: counter@3: boom"}).encode()


def test_reports_from_made_up_devices_neither_roll_back_nor_block(release_server, built):
    s = release_server(steps=[1.0], min_samples=5, max_failure_rate=0.1)
    for i in range(25):
        status, _, body = s.raw("POST", "/deploy/api/report", {"X-Streamflow-Device": f"fake-{i}",
                                                               "Content-Type": "application/json"},
                                _report(f"fake-{i}", False))
        assert status == 401 and b"device authentication failed" in body, (status, body)
    assert s.release.status == "active" and not s.release.failed
    assert s.server.store.blocked() == {}
    assert s.server.store.reports(s.release_id) == []


def test_only_devices_offered_the_release_are_counted(release_server, device_keys):
    s = release_server(steps=[0.5, 1.0], min_samples=10, max_failure_rate=0.3)
    release = s.release
    # 400 processes claim to run v3 or report success without a key: no sample
    for i in range(400):
        path, headers = ("/app/feed", {"X-Streamflow-Device": f"fake-{i}", "X-Streamflow-Tasks": "counter=3"})
        status, got, _ = s.raw("GET", path, headers)
        assert status == 200 and "x-streamflow-deploy-error" in got
        assert s.raw("POST", "/deploy/api/report", {**headers, "Content-Type": "application/json"},
                     _report(f"fake-{i}", True))[0] == 401
    # registered devices outside the 50 % cohort were never offered v3: their reports do not count either
    names = [f"phone-{i}" for i in range(80)]
    inside = [n for n in names if cohort_point(s.release_id, n) < 0.5][:20]
    outside = [n for n in names if cohort_point(s.release_id, n) >= 0.5][:10]
    for name in outside:
        client = device_client(s.base_url, device_keys, name)
        client.tasks = {"counter": "1"}
        assert client.request("/app/feed")[1] == []
        client.report("counter", "3", ok=True)
        client.tasks = {"counter": "3"}
        client.request("/app/feed")  # claims to run it
    assert release.total().samples == 0 and release.status == "active"
    # the devices offered it: 14 run it, 6 fail; 6 of 20 (30 %) is within the guardrail, a 7th failure is not
    offered = []
    for name in inside:
        client = device_client(s.base_url, device_keys, name)
        client.tasks = {"counter": "1"}
        assert client.request("/app/feed")[1][0]["version"] == "3"
        offered.append(client)
    for client in offered[:14]:
        client.tasks = {"counter": "3"}
        client.request("/app/feed")
    for client in offered[14:]:
        client.report("counter", "3", ok=False, reason="load_failed: counter@3: boom")
        client.report("counter", "3", ok=False, reason="again")  # one device, one sample
    assert (release.total().samples, len(release.failed), release.status) == (20, 6, "active")
    offered[0].report("counter", "3", ok=False, reason="TypeError at run time")
    assert release.status == "rolled_back" and release.failed == {c.device_id for c in offered[14:]} | {
        offered[0].device_id}
    assert len(s.server.store.reports(s.release_id)) == 7


def test_exclusive_files_need_the_devices_signature(release_server, built, device_keys):
    s = release_server(steps=[1.0])
    manifest = verify_manifest(*read_signed(built["v3"]), s.server.trusted)
    exclusive = manifest.entry("config/device.json")
    assert exclusive.scope == "exclusive"
    phone = device_client(s.base_url, device_keys, "phone-1")  # registered: the server holds its key
    headers = {"X-Streamflow-Device": "phone-1", "X-Streamflow-Tasks": "counter=3"}
    status, _, body = s.raw("GET", f"/deploy/api/files/{exclusive.sha256}", headers)
    assert status == 401 and b"carries no X-Streamflow-Auth" in body
    assert phone.fetch_file(exclusive) == (built["v3"] / FILES / exclusive.name).read_bytes()
    # a signature of another request does not carry over (path, headers and body are signed)
    signed = phone.headers()
    signed[AUTH_HEADER] = sign_request(phone.key, "GET", "/app/feed", signed, b"", time.time())
    assert s.raw("GET", f"/deploy/api/files/{exclusive.sha256}", signed)[0] == 401


def test_a_large_body_is_refused_at_the_door_but_an_admins_publish(release_server, counter_repo, signing_key,
                                                                   tmp_path, device_keys):
    s = release_server(steps=[1.0])
    device_keys.add("phone-1")  # a device the server knows: it has to read the body to check its signature
    host, port = s.base_url.split("//")[1].split(":")
    for path in ("/deploy/api/report", "/app/upload"):  # a report; an app request with the piggyback headers
        with socket.create_connection((host, int(port)), timeout=15) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {400 << 20}\r\nX-Streamflow-Device: phone-1\r\n"
                         f"X-Streamflow-Tasks: counter=1\r\n\r\n".encode())
            try:
                for _ in range(16):  # 1 MiB of the 400 MiB announced; the server answers without waiting for the rest
                    sock.sendall(b" " * (64 << 10))
            except OSError:
                pass  # the server closed the connection after answering: the answer is there to read
            answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 413"), (path, answer[:200])
    # an admin publishes a bundle far larger than the device routes' limit
    counter_repo.commit({"models/big.bin": os.urandom(600 << 10), "job.py": counter_job("5")}, tag="v5")
    big = build_bundle(counter_repo.path, "v5", signing_key=signing_key, out=tmp_path / "big")
    assert s.admin.publish(big)["version"] == "5"


def test_made_up_task_names_do_not_grow_the_devices_table(release_server, device_keys):
    s = release_server(steps=[1.0])
    phone = device_client(s.base_url, device_keys, "phone-1")
    for i in range(500):
        phone.request("/app/feed", tasks={f"made-up-{i}-{j}": "1" for j in range(4)} | {"counter": "1"})
        s.raw("GET", "/app/feed", {"X-Streamflow-Device": f"fake-{i}", "X-Streamflow-Tasks": f"other-{i}=1"})
    s.server.manager.flush()
    assert s.server.store.devices() == [("phone-1", "counter", "1")]
