"""Ed25519 keys that sign bundle manifests, and the set of public keys a device trusts.

A signing key is a PEM file (PKCS#8, unencrypted, mode 0600) kept by whoever builds bundles; its
public half is ``<key>.pub`` (PEM SubjectPublicKeyInfo), the file devices are provisioned with. A
key's id is the first 16 hex digits of the sha256 of its raw 32-byte public key; a manifest names
the key that signed it by that id.

(These are not the tunnel's keys: ``connectors/tunnel/keys.py`` holds per-device HMAC secrets that
authenticate feature batches; these are one asymmetric key pair per publisher, whose public half
every device holds.)

Example:
    >>> import tempfile, pathlib
    >>> key = pathlib.Path(tempfile.mkdtemp()) / "release.key"
    >>> key_id = generate_key(key)
    >>> trusted = TrustedKeys.from_files([public_key_path(key)])
    >>> signature = sign(load_signing_key(key), b"manifest bytes")
    >>> trusted.verify(key_id, b"manifest bytes", signature), trusted.verify(key_id, b"tampered", signature)
    (True, False)
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from connectors.private import create_private
from streamflow.prerequisites import MissingExtra

try:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
except ImportError as exc:  # the core install stays light; deployment needs the extra
    raise MissingExtra(f"signing and verifying bundles needs the deploy extra: pip install 'streamflow[deploy]' "
                       f"({exc})") from exc

SIGNATURE_BYTES = 64


def key_id(public_key: Ed25519PublicKey) -> str:
    """The id a manifest names its key by: sha256 of the raw public key, first 16 hex digits."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def public_key_path(private_key_path: str | os.PathLike[str]) -> Path:
    """Where the public half of a signing key lives: ``<key>.pub``."""
    path = Path(private_key_path)
    return path.with_name(path.name + ".pub")


def generate_key(path: str | os.PathLike[str]) -> str:
    """Write a new signing key to ``path`` (0600) and its public key to ``<path>.pub``; returns the key id.

    An existing file is never overwritten (``FileExistsError``).
    """
    path = Path(path)
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = private.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    path.parent.mkdir(parents=True, exist_ok=True)
    pub_path = public_key_path(path)
    if pub_path.exists():
        raise FileExistsError(f"{pub_path} exists; not overwriting a key")
    create_private(path, pem)
    pub_path.write_bytes(public)
    return key_id(private.public_key())


def load_signing_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """The Ed25519 private key in PEM file ``path``; ``ValueError`` if it is not one."""
    data = Path(path).read_bytes()
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path} is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
    return key


def load_public_key(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    """The Ed25519 public key in PEM file ``path``; ``ValueError`` if it is not one."""
    data = Path(path).read_bytes()
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path} is not a PEM public key: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
    return key


def sign(private_key: Ed25519PrivateKey, data: bytes) -> bytes:
    """The raw 64-byte Ed25519 signature of ``data``."""
    return private_key.sign(data)


class TrustedKeys:
    """The public keys a device (or the release server) accepts manifests from, by key id, each optionally limited
    to some task names (a publisher's scope: a key for team B's tasks cannot sign team A's).

    Example:
        >>> TrustedKeys().get("0123456789abcdef") is None
        True
        >>> import tempfile, pathlib
        >>> key = pathlib.Path(tempfile.mkdtemp()) / "team-b.key"
        >>> kid = generate_key(key)
        >>> trusted = TrustedKeys.from_files([f"{public_key_path(key)}=sessions,windows"])
        >>> trusted.allows(kid, "sessions"), trusted.allows(kid, "ipv"), trusted.scope(kid)
        (True, False, ('sessions', 'windows'))
    """

    def __init__(self, keys: Iterable[Ed25519PublicKey] = ()):
        self._keys: dict[str, Ed25519PublicKey] = {}
        self._scopes: dict[str, frozenset[str]] = {}
        for key in keys:
            self.add(key)

    @classmethod
    def from_files(cls, paths: Iterable[str | os.PathLike[str]]) -> TrustedKeys:
        """Trust the public keys in these PEM files; ``KEY.pub=task,task`` limits a key to those tasks."""
        trusted = cls()
        for spec in paths:
            path, tasks = parse_key_spec(spec)
            trusted.add(load_public_key(path), tasks)
        return trusted

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str]) -> TrustedKeys:
        """Trust every ``*.pub`` file in ``directory`` (for any task)."""
        return cls.from_files(sorted(Path(directory).glob("*.pub")))

    def add(self, key: Ed25519PublicKey, tasks: Iterable[str] | None = None) -> str:
        """Trust ``key`` (for ``tasks`` only, if given); returns its id."""
        if not isinstance(key, Ed25519PublicKey):
            raise TypeError(f"a trusted key is an Ed25519PublicKey, not {type(key).__name__}")
        kid = key_id(key)
        self._keys[kid] = key
        if tasks is None:
            self._scopes.pop(kid, None)
        else:
            from streamflow.deploy.manifest import check_task_name

            scope = frozenset(check_task_name(t) for t in tasks)
            if not scope:
                raise ValueError(f"key {kid}: an empty task scope would trust it for nothing")
            self._scopes[kid] = scope
        return kid

    def get(self, kid: str) -> Ed25519PublicKey | None:
        return self._keys.get(kid)

    def ids(self) -> list[str]:
        return sorted(self._keys)

    def scope(self, kid: str) -> tuple[str, ...] | None:
        """The task names key ``kid`` may sign, sorted; None: any task."""
        scope = self._scopes.get(kid)
        return tuple(sorted(scope)) if scope is not None else None

    def allows(self, kid: str, task: str) -> bool:
        """True if key ``kid`` is trusted to sign ``task``."""
        if kid not in self._keys:
            return False
        scope = self._scopes.get(kid)
        return scope is None or task in scope

    def __contains__(self, kid: object) -> bool:
        return kid in self._keys

    def verify(self, kid: str, data: bytes, signature: bytes) -> bool:
        """True if key ``kid`` is trusted and ``signature`` is its signature of ``data``."""
        key = self._keys.get(kid)
        if key is None or not isinstance(signature, (bytes, bytearray)) or len(signature) != SIGNATURE_BYTES:
            return False
        try:
            key.verify(bytes(signature), data)
        except InvalidSignature:
            return False
        return True


def parse_key_spec(spec: str | os.PathLike[str]) -> tuple[Path, list[str] | None]:
    """``KEY.pub`` → (path, None); ``KEY.pub=ipv,sessions`` → (path, ["ipv", "sessions"]).

    Example:
        >>> parse_key_spec("keys/team-b.pub=sessions, windows")
        (PosixPath('keys/team-b.pub'), ['sessions', 'windows'])
    """
    text = os.fspath(spec)
    path, sep, tasks = text.rpartition("=") if "=" in text else (text, "", "")
    if not sep:
        return Path(text), None
    return Path(path), [t.strip() for t in tasks.split(",") if t.strip()]
