"""Files only this user may read: keys, tokens, state. One place for how they are created, for the tunnel's key
registry (:mod:`connectors.tunnel.keys`) and the release server's state and keys (``streamflow.deploy``): here, in
``connectors``, because the connectors may not import ``streamflow`` and both may import this.

- a directory is created (or tightened) to mode 0700; a symlink in its place is refused;
- a file is written under a fresh :func:`tempfile.mkstemp` name (``O_EXCL``, mode 0600: no fixed
  temporary name another local process could plant a symlink or a 0644 file at) and renamed into place;
- a file created once (a token, a key) is opened ``O_CREAT | O_EXCL | O_NOFOLLOW`` with mode 0600.

Example:
    >>> import tempfile, pathlib, stat
    >>> root = private_dir(pathlib.Path(tempfile.mkdtemp()) / "state")
    >>> write_private(root / "state.json", b"{}")
    >>> oct(stat.S_IMODE((root / "state.json").stat().st_mode)), oct(stat.S_IMODE(root.stat().st_mode))
    ('0o600', '0o700')
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def private_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as a directory of mode 0700 (created with its parents if missing; an existing one is tightened).

    ``ValueError`` if ``path`` is a symlink or not a directory.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    tighten(path, 0o700, directory=True)
    return path


def tighten(path: Path, mode: int, *, directory: bool = False) -> None:
    """Clear the permission bits of an existing ``path`` beyond ``mode``; a symlink (or the wrong kind of file) is
    refused with ``ValueError``. A missing ``path`` is left alone."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode) or (stat.S_ISDIR(info.st_mode) != directory):
        kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a directory" if directory else "a directory"
        raise ValueError(f"{path} is {kind}; refusing to use it for private state")
    if stat.S_IMODE(info.st_mode) & ~mode:
        os.chmod(path, stat.S_IMODE(info.st_mode) & mode, follow_symlinks=False)


def write_private(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` (mode 0600) in one rename: a crash leaves the old file or the new one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # O_EXCL, 0600, an unguessable name
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def create_private(path: Path, data: bytes) -> None:
    """Create ``path`` (which must not exist: ``FileExistsError``, also for a symlink there) holding ``data``, 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def read_private(path: Path, max_bytes: int = 1 << 20) -> bytes:
    """At most ``max_bytes`` of the regular file ``path``, never through a symlink (``ValueError``)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError:
        if path.is_symlink():
            raise ValueError(f"{path} is a symlink; refusing to read private state through it") from None
        raise
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file")
        return f.read(max_bytes)
