"""Per-device signing keys: a registry file the cloud side reads and each device reads its own entry of.

The registry is a JSON file ``{"devices": {"<device id>": "<hex key>"}}`` written with mode 0600 through a fresh
temporary file (:mod:`connectors.private`, in a directory of mode 0700 when it makes one);
keys are 32 random bytes (HMAC-SHA256). A device needs only its own key; in production the cloud's
registry would hold all of them and each device would be provisioned with one (``export``).

Signing is here too, in one place: :func:`sign` and :func:`verify` (HMAC-SHA256, the full 32 bytes).
An envelope names its device by a 4-byte :func:`device_tag` rather than its id (any length up to 128);
:func:`key_candidates` gives the devices (and keys) with that tag, and the signature decides which one
sent it (two devices sharing a tag cost one more HMAC, never a wrong attribution).

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "keys.json")
    >>> registry = KeyRegistry(path)
    >>> key = registry.add("phone-1")
    >>> KeyRegistry(path).key_for("phone-1") == key, len(key)
    (True, 32)
    >>> cloud = KeyRegistry(path)
    >>> cloud.key_for("phone-2") is None
    True
    >>> _ = registry.add("phone-2")  # registered while the cloud runs: it sees the new key
    >>> import time; time.sleep(RELOAD_EVERY_S); cloud.key_for("phone-2") == registry.key_for("phone-2")
    True
    >>> [device for device, _ in key_candidates(cloud, device_tag("phone-2"))]
    ['phone-2']
    >>> verify(key, b"rows", sign(key, b"rows")), verify(key, b"rows!", sign(key, b"rows"))
    (True, False)
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import time
from collections.abc import Mapping
from pathlib import Path

from connectors.private import private_dir, write_private

#: The registry file a :class:`KeyRegistry` given no path reads (relative to the working directory). The CLI
#: passes ``streamflow.settings``' ``key_registry`` (``$STREAMFLOW_KEY_REGISTRY``, then this same path).
DEFAULT_REGISTRY_PATH = Path(".streamflow") / "keys.json"
#: How often at most an unknown device makes the registry look at its file again.
RELOAD_EVERY_S = 1.0
MAC_BYTES = 32
TAG_BYTES = 4
_DEVICE_ID = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")


def check_device_id(device: str) -> str:
    """``device`` if it is a usable device id (1-128 letters, digits and ``_.:@-``), else ``ValueError``."""
    if not isinstance(device, str) or not _DEVICE_ID.match(device):
        raise ValueError(f"device id {device!r} must be 1-128 characters of letters, digits and _.:@-")
    return device


def sign(key: bytes, data: bytes) -> bytes:
    """HMAC-SHA256 of ``data`` with ``key`` (32 bytes)."""
    return hmac.digest(key, data, hashlib.sha256)


def verify(key: bytes, data: bytes, mac: bytes) -> bool:
    """Whether ``mac`` is :func:`sign` of ``data`` with ``key`` (compared in constant time)."""
    return hmac.compare_digest(sign(key, data), mac)


def device_tag(device: str) -> bytes:
    """The 4 bytes an envelope names its device by: the start of SHA-256 of the device id."""
    return hashlib.sha256(device.encode()).digest()[:TAG_BYTES]


def key_candidates(keys: KeyRegistry | Mapping[str, bytes], tag: bytes) -> list[tuple[str, bytes]]:
    """The (device, key) pairs whose device has ``tag``: from a :class:`KeyRegistry` or a device → key mapping."""
    if isinstance(keys, KeyRegistry):
        return keys.candidates(tag)
    return [(device, key) for device, key in keys.items() if device_tag(device) == tag]


class KeyRegistry:
    """Device id → HMAC key, kept in the JSON file ``path`` (default :data:`DEFAULT_REGISTRY_PATH`; read once,
    :meth:`reload` re-reads it)."""

    def __init__(self, path: str | os.PathLike[str] | None = None):
        self.path = Path(path) if path else DEFAULT_REGISTRY_PATH
        self._keys: dict[str, bytes] = {}
        self._tags: dict[bytes, list[str]] = {}
        self.reload()

    def reload(self) -> None:
        """Re-read the file (a missing file is an empty registry)."""
        self._loaded_mtime = self._mtime()
        self._checked = time.monotonic()
        if not self.path.exists():
            self._keys = {}
        else:
            try:
                devices = json.loads(self.path.read_text())["devices"]
                self._keys = {check_device_id(d): bytes.fromhex(k) for d, k in devices.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"key registry {self.path} is not valid: {exc}") from exc
        self._index()

    def _index(self) -> None:
        tags: dict[bytes, list[str]] = {}
        for device in self._keys:
            tags.setdefault(device_tag(device), []).append(device)
        self._tags = tags

    def key_for(self, device: str) -> bytes | None:
        """The device's key, or None for a device the registry does not know.

        A device not known yet makes the registry re-read its file if the file changed since (a
        device registered while a consumer runs), at most every :data:`RELOAD_EVERY_S` seconds.
        """
        key = self._keys.get(device)
        if key is None and self._maybe_reload():
            key = self._keys.get(device)
        return key

    def candidates(self, tag: bytes) -> list[tuple[str, bytes]]:
        """The registered devices with :func:`device_tag` ``tag`` and their keys (re-reading the file as
        :meth:`key_for` does when none is known)."""
        devices = self._tags.get(tag)
        if devices is None and self._maybe_reload():
            devices = self._tags.get(tag)
        return [(device, self._keys[device]) for device in devices or ()]

    def _maybe_reload(self) -> bool:
        """Re-read the file if it changed, at most every RELOAD_EVERY_S; whether it was re-read."""
        if time.monotonic() - self._checked < RELOAD_EVERY_S:
            return False
        self._checked = time.monotonic()
        if self._mtime() == self._loaded_mtime:
            return False
        self.reload()
        return True

    def _mtime(self) -> int | None:
        try:
            return self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return None

    def devices(self) -> list[str]:
        return sorted(self._keys)

    def add(self, device: str, key: bytes | None = None) -> bytes:
        """Register ``device`` with ``key`` (default: 32 fresh random bytes) and save; returns the key."""
        check_device_id(device)
        if device in self._keys and key is None:
            raise ValueError(f"device {device!r} is already registered in {self.path}")
        key = key if key is not None else secrets.token_bytes(32)
        if len(key) < 16:
            raise ValueError("an HMAC key must be at least 16 bytes")
        self._keys[device] = key
        self._index()
        self._save()
        return key

    def remove(self, device: str) -> bool:
        """Forget ``device`` (its batches become unknown-device dead letters); False if it was not there."""
        if self._keys.pop(device, None) is None:
            return False
        self._index()
        self._save()
        return True

    def _save(self) -> None:
        """Write the file through a fresh temporary of mode 0600 (never a fixed name another local user could
        plant a 0644 file or a symlink at), renamed into place; a directory made for it is 0700."""
        if not self.path.parent.exists():  # an existing directory (a project's, say) keeps its mode
            private_dir(self.path.parent)
        body = json.dumps({"devices": {d: k.hex() for d, k in sorted(self._keys.items())}}, indent=1)
        write_private(self.path, body.encode())
