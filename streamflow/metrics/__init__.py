"""Prometheus metrics and health checks for the long-running parts (issue 30).

One module per part, each exposing counts the part keeps anyway (no second tally of the same thing):

- :mod:`.cloud`: the tunnel's cloud consumer (``streamflow tunnel consume --metrics-port``);
- :mod:`.device`: the device runner (``streamflow run --metrics-port``);
- :mod:`.serve`: the serving worker (``streamflow serve --metrics-port``, on faust's own web server);
- :mod:`.deploy`: the release server (``streamflow deploy-server``: ``/metrics`` on its own port).

The parts without an HTTP server of their own get :class:`MetricsServer`: a small threaded HTTP server on
127.0.0.1 that answers ``/metrics`` (the exposition of a ``prometheus_client`` registry), ``/healthz`` (the
process answers: liveness) and ``/readyz`` (200 once the part says it is ready, else 503 with the reason).
``prometheus-client`` is the ``metrics`` extra; :func:`require_metrics` says so in one line when it is missing.

Example:
    >>> from prometheus_client import CollectorRegistry, Counter
    >>> registry = CollectorRegistry()
    >>> Counter("demo_things", "things done", registry=registry).inc(3)
    >>> with MetricsServer(registry, port=0, ready=lambda: None) as server:
    ...     text = fetch(server.url + "/metrics")
    ...     health = fetch(server.url + "/healthz")
    >>> "demo_things_total 3.0" in text, health
    (True, 'ok\\n')
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from streamflow.prerequisites import require_extra

#: Where a metrics server binds unless told otherwise: this host only.
DEFAULT_HOST = "127.0.0.1"
#: ``ready()`` returns None when ready, else why not (a short sentence, the body of the 503).
Readiness = Callable[[], "str | None"]


def require_metrics(what: str) -> None:
    """Raise :class:`~streamflow.prerequisites.MissingExtra` naming ``pip install 'streamflow[metrics]'``."""
    require_extra("metrics", what=what)


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` of ``registry`` on ``host:port`` (0: a free port), in a
    daemon thread; :meth:`close` stops it. ``ready`` is asked at every ``/readyz``."""

    def __init__(self, registry: Any, port: int, ready: Readiness, host: str = DEFAULT_HOST):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._answer(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    self._answer(200, b"ok\n")
                elif path == "/readyz":
                    try:
                        why = ready()
                    except Exception as exc:  # noqa: BLE001 - a failing check means not ready, said so
                        why = f"{type(exc).__name__}: {exc}"
                    self._answer(200, b"ready\n") if why is None else self._answer(503, f"not ready: {why}\n".encode())
                else:
                    self._answer(404, b"/metrics, /healthz or /readyz\n")

            def _answer(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - scrapes are not news
                pass

        self._http = ThreadingHTTPServer((host, port), Handler)
        self._http.daemon_threads = True
        bound, self.port = self._http.server_address[:2]
        self.host = bound if isinstance(bound, str) else bound.decode()  # (an IPv4 address: a str)
        self._thread = threading.Thread(target=self._http.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fetch(url: str, timeout_s: float = 5.0) -> str:
    """The body of ``url`` as text, whatever its status (a 503 from ``/readyz`` included)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.read().decode()


__all__ = ["DEFAULT_HOST", "MetricsServer", "Readiness", "fetch", "require_metrics"]
