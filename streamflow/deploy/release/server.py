"""The release server: an aiohttp app on 127.0.0.1 that answers the app's requests with deploy directives.

Protocol (push-then-pull, piggybacked on the app's own requests). Every request in a device's name is
signed with that device's key (``X-Streamflow-Auth``, :mod:`streamflow.deploy.device_auth`; the keys are
the tunnel's key registry, ``devices``):

- any request carrying ``X-Streamflow-Tasks: ipv=2,sessions=1`` and ``X-Streamflow-Device: <id>`` (optional
  ``X-Streamflow-Attrs: k=v,...``, ``X-Streamflow-User``) gets, in the same response, ``X-Streamflow-Deploy:
  [<directive>, ...]`` when the device should change something (:mod:`streamflow.deploy.release.policy`); a
  malformed device header or a request not signed by that device gets ``X-Streamflow-Deploy-Error:
  <reason>`` instead (nothing of it is noted) and the request is served as usual. ``GET /app/...``
  stands for the app's own API here.
- ``GET /deploy/bundles/<task>/<version>/manifest.json`` and ``.../manifest.sig``: the signed manifest.
- ``GET /deploy/static/<sha256>``: a shared file, cacheable forever (a CDN may sit in front).
- ``GET /deploy/api/files/<sha256>``, signed: any file, exclusive ones included, not cached, only to a
  device the policy has on a version listing it.
- ``POST /deploy/api/report`` ``{"device", "task", "version", "ok", "reason"}``, signed by that device: its
  success or failure (counted only if the device was offered the release); devices with a tunnel report
  over Kafka instead (:meth:`DeployServer.read_tunnel_reports`).
- ``GET /deploy/status``: the read-only HTML status page; ``GET /deploy/api/status``: the same as JSON.
- ``GET /metrics`` (Prometheus, :mod:`streamflow.metrics.deploy`), ``GET /healthz``, ``GET /readyz``.
- Admin (``Authorization: Bearer <token>``, the token in ``<dir>/admin.token``, mode 0600):
  ``POST /deploy/api/bundles`` (publish: manifest, signature and files, base64 in JSON; the signature
  and every file's digest and size are verified before anything is stored), ``POST /deploy/api/releases``
  (start), ``POST /deploy/api/tasks/<task>/advance|rollback|pin``.

Bodies are limited per route: :data:`DEVICE_BODY_BYTES` everywhere, the bundle size only for a publish
whose admin token was checked first.

Example (a real server on a free port, in a thread)::

    server = DeployServer(".streamflow/deploy", trusted=TrustedKeys.from_files(["release.key.pub"]),
                          devices=KeyRegistry(".streamflow/keys.json"))
    with serve_in_thread(server) as base_url:
        ...
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from connectors.private import create_private, private_dir, read_private, tighten
from streamflow.deploy.device_auth import WINDOW_S, verify_request
from streamflow.deploy.manifest import check_task_name
from streamflow.deploy.protocol import (
    ATTRS_HEADER,
    DEPLOY_HEADER,
    DEVICE_HEADER,
    TASKS_HEADER,
    USER_HEADER,
    parse_pairs,
    valid_version,
)
from streamflow.deploy.release.policy import Target
from streamflow.deploy.release.stages import PublishedBundle, ReleaseError, ReleaseManager, ReleasePlan, Simulator
from streamflow.deploy.release.state import ReleaseStore
from streamflow.metrics.deploy import DeployMetrics

if TYPE_CHECKING:
    from connectors.tunnel.keys import KeyRegistry
    from streamflow.deploy.release.tunnel_reports import TunnelReportReader
    from streamflow.deploy.signing import TrustedKeys

log = logging.getLogger("streamflow.deploy.release.server")

DEFAULT_PORT = 8470
DEPLOY_ERROR_HEADER = "X-Streamflow-Deploy-Error"
IMMUTABLE = "public, max-age=31536000, immutable"
MAX_BUNDLE_BYTES = 256 << 20
#: The largest body a request may have but an admin's publish (a report is a few hundred bytes).
DEVICE_BODY_BYTES = 64 << 10
_DEVICE = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def check_device(device: str | None) -> str:
    """``device`` if it is a usable device id (1-128 of letters, digits, ``_.:@-``), else ``ValueError``."""
    if device is None or not _DEVICE.match(device):
        raise ValueError(f"device id {device!r} must be 1 to 128 letters, digits or _.:@-")
    return device


class DeployServer:
    """The release manager behind an aiohttp application (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str], trusted: TrustedKeys | None = None, *,
                 devices: KeyRegistry | None = None, admin_token: str | None = None,
                 clock: Callable[[], float] = time.time, simulator: Simulator | None = None,
                 max_bundle_bytes: int = MAX_BUNDLE_BYTES, tick_s: float = 0.5, auth_window_s: float = WINDOW_S):
        self.dir = Path(directory)
        self.devices = devices  # the devices' keys; None: no device is known, every device request is refused
        self.auth_window_s = auth_window_s
        self.store = ReleaseStore(self.dir)
        self.manager = ReleaseManager(self.store, clock=clock, simulator=simulator)
        self.trusted = trusted
        self.admin_token = admin_token or load_admin_token(self.dir)
        self.max_bundle_bytes = max_bundle_bytes
        self.tick_s = tick_s
        self.stats: Counter[str] = Counter()  # requests, directives, bad headers, refused reports...
        self.tunnel_reader: TunnelReportReader | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.metrics = DeployMetrics(self)  # GET /metrics (streamflow.metrics.deploy)

    def read_tunnel_reports(self, registry: KeyRegistry | None = None, *, bootstrap: str | None = None,
                            topic: str | None = None) -> None:
        """Also take device reports off the Kafka tunnel (:mod:`streamflow.deploy.release.tunnel_reports`) while serving
        (verified with ``registry``, default the server's ``devices``)."""
        from streamflow.deploy.release.tunnel_reports import TunnelReportReader

        registry = registry or self.devices
        if registry is None:
            raise ValueError("tunnel reports are verified with the devices' keys: give the server a key registry")
        options: dict[str, Any] = {"topic": topic} if topic else {}
        self.tunnel_reader = TunnelReportReader(self.report_threadsafe, registry, bootstrap=bootstrap, **options)

    def report_threadsafe(self, device: str, task: str, version: str, ok: bool, reason: str) -> None:
        """A report from another thread (the tunnel reader): applied on the server's event loop."""
        if self._loop is None:
            raise RuntimeError("the server is not running")
        self._loop.call_soon_threadsafe(lambda: self.manager.report(device, task, version, ok=ok, reason=reason,
                                                                    via="tunnel"))

    # -- the application ---------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._piggyback], client_max_size=DEVICE_BODY_BYTES)
        r = app.router
        r.add_route("*", "/app/{tail:.*}", self._app_api)
        r.add_get("/deploy/bundles/{task}/{version}/manifest.json", self._manifest)
        r.add_get("/deploy/bundles/{task}/{version}/manifest.sig", self._signature)
        r.add_get("/deploy/static/{sha256}", self._static)
        r.add_get("/deploy/api/files/{sha256}", self._exclusive)
        r.add_post("/deploy/api/report", self._report)
        r.add_get("/deploy/status", self._status_page)
        r.add_get("/deploy/api/status", self._status)
        r.add_get("/deploy/api/releases/{release_id}/coverage", self._coverage)
        r.add_post("/deploy/api/bundles", self._publish)
        r.add_post("/deploy/api/releases", self._start)
        r.add_post("/deploy/api/tasks/{task}/{command}", self._task_command)
        r.add_get("/metrics", self._metrics)
        r.add_get("/healthz", self._healthz)
        r.add_get("/readyz", self._readyz)
        app.cleanup_ctx.append(self._ticker)
        return app

    async def _ticker(self, app: web.Application) -> Any:
        async def loop() -> None:
            while True:
                await asyncio.sleep(self.tick_s)
                try:
                    self.manager.tick()
                except Exception:  # noqa: BLE001 - a failed tick (disk full, say) must not stop the server
                    log.exception("release tick failed")

        self._loop = asyncio.get_running_loop()
        task = self._loop.create_task(loop())
        if self.tunnel_reader is not None:
            self.tunnel_reader.start()
        yield
        if self.tunnel_reader is not None:
            await asyncio.to_thread(self.tunnel_reader.stop)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        self.manager.flush()

    @web.middleware
    async def _piggyback(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        self.stats["requests"] += 1
        tasks = request.headers.get(TASKS_HEADER)
        device: str | None = None
        refused: str | None = None
        if tasks is not None:
            try:
                device = await self._device(request)
            except web.HTTPUnauthorized as exc:
                refused = exc.text
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            if tasks is not None:
                self._decide(request, exc, tasks, device, refused)
            raise
        if tasks is not None:
            self._decide(request, response, tasks, device, refused)
        return response

    async def _device(self, request: web.Request) -> str:
        """The device that signed this request (:mod:`streamflow.deploy.device_auth`); ``HTTPUnauthorized`` saying
        why not. The body is read (at most the route's limit) to check its digest."""
        known = request.get("device")
        if known is not None:
            return known
        headers = request.headers
        try:
            device = check_device(headers.get(DEVICE_HEADER))
            key = self.devices.key_for(device) if self.devices is not None else None
            if key is None:
                raise ValueError(f"device {device!r} is not registered (streamflow tunnel keys add DEVICE)")
            body = await request.read() if request.body_exists else b""
            verify_request(key, request.method, request.raw_path, headers, body, time.time(), self.auth_window_s)
        except ValueError as exc:
            self.stats["unauthenticated"] += 1
            raise web.HTTPUnauthorized(text=f"device authentication failed: {exc}") from None
        request["device"] = device
        return device

    def _decide(self, request: web.Request, response: web.StreamResponse, tasks: str, device: str | None,
                refused: str | None) -> None:
        if device is None:
            self.stats["bad_device_header"] += 1
            response.headers[DEPLOY_ERROR_HEADER] = (refused or "unauthenticated")[:300]
            return
        headers = request.headers
        started = time.perf_counter()
        value = self.manager.decide_header(device, tasks, headers.get(ATTRS_HEADER), headers.get(USER_HEADER))
        self.metrics.decision.observe(time.perf_counter() - started)
        if value is not None:
            self.stats["directives"] += 1
            response.headers[DEPLOY_HEADER] = value

    # -- operating it: Prometheus metrics, liveness, readiness ---------------------------------------
    async def _metrics(self, request: web.Request) -> web.Response:
        body, content_type = self.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        why = self.metrics.ready()
        return web.Response(text="ready\n") if why is None else web.Response(status=503, text=f"not ready: {why}\n")

    # -- device endpoints -------------------------------------------------------------------------
    async def _app_api(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "path": request.match_info["tail"]})

    def _stored_bundle(self, request: web.Request) -> Any:
        task, version = request.match_info["task"], request.match_info["version"]
        bundle = self.store.bundle(task, version)
        if bundle is None:
            raise web.HTTPNotFound(text=f"no bundle {task}@{version}")
        return bundle

    async def _manifest(self, request: web.Request) -> web.Response:
        bundle = self._stored_bundle(request)
        return web.Response(body=bundle.manifest, content_type="application/json",
                            headers={"Cache-Control": IMMUTABLE, "ETag": f'"{bundle.digest}"'})

    async def _signature(self, request: web.Request) -> web.Response:
        bundle = self._stored_bundle(request)
        return web.Response(body=bundle.signature, content_type="application/octet-stream",
                            headers={"Cache-Control": IMMUTABLE})

    def _file(self, sha256: str, *, shared_only: bool) -> Path:
        info = self.store.file_info(sha256) if _SHA256.match(sha256) else None
        path = self.store.file_path(sha256) if info is not None else None
        if path is None or info is None:
            raise web.HTTPNotFound(text=f"no file {sha256[:64]!r}")
        if shared_only and info.scope != "shared":
            raise web.HTTPNotFound(text=f"file {sha256} is exclusive: fetch it from /deploy/api/files/ with the "
                                        "device header")
        return path

    async def _static(self, request: web.Request) -> web.FileResponse:
        sha256 = request.match_info["sha256"]
        path = self._file(sha256, shared_only=True)
        return web.FileResponse(path, headers={"Cache-Control": IMMUTABLE, "ETag": f'"{sha256}"',
                                               "Content-Type": "application/octet-stream"})

    async def _exclusive(self, request: web.Request) -> web.FileResponse:
        device = await self._device(request)
        headers = request.headers
        sha256 = request.match_info["sha256"]
        path = self._file(sha256, shared_only=False)
        # per device: only to a device the policy has on a version listing the file (its signed attributes)
        attrs = parse_pairs(headers.get(ATTRS_HEADER, ""))
        policy = self.manager.policy
        for task, version in self.store.versions_with_file(sha256):
            task_policy = policy.tasks.get(task)
            if task_policy is not None and task_policy.want(device, attrs, headers.get(USER_HEADER)) == version:
                break
        else:
            self.stats["exclusive_refused"] += 1
            raise web.HTTPForbidden(text=f"device {device!r} is not to run a version with file {sha256}")
        self.stats["exclusive_files"] += 1
        log.debug("exclusive file %s to device %s", sha256[:12], device)
        return web.FileResponse(path, headers={"Cache-Control": "private, no-store",
                                               "Content-Type": "application/octet-stream"})

    async def _report(self, request: web.Request) -> web.Response:
        device = await self._device(request)
        body = await _json_body(request)
        try:
            if body.get("device") != device:
                raise ValueError(f"report for device {body.get('device')!r} signed by device {device!r}")
            task = check_task_name(body.get("task"))
            version = valid_version(body.get("version"))
            ok = body.get("ok")
            if not isinstance(ok, bool):
                raise ValueError(f"'ok' must be true or false, got {ok!r}")
            reason = body.get("reason") or ""
            if not isinstance(reason, str):
                raise ValueError(f"'reason' must be a string, got {type(reason).__name__}")
        except ValueError as exc:
            self.stats["refused_reports"] += 1
            log.warning("refused report %s: %s", _short(body), exc)
            raise _bad_request(f"refused report: {exc}") from exc
        self.manager.report(device, task, version, ok=ok, reason=reason, via="http")
        return web.json_response({"ok": True})

    # -- reading -----------------------------------------------------------------------------------
    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response({**self.manager.status(), "server": dict(self.stats)})

    async def _coverage(self, request: web.Request) -> web.Response:
        release_id = request.match_info["release_id"]
        if release_id not in self.manager.releases:
            raise web.HTTPNotFound(text=f"no release {release_id!r}")
        return web.json_response(self.manager.coverage(release_id))

    async def _status_page(self, request: web.Request) -> web.Response:
        from streamflow.deploy.release.status_page import render

        status = self.manager.status()
        coverage = {r["release_id"]: self.manager.coverage(r["release_id"]) for r in status["releases"][:6]}
        events = self.store.events(limit=30)
        return web.Response(text=render(status, coverage, events), content_type="text/html",
                            headers={"Cache-Control": "no-store"})

    # -- admin -------------------------------------------------------------------------------------
    def _admin(self, request: web.Request) -> None:
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.admin_token}".encode()):
            raise web.HTTPUnauthorized(text="admin commands need 'Authorization: Bearer <token>' (the server's "
                                            "admin.token)")

    async def _publish(self, request: web.Request) -> web.Response:
        self._admin(request)  # before a byte of the body is read: only an admin may send a large one
        body = await _json_body(request.clone(client_max_size=self.max_bundle_bytes * 2))
        try:
            manifest = _b64(body, "manifest")
            signature = _b64(body, "signature")
            files = body.get("files")
            if not isinstance(files, dict):
                raise ValueError("'files' must map each file name to its base64 content")
            contents = {name: _b64(files, name) for name in files}
            bundle = await asyncio.to_thread(self.publish, manifest, signature, contents)
        except (ValueError, ReleaseError) as exc:
            raise _conflict(str(exc)) if isinstance(exc, ReleaseError) else _bad_request(str(exc)) from exc
        return web.json_response({"task": bundle.task, "version": bundle.version, "digest": bundle.digest})

    def publish(self, manifest: bytes, signature: bytes, files: Mapping[str, bytes]) -> PublishedBundle:
        """Verify a bundle (signature, every file's digest and size, nothing more nor less) and store it.

        Raises ``ValueError`` (the bundle's :class:`~streamflow.deploy.errors.BundleError` reason and
        message) for anything that does not check out; nothing is stored then.
        """
        from streamflow.deploy.bundle import BundleError, verify_manifest

        if self.trusted is None:
            raise ValueError("this server trusts no signing key (start it with --trusted-key KEY.pub)")
        try:
            parsed = verify_manifest(manifest, signature, self.trusted)
        except BundleError as exc:
            raise ValueError(exc.report()) from exc
        total = sum(len(data) for data in files.values())
        if total > self.max_bundle_bytes:
            raise ValueError(f"{parsed.task}@{parsed.version}: {total} bytes of files, more than the server's "
                             f"{self.max_bundle_bytes}")
        names = {entry.name for entry in parsed.files}
        if set(files) != names:
            missing, extra = sorted(names - set(files)), sorted(set(files) - names)
            raise ValueError(f"{parsed.task}@{parsed.version}: files do not match the manifest (missing: "
                             f"{missing or 'none'}, not in the manifest: {extra or 'none'})")
        for entry in parsed.files:
            data = files[entry.name]
            digest = hashlib.sha256(data).hexdigest()
            if digest != entry.sha256 or len(data) != entry.size:
                raise ValueError(f"tampered: {parsed.task}@{parsed.version}: {entry.name} has sha256 {digest} and "
                                 f"{len(data)} bytes, the manifest says {entry.sha256} and {entry.size}")
        for entry in parsed.files:
            self.store.put_file(files[entry.name])
        digest = hashlib.sha256(manifest).hexdigest()
        bundle = PublishedBundle(parsed.task, parsed.version, digest, parsed.key_id, parsed.previous)
        return self.manager.add_bundle(bundle, manifest, signature,
                                       [(e.name, e.sha256, e.size, e.scope) for e in parsed.files])

    async def _start(self, request: web.Request) -> web.Response:
        self._admin(request)
        body = await _json_body(request)
        try:
            task = check_task_name(body.get("task"))
            version = valid_version(str(body.get("version")))
            plan = plan_from_json(body.get("plan") or {})
            release = await asyncio.to_thread(self.manager.start, task, version, plan)
        except ReleaseError as exc:
            raise _conflict(str(exc)) from exc
        except (ValueError, TypeError) as exc:
            raise _bad_request(str(exc)) from exc
        return web.json_response(release.to_json())

    async def _task_command(self, request: web.Request) -> web.Response:
        self._admin(request)
        task, command = request.match_info["task"], request.match_info["command"]
        body = await _json_body(request) if request.can_read_body else {}
        try:
            check_task_name(task)
            if command == "advance":
                result = self.manager.advance(task).to_json()
            elif command == "rollback":
                result = self.manager.rollback(task, str(body.get("reason") or "by command"),
                                               block=bool(body.get("block", False))).to_json()
            elif command == "pin":
                version = valid_version(str(body.get("version")))
                self.manager.set_stable(task, version)
                result = {"task": task, "stable": version}
            else:
                raise web.HTTPNotFound(text=f"no command {command!r} (advance, rollback, pin)")
        except ReleaseError as exc:
            raise _conflict(str(exc)) from exc
        except ValueError as exc:
            raise _bad_request(str(exc)) from exc
        return web.json_response(result)


def plan_from_json(data: Mapping[str, Any]) -> ReleasePlan:
    """A :class:`ReleasePlan` from the JSON an admin client sends (unknown fields refused)."""
    known = {"steps", "beta", "rules", "users", "step_interval_s", "max_failure_rate", "min_samples", "simulate"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown release plan field(s) {unknown}; known: {sorted(known)}")
    fields: dict[str, Any] = {k: data[k] for k in ("step_interval_s", "max_failure_rate", "min_samples", "simulate")
                              if k in data}
    if "steps" in data:
        fields["steps"] = tuple(float(s) for s in data["steps"])
    if "beta" in data:
        fields["beta"] = tuple(check_device(d) for d in data["beta"])
    fields["target"] = Target.parse(data.get("rules") or (), data.get("users"))
    return ReleasePlan(**fields)


def load_admin_token(directory: Path) -> str:
    """The admin token in ``<directory>/admin.token``, created (mode 0600, never through a symlink) if missing."""
    path = private_dir(directory) / "admin.token"
    with contextlib.suppress(FileExistsError):
        create_private(path, secrets.token_urlsafe(32).encode())
    tighten(path, 0o600)
    return read_private(path, 4096).decode().strip()


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _bad_request(f"the body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise _bad_request(f"the body must be a JSON object, got {type(body).__name__}")
    return body


def _b64(mapping: Mapping[str, Any], key: str) -> bytes:
    value = mapping.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{key!r} must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"{key!r} is not valid base64: {exc}") from exc


def _short(body: Any) -> str:
    text = json.dumps(body, default=str)
    return text if len(text) <= 200 else text[:200] + "..."


def _bad_request(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=json.dumps({"error": message}), content_type="application/json")


def _conflict(message: str) -> web.HTTPConflict:
    return web.HTTPConflict(text=json.dumps({"error": message}), content_type="application/json")


def run(server: DeployServer, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> None:
    """Serve until interrupted (``streamflow deploy-server``)."""
    web.run_app(server.app(), host=host, port=port, access_log=None, print=None)


@contextlib.contextmanager
def serve_in_thread(server: DeployServer, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Run ``server`` on its own event loop in a thread; yields its base URL; stops it on exit."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict[str, Any] = {}

    async def start() -> None:
        runner = web.AppRunner(server.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        holder["runner"] = runner
        holder["port"] = runner.addresses[0][1]

    def main() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(start())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            holder["error"] = exc
            started.set()
            return
        started.set()
        loop.run_forever()
        loop.run_until_complete(holder["runner"].cleanup())
        loop.close()

    thread = threading.Thread(target=main, name="deploy-server", daemon=True)
    thread.start()
    started.wait(30)
    if "error" in holder:
        raise holder["error"]
    try:
        yield f"http://{host}:{holder['port']}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
