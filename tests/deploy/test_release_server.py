"""The release server over real HTTP: publish (verified), the piggyback protocol, files, reports, staged release,
guardrail rollback and blocked digests; every bad input refused with its reason."""

from __future__ import annotations

import base64
import hashlib
import json
import urllib.error
import urllib.request

import pytest
from deploy_helpers import counter_job, device_client

from streamflow.deploy.bundle import read_signed, verify_manifest
from streamflow.deploy.device.client import DeployClientError
from streamflow.deploy.layout import FILES, MANIFEST
from streamflow.deploy.release.admin import AdminClient, AdminError
from streamflow.deploy.release.build import build_bundle
from streamflow.deploy.release.policy import cohort_point
from streamflow.deploy.release.server import DeployServer, serve_in_thread
from streamflow.deploy.signing import generate_key


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def built(counter_repo, signing_key, tmp_path):
    counter_repo.commit({"job.py": counter_job("3")}, tag="v3")
    out = tmp_path / "out"
    return {tag: build_bundle(counter_repo.path, tag, signing_key=signing_key, out=out) for tag in ("v1", "v2", "v3")}


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def server(tmp_path, trusted, clock, device_keys):
    server = DeployServer(tmp_path / "server", trusted, devices=device_keys, clock=clock, tick_s=3600)
    yield server
    server.store.close()


@pytest.fixture
def running(server):
    with serve_in_thread(server) as base_url:
        yield base_url, AdminClient(base_url, server.admin_token)


def _get(url, headers=None):
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_publish_then_devices_get_directives_manifests_and_files(running, built, server, trusted, device_keys):
    base_url, admin = running
    for tag in ("v1", "v2"):
        assert admin.publish(built[tag])["version"] == tag[1:]
    assert admin.publish(built["v2"])["version"] == "2"  # the same bundle again: accepted once, no change
    admin.start("counter", "2", {"steps": [1.0], "simulate": False, "step_interval_s": None})
    client = device_client(base_url, device_keys, "phone-1")
    client.tasks = {"counter": "1"}
    response, directives = client.request("/app/feed")
    assert response.status == 200 and response.json() == {"ok": True, "path": "feed"}
    assert directives == [{"task": "counter", "version": "2", "manifest": "/deploy/bundles/counter/2/manifest.json",
                           "signature": "/deploy/bundles/counter/2/manifest.sig", "action": "update"}]
    manifest_bytes, signature = client.fetch_manifest(directives[0])
    assert (manifest_bytes, signature) == read_signed(built["v2"])
    manifest = verify_manifest(manifest_bytes, signature, trusted)
    for entry in manifest.files:
        assert client.fetch_file(entry) == (built["v2"] / FILES / entry.name).read_bytes()
    # a device already on the version hears nothing
    assert client.request("/app/feed", tasks={"counter": "2"})[1] == []
    # shared files are cacheable forever at the static path; exclusive ones are not served there
    shared = manifest.entry("models/weights.bin")
    status, headers, body = _get(f"{base_url}/deploy/static/{shared.sha256}")
    assert status == 200 and headers["Cache-Control"] == "public, max-age=31536000, immutable"
    assert hashlib.sha256(body).hexdigest() == shared.sha256
    exclusive = manifest.entry("config/device.json")
    assert exclusive.scope == "exclusive"
    assert _get(f"{base_url}/deploy/static/{exclusive.sha256}")[0] == 404
    status, _, body = _get(f"{base_url}/deploy/api/files/{exclusive.sha256}")
    assert status == 401 and b"device id" in body
    status, _, body = _get(f"{base_url}/deploy/api/files/{exclusive.sha256}", {"X-Streamflow-Device": "phone-1"})
    assert status == 401 and b"carries no X-Streamflow-Auth" in body  # the header alone proves nothing
    admin.rollback("counter", "done here")  # v2 withdrawn: every device is to run v1, which lists the same file
    other = device_client(base_url, device_keys, "other")
    assert other.fetch_file(exclusive) == (built["v1"] / FILES / exclusive.name).read_bytes()
    response = client._send("GET", f"/deploy/api/files/{exclusive.sha256}", None, client.headers())
    assert response.status == 200 and response.headers["cache-control"] == "private, no-store"
    assert _get(f"{base_url}/deploy/static/{'0' * 64}")[0] == 404
    assert _get(f"{base_url}/deploy/static/..%2F..%2Frelease.sqlite")[0] == 404
    assert _get(f"{base_url}/deploy/bundles/counter/9/manifest.json")[0] == 404


def test_publish_refuses_what_does_not_verify(running, built, tmp_path, server, counter_repo):
    base_url, admin = running
    bundle = built["v1"]
    manifest, signature = read_signed(bundle)
    files = {"job.py": (bundle / FILES / "job.py").read_bytes()}

    def upload(manifest=manifest, signature=signature, files=files, token=server.admin_token):
        body = {"manifest": base64.b64encode(manifest).decode(), "signature": base64.b64encode(signature).decode(),
                "files": {name: base64.b64encode(data).decode() for name, data in files.items()}}
        return AdminClient(base_url, token)._call("POST", "/deploy/api/bundles", body)

    with pytest.raises(AdminError, match="401"):
        upload(token="wrong")
    with pytest.raises(AdminError, match="files do not match the manifest .missing: .'README.md'"):
        upload()
    every = {p.relative_to(bundle / FILES).as_posix(): p.read_bytes() for p in (bundle / FILES).rglob("*")
             if p.is_file()}
    tampered = {**every, "job.py": every["job.py"] + b"\nimport os"}
    with pytest.raises(AdminError, match="tampered: counter@1: job.py has sha256"):
        upload(files=tampered)
    with pytest.raises(AdminError, match="signature does not verify"):
        upload(signature=bytes(64), files=every)
    other = tmp_path / "other.key"
    generate_key(other)
    stranger = build_bundle(counter_repo.path, "v1", signing_key=other, out=tmp_path / "out-other")
    with pytest.raises(AdminError, match="unknown_key"):
        admin.publish(stranger)
    with pytest.raises(AdminError, match="400 .*not valid base64"):
        AdminClient(base_url, server.admin_token)._call("POST", "/deploy/api/bundles", {
            "manifest": "!!", "signature": "", "files": {}})
    assert server.store.bundles() == []  # nothing refused was stored
    assert list((server.dir / "files").iterdir()) == []
    admin.publish(bundle)
    assert [b.version for b in server.store.bundles()] == ["1"]


def test_staged_release_advances_on_schedule_and_cohorts_are_sticky(running, built, server, clock):
    base_url, admin = running
    for tag in ("v1", "v2"):
        admin.publish(built[tag])
    with pytest.raises(AdminError, match="409 task counter has no stable version to roll back to"):
        admin.start("counter", "1")
    plan = {"steps": [0.1, 0.5, 1.0], "beta": ["beta-1"], "step_interval_s": 60, "min_samples": 1,
            "max_failure_rate": 0.5, "simulate": False}
    release = admin.start("counter", "2", plan)
    assert (release["stage"], release["fraction"]) == ("beta", 0.0)
    with pytest.raises(AdminError, match="already has a release in progress"):
        admin.start("counter", "2", plan)
    clients = {name: device_client(base_url, server.devices, name)
               for name in ["beta-1"] + [f"phone-{i}" for i in range(60)]}

    def round_trip() -> set[str]:
        told = set()
        for name, client in clients.items():
            if client.request("/app/x", tasks={"counter": client.tasks.get("counter", "1")})[1]:
                told.add(name)
                client.tasks = {"counter": "2"}  # it installed the update
        return told

    assert round_trip() == {"beta-1"}
    clients["beta-1"].request("/app/x")  # seen running v2: the beta cohort's one sample
    server.manager.tick()
    assert server.manager.active["counter"].stage == "beta"  # not yet due
    clock.now += 61
    server.manager.tick()
    assert server.manager.active["counter"].stage == "gray"
    release_id = server.manager.active["counter"].release_id
    first = round_trip()
    assert first == {n for n in clients if n != "beta-1" and cohort_point(release_id, n) < 0.1}
    round_trip()  # they are seen on v2 now: samples of the 0-10% cohort
    clock.now += 61
    server.manager.tick()
    assert server.manager.active["counter"].fraction == 0.5
    second = round_trip()
    assert not second & first  # sticky: nobody told twice, nobody dropped
    assert second == {n for n in clients if n != "beta-1" and 0.1 <= cohort_point(release_id, n) < 0.5}
    round_trip()
    admin.advance("counter")
    admin.advance("counter")
    status = admin.status()
    assert status["tasks"]["counter"]["stable"] == "2" and status["tasks"]["counter"]["active"] is None
    round_trip()
    assert all(c.tasks == {"counter": "2"} for c in clients.values())
    with pytest.raises(AdminError, match="409 counter@1 is not newer than the stable counter@2"):
        admin.start("counter", "1")
    events = [e[2] for e in server.store.events(release_id)]
    assert events == ["start", "beta", "gray", "gray", "gray", "complete"]
    # a completed release rolled back by command: the stable version goes back, every device is told
    assert admin.rollback("counter", "regression found later")["status"] == "rolled_back"
    assert admin.status()["tasks"]["counter"]["stable"] == "1"
    assert all(c.request("/app/x")[1][0]["action"] == "rollback" for c in clients.values())
    assert server.store.blocked() == {}  # not blocked unless asked (--block)


def test_failures_over_the_guardrail_roll_back_and_block_the_digest(running, built, server):
    base_url, admin = running
    for tag in ("v1", "v2", "v3"):
        admin.publish(built[tag])
    admin.pin("counter", "2")
    admin.start("counter", "3", {"steps": [1.0], "min_samples": 3, "max_failure_rate": 0.4, "simulate": False})
    devices = [device_client(base_url, server.devices, f"phone-{i}") for i in range(6)]
    for device in devices:
        device.tasks = {"counter": "2"}
        assert device.request("/app/x")[1][0]["version"] == "3"
    devices[0].tasks = {"counter": "3"}
    devices[0].request("/app/x")  # seen running v3: a success
    devices[1].report("counter", "3", ok=True)
    devices[2].report("counter", "3", ok=False, reason="load_failed: counter@3: ImportError: no module named x")
    assert server.manager.active["counter"].stage == "gray"  # 1 failure of 3 devices: 33%, within 40%
    devices[3].report("counter", "3", ok=False, reason="TypeError at run time")
    assert "counter" not in server.manager.active
    release = server.manager.releases["counter-3-1"]  # 2 of 4: 50%, above 40%
    assert release.status == "rolled_back" and release.reason.startswith("guardrail: ")
    # every device on v3 is told to roll back to v2; the others are left on v2
    response, directives = devices[0].request("/app/x")
    assert directives == [{"task": "counter", "version": "2", "action": "rollback",
                           "manifest": "/deploy/bundles/counter/2/manifest.json",
                           "signature": "/deploy/bundles/counter/2/manifest.sig"}]
    assert devices[4].request("/app/x")[1] == []
    status = admin.status()
    digest = hashlib.sha256((built["v3"] / MANIFEST).read_bytes()).hexdigest()
    assert [b["digest"] for b in status["blocked"]] == [digest]
    with pytest.raises(AdminError, match="409 .*blocked: guardrail"):
        admin.start("counter", "3", {"simulate": False})
    reports = server.store.reports(release.release_id)
    assert [(ok) for _, _, ok in reports] == [1, 0, 0]


def test_bad_protocol_input_is_refused_with_a_reason(running, built, server):
    base_url, admin = running
    admin.publish(built["v1"])
    admin.pin("counter", "1")
    bad_device = "bad device\u00e9".encode().decode("latin1")
    status, headers, _ = _get(f"{base_url}/app/x", {"X-Streamflow-Tasks": "counter=0",
                                                    "X-Streamflow-Device": bad_device})
    assert status == 200 and "X-Streamflow-Deploy" not in headers
    assert "must be 1 to 128" in headers["X-Streamflow-Deploy-Error"]
    client = device_client(base_url, server.devices, "ok-1")
    response = client._send("GET", "/app/x", None, {"X-Streamflow-Tasks": "counter=0,,junk,=1",
                                                    "X-Streamflow-Device": "ok-1"})
    assert json.loads(response.headers["x-streamflow-deploy"])[0]["version"] == "1"  # malformed pairs skipped
    for body, reason in [(b"not json", "not JSON"), (b"[1]", "JSON object"),
                         (json.dumps({"device": "ok-1", "task": "x;drop", "version": "1", "ok": False}).encode(),
                          "task name 'x;drop' must be letters"),
                         (json.dumps({"device": "ok-1", "task": "counter", "version": "1'", "ok": False}).encode(),
                          "version"),
                         (json.dumps({"device": "ok-1", "task": "counter", "version": "1", "ok": "no"}).encode(),
                          "'ok' must be true or false"),
                         (json.dumps({"device": "other", "task": "counter", "version": "1", "ok": True}).encode(),
                          "signed by device 'ok-1'")]:
        response = client._send("POST", "/deploy/api/report", body, {"X-Streamflow-Device": "ok-1"})
        assert response.status == 400 and reason in response.body.decode(), (body, response.body)
    assert server.stats["refused_reports"] == 4  # the two non-objects fail before the report checks
    with pytest.raises(DeployClientError, match="manifest must be /deploy/bundles/c/1/manifest.json"):
        from streamflow.deploy.device.client import parse_directives
        parse_directives('[{"task":"c","version":"1","manifest":"http://evil/m","signature":"/s","action":"update"}]')


def test_state_survives_a_restart(tmp_path, built, trusted, clock):
    server = DeployServer(tmp_path / "server", trusted, clock=clock)
    d1 = next(d for d in (f"d{i}" for i in range(100)) if cohort_point("counter-2-1", d) < 0.5)
    for tag in ("v1", "v2"):
        server.publish(*read_signed(built[tag]), {p.relative_to(built[tag] / FILES).as_posix(): p.read_bytes()
                                                  for p in (built[tag] / FILES).rglob("*") if p.is_file()})
    from streamflow.deploy.release.stages import ReleasePlan
    server.manager.start("counter", "2", ReleasePlan(steps=(0.5, 1.0), simulate=False, min_samples=5))
    assert server.manager.decide_header(d1, "counter=1") is not None  # offered the release
    server.manager.report(d1, "counter", "2", ok=False, reason="boom")
    server.manager.decide_header("d2", "counter=2")
    server.manager.flush()
    token = server.admin_token
    server.store.close()
    again = DeployServer(tmp_path / "server", trusted, clock=clock)
    assert again.admin_token == token
    release = again.manager.active["counter"]
    assert (release.version, release.fraction, release.failed, release.exposed) == ("2", 0.5, {d1}, {d1})
    assert again.manager.seen["counter"] == {d1: "1", "d2": "2"}
    assert again.manager.decide_header(d1, "counter=2") is not None  # d1 failed: held back on v1
    again.store.close()


def test_exclusive_files_go_only_to_devices_that_are_to_run_them(running, counter_repo, signing_key, tmp_path,
                                                                 server):
    base_url, admin = running
    counter_repo.commit({"config/device.json": '{"threshold": 3}', "job.py": counter_job("3")}, tag="v3")
    out = tmp_path / "out"
    for tag in ("v1", "v2", "v3"):
        admin.publish(build_bundle(counter_repo.path, tag, signing_key=signing_key, out=out))
    admin.pin("counter", "2")
    admin.start("counter", "3", {"steps": [1.0], "rules": ["os=android"], "simulate": False})
    manifest = read_signed(out / "counter" / "3")[0]
    config = json.loads(manifest)["files"]
    [entry] = [f for f in config if f["name"] == "config/device.json"]
    phone = device_client(base_url, server.devices, "phone-1", attrs={"os": "android"})
    phone.tasks = {"counter": "2"}
    tablet = device_client(base_url, server.devices, "tablet-1", attrs={"os": "ios"})
    tablet.tasks = {"counter": "2"}

    class Entry:
        sha256, size, scope = entry["sha256"], entry["size"], entry["scope"]

    assert phone.fetch_file(Entry) == b'{"threshold": 3}'
    with pytest.raises(DeployClientError, match="403 .*is not to run a version with file"):
        tablet.fetch_file(Entry)
    tablet.tasks = {"counter": "3"}  # claiming to run it is not enough
    with pytest.raises(DeployClientError, match="403 .*is not to run a version with file"):
        tablet.fetch_file(Entry)


def test_a_small_fleet_is_not_held_by_min_samples(tmp_path, clock):
    from streamflow.deploy.release.stages import PublishedBundle, ReleaseManager, ReleasePlan
    from streamflow.deploy.release.state import ReleaseStore

    manager = ReleaseManager(ReleaseStore(tmp_path / "state"), clock=clock)
    for version, previous in (("1", None), ("2", "1")):
        manager.add_bundle(PublishedBundle("counter", version, f"d{version}", "key", previous), b"{}", b"s", [])
    manager.set_stable("counter", "1")
    release = manager.start("counter", "2", ReleasePlan(step_interval_s=60, min_samples=20, simulate=False))
    fleet = {f"phone-{i}": "1" for i in range(30)}
    for _ in range(12):  # twelve minutes: every device asks once a minute, installs what it is told
        for device, version in fleet.items():
            if manager.decide_header(device, f"counter={version}"):
                fleet[device] = "2"
        clock.now += 61
        manager.tick()
    # the 1 % and 5 % bands of 30 devices hold none or one: they pass on time; the 20 % band (~4 devices) needs 2
    assert release.status == "complete" and set(fleet.values()) == {"2"}
    stages = [detail for _, _, event, detail in manager.store.events(release.release_id) if event == "gray"]
    assert [d.split(" (")[0] for d in stages] == ["gray 1%", "gray 5%", "gray 20%", "gray 50%", "gray 100%"]
    manager.store.close()
