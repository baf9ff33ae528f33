"""A device's bundle store: installed task versions (the running one and N-1) and a file cache by sha256.

Layout under the store's root::

    cache/<sha256[:2]>/<sha256>           every file fetched, by content (a file shared by two versions,
                                          or by two tasks, is fetched once)
    tasks/<task>/<version>/               an installed bundle (manifest.json, manifest.sig, files/...)
    tasks/<task>/state.json               {"current": "3", "previous": "2", "highest": "3"}
    blocked.json                          manifest digests that failed on this device, with the reason

Everything read back is verified again (:func:`~streamflow.deploy.bundle.load_installed`, and the
cache checks a file's digest on the way out), so a file changed on disk is refused, not run.

Example:
    >>> import tempfile, pathlib, hashlib
    >>> cache = ContentCache(pathlib.Path(tempfile.mkdtemp()))
    >>> digest = hashlib.sha256(b"weights").hexdigest()
    >>> cache.put(digest, b"weights"); cache.get(digest)
    b'weights'
    >>> cache.get("0" * 64) is None
    True
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from connectors.private import private_dir, write_private
from streamflow.deploy.bundle import install_bundle, load_installed
from streamflow.deploy.errors import DigestMismatch
from streamflow.deploy.layout import MANIFEST
from streamflow.deploy.manifest import FileEntry, Limits, Manifest, check_task_name, version_key
from streamflow.deploy.signing import TrustedKeys

log = logging.getLogger("streamflow.deploy")


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` in one rename (mode 0600; a crash leaves the old file or the new one)."""
    private_dir(path.parent)
    write_private(path, data)


class ContentCache:
    """Files by their sha256; a file is checked against its digest when it goes in and when it comes out."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, sha256: str) -> Path:
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise ValueError(f"{sha256!r} is not a sha256 hex digest")
        return self.root / sha256[:2] / sha256

    def holds(self, sha256: str) -> bool:
        """True if the file is cached and still matches its digest (one that no longer does is dropped)."""
        return self.get(sha256) is not None

    def get(self, sha256: str) -> bytes | None:
        """The file, or None if it is not cached (a cached file that no longer matches is dropped)."""
        path = self.path(sha256)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if hashlib.sha256(data).hexdigest() != sha256:
            log.warning("cached file %s no longer matches its digest: dropped", path)
            path.unlink(missing_ok=True)
            return None
        return data

    def put(self, sha256: str, data: bytes) -> None:
        if hashlib.sha256(data).hexdigest() != sha256:
            raise DigestMismatch(f"refusing to cache bytes under {sha256}: their sha256 differs")
        path = self.path(sha256)
        if not path.exists():
            write_atomically(path, data)

    def digests(self) -> set[str]:
        return {p.name for p in self.root.glob("??/*") if len(p.name) == 64}

    def prune(self, keep: Iterable[str]) -> int:
        """Remove every cached file not in ``keep``; how many were removed."""
        keep = set(keep)
        removed = 0
        for digest in self.digests() - keep:
            self.path(digest).unlink(missing_ok=True)
            removed += 1
        return removed


@dataclass(frozen=True)
class TaskState:
    """Which installed version of a task runs, the one before it (kept for one rollback), and the highest version
    ever accepted (never older than that again, but for that one rollback)."""

    current: str | None = None
    previous: str | None = None
    highest: str | None = None


class BundleStore:
    """Installed bundles of a device, verified with ``trusted`` whenever they are read back."""

    def __init__(self, root: Path, trusted: TrustedKeys, limits: Limits | None = None):
        self.root = private_dir(root)
        self.trusted = trusted
        self.limits = limits or Limits()
        self.cache = ContentCache(self.root / "cache")

    def bundle_dir(self, task: str, version: str) -> Path:
        version_key(version)  # a version is dotted digits: safe as a directory name
        return self.root / "tasks" / check_task_name(task) / version

    # -- versions ----------------------------------------------------------------------------
    def tasks(self) -> list[str]:
        """Tasks with a recorded state."""
        return sorted(p.parent.name for p in (self.root / "tasks").glob("*/state.json"))

    def state(self, task: str) -> TaskState:
        path = self.root / "tasks" / check_task_name(task) / "state.json"
        try:
            value = json.loads(path.read_text())
            state = TaskState(value.get("current"), value.get("previous"), value.get("highest"))
            for version in (state.current, state.previous, state.highest):
                if version is not None:
                    version_key(version)
            return state
        except FileNotFoundError:
            return TaskState()
        except (ValueError, AttributeError, TypeError) as exc:
            log.warning("task state %s is damaged (%s): treated as nothing installed", path, exc)
            return TaskState()

    def set_state(self, task: str, current: str | None, previous: str | None) -> None:
        """Record the running version and the kept N-1 (None: no rollback left); the highest only ever rises."""
        path = self.root / "tasks" / check_task_name(task) / "state.json"
        highest = max((v for v in (self.state(task).highest, current, previous) if v is not None),
                      key=version_key, default=None)
        write_atomically(path, json.dumps({"current": current, "previous": previous, "highest": highest}).encode())

    def installed(self, task: str) -> list[str]:
        """Versions of ``task`` on disk (complete installs only)."""
        root = self.root / "tasks" / check_task_name(task)
        return sorted((p.name for p in root.glob("*") if (p / MANIFEST).is_file()), key=version_key)

    # -- bundles -----------------------------------------------------------------------------
    def install(self, manifest: Manifest, signature: bytes, fetch: Callable[[FileEntry], bytes]) -> Path:
        """Install a verified manifest's bundle (files from the cache when it has them)."""
        return install_bundle(manifest, fetch, self.bundle_dir(manifest.task, manifest.version),
                              limits=self.limits, signature=signature, cache=self.cache)

    def load(self, task: str, version: str) -> Manifest:
        """An installed bundle's manifest, verified again from disk with every file."""
        return load_installed(self.bundle_dir(task, version), self.trusted, limits=self.limits)

    def prune(self, task: str) -> None:
        """Remove the versions of ``task`` other than the current one and N-1, and cached files no installed
        bundle lists."""
        state = self.state(task)
        for version in self.installed(task):
            if version not in (state.current, state.previous):
                shutil.rmtree(self.bundle_dir(task, version), ignore_errors=True)
        keep: set[str] = set()
        for manifest_path in (self.root / "tasks").glob("*/*/" + MANIFEST):
            try:
                keep.update(entry.sha256 for entry in Manifest.from_bytes(manifest_path.read_bytes()).files)
            except Exception:  # a damaged install keeps nothing alive; it is refused when loaded
                continue
        self.cache.prune(keep)

    # -- manifests that failed here ------------------------------------------------------------
    def blocked(self, digest: str) -> str | None:
        """Why this manifest (by digest) was blocked on this device, or None."""
        return self._blocklist().get(digest)

    def block(self, digest: str, reason: str) -> None:
        blocked = self._blocklist()
        blocked[digest] = reason
        write_atomically(self.root / "blocked.json", json.dumps(blocked, sort_keys=True, indent=1).encode())

    def _blocklist(self) -> dict[str, str]:
        path = self.root / "blocked.json"
        try:
            value = json.loads(path.read_bytes())
        except FileNotFoundError:
            return {}
        except ValueError as exc:
            log.warning("blocklist %s is damaged: %s", path, exc)
            return {}
        return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}
