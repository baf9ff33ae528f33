"""A local standalone Apache Flink cluster (one JobManager, one or more TaskManagers) run from the PyFlink wheel's jars.

``pip install apache-flink`` ships a whole Flink distribution inside the ``pyflink`` package (``bin/``, ``lib/``,
``opt/``, ``conf/``). This module starts it as a real standalone cluster, separate from the Python process, so that
``streamflow run JOB --runner flink --cluster 127.0.0.1:8081`` can be tried without Docker or a Flink download:

- every file the cluster writes (generated ``conf/config.yaml``, ``log/``, ``pid/``, ``tmp/`` and a ``lib/`` of
  symlinks: the wheel's ``lib/*.jar`` plus ``opt/flink-python-*.jar``, which Python jobs need on the cluster) lives
  in a state directory: ``$STREAMFLOW_FLINK_HOME_DIR``, else ``.flink-cluster/`` in the working directory;
- everything binds to 127.0.0.1; the REST port is configurable (default 8081), the JobManager RPC port is picked
  free at start, all other ports are ephemeral;
- the TaskManager can run PyFlink Python functions in thread mode: ``python.executable`` is this interpreter, and
  ``PYTHONPATH`` holds this environment's site-packages and the repository root, because the embedded interpreter
  (pemja) does not process the venv's ``.pth`` files, so an editable install of streamflow would not be visible.

From the shell::

    streamflow flink-cluster start [--port 8081] [--dir .flink-cluster]
    streamflow flink-cluster status
    streamflow flink-cluster stop

A job submitted to it needs (PyFlink ``Configuration``): ``execution.target=remote``, ``rest.address=127.0.0.1``,
``rest.port=PORT``, ``python.execution-mode=thread``, ``python.executable=sys.executable``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamflow.settings import env_name, settings

__all__ = [
    "DEFAULT_PORT",
    "STATE_DIR_ENV",
    "ClusterError",
    "ClusterLayout",
    "flink_distribution",
    "python_path",
    "remote_environment",
    "render_config",
    "start",
    "status",
    "stop",
]

DEFAULT_PORT = 8081
STATE_DIR_ENV = env_name("flink_home_dir")
HOST = "127.0.0.1"
_SETTINGS = "cluster.json"  # what start() chose (ports), so status()/stop() find the cluster again

# Used only if the wheel's conf/config.yaml cannot be read: the JVM flags Flink needs on Java 17.
_FALLBACK_JAVA_OPTS = " ".join(
    [f"--add-exports={m}=ALL-UNNAMED" for m in (
        "java.rmi/sun.rmi.registry", "jdk.compiler/com.sun.tools.javac.api", "jdk.compiler/com.sun.tools.javac.file",
        "jdk.compiler/com.sun.tools.javac.parser", "jdk.compiler/com.sun.tools.javac.tree",
        "jdk.compiler/com.sun.tools.javac.util", "java.security.jgss/sun.security.krb5")]
    + [f"--add-opens=java.base/{p}=ALL-UNNAMED" for p in (
        "java.lang", "java.net", "java.io", "java.nio", "sun.nio.ch", "java.lang.reflect", "java.text", "java.time",
        "java.util", "java.util.concurrent", "java.util.concurrent.atomic", "java.util.concurrent.locks")])


class ClusterError(RuntimeError):
    """The cluster could not be started or stopped; the message carries the reason and the logs' tails."""


@dataclass(frozen=True)
class ClusterLayout:
    """Where one cluster's files live, all under ``root`` (the state directory).

    >>> layout = ClusterLayout(Path("/tmp/fc"))
    >>> str(layout.conf_dir), str(layout.log_dir)
    ('/tmp/fc/conf', '/tmp/fc/log')
    """

    root: Path

    @property
    def conf_dir(self) -> Path:
        return self.root / "conf"

    @property
    def log_dir(self) -> Path:
        return self.root / "log"

    @property
    def pid_dir(self) -> Path:
        return self.root / "pid"

    @property
    def lib_dir(self) -> Path:
        return self.root / "lib"

    @property
    def tmp_dir(self) -> Path:
        return self.root / "tmp"

    @property
    def settings_file(self) -> Path:
        return self.root / _SETTINGS

    @classmethod
    def resolve(cls, directory: str | os.PathLike[str] | None = None) -> ClusterLayout:
        """The layout for ``directory``, else ``$STREAMFLOW_FLINK_HOME_DIR``, else ``./.flink-cluster``.

        >>> ClusterLayout.resolve("/tmp/x").root
        PosixPath('/tmp/x')
        """
        return cls(settings(flink_home_dir=directory).flink_home_dir.expanduser().resolve())


def flink_distribution() -> Path:
    """The Flink distribution inside the installed PyFlink package (its ``bin/``, ``lib/``, ``opt/``).

    Raises :class:`ClusterError` if PyFlink is not installed (``pip install 'streamflow[flink]'``).

    >>> (flink_distribution() / "bin" / "start-cluster.sh").is_file()  # doctest: +SKIP
    True
    """
    try:
        import pyflink
    except ImportError as exc:
        raise ClusterError("PyFlink is not installed: pip install 'streamflow[flink]' (apache-flink==2.3.0)") from exc
    home = Path(pyflink.__file__).resolve().parent
    for needed in ("bin/start-cluster.sh", "bin/stop-cluster.sh", "bin/config.sh", "lib"):
        if not (home / needed).exists():
            raise ClusterError(f"the PyFlink package at {home} has no {needed}; is it a full apache-flink wheel?")
    return home


def python_path() -> list[str]:
    """The ``PYTHONPATH`` entries the TaskManager's embedded interpreter needs to import our code and PyFlink:
    the repository root (so ``import streamflow, operators`` works without the editable install's ``.pth``),
    this environment's site-packages, then whatever ``$PYTHONPATH`` already holds.

    >>> import streamflow
    >>> str(Path(streamflow.__file__).resolve().parents[1]) in python_path()
    True
    """
    import streamflow

    entries = [str(Path(streamflow.__file__).resolve().parents[1])]
    entries += [sysconfig.get_paths()[key] for key in ("purelib", "platlib")]
    entries += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    unique: list[str] = []
    for entry in entries:
        if entry not in unique:
            unique.append(entry)
    return unique


def render_config(layout: ClusterLayout, port: int, rpc_port: int, *, slots: int = 2,
                  jobmanager_memory: str = "1024m", taskmanager_memory: str = "1536m",
                  python_executable: str | None = None, java_opts: str = _FALLBACK_JAVA_OPTS) -> str:
    """The ``config.yaml`` for a one-JobManager, one-TaskManager cluster bound to 127.0.0.1 (flat keys; values
    JSON-quoted, which is valid YAML).

    >>> text = render_config(ClusterLayout(Path("/tmp/fc")), 8081, 6123, python_executable="/usr/bin/python3")
    >>> 'rest.port: 8081' in text and 'taskmanager.numberOfTaskSlots: 2' in text
    True
    >>> 'python.executable: "/usr/bin/python3"' in text
    True
    """
    settings: dict[str, Any] = {
        "env.java.opts.all": java_opts,
        "env.log.dir": str(layout.log_dir),
        "env.pid.dir": str(layout.pid_dir),
        "io.tmp.dirs": str(layout.tmp_dir),
        "jobmanager.rpc.address": HOST,
        "jobmanager.rpc.port": rpc_port,
        "jobmanager.bind-host": HOST,
        "jobmanager.memory.process.size": jobmanager_memory,
        "jobmanager.execution.failover-strategy": "region",
        "taskmanager.bind-host": HOST,
        "taskmanager.host": HOST,
        "taskmanager.numberOfTaskSlots": slots,
        "taskmanager.memory.process.size": taskmanager_memory,
        "parallelism.default": 1,
        "rest.address": HOST,
        "rest.bind-address": HOST,
        "rest.port": port,
        "python.executable": python_executable or sys.executable,
        "python.client.executable": python_executable or sys.executable,
    }
    lines = ["# Generated by streamflow.flink.cluster; rewritten on every start."]
    lines += [f"{key}: {json.dumps(value)}" for key, value in settings.items()]
    return "\n".join(lines) + "\n"


def status(port: int | None = None, directory: str | os.PathLike[str] | None = None,
           timeout: float = 2.0) -> dict[str, Any] | None:
    """The cluster's ``GET /overview`` (``taskmanagers``, ``slots-total``, ``jobs-running``, ...) or ``None`` if no
    Flink REST API answers on 127.0.0.1:``port`` (default: the port the cluster in ``directory`` was started with).

    >>> status(port=1)  # nothing listens there
    """
    if port is None:
        port = _saved_settings(ClusterLayout.resolve(directory)).get("port", DEFAULT_PORT)
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/overview", timeout=timeout) as response:
            overview = json.loads(response.read().decode())
    except (OSError, ValueError):
        return None
    return overview if isinstance(overview, dict) and "taskmanagers" in overview else None


def start(port: int = DEFAULT_PORT, directory: str | os.PathLike[str] | None = None, *, slots: int = 2,
          timeout: float = 120.0, jobmanager_memory: str = "1024m", taskmanager_memory: str = "1536m",
          python_executable: str | None = None, taskmanagers: int = 1) -> dict[str, Any]:
    """Start a JobManager and ``taskmanagers`` TaskManagers (``slots`` slots each) from the PyFlink wheel; return
    ``/overview`` once they have registered. Idempotent: if this directory's cluster already answers on ``port``,
    its overview is returned. Several TaskManagers on one machine are separate JVMs (their ports ephemeral): a
    cluster's data exchange between them goes over the network stack, as between machines.

    Raises :class:`ClusterError` (with the tails of the cluster's logs) if the port is taken by something else, a
    process dies, or no TaskManager registers within ``timeout`` seconds; a half-started cluster is stopped.

    >>> overview = start(port=8081)  # doctest: +SKIP
    >>> overview["taskmanagers"], overview["slots-total"]  # doctest: +SKIP
    (1, 2)
    >>> stop()  # doctest: +SKIP
    True
    """
    layout = ClusterLayout.resolve(directory)
    home = flink_distribution()
    if _live_pids(layout):
        overview = status(port)
        if overview is not None and overview.get("taskmanagers", 0) >= 1:
            return overview
        stop(layout.root)  # a leftover or half-started cluster of ours: clear it before starting afresh
    if _port_in_use(port):
        raise ClusterError(f"port {HOST}:{port} is already in use (another Flink cluster?); choose --port")

    for folder in (layout.conf_dir, layout.log_dir, layout.pid_dir, layout.tmp_dir):
        folder.mkdir(parents=True, exist_ok=True)
    _link_jars(home, layout.lib_dir)
    for old in layout.log_dir.glob("*"):
        with contextlib.suppress(OSError):
            old.unlink()
    rpc_port = _free_port()
    python = python_executable or sys.executable
    (layout.conf_dir / "config.yaml").write_text(render_config(
        layout, port, rpc_port, slots=slots, jobmanager_memory=jobmanager_memory,
        taskmanager_memory=taskmanager_memory, python_executable=python, java_opts=_java_opts(home)))
    for name in ("log4j.properties", "log4j-console.properties", "log4j-cli.properties", "logback.xml"):
        if (home / "conf" / name).is_file():
            (layout.conf_dir / name).write_bytes((home / "conf" / name).read_bytes())
    (layout.conf_dir / "masters").write_text(f"{HOST}:{port}\n")
    (layout.conf_dir / "workers").write_text(f"{HOST}\n")
    layout.settings_file.write_text(json.dumps({"port": port, "rpc_port": rpc_port, "python": python}) + "\n")

    # What start-cluster.sh does (jobmanager.sh start, then taskmanager.sh start), but both at once: each script
    # first runs two short JVMs to read the config, seconds each on a busy machine; the TaskManager retries its
    # registration until the JobManager is up.
    results = _scripts(home, layout, [("jobmanager.sh", "start"), ("taskmanager.sh", "start")])
    for _ in range(taskmanagers - 1):  # one at a time: the daemon script numbers an instance by its pid file
        results += _scripts(home, layout, [("taskmanager.sh", "start")])
    failures = [f"{name} failed ({r.returncode}): {r.stdout}{r.stderr}" for name, r in results if r.returncode != 0]
    if failures:
        stop(layout.root)
        raise ClusterError("; ".join(failures) + _log_tail(layout))
    deadline = time.monotonic() + timeout
    expected = {"standalonesession", "taskexecutor"}
    while True:
        overview = status(port)
        if (overview is not None and overview.get("taskmanagers", 0) >= taskmanagers
                and overview.get("slots-total", 0) >= slots * taskmanagers):
            return overview
        alive = {daemon for daemon, _ in _live_pids(layout)}
        dead = expected - alive
        if dead or time.monotonic() > deadline:
            reason = (f"the {', '.join(sorted(dead))} process exited" if dead
                      else f"not {taskmanagers} TaskManager(s) of {slots} slots registered within {timeout:.0f}s")
            stop(layout.root)
            raise ClusterError(f"Flink cluster on {HOST}:{port} did not start: {reason}" + _log_tail(layout))
        time.sleep(0.5)


def stop(directory: str | os.PathLike[str] | None = None, timeout: float = 30.0) -> bool:
    """Stop this directory's cluster and wait until its processes are gone and its REST port is closed. Returns
    ``True`` if something was running.

    It does what ``stop-cluster.sh`` does (``flink-daemon.sh stop``: SIGTERM to each daemon's pid from the pid files,
    SIGKILL if it outlives the grace period), TaskManager first, without the scripts' config-reading JVMs (which cost
    ~10-20 s on a busy machine). Only processes whose command line names this cluster's conf dir are signalled.

    >>> stop("/tmp/no-such-flink-cluster")
    False
    """
    layout = ClusterLayout.resolve(directory)
    pids = sorted(_live_pids(layout), key=lambda entry: entry[0] != "taskexecutor")  # TaskManager first
    port = _saved_settings(layout).get("port")
    if not pids:
        return False
    deadline = time.monotonic() + timeout
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for _, pid in _live_pids(layout, pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        while _live_pids(layout, pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _live_pids(layout, pids):
            break
        deadline = time.monotonic() + 5.0
    left = _live_pids(layout, pids)
    if left:
        raise ClusterError(f"Flink processes still alive after stop: {left}")
    for pid_file in layout.pid_dir.glob("*.pid"):
        with contextlib.suppress(OSError):
            pid_file.unlink()
    while port is not None and _port_in_use(port) and time.monotonic() < deadline + 5.0:
        time.sleep(0.1)
    return True


def remote_environment(address: str, configuration: Any = None, *, parallelism: int | None = None) -> Any:
    """A PyFlink ``StreamExecutionEnvironment`` that submits to the cluster at ``HOST:PORT`` (REST address).

    ``StreamExecutionEnvironment.get_execution_environment(config)`` ignores ``execution.target=remote`` when the
    script is run with plain ``python`` (not ``flink run``): Java's ``getExecutionEnvironment`` falls back to a
    ``LocalStreamEnvironment``, which forces the target to ``local`` and starts a MiniCluster. The environment built
    here is Java's plain ``new StreamExecutionEnvironment(configuration)``, which honours the remote target.
    ``configuration`` (a ``pyflink.common.Configuration``) is copied; these keys are set on top of it:
    ``execution.target=remote``, ``rest.address``, ``rest.port``, and, unless already set,
    ``execution.attached=true`` (else ``execute()`` returns as soon as the job is submitted),
    ``python.execution-mode=thread`` and ``python.executable=sys.executable``.

    >>> env = remote_environment("127.0.0.1:8081")  # doctest: +SKIP
    >>> env.from_collection([1, 2, 3]).map(lambda x: x * 2).print()  # doctest: +SKIP
    >>> env.execute("doubled")  # doctest: +SKIP
    """
    from pyflink.common import Configuration
    from pyflink.datastream import StreamExecutionEnvironment
    from pyflink.java_gateway import get_gateway

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"cluster address must be HOST:PORT, got {address!r}")
    config = Configuration()
    if configuration is not None:
        config.add_all(configuration)
    config.set_string("execution.target", "remote")
    config.set_string("rest.address", host)
    config.set_string("rest.port", port)
    if not config.contains_key("execution.attached"):
        config.set_string("execution.attached", "true")  # default false: execute() would return at submission
    if not config.contains_key("python.execution-mode"):
        config.set_string("python.execution-mode", "thread")
    if not config.contains_key("python.executable"):
        config.set_string("python.executable", sys.executable)
    j_env_class = get_gateway().jvm.org.apache.flink.streaming.api.environment.StreamExecutionEnvironment
    env = StreamExecutionEnvironment(j_env_class(config._j_configuration))
    if parallelism is not None:
        env.set_parallelism(parallelism)
    return env


# --- helpers -----------------------------------------------------------------------------------------------------

def _scripts(home: Path, layout: ClusterLayout, commands: list[tuple[str, str]],
             timeout: float = 120.0) -> list[tuple[str, subprocess.CompletedProcess]]:
    """Run the wheel's bin/ scripts concurrently, each with ``bash`` (the wheel may not keep their +x bit), in the
    cluster's environment; wait for all of them (the daemons they launch keep running)."""
    env = dict(os.environ)
    env.update({
        "FLINK_HOME": str(home),
        "FLINK_CONF_DIR": str(layout.conf_dir),
        "FLINK_LIB_DIR": str(layout.lib_dir),
        "FLINK_OPT_DIR": str(home / "opt"),
        "FLINK_PLUGINS_DIR": str(home / "plugins"),
        "FLINK_LOG_DIR": str(layout.log_dir),
        "FLINK_PID_DIR": str(layout.pid_dir),
        "FLINK_IDENT_STRING": "streamflow",
        "PYTHONPATH": os.pathsep.join(python_path()),
    })
    env.pop("_FLINK_HOME_DETERMINED", None)
    running = [(name, subprocess.Popen(["bash", str(home / "bin" / name), action], env=env, cwd=layout.root,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       start_new_session=True)) for name, action in commands]
    results = []
    for name, process in running:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        results.append((name, subprocess.CompletedProcess(process.args, process.returncode, out, err)))
    return results


def _link_jars(home: Path, lib_dir: Path) -> None:
    """``lib_dir`` = symlinks to the wheel's lib/*.jar plus opt/flink-python-*.jar (Python jobs need it there)."""
    lib_dir.mkdir(parents=True, exist_ok=True)
    for old in lib_dir.iterdir():
        old.unlink()
    jars = sorted((home / "lib").glob("*.jar")) + sorted((home / "opt").glob("flink-python-*.jar"))
    for jar in jars:
        (lib_dir / jar.name).symlink_to(jar)


def _java_opts(home: Path) -> str:
    """``env.java.opts.all`` of the wheel's own config.yaml (the JVM flags Flink needs on Java 17+)."""
    try:
        for line in (home / "conf" / "config.yaml").read_text().splitlines():
            stripped = line.strip()
            if stripped.startswith("all:") and "--add-" in stripped:
                return stripped.removeprefix("all:").strip()
    except OSError:
        pass
    return _FALLBACK_JAVA_OPTS


def process_ids(directory: str | os.PathLike[str] | None = None) -> list[tuple[str, int]]:
    """``(daemon, pid)`` of this directory's live cluster processes (``standalonesession``, ``taskexecutor``)."""
    return _live_pids(ClusterLayout.resolve(directory))


def _saved_settings(layout: ClusterLayout) -> dict[str, Any]:
    try:
        return json.loads(layout.settings_file.read_text())
    except (OSError, ValueError):
        return {}


def _live_pids(layout: ClusterLayout, among: list[tuple[str, int]] | None = None) -> list[tuple[str, int]]:
    """(daemon, pid) of this cluster's processes that are alive: from the pid files, and only processes whose
    command line names our conf dir (a recycled pid is never someone else's process we then kill)."""
    if among is None:
        among = []
        for pid_file in sorted(layout.pid_dir.glob("*.pid")) if layout.pid_dir.is_dir() else []:
            daemon = pid_file.stem.rsplit("-", 1)[-1]
            for line in pid_file.read_text().split():
                if line.isdigit():
                    among.append((daemon, int(line)))
    alive = []
    for daemon, pid in among:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(layout.conf_dir) in cmdline:
            alive.append((daemon, pid))
    return alive


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((HOST, port)) == 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _log_tail(layout: ClusterLayout, lines: int = 30) -> str:
    parts = []
    for log in sorted(layout.log_dir.glob("*")) if layout.log_dir.is_dir() else []:
        if log.suffix in (".log", ".out") and log.stat().st_size:
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"\n--- {log} (last {len(tail)} lines) ---\n" + "\n".join(tail))
    return "".join(parts) or f"\n(no logs in {layout.log_dir})"
