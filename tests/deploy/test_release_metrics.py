"""The release server's ``/metrics``, ``/healthz`` and ``/readyz`` over real HTTP during a real release, parsed with
prometheus_client's parser: stage, cohorts, rollbacks and request counts equal the server's own status."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from deploy_helpers import counter_job, device_client

pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from streamflow.deploy.release.admin import AdminClient  # noqa: E402
from streamflow.deploy.release.build import build_bundle  # noqa: E402
from streamflow.deploy.release.server import DeployServer, serve_in_thread  # noqa: E402


@pytest.fixture
def running(tmp_path, trusted, device_keys, counter_repo, signing_key):
    counter_repo.commit({"job.py": counter_job("3")}, tag="v3")
    built = {tag: build_bundle(counter_repo.path, tag, signing_key=signing_key, out=tmp_path / "out")
             for tag in ("v1", "v2", "v3")}
    server = DeployServer(tmp_path / "server", trusted, devices=device_keys, tick_s=3600)
    try:
        with serve_in_thread(server) as base_url:
            yield server, base_url, AdminClient(base_url, server.admin_token), built
    finally:
        server.store.close()


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, text = get(base_url + "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def labelled(got: dict, name: str, **fixed: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in got.items() if n == name and set(fixed.items()) <= set(labels)}


def test_release_metrics_follow_a_release_to_its_rollback(running):
    server, base_url, admin, built = running
    assert get(base_url + "/healthz") == (200, "ok\n")
    assert get(base_url + "/readyz") == (200, "ready\n")
    for tag in ("v1", "v2", "v3"):
        admin.publish(built[tag])
    admin.pin("counter", "2")
    admin.start("counter", "3", {"steps": [1.0], "min_samples": 3, "max_failure_rate": 0.4, "simulate": False})
    devices = [device_client(base_url, server.devices, f"phone-{i}") for i in range(6)]
    for device in devices:
        device.tasks = {"counter": "2"}
        device.request("/app/x")
    devices[0].tasks = {"counter": "3"}
    devices[0].request("/app/x")  # seen running v3: a success
    devices[1].report("counter", "3", ok=True)
    devices[2].report("counter", "3", ok=False, reason="load_failed")

    during = scrape(base_url)
    release = admin.status()["releases"][0]
    assert (release["stage"], release["status"]) == ("gray", "active")
    v3 = {"task": "counter", "version": "3"}
    assert labelled(during, "streamflow_release_stage", **v3, stage="gray") == {
        (("stage", "gray"), ("task", "counter"), ("version", "3")): 1}
    assert sum(labelled(during, "streamflow_release_stage", **v3).values()) == 1
    assert during[("streamflow_release_fraction", (("task", "counter"), ("version", "3")))] == release["fraction"]
    cohorts = {dict(labels)["cohort"]: v for labels, v in labelled(during, "streamflow_release_cohort_samples").items()}
    assert cohorts == {name: c["samples"] for name, c in release["cohorts"].items()}
    rates = {dict(labels)["cohort"]: v
             for labels, v in labelled(during, "streamflow_release_cohort_failure_ratio").items()}
    assert rates == {name: c["failure_rate"] for name, c in release["cohorts"].items()}
    assert during[("streamflow_release_coverage_ratio", (("task", "counter"), ("version", "3")))] == 1 / 6
    assert during[("streamflow_release_rollbacks_total", (("task", "counter"),))] == 0

    devices[3].report("counter", "3", ok=False, reason="TypeError at run time")  # 2 of 4 failed: rolled back
    after = scrape(base_url)
    status = admin.status()
    assert status["releases"][0]["status"] == "rolled_back"
    assert labelled(after, "streamflow_release_stage", **v3, stage="rolled_back") == {
        (("stage", "rolled_back"), ("task", "counter"), ("version", "3")): 1}
    assert after[("streamflow_release_rollbacks_total", (("task", "counter"),))] == 1
    assert after[("streamflow_release_decision_seconds_count", ())] == 7  # every request with the tasks header
    requests = {dict(labels)["outcome"]: v for labels, v in labelled(after, "streamflow_release_server_requests_total")
                .items()}
    # the status call above and the scrape itself came after; every count before it is the server's own
    assert requests["directives"] == status["server"]["directives"]
    assert requests["requests"] == status["server"]["requests"] - 1
    assert not any("phone-" in v for (_, labels) in after for _, v in labels)  # never a device id as a label
