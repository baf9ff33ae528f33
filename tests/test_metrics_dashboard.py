"""docker/'s Prometheus and Grafana files: they parse, Prometheus scrapes the ports the README names, and every
streamflow metric the dashboard queries is one a part exposes (documented in its module, and for the parts that
need no broker, in a real exposition)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")
yaml = pytest.importorskip("yaml")

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from connectors.storage import CollectiveStorage  # noqa: E402
from operators import Aggregate, Count  # noqa: E402
from streamflow.job import Job, Task  # noqa: E402
from streamflow.metrics import cloud, deploy, device, serve  # noqa: E402
from streamflow.metrics.device import DeviceMetrics  # noqa: E402
from streamflow.runners.device import DeviceRunner  # noqa: E402

DOCKER = Path(__file__).resolve().parent.parent / "docker"
SUFFIXES = re.compile(r"_(bucket|count|sum)$")


def dashboard_metrics() -> set[str]:
    dashboard = json.loads((DOCKER / "grafana" / "dashboards" / "streamflow.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert exprs
    return {SUFFIXES.sub("", name) for expr in exprs for name in re.findall(r"\bstreamflow_\w+", expr)}


def documented() -> set[str]:
    text = "".join(module.__doc__ for module in (cloud, deploy, device, serve))
    return {re.sub(r"_total$", "", name) for name in re.findall(r"``(streamflow_\w+)", text)}


def exposed(registry: CollectorRegistry) -> set[str]:
    return {family.name for family in text_string_to_metric_families(generate_latest(registry).decode())}


def test_every_metric_the_dashboard_queries_is_documented_by_its_part():
    queried = {re.sub(r"_total$", "", name) for name in dashboard_metrics()}
    assert queried - documented() == set()
    assert {name.split("_")[1] for name in queried} == {"cloud", "serve", "release", "device"}  # the four parts


def test_device_and_release_metrics_the_dashboard_queries_are_exposed(tmp_path):
    registry = CollectorRegistry()
    storage = CollectiveStorage(tmp_path / "d.duckdb")
    runner = DeviceRunner(Job("j", [Task("t", ["x"], [Aggregate(n=Count())])]), storage)
    DeviceMetrics(runner, registry)
    names = exposed(registry)
    runner.close()
    storage.close()
    pytest.importorskip("aiohttp")
    from streamflow.deploy.release.server import DeployServer

    server = DeployServer(tmp_path / "server")
    names |= exposed(server.metrics.registry)
    server.store.close()
    queried = {re.sub(r"_total$", "", n) for n in dashboard_metrics() if n.startswith(("streamflow_device",
                                                                                       "streamflow_release"))}
    # tunnel_backlog needs a tunnel; the release gauges with labels are there once a release is
    without_data = {"streamflow_device_tunnel_backlog_rows"}
    assert queried - without_data - names == set()


def test_compose_runs_prometheus_and_grafana_on_this_host_only():
    compose = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
    services = compose["services"]
    assert "--web.listen-address=127.0.0.1:9090" in services["prometheus"]["command"]
    assert services["grafana"]["environment"]["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"
    config = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    assert all(t.startswith("127.0.0.1:") for ts in targets.values() for t in ts)
    assert len(targets) == 4
