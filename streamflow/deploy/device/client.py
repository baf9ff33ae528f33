"""The device's side of the piggyback protocol: app requests that carry task versions and bring back directives.

Standard library only (``http.client``, one kept-alive connection, thread-safe), so the device core
stays light. Every :meth:`DeployClient.request` sends the device's task versions
(``X-Streamflow-Tasks``), id, attributes and user, and returns the response with the directives the
server piggybacked on it (``X-Streamflow-Deploy``). The directives are requests, not trust: the
updater verifies whatever it downloads (:mod:`streamflow.deploy.device.updater`). Every request in the
device's name (app requests, exclusive files, reports) is signed with the device's key
(:mod:`streamflow.deploy.device_auth`); the server refuses those that are not.

Example (needs a release server)::

    key = KeyRegistry(".streamflow/keys.json").key_for("phone-7")   # streamflow tunnel keys add phone-7
    client = DeployClient("http://127.0.0.1:8470", "phone-7", key, attrs={"os": "android"})
    client.tasks = {"ipv": "2"}
    response, directives = client.request("/app/feed")
    for d in directives:                       # {"task", "version", "manifest", "signature", "action"}
        manifest, signature = client.fetch_manifest(d)
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streamflow.deploy.device_auth import AUTH_HEADER, sign_request
from streamflow.deploy.manifest import MAX_MANIFEST_BYTES, check_task_name
from streamflow.deploy.protocol import (
    ATTRS_HEADER,
    DEPLOY_HEADER,
    DEVICE_HEADER,
    REPORTS_TABLE,
    TASKS_HEADER,
    USER_HEADER,
    directive,
    format_pairs,
    report_row,
    valid_version,
)

if TYPE_CHECKING:
    from connectors.tunnel.sink import TunnelSink

DIRECTIVE_FIELDS = ("task", "version", "manifest", "signature", "action")
ACTIONS = ("update", "rollback")
MAX_SIGNATURE_BYTES = 1024


class DeployClientError(Exception):
    """The server could not be reached, refused a request, or answered something malformed."""


@dataclass(frozen=True)
class Response:
    """An HTTP response: status, headers (lower-case names) and body."""

    status: int
    headers: Mapping[str, str]
    body: bytes = field(repr=False)

    def json(self) -> Any:
        return json.loads(self.body)


def parse_directives(value: str | None) -> list[dict[str, str]]:
    """The directives of an ``X-Streamflow-Deploy`` value; ``DeployClientError`` naming what is malformed.

    Example:
        >>> parse_directives('[{"task":"ipv","version":"3","manifest":"/deploy/bundles/ipv/3/manifest.json",'
        ...                  '"signature":"/deploy/bundles/ipv/3/manifest.sig","action":"update"}]')[0]["action"]
        'update'
        >>> parse_directives('[{"task":"ipv"}]')  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        streamflow.deploy.device.client.DeployClientError: directive {"task": "ipv"} lacks version, manifest, ...
    """
    if not value:
        return []
    try:
        items = json.loads(value)
    except json.JSONDecodeError as exc:
        raise DeployClientError(f"{DEPLOY_HEADER} is not JSON: {exc}") from exc
    if not isinstance(items, list):
        raise DeployClientError(f"{DEPLOY_HEADER} must be a JSON list, got {type(items).__name__}")
    out = []
    for item in items:
        if not isinstance(item, dict):
            raise DeployClientError(f"directive {item!r} is not an object")
        missing = [f for f in DIRECTIVE_FIELDS if not isinstance(item.get(f), str)]
        if missing:
            raise DeployClientError(f"directive {json.dumps(item)} lacks {', '.join(missing)}")
        if item["action"] not in ACTIONS:
            raise DeployClientError(f"directive {json.dumps(item)}: unknown action {item['action']!r}")
        try:
            check_task_name(item["task"])
            valid_version(item["version"])
        except ValueError as exc:
            raise DeployClientError(f"directive {json.dumps(item)}: {exc}") from None
        expected = directive(item["task"], item["version"], item["action"])
        for key in ("manifest", "signature"):
            if item[key] != expected[key]:
                raise DeployClientError(f"directive {json.dumps(item)}: {key} must be {expected[key]}")
        out.append({f: item[f] for f in DIRECTIVE_FIELDS})
    return out


class DeployClient:
    """A device's HTTP client for the release server (see the module docstring).

    ``key`` is the device's own key (its entry in the tunnel's key registry); ``tasks`` (task → version)
    is what the device runs now; the updater keeps it current.
    """

    def __init__(self, base_url: str, device_id: str, key: bytes, attrs: Mapping[str, str] | None = None, *,
                 user: str | None = None, timeout_s: float = 10.0, tunnel: TunnelSink | None = None):
        if not isinstance(key, (bytes, bytearray)) or len(key) < 16:
            raise ValueError(f"device {device_id!r}: its key must be at least 16 bytes (the tunnel's key registry "
                             "holds one per device: streamflow tunnel keys add DEVICE)")
        url = urllib.parse.urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"release server URL {base_url!r} must be http(s)://HOST[:PORT]")
        self.base_url = base_url.rstrip("/")
        self._scheme, self._host, self._port = url.scheme, url.hostname, url.port
        self._prefix = url.path.rstrip("/")
        self.device_id = device_id
        self.key = bytes(key)
        self.attrs = dict(attrs or {})
        self.user = user
        self.tasks: dict[str, str] = {}
        self.timeout_s = timeout_s
        self.tunnel = tunnel
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()

    def headers(self, tasks: Mapping[str, str] | None = None) -> dict[str, str]:
        """The piggyback headers of one request."""
        headers = {DEVICE_HEADER: self.device_id, TASKS_HEADER: format_pairs(self.tasks if tasks is None else tasks)}
        if self.attrs:
            headers[ATTRS_HEADER] = format_pairs(self.attrs)
        if self.user is not None:
            headers[USER_HEADER] = self.user
        return headers

    def request(self, path: str, *, method: str = "GET", body: bytes | None = None,
                tasks: Mapping[str, str] | None = None) -> tuple[Response, list[dict[str, str]]]:
        """An app request carrying this device's task versions; the response and the directives on it."""
        response = self._send(method, path, body, self.headers(tasks))
        return response, parse_directives(response.headers.get(DEPLOY_HEADER.lower()))

    def fetch_manifest(self, directive: Mapping[str, str]) -> tuple[bytes, bytes]:
        """The manifest bytes and the signature a directive points at (not yet verified)."""
        manifest = self._get(directive["manifest"], MAX_MANIFEST_BYTES)
        signature = self._get(directive["signature"], MAX_SIGNATURE_BYTES)
        return manifest, signature

    def fetch_file(self, entry: Any, max_bytes: int | None = None) -> bytes:
        """A bundle file's bytes (shared: the static path; exclusive: the API); its digest is the caller's to check.

        ``entry`` has ``sha256``, ``size`` and ``scope`` (a manifest's file entry). At most ``entry.size + 1``
        bytes (or ``max_bytes``) are read.
        """
        sha256 = str(entry.sha256)
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise DeployClientError(f"file digest {sha256!r} is not 64 hex digits")
        path = f"/deploy/static/{sha256}" if entry.scope == "shared" else f"/deploy/api/files/{sha256}"
        # one byte more than declared: a longer file then fails the caller's size check with its reason
        limit = entry.size + 1 if max_bytes is None else min(entry.size + 1, max_bytes)
        return self._get(path, limit, self.headers())  # exclusive files are served per device: who, what it runs

    def report(self, task: str, version: str, ok: bool, reason: str | None = None) -> None:
        """Tell the server ``task@version`` loaded and runs (``ok``) or failed, and why.

        With a ``tunnel``, the report is a ``deploy_reports`` row on it (signed, spooled while the broker
        is away; :mod:`streamflow.deploy.release.tunnel_reports`); otherwise ``POST /deploy/api/report``.
        """
        if self.tunnel is not None:
            self.tunnel.write(REPORTS_TABLE, [report_row(task, version, ok, reason)])
            return
        body = json.dumps({"device": self.device_id, "task": task, "version": version, "ok": ok,
                           "reason": (reason or "")[:2000]}).encode()
        response = self._send("POST", "/deploy/api/report", body, {DEVICE_HEADER: self.device_id,
                                                                   "Content-Type": "application/json"})
        if response.status != 200:
            raise DeployClientError(f"report refused ({response.status}): {response.body[:300]!r}")

    # -- plumbing ------------------------------------------------------------------------------
    def _get(self, path: str, max_bytes: int, headers: Mapping[str, str] | None = None) -> bytes:
        response = self._send("GET", path, None, dict(headers or {}), max_bytes=max_bytes)
        if response.status != 200:
            raise DeployClientError(f"GET {path}: {response.status} {response.body[:300]!r}")
        return response.body

    def _send(self, method: str, path: str, body: bytes | None, headers: dict[str, str],
              max_bytes: int | None = None) -> Response:
        if not path.startswith("/"):
            raise ValueError(f"request path {path!r} must start with '/'")
        if DEVICE_HEADER in headers:  # in the device's name: signed with its key
            headers[AUTH_HEADER] = sign_request(self.key, method, self._prefix + path, headers, body, time.time())
        with self._lock:
            for attempt in (1, 2):  # a kept-alive connection the server closed: reconnect once
                conn = self._connection()
                try:
                    conn.request(method, self._prefix + path, body=body, headers=headers)
                    raw = conn.getresponse()
                    length = raw.getheader("Content-Length")
                    if max_bytes is not None and raw.status != 200:  # an error: its reason, not the file
                        max_bytes = max(max_bytes, 4096)
                    if max_bytes is not None and length is not None and int(length) > max_bytes:
                        self._close()
                        raise DeployClientError(f"{method} {path}: {length} bytes, more than the {max_bytes} expected")
                    data = raw.read() if max_bytes is None else raw.read(max_bytes + 1)
                    if max_bytes is not None and len(data) > max_bytes:
                        self._close()
                        raise DeployClientError(f"{method} {path}: more than the {max_bytes} bytes expected")
                    return Response(raw.status, {k.lower(): v for k, v in raw.getheaders()}, data)
                except (http.client.HTTPException, OSError) as exc:
                    self._close()
                    if attempt == 2:
                        raise DeployClientError(f"{method} {self.base_url}{path}: {type(exc).__name__}: {exc}") from exc
        raise AssertionError("unreachable")

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=self.timeout_s)
        return self._conn

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self._close()
