"""A bundle's manifest: what a task version is made of, in the canonical JSON form that gets signed.

Format 1 (``json.dumps(sort_keys=True, separators=(",", ":"))``, UTF-8)::

    {"created": "...", "files": [{"name": "job.py", "scope": "shared", "sha256": "<hex>", "size": 123}, ...],
     "format": 1, "job": "job.py", "key_id": "<16 hex>", "previous": "2", "task": "ipv", "version": "3"}

Parsing is strict: the bytes must be exactly the canonical form of what they decode to (so the
signature covers one unambiguous document: no duplicate keys, no extra whitespace, no NaN), every
field must be there with its type, no unknown field, and every file name must be safe to join under
a directory (:func:`check_file_name`).

Example:
    >>> m = Manifest("ipv", "3", "job.py", (FileEntry("job.py", "ab" * 32, 10, "shared"),), "0123456789abcdef",
    ...              previous="2", created="2024-01-01T00:00:00+00:00")
    >>> Manifest.from_bytes(m.to_bytes()) == m
    True
    >>> m.label, version_key("3.10") > version_key("3.9")
    ('ipv@3', True)
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from streamflow.deploy.errors import ManifestInvalid, UnsafePath

FORMAT = 1
SCOPES = ("shared", "exclusive")
#: Hard caps of the parser itself; a device's :class:`Limits` are usually tighter.
MAX_MANIFEST_BYTES = 1 << 20
MAX_NAME_CHARS = 255
_TASK = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")  # the same rule as a Task's name (streamflow/job.py)
_VERSION = re.compile(r"^[0-9]{1,9}(\.[0-9]{1,9}){0,3}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_KEY_ID = re.compile(r"^[0-9a-f]{16}$")
_FIELDS = {"format", "task", "version", "job", "created", "files", "key_id", "previous"}
_FILE_FIELDS = {"name", "sha256", "size", "scope"}


@dataclass(frozen=True)
class Limits:
    """What a device accepts: total bytes of a bundle's files and how many files."""

    max_bytes: int = 256 << 20
    max_files: int = 1000


def canonical_json(value: Any) -> bytes:
    """The one byte form of a JSON value that is signed and compared.

    Example:
        >>> canonical_json({"b": 1, "a": [1, "é"]})
        b'{"a":[1,"\\\\u00e9"],"b":1}'
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")


def version_key(version: object) -> tuple[int, ...]:
    """A version's sort key: ``"3"`` < ``"3.1"`` < ``"10"``; ``ValueError`` for anything but dotted numbers."""
    if not isinstance(version, str) or not _VERSION.match(version):
        raise ValueError(f"version {version!r} must be 1 to 4 dot-separated numbers, e.g. 3 or 1.2.0")
    return tuple(int(part) for part in version.split("."))


def check_task_name(task: object) -> str:
    """``task`` if it is a usable task name (letters, digits, underscores), else ``ValueError``."""
    if not isinstance(task, str) or not _TASK.match(task):
        raise ValueError(f"task name {task!r} must be letters, digits and underscores (not starting with a digit)")
    return task


def check_file_name(name: Any, bundle: str | None = None) -> str:
    """``name`` if joining it under a directory stays inside it, else :class:`UnsafePath`.

    A name is relative POSIX: no leading ``/``, no ``.`` or ``..`` or empty component, no backslash,
    no NUL or other control character, no drive letter, at most 255 characters.

    Example:
        >>> check_file_name("models/m.onnx")
        'models/m.onnx'
        >>> check_file_name("../etc/passwd")
        Traceback (most recent call last):
        ...
        streamflow.deploy.errors.UnsafePath: file name '../etc/passwd' has a '..' component
    """
    def refuse(why: str) -> UnsafePath:
        return UnsafePath(f"file name {name!r} {why}", bundle=bundle)

    if not isinstance(name, str) or not name:
        raise refuse("is not a non-empty string")
    if len(name) > MAX_NAME_CHARS:
        raise refuse(f"is longer than {MAX_NAME_CHARS} characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise refuse("has a NUL or control character")
    if "\\" in name:
        raise refuse("has a backslash")
    if name.startswith("/"):
        raise refuse("is absolute")
    if re.match(r"^[A-Za-z]:", name):
        raise refuse("starts with a drive letter")
    parts = name.split("/")
    if ".." in parts:
        raise refuse("has a '..' component")
    if any(part in ("", ".") for part in parts):
        raise refuse("has an empty or '.' component")
    return name


@dataclass(frozen=True)
class FileEntry:
    """One file of a bundle: its path inside the bundle, digest, size and how it is shipped.

    ``shared`` files are the same for every device (served from a cacheable static path);
    ``exclusive`` ones are fetched through the API with the device's identity.
    """

    name: str
    sha256: str
    size: int
    scope: str = "shared"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "sha256": self.sha256, "size": self.size, "scope": self.scope}


@dataclass(frozen=True)
class Manifest:
    """A task version: its files, the job module among them, the key that signed it, the version before it."""

    task: str
    version: str
    job: str
    files: tuple[FileEntry, ...]
    key_id: str
    previous: str | None = None
    created: str = ""
    format: int = FORMAT
    #: sha256 of the canonical bytes: the identity of this exact manifest (blocked digests, local blocklist).
    digest: str = field(default="", compare=False)

    @property
    def label(self) -> str:
        """``task@version``, how errors and logs name a bundle."""
        return f"{self.task}@{self.version}"

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)

    def entry(self, name: str) -> FileEntry:
        for entry in self.files:
            if entry.name == name:
                return entry
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "task": self.task, "version": self.version, "job": self.job,
                "created": self.created, "files": [entry.to_json() for entry in self.files],
                "key_id": self.key_id, "previous": self.previous}

    def to_bytes(self) -> bytes:
        """The canonical bytes (what is signed)."""
        return canonical_json(self.to_json())

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """Parse and validate canonical manifest bytes; :class:`ManifestInvalid` or :class:`UnsafePath` says why."""
        if not isinstance(data, (bytes, bytearray)):
            raise ManifestInvalid(f"a manifest is bytes, got {type(data).__name__}")
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestInvalid(f"manifest is {len(data)} bytes, more than {MAX_MANIFEST_BYTES}")
        value = parse_json(bytes(data), "manifest")
        manifest = cls.from_json(value)
        if canonical_json(value) != data:
            raise ManifestInvalid("manifest is not in canonical form (sorted keys, no spaces, UTF-8 JSON)",
                                  bundle=manifest.label)
        object.__setattr__(manifest, "digest", hashlib.sha256(data).hexdigest())
        return manifest

    @classmethod
    def from_json(cls, value: Any) -> Manifest:
        """Validate a decoded manifest (every field, every file name)."""
        if not isinstance(value, dict):
            raise ManifestInvalid(f"manifest must be a JSON object, got {type(value).__name__}")
        label = f"{value.get('task')}@{value.get('version')}"

        def bad(message: str) -> ManifestInvalid:
            return ManifestInvalid(message, bundle=label)

        missing, unknown = _FIELDS - value.keys(), value.keys() - _FIELDS
        if missing or unknown:
            raise bad(f"manifest fields: missing {sorted(missing)}, unknown {sorted(unknown)}")
        if value["format"] != FORMAT or type(value["format"]) is not int:
            raise bad(f"manifest format {value['format']!r} is not {FORMAT}")
        try:
            check_task_name(value["task"])
            version_key(value["version"])
            if value["previous"] is not None and version_key(value["previous"]) >= version_key(value["version"]):
                raise ValueError(f"previous version {value['previous']!r} is not lower than {value['version']!r}")
        except ValueError as exc:
            raise bad(str(exc)) from None
        if not isinstance(value["key_id"], str) or not _KEY_ID.match(value["key_id"]):
            raise bad(f"key_id {value['key_id']!r} must be 16 lowercase hex digits")
        if not isinstance(value["created"], str) or len(value["created"]) > 64:
            raise bad("created must be a string of at most 64 characters")
        files = value["files"]
        if not isinstance(files, list) or not files:
            raise bad("files must be a non-empty list")
        entries = tuple(_file_entry(item, label) for item in files)
        _check_layout([entry.name for entry in entries], label)
        if not isinstance(value["job"], str) or not value["job"].endswith(".py") \
                or value["job"] not in {entry.name for entry in entries}:
            raise bad(f"job {value['job']!r} must be one of the bundle's .py files")
        return cls(value["task"], value["version"], value["job"], entries, value["key_id"], value["previous"],
                   value["created"], value["format"])


def parse_json(data: bytes, what: str) -> Any:
    """Strict JSON from untrusted bytes: UTF-8, no duplicate keys, no NaN/Infinity; :class:`ManifestInvalid`."""
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in pairs]
        if len(set(keys)) != len(keys):
            raise ValueError(f"duplicate key in {keys}")
        return dict(pairs)

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=no_duplicates, parse_constant=no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ManifestInvalid(f"{what} is not valid JSON: {exc}") from None


def _file_entry(item: Any, label: str) -> FileEntry:
    if not isinstance(item, dict) or item.keys() != _FILE_FIELDS:
        raise ManifestInvalid(f"a file entry must be an object with exactly {sorted(_FILE_FIELDS)}: {item!r}",
                              bundle=label)
    name = check_file_name(item["name"], label)
    if not isinstance(item["sha256"], str) or not _SHA256.match(item["sha256"]):
        raise ManifestInvalid(f"file {name!r}: sha256 must be 64 lowercase hex digits", bundle=label)
    if type(item["size"]) is not int or item["size"] < 0:
        raise ManifestInvalid(f"file {name!r}: size must be a non-negative integer", bundle=label)
    if item["scope"] not in SCOPES:
        raise ManifestInvalid(f"file {name!r}: scope {item['scope']!r} is not one of {SCOPES}", bundle=label)
    return FileEntry(name, item["sha256"], item["size"], item["scope"])


def _check_layout(names: list[str], label: str) -> None:
    """No name twice, none both a file and a directory (``a`` and ``a/b``); case-insensitive, as some disks are."""
    seen: set[str] = set()
    for name in names:
        folded = name.casefold()
        if folded in seen:
            raise UnsafePath(f"file name {name!r} appears twice (names are compared case-insensitively)",
                             bundle=label)
        seen.add(folded)
    for name in names:
        parts = name.casefold().split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in seen:
                raise UnsafePath(f"file name {name!r} lies under {'/'.join(name.split('/')[:i])!r}, which is a file",
                                 bundle=label)
