"""The release server's admin client: publish a bundle, start/advance/roll back a release, read the status.

What ``streamflow release ...`` calls. Every command carries the server's admin token
(``<server dir>/admin.token``); the server verifies a published bundle itself, so nothing here is trusted.

Example (needs a release server)::

    admin = AdminClient("http://127.0.0.1:8470", token=Path(".streamflow/deploy/admin.token").read_text())
    admin.publish(Path("out/counter/2"))
    admin.start("counter", "2", {"steps": [0.01, 0.05, 0.2, 0.5, 1.0], "beta": ["phone-1"]})
"""

from __future__ import annotations

import base64
import contextlib
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from streamflow.deploy.bundle import directory_fetcher, read_signed
from streamflow.deploy.manifest import Manifest


class AdminError(Exception):
    """The server refused a command (the message is its reason) or could not be reached."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class AdminClient:
    """Admin commands over HTTP (see the module docstring)."""

    def __init__(self, base_url: str, token: str, timeout_s: float = 60.0):
        self.base_url = base_url.rstrip("/")
        self.token = token.strip()
        self.timeout_s = timeout_s

    def publish(self, bundle_dir: Path) -> dict[str, Any]:
        """Upload a built bundle directory (``manifest.json``, ``manifest.sig``, ``files/``)."""
        manifest, signature = read_signed(Path(bundle_dir))
        parsed = Manifest.from_bytes(manifest)  # only to know which files to send: the server verifies
        fetch = directory_fetcher(Path(bundle_dir))
        files = {entry.name: base64.b64encode(fetch(entry)).decode() for entry in parsed.files}
        return self._call("POST", "/deploy/api/bundles", {"manifest": base64.b64encode(manifest).decode(),
                                                          "signature": base64.b64encode(signature).decode(),
                                                          "files": files})

    def start(self, task: str, version: str, plan: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._call("POST", "/deploy/api/releases", {"task": task, "version": version, "plan": plan or {}})

    def advance(self, task: str) -> dict[str, Any]:
        return self._call("POST", f"/deploy/api/tasks/{task}/advance", {})

    def rollback(self, task: str, reason: str = "by command", block: bool = False) -> dict[str, Any]:
        return self._call("POST", f"/deploy/api/tasks/{task}/rollback", {"reason": reason, "block": block})

    def pin(self, task: str, version: str) -> dict[str, Any]:
        return self._call("POST", f"/deploy/api/tasks/{task}/pin", {"version": version})

    def status(self) -> dict[str, Any]:
        return self._call("GET", "/deploy/api/status", None)

    def _call(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base_url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            with contextlib.suppress(json.JSONDecodeError, AttributeError):
                text = json.loads(text).get("error", text)
            raise AdminError(f"{method} {path}: {exc.code} {text}", exc.code) from None
        except (urllib.error.URLError, OSError) as exc:
            raise AdminError(f"{method} {self.base_url}{path}: {exc}") from None
