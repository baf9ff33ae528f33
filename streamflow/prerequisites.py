"""What a command needs beyond the core install, checked before it starts: an extra, a JVM, a broker, a cluster.

``make run`` installs the core only. A command that needs more calls these first, so that what is missing is
one line naming the fix (``streamflow`` prints it and exits with 2), not a traceback, a retry loop or a silent
wait. Each check is cheap: :func:`require_extra` looks the modules up without importing them, and
:func:`require_broker` and :func:`require_cluster` give up within a few seconds.

    >>> require_extra("core", "json", what="this")       # present: nothing happens
    >>> require_extra("kafka", "no_such_module_xyz", what="tunnel consume")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    streamflow.prerequisites.MissingExtra: tunnel consume needs the kafka extra: pip install 'streamflow[kafka]' ...
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import sys
import urllib.parse
from pathlib import Path

#: The modules each extra brings that the commands check for (the extras are in pyproject.toml).
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "flink": ("pyflink", "cloudpickle"),
    "kafka": ("kafka", "zstandard"),
    "deploy": ("cryptography",),
    "deploy-server": ("aiohttp", "cryptography", "prometheus_client"),
    "serve": ("faust", "PIL", "onnx", "kafka", "prometheus_client"),
    "metrics": ("prometheus_client",),
}
CLUSTER_PROBE_TIMEOUT_S = 3.0
BROKER_PROBE_TIMEOUT_S = 3.0


class MissingPrerequisite(RuntimeError):
    """Something a command needs is not there; the message is one line that names the fix."""


class MissingExtra(MissingPrerequisite, ImportError):
    """An optional dependency group of streamflow is not installed (also an ``ImportError``)."""


def require_extra(extra: str, *modules: str, what: str) -> None:
    """Raise :class:`MissingExtra` if any of ``modules`` (default: :data:`EXTRA_MODULES` of ``extra``) is absent."""
    for name in modules or EXTRA_MODULES[extra]:
        if sys.modules.get(name) is not None:
            continue  # imported already (faust's lazy module then has no __spec__, which find_spec refuses)
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package missing, or the module blocked (sys.modules[name] None)
            found = False
        if not found:
            raise MissingExtra(f"{what} needs the {extra} extra: pip install 'streamflow[{extra}]' "
                               f"(no module named {name!r})")


def require_java(what: str = "Flink") -> str:
    """The ``java`` PyFlink will start (``$JAVA_HOME/bin/java``, else ``java`` on ``PATH``), or
    :class:`MissingPrerequisite` saying how to get one."""
    home = os.environ.get("JAVA_HOME")
    if home:
        java = Path(home) / "bin" / "java"
        if os.access(java, os.X_OK):
            return str(java)
        raise MissingPrerequisite(f"{what} needs a Java 17 runtime: JAVA_HOME={home} has no bin/java; "
                                  "point JAVA_HOME at a JDK 17 (or unset it to use java on PATH)")
    java_on_path = shutil.which("java")
    if java_on_path is None:
        raise MissingPrerequisite(f"{what} needs a Java 17 runtime and there is no java on PATH: install JDK 17 "
                                  "(apt-get install openjdk-17-jre-headless) or set JAVA_HOME")
    return java_on_path


def require_flink(what: str, cluster: str | None = None) -> None:
    """PyFlink, a JVM and, when submitting to ``cluster`` (``HOST:PORT``), a JobManager answering there."""
    require_extra("flink", what=what)
    require_java(what)
    if cluster:
        require_cluster(cluster)


def require_cluster(cluster: str, timeout_s: float = CLUSTER_PROBE_TIMEOUT_S) -> dict:
    """The ``/overview`` of the Flink JobManager at ``HOST:PORT``, or :class:`MissingPrerequisite` within
    ``timeout_s`` if none answers there (PyFlink itself would wait over a minute, then print a Java trace).

    >>> require_cluster("127.0.0.1:1", timeout_s=1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    streamflow.prerequisites.MissingPrerequisite: no Flink cluster answers at 127.0.0.1:1 (Connection refused): ...
    """
    host, _, port = cluster.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--cluster must be HOST:PORT, got {cluster!r}")
    import urllib.request  # here: ~10 ms of every command's start-up otherwise

    try:
        with urllib.request.urlopen(f"http://{host}:{port}/overview", timeout=timeout_s) as response:
            overview = json.loads(response.read().decode())
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        reason = getattr(reason, "strerror", None) or str(reason)
        raise MissingPrerequisite(f"no Flink cluster answers at {cluster} ({reason}): start one with `streamflow "
                                  f"flink-cluster start --port {port}`, or run without --cluster (a local "
                                  "MiniCluster)") from exc
    if not isinstance(overview, dict) or "taskmanagers" not in overview:
        raise MissingPrerequisite(f"{cluster} answers, but not as a Flink JobManager's REST endpoint")
    if overview["taskmanagers"] < 1:
        raise MissingPrerequisite(f"the Flink cluster at {cluster} has no TaskManager to run the job")
    return overview


def require_broker(what: str, bootstrap: str | None = None, timeout_s: float = BROKER_PROBE_TIMEOUT_S) -> str:
    """The bootstrap servers (``bootstrap``, else the settings') if one of them answers as a Kafka broker within
    ``timeout_s``, else :class:`MissingPrerequisite` naming how to start one (a client would retry for minutes).

    >>> require_broker("consume", "127.0.0.1:1", timeout_s=1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    streamflow.prerequisites.MissingPrerequisite: consume needs a Kafka broker and none answers at 127.0.0.1:1 ...
    """
    from connectors.tunnel.kafka import probe_broker
    from streamflow.settings import env_name, settings

    servers = settings(kafka_bootstrap=bootstrap).kafka_bootstrap
    try:
        probe_broker(servers, timeout_s)
    except ConnectionError as exc:
        raise MissingPrerequisite(f"{what} needs a Kafka broker and none answers at {servers} ({exc}): start one "
                                  f"with `make broker-up`, or point {env_name('kafka_bootstrap')} at one") from None
    return servers


def require_server(url: str, what: str, fix: str, timeout_s: float = CLUSTER_PROBE_TIMEOUT_S) -> None:
    """Something accepts connections at ``url``'s host and port within ``timeout_s``, else
    :class:`MissingPrerequisite` naming ``fix`` (a request would wait up to its own, longer timeout).

    >>> require_server("http://127.0.0.1:1", "release", "start one", timeout_s=1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    streamflow.prerequisites.MissingPrerequisite: release: nothing answers at http://127.0.0.1:1 (Connection ...
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s)://HOST[:PORT] URL")
    try:
        with socket.create_connection((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)),
                                      timeout=timeout_s):
            pass
    except OSError as exc:
        raise MissingPrerequisite(f"{what}: nothing answers at {url} ({exc.strerror or exc}): {fix}") from None
