"""An on-disk store of named entries (arrays and/or JSON), checksummed, written atomically, kept
under a size limit by evicting the least recently used entries.

File layout of one entry::

    b"SFCACHE1" | u64 header length | JSON header | padding to 64 | array bytes

The header holds ``meta`` (any JSON), per array its dtype/shape/offset/size, and the CRC-32 of the
array bytes. An entry whose magic, header or checksum does not match is deleted and reported as a
miss, so the caller rebuilds it; a half-written entry can never be seen because entries are written
to a temporary file in the same directory and renamed into place. A hit touches the file's mtime:
eviction removes the oldest mtimes first.

>>> import tempfile, numpy as np
>>> store = EntryStore(tempfile.mkdtemp(), limit_bytes=1 << 20)
>>> store.put("k", {"w": np.ones(3, np.float32)}, meta={"kernel": "x"})
>>> arrays, meta = store.get("k"); arrays["w"].tolist(), meta["kernel"]
([1.0, 1.0, 1.0], 'x')
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"SFCACHE1"
ALIGN = 64
SUFFIX = ".sfc"
FILE_SUFFIXES = (SUFFIX, ".sfe")  # entries, and whole files kept by put_file (engine model files)
LINK_SUFFIX = ".sfl"  # links to a file of the store, resolved without reading the disk
_KEY = re.compile(r"^[A-Za-z0-9_.=-]{1,200}$")


def default_dir() -> Path:
    """``$STREAMFLOW_ENGINE_CACHE``, else ``$XDG_CACHE_HOME/streamflow/engine`` (``~/.cache/...``)."""
    env = os.environ.get("STREAMFLOW_ENGINE_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "streamflow" / "engine"


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _file_name(key: str) -> str:
    """The file of entry ``key``; a key that could name another path is refused."""
    if not _KEY.match(key):
        raise ValueError(f"cache key {key!r} must match {_KEY.pattern}")
    return key + SUFFIX


class EntryStore:
    """Checksummed, atomically written, LRU-limited entries in one directory (see module doc).

    ``limit_bytes`` caps the directory's total entry size; ``stats`` counts hits, misses, rebuilt
    (corrupt or unreadable) entries, writes and evictions.
    """

    def __init__(self, root: str | os.PathLike | None = None, limit_bytes: int = 512 << 20) -> None:
        self.root = Path(root) if root is not None else default_dir()
        self.limit_bytes = limit_bytes
        self.stats = {"hits": 0, "misses": 0, "corrupt": 0, "writes": 0, "evicted": 0}

    def path(self, key: str) -> Path:
        return self.root / _file_name(key)

    def exists(self, key: str) -> bool:
        """Whether the entry ``key`` is there (one ``stat``; no ``Path`` objects: a cold plan checks
        dozens of keys before its first kernel, ~30 us each through :meth:`path`)."""
        return os.path.exists(os.path.join(self.root, _file_name(key)))

    def get(self, key: str) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        """(arrays, meta) of a valid entry, or None (missing, or corrupt: then it is deleted)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            self.stats["misses"] += 1
            return None
        entry = self._decode(raw)
        if entry is None:
            self.stats["corrupt"] += 1
            self.stats["misses"] += 1
            path.unlink(missing_ok=True)
            return None
        self.stats["hits"] += 1
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used
        return entry

    @staticmethod
    def _decode(raw: bytes) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
        if len(raw) < len(MAGIC) + 8 or raw[: len(MAGIC)] != MAGIC:
            return None
        (n,) = struct.unpack_from("<Q", raw, len(MAGIC))
        start = len(MAGIC) + 8
        try:
            header = json.loads(raw[start : start + n])
            data_start = _align(start + n)
            data = memoryview(raw)[data_start:]
            if len(data) != header["data_bytes"] or zlib.crc32(data) != header["crc32"]:
                return None
            arrays = {a["name"]: np.frombuffer(data, np.dtype(a["dtype"]), int(np.prod(a["shape"], dtype=np.int64)),
                                               a["offset"]).reshape(a["shape"]) for a in header["arrays"]}
        except (ValueError, KeyError, TypeError):
            return None
        return arrays, header["meta"]

    def put(self, key: str, arrays: dict[str, np.ndarray], meta: dict[str, Any] | None = None) -> None:
        """Write an entry atomically (temp file + rename), then evict old entries over the limit."""
        path = self.path(key)
        table, offset, blobs = [], 0, []
        for name, a in arrays.items():
            a = np.ascontiguousarray(a)
            table.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset})
            pad = _align(offset + a.nbytes) - offset - a.nbytes
            blobs += [a.tobytes(), b"\0" * pad]
            offset += a.nbytes + pad
        data = b"".join(blobs)
        header = json.dumps({"arrays": table, "meta": meta or {}, "data_bytes": len(data),
                             "crc32": zlib.crc32(data)}, separators=(",", ":")).encode()
        head = MAGIC + struct.pack("<Q", len(header)) + header
        self._replace(path, lambda tmp: tmp.write_bytes(head + b"\0" * (_align(len(head)) - len(head)) + data))

    def prefetch(self, *paths: Path | tuple[Path, int]) -> None:
        """Ask the kernel to read these files (entries of this store, or anything; ``(path, n)``: its
        first ``n`` bytes) in the background now (``WILLNEED``), in this order: a cold process that
        needs several small files waits for the disk once, not once per file. Missing files are skipped."""
        for item in paths:
            path, n = item if isinstance(item, tuple) else (item, 0)
            with contextlib.suppress(OSError, AttributeError):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, n, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)

    def file(self, key: str, suffix: str, touch: bool = True) -> Path | None:
        """The path of a whole file kept by :meth:`put_file` (marked recently used unless ``touch`` is
        False: the caller marks it later), or None. The file's format checks its own integrity (an
        engine model file has a CRC-32 per weight)."""
        path = self.path(key).with_suffix(suffix)
        try:
            os.utime(path) if touch else os.stat(path)
        except FileNotFoundError:
            self.stats["misses"] += 1
            return None
        self.stats["hits"] += 1
        return path

    def put_file(self, key: str, suffix: str, write) -> Path:
        """Keep a whole file: ``write(tmp_path)`` writes it, then it is renamed into place atomically."""
        if suffix not in FILE_SUFFIXES:
            raise ValueError(f"suffix {suffix!r} is not one of {FILE_SUFFIXES}")
        path = self.path(key).with_suffix(suffix)
        self._replace(path, write)
        return path

    def _replace(self, path: Path, write) -> None:
        """``write(tmp_path)`` a temporary file beside ``path``, rename it into place atomically, evict."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=path.suffix)
        os.close(fd)
        try:
            write(Path(tmp))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.stats["writes"] += 1
        self.evict()

    def put_link(self, key: str, target: Path) -> None:
        """Remember ``target`` (a file of this store) under ``key``, as a symbolic link made atomically
        (temp link + rename). :meth:`link` resolves it with one system call and no disk read (a short
        link's target is kept in its inode), so a cold start can ask for the target's bytes before
        reading anything else."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{os.getpid()}-{key}{LINK_SUFFIX}"
        tmp.unlink(missing_ok=True)
        os.symlink(Path(target).name, tmp)
        os.replace(tmp, self.path(key).with_suffix(LINK_SUFFIX))

    def link(self, key: str) -> Path | None:
        """The file of this store that link ``key`` names (:meth:`put_link`), or None. The target is
        not checked: the caller checks what it reads there (it may have been evicted or replaced)."""
        try:
            name = os.readlink(self.path(key).with_suffix(LINK_SUFFIX))
        except OSError:
            return None
        stem, dot, suffix = name.rpartition(".")
        if not dot or "." + suffix not in FILE_SUFFIXES or not _KEY.match(stem):
            return None  # only a plain file name of this store, never a path elsewhere
        return self.root / name

    def delete(self, key: str, suffix: str = SUFFIX) -> None:
        self.path(key).with_suffix(suffix).unlink(missing_ok=True)

    def _files(self) -> list[Path]:
        return [p for s in FILE_SUFFIXES for p in self.root.glob("*" + s) if not p.name.startswith(".")]

    def keys(self, prefix: str = "") -> list[str]:
        return sorted(p.name[: -len(SUFFIX)] for p in self.root.glob(prefix + "*" + SUFFIX)
                      if not p.name.startswith("."))

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self._files())

    def evict(self) -> None:
        """Delete least recently used entries and files until the total size is within the limit."""
        entries = []
        for p in self._files():
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime_ns, st.st_size, p))
        total = sum(e[1] for e in entries)
        for _, size, p in sorted(entries, key=lambda e: e[0]):
            if total <= self.limit_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size
            self.stats["evicted"] += 1
