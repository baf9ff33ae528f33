"""A bundle directory on disk: where its parts live, and reading/writing them without following links.

    <dir>/manifest.json   <dir>/manifest.sig   <dir>/files/<name> ...

Writes create new files only (``O_EXCL``, ``O_NOFOLLOW``) under checked relative names, into a
temporary directory that is renamed into place, so a bundle directory is complete or absent. Reads
never follow a symlink, never block on a FIFO and read at most a given number of bytes.

Example:
    >>> import tempfile, pathlib
    >>> dest = pathlib.Path(tempfile.mkdtemp()) / "ipv" / "3"
    >>> _ = assemble(dest, [("job.py", b"job = None")], b"{}", b"s" * 64)
    >>> read_regular(dest / FILES / "job.py", 100), sorted(p.name for p in dest.iterdir())
    (b'job = None', ['files', 'manifest.json', 'manifest.sig'])
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

from streamflow.deploy.errors import ManifestInvalid, UnsafePath
from streamflow.deploy.manifest import check_file_name

MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
FILES = "files"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def assemble(dest: Path, files: Iterable[tuple[str, bytes | Path]], manifest: bytes, signature: bytes | None
             ) -> Path:
    """Write a bundle directory at ``dest`` (which must not exist) in one rename; returns ``dest``.

    ``files`` yields ``(name, content)``: bytes are written, a path (a verified file of a cache) is
    hard-linked (copied where links are not possible), so a large model is on the disk once. It is
    consumed lazily: an error while it yields leaves nothing behind.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        for name, content in files:
            if isinstance(content, Path):
                link_new(tmp / FILES, name, content)
            else:
                write_new(tmp / FILES, name, content)
        write_new(tmp, MANIFEST, manifest)
        if signature is not None:
            write_new(tmp, SIGNATURE, signature)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def write_new(root: Path, name: str, data: bytes) -> None:
    """Create ``root/name`` (which must not exist) holding ``data``; ``name`` must pass ``check_file_name``."""
    path = root / check_file_name(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def link_new(root: Path, name: str, source: Path) -> None:
    """Hard-link ``source`` as ``root/name`` (which must not exist); a copy if the file system cannot link."""
    path = root / check_file_name(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, path, follow_symlinks=False)
    except OSError:
        if path.exists():
            raise
        write_new(root, name, source.read_bytes())


def read_regular(path: Path, max_bytes: int, root: Path | None = None) -> bytes:
    """At most ``max_bytes`` of the regular file ``path``; a symlink (anywhere below ``root``), a FIFO or a
    device is refused with :class:`UnsafePath`. ``FileNotFoundError`` if it is missing."""
    if root is not None:
        current = root
        for part in path.relative_to(root).parts[:-1]:
            current = current / part
            if current.is_symlink():
                raise UnsafePath(f"{current.relative_to(root).as_posix()!r} is a symlink")
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if path.is_symlink():
            raise UnsafePath(f"{path.name!r} is a symlink") from None
        raise ManifestInvalid(f"cannot read {path}: {exc}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafePath(f"{path.name!r} is not a regular file")
        return f.read(max_bytes)
