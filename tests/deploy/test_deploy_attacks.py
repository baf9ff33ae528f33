"""Issue 26, the release server and the device updater attacked as a device with a key of its own, or as another
process on the same host would: each test drives the real component (a server on 127.0.0.1, real files)."""

from __future__ import annotations

import hashlib
import os
import stat
import threading

import pytest
from deploy_helpers import counter_job

from streamflow.deploy.admin import AdminClient
from streamflow.deploy.build import build_bundle
from streamflow.deploy.directory import DirectoryClient
from streamflow.deploy.server import DeployServer, serve_in_thread
from streamflow.deploy.state import ReleaseStore
from streamflow.deploy.updater import Updater


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
    from connectors.storage import CollectiveStorage
    from streamflow.job import Job
    from streamflow.runners.device import DeviceRunner

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
    from streamflow.deploy.admin import AdminError
    from streamflow.deploy.signing import TrustedKeys, public_key_path

    scoped = TrustedKeys.from_files([f"{public_key_path(signing_key)}=sessions,windows"])
    server = DeployServer(tmp_path / "server", scoped, tick_s=3600)
    refused = "key_scope: counter@1: key [0-9a-f]{16} may sign only sessions, windows, not task counter"
    with serve_in_thread(server) as base_url, pytest.raises(AdminError, match=refused):
        AdminClient(base_url, server.admin_token).publish(built["v1"])
    assert server.store.bundles() == []
    server.store.close()
    # a device holding the same scope refuses the bundle too, whoever serves it
    from connectors.storage import CollectiveStorage
    from streamflow.job import Job
    from streamflow.runners.device import DeviceRunner

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
