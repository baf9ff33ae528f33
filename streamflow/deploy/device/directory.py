"""Deploy from a bundles directory instead of over HTTP: side-loading, an offline fleet, a simulation.

:class:`DirectoryClient` answers the :class:`~streamflow.deploy.device.updater.Updater`'s three questions
from a directory ``streamflow bundle build`` wrote (``<task>/<version>/manifest.json|manifest.sig|
files/...``) — the same directory the release server serves — and keeps the device's reports (and
appends them to a JSON-lines file, if given). It trusts nothing it reads: the updater verifies the
signature and every digest as it does for bytes from the network.

Example:
    >>> import tempfile, pathlib
    >>> client = DirectoryClient(pathlib.Path(tempfile.mkdtemp()))
    >>> client.report("ipv", "3", False, "tampered: ...")
    >>> client.reports
    [{'task': 'ipv', 'version': '3', 'ok': False, 'reason': 'tampered: ...'}]
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from streamflow.deploy.errors import DirectiveInvalid
from streamflow.deploy.layout import FILES, MANIFEST, SIGNATURE, read_regular
from streamflow.deploy.manifest import MAX_MANIFEST_BYTES, FileEntry, Manifest, check_task_name, version_key
from streamflow.deploy.signing import SIGNATURE_BYTES


class DirectoryClient:
    """A deploy client over a bundles directory (see the module docstring)."""

    def __init__(self, bundles: Path, report_file: Path | None = None):
        self.bundles = Path(bundles)
        self.report_file = report_file
        self.reports: list[dict[str, Any]] = []
        #: What the device runs (task → version), kept current by the updater.
        self.tasks: dict[str, str] = {}
        #: How often each file (by sha256) was fetched: a shared file is fetched once per device.
        self.fetched: Counter[str] = Counter()
        self._index: dict[str, Path] = {}
        self._lock = threading.Lock()

    def fetch_manifest(self, directive: Mapping[str, Any]) -> tuple[bytes, bytes]:
        try:
            version_key(directive["version"])
            root = self.bundles / check_task_name(directive["task"]) / directive["version"]
        except (KeyError, ValueError, TypeError) as exc:
            raise DirectiveInvalid(f"directive {dict(directive)!r}: {exc}") from None
        return (read_regular(root / MANIFEST, MAX_MANIFEST_BYTES, self.bundles),
                read_regular(root / SIGNATURE, SIGNATURE_BYTES + 1, self.bundles))

    def fetch_file(self, entry: FileEntry) -> bytes:
        with self._lock:
            self.fetched[entry.sha256] += 1
            path = self._index.get(entry.sha256)
            if path is None:
                self._reindex()
                path = self._index.get(entry.sha256)
        if path is None:
            raise FileNotFoundError(f"no bundle under {self.bundles} lists a file with sha256 {entry.sha256}")
        return read_regular(path, entry.size + 1, self.bundles)

    def report(self, task: str, version: str, ok: bool, reason: str = "") -> None:
        row = {"task": task, "version": version, "ok": ok, "reason": reason}
        with self._lock:
            self.reports.append(row)
            if self.report_file is not None:
                with open(self.report_file, "a") as out:
                    out.write(json.dumps(row) + "\n")

    def _reindex(self) -> None:
        """Map sha256 → a file listing it, from every manifest under the directory (as the server does)."""
        for manifest_path in self.bundles.glob(f"*/*/{MANIFEST}"):
            try:
                manifest = Manifest.from_bytes(manifest_path.read_bytes())
            except Exception:  # not a bundle the updater would accept either; skip it
                continue
            for file in manifest.files:
                self._index.setdefault(file.sha256, manifest_path.parent / FILES / file.name)
