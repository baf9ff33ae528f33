"""Failure reports over the real Kafka tunnel (noida-db): a device's signed deploy_reports rows reach the release
server and trip the guardrail; a forged or malformed report is refused with its reason and never counted."""

from __future__ import annotations

import os
import time

from connectors.tunnel.keys import KeyRegistry
from connectors.tunnel.sink import TunnelSink
from streamflow.deploy.device.client import DeployClient
from streamflow.deploy.protocol import REPORTS_TABLE, report_row
from streamflow.deploy.release.server import DeployServer, serve_in_thread
from streamflow.deploy.release.stages import PublishedBundle, ReleasePlan


def _wait(condition, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_reports_over_the_tunnel_roll_a_bad_release_back(tmp_path, kafka_bootstrap):
    topic = f"deploy-reports-{os.getpid()}-{time.monotonic_ns()}"
    registry = KeyRegistry(tmp_path / "keys.json")
    server = DeployServer(tmp_path / "server", None, devices=registry, tick_s=0.2)
    manager = server.manager
    for version, previous in (("1", None), ("2", "1")):
        manager.add_bundle(PublishedBundle("counter", version, f"digest{version}".ljust(64, "0"), "key", previous),
                           b"{}", b"sig", [])
    manager.start("counter", "2", ReleasePlan(steps=(1.0,), min_samples=3, max_failure_rate=0.5, simulate=False))
    server.read_tunnel_reports(bootstrap=kafka_bootstrap, topic=topic)
    for i in range(4):  # the devices offered the release: only their reports count
        assert manager.decide_header(f"phone-{i}", "counter=1") is not None
    sinks = []
    with serve_in_thread(server) as base_url:
        for i in range(4):
            sink = TunnelSink(f"phone-{i}", registry.add(f"phone-{i}"), tmp_path / f"spool-{i}", topic=topic,
                              bootstrap=kafka_bootstrap, linger_s=0.0)
            sinks.append(sink)
            client = DeployClient(base_url, f"phone-{i}", registry.key_for(f"phone-{i}"), tunnel=sink)
            client.report("counter", "2", ok=i == 0, reason=None if i == 0 else "load_failed: counter@2: boom")
        # a device whose key the registry does not hold (a forger), and a malformed row of a known device
        forger = TunnelSink("phone-0", b"k" * 32, tmp_path / "spool-forged", topic=topic, bootstrap=kafka_bootstrap,
                            linger_s=0.0)
        forger.write(REPORTS_TABLE, [report_row("counter", "2", False, "forged")])
        sinks[0].write(REPORTS_TABLE, [{**report_row("counter", "2", True), "version": "2; drop"}])
        sinks[0].write("ipv", [{"user_id": "u", "n": 1}])  # feature rows on the same topic: not reports
        for sink in [*sinks, forger]:
            assert sink.close(timeout_s=30)
        reader = server.tunnel_reader

        def forged() -> int:  # read at each poll: the forger's refusal may arrive after the others
            stats = dict(reader.stats)
            return sum(n for k, n in stats.items() if k.startswith("refused:") and k != "refused:bad_report")

        assert _wait(lambda: reader.stats["reports"] == 4 and reader.stats["refused:bad_report"] == 1
                     and forged() == 1 and reader.stats["other_tables"] == 1), reader.stats
        assert _wait(lambda: manager.releases["counter-2-1"].status == "rolled_back")
        release = manager.releases["counter-2-1"]
        assert release.reason.startswith("guardrail: ")
        assert release.failed == {"phone-1", "phone-2", "phone-3"}  # the forged failure of phone-0 was not believed
    reports = server.store.reports("counter-2-1")
    assert sorted((device, ok) for device, _, ok in reports) == [("phone-0", 1), ("phone-1", 0), ("phone-2", 0),
                                                                ("phone-3", 0)]
    assert server.store._query("SELECT DISTINCT via FROM reports") == [("tunnel",)]
    server.store.close()


def test_a_report_reader_whose_broker_stays_away_gives_up_and_says_so(tmp_path, caplog):
    """Bounded, as the first hour asks: a broker that does not come back within ``retry_for_s`` stops the reader
    with an ERROR naming what to do (the server's /readyz then reports it not running)."""
    import socket

    from streamflow.deploy.release.tunnel_reports import TunnelReportReader

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    reader = TunnelReportReader(lambda *args: None, KeyRegistry(tmp_path / "keys.json"), bootstrap=f"127.0.0.1:{port}",
                                retry_for_s=1.0)
    reader.start()
    reader._thread.join(20)
    assert not reader._thread.is_alive()
    assert any(r.levelname == "ERROR" and "deploy report reader stopped" in r.getMessage() for r in caplog.records)
