"""The local standalone Flink cluster from the PyFlink wheel: it starts (1 TaskManager, 2 slots), runs a real PyFlink
DataStream job submitted remotely whose Python function imports streamflow inside the TaskManager's embedded
interpreter (thread mode), and stops with its REST port closed.

One cluster for the module (start-up of two JVMs costs tens of seconds on a busy machine); teardown always stops it.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyflink", reason="needs the flink extra: pip install 'streamflow[flink]'", exc_type=ImportError)
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("no Java runtime (Flink needs Java 11+)", allow_module_level=True)

from streamflow.flink import cluster as flink_cluster  # noqa: E402

pytestmark = pytest.mark.slow  # a standalone cluster: two JVMs started and stopped

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("flink-cluster")
    port = _free_port()
    try:
        try:
            overview = flink_cluster.start(port=port, directory=state, timeout=150)
        except flink_cluster.ClusterError as exc:
            # Seen once in a fresh-clone suite (2 workers, a MiniCluster beside it): the standalonesession JVM
            # exited before writing a log line, and the file passed alone. One more start, said in the output.
            print(f"the standalone cluster did not start ({exc}); starting it once more")
            overview = flink_cluster.start(port=port, directory=state, timeout=150)
        yield {"port": port, "dir": state, "overview": overview}
    finally:
        flink_cluster.stop(state)


def test_cluster_has_one_taskmanager_with_two_slots(cluster):
    assert cluster["overview"]["taskmanagers"] == 1
    overview = flink_cluster.status(cluster["port"])
    assert overview is not None
    assert overview["taskmanagers"] == 1
    assert overview["slots-total"] == 2
    assert overview["flink-version"].startswith("2.")
    assert flink_cluster.status(directory=cluster["dir"]) == flink_cluster.status(cluster["port"])
    config = (cluster["dir"] / "conf" / "config.yaml").read_text()
    assert "rest.bind-address: \"127.0.0.1\"" in config and f"rest.port: {cluster['port']}" in config


def test_start_again_returns_the_running_cluster(cluster):
    again = flink_cluster.start(port=cluster["port"], directory=cluster["dir"])
    assert again["taskmanagers"] == 1


def test_remote_pyflink_job_imports_streamflow_in_the_taskmanager(cluster, tmp_path):
    from pyflink.common import Configuration, Types
    from pyflink.datastream import MapFunction

    out = tmp_path / "out.txt"
    config = Configuration()
    config.set_string("python.execution-mode", "thread")
    config.set_string("python.executable", sys.executable)
    env = flink_cluster.remote_environment(f"127.0.0.1:{cluster['port']}", config, parallelism=1)
    j_config = env._j_stream_execution_environment.getConfiguration()
    assert j_config.toMap().get("execution.target") == "remote"
    assert j_config.toMap().get("execution.attached") == "true"

    # Defined inside the test so cloudpickle ships it by value (the TaskManager cannot import this test module).
    class SquareAndRecord(MapFunction):
        def __init__(self, path: str):
            self.path = path

        def open(self, runtime_context):
            self.file = open(self.path, "a")  # noqa: SIM115 - closed in close()

        def map(self, value):
            import operators
            import streamflow

            line = f"{value},{value * value},{Path(streamflow.__file__).parent},{operators.__name__}"
            self.file.write(line + "\n")
            self.file.flush()
            return value * value

        def close(self):
            self.file.close()

    env.from_collection(list(range(10)), type_info=Types.INT()).map(
        SquareAndRecord(str(out)), output_type=Types.INT())
    result = env.execute("streamflow-flink-cluster-smoke")
    assert result.get_job_id() is not None

    rows = [line.split(",") for line in out.read_text().splitlines()]
    assert sorted(int(r[0]) for r in rows) == list(range(10))
    assert all(int(r[1]) == int(r[0]) ** 2 for r in rows)
    assert {r[2] for r in rows} == {str(ROOT / "streamflow")}  # the repository's package, not a copy
    assert {r[3] for r in rows} == {"operators"}
    overview = flink_cluster.status(cluster["port"])
    assert overview["jobs-finished"] >= 1 and overview["jobs-failed"] == 0


def test_ipv_job_on_the_cluster_matches_the_device_runner(cluster, tmp_path):
    """`streamflow run --runner flink --cluster --parallelism 2`: the translated job (the file split across two
    readers, keyed state with TTL, timers, side outputs, the DuckDB writer) runs in the standalone TaskManager's
    two slots, not only a smoke job."""
    import duckdb

    from connectors.storage import CollectiveStorage
    from streamflow.flink.runner import run_flink
    from streamflow.job import load_job
    from streamflow.runners.device import DeviceRunner
    from streamflow.sources import open_source

    events = tmp_path / "events.csv"
    lines = (ROOT / "jobs" / "data" / "taobao_user_behavior_10k.csv").read_text().splitlines()[:2000]
    events.write_text("\n".join(lines) + "\n")
    summary = run_flink(load_job(ROOT / "jobs" / "ipv.py"), events, db=tmp_path / "flink.duckdb",
                        cluster=f"127.0.0.1:{cluster['port']}", parallelism=2)
    with CollectiveStorage(tmp_path / "device.duckdb") as storage:
        DeviceRunner(load_job(ROOT / "jobs" / "ipv.py"), storage).run(open_source(events))

    def rows(db):
        with duckdb.connect(str(db), read_only=True) as con:
            return sorted(con.sql("SELECT * FROM ipv").fetchall())

    assert summary.tasks_fired == len(rows(tmp_path / "flink.duckdb")) > 1000
    assert rows(tmp_path / "flink.duckdb") == rows(tmp_path / "device.duckdb")


def test_stop_closes_the_port(cluster):
    assert flink_cluster.stop(cluster["dir"]) is True
    assert not _port_open(cluster["port"])
    assert flink_cluster.status(cluster["port"]) is None
    assert flink_cluster.stop(cluster["dir"]) is False
