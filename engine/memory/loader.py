"""Read weight blocks of an engine model file into buffers the caller owns.

One loader serves every runtime that streams weights from disk (budgeted inference, cold start).
It never maps the file: each read is one ``preadv`` straight into the caller's buffer (the GIL is
released while the kernel copies, so a background thread overlaps with numpy compute), followed by
``posix_fadvise(DONTNEED)`` on the range just read so the page cache does not keep a second copy.

Or, for a runtime that keeps every weight (the cold start), :meth:`WeightLoader.map_all` maps the
whole file once (private, copy-on-write: writeable views, no copy) and starts the kernel reading it
in the background (``MADV_WILLNEED``); :meth:`WeightLoader.verify` checks a mapped block's CRC-32
before its first use.

Every block (one weight) carries a CRC-32 in the file header. Reading a block whole, or its row
ranges in order (slice 0, 1, ..., last), checks it when the last byte arrives; a mismatch, a short
read, or a file replaced or resized since it was opened raises :class:`ModelFileError` naming the
block and the reason. Files written before checksums existed are checked for size only.

>>> loader = WeightLoader("model.sfe")                                 # doctest: +SKIP
>>> buf = np.empty(loader.blocks["conv1.w"].nbytes, np.uint8)           # doctest: +SKIP
>>> w = loader.read_into("conv1.w", buf)          # typed view of buf   # doctest: +SKIP
>>> part = loader.read_into("conv1.w", buf, rows=(0, 16))  # first 16 output channels  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.format import ModelFile


class ModelFileError(ValueError):
    """The model file is corrupt, truncated, or changed while in use."""


@dataclass(frozen=True)
class Block:
    """One weight in the file: where it is (absolute offset), its type and its checksum."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32: int | None

    @property
    def row_bytes(self) -> int:
        """Bytes per index of the first axis (a Conv's output channel, a transposed Gemm's row)."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


class WeightLoader:
    """Reads blocks of one model file; safe to call from one background thread while others compute.

    ``drop_cache`` (default True) advises the kernel to drop the pages just read.
    """

    def __init__(self, path: str | os.PathLike, *, drop_cache: bool = True) -> None:
        self.path = Path(path)
        self._fd = -1
        try:
            mf = ModelFile(self.path)
        except (ValueError, OSError) as e:  # bad magic, truncated or garbled header
            raise ModelFileError(f"{self.path}: unreadable model header ({e})") from e
        self.header = mf.header
        self.drop_cache = drop_cache
        self._fd = os.open(self.path, os.O_RDONLY)
        st = os.fstat(self._fd)
        self._identity = (st.st_ino, st.st_size, st.st_mtime_ns)
        self.blocks: dict[str, Block] = {}
        for e in self.header["weights"]:
            b = Block(e["name"], np.dtype(e["dtype"]), tuple(e["shape"]), mf.data_start + e["offset"],
                      e["nbytes"], e.get("crc32"))
            if b.offset + b.nbytes > st.st_size:
                self.close()
                raise ModelFileError(f"{self.path}: weight {b.name!r} ends at byte {b.offset + b.nbytes}, "
                                     f"past the end of the file ({st.st_size} bytes): truncated")
            self.blocks[b.name] = b
        self._progress: dict[str, tuple[int, int]] = {}  # block -> (next byte expected, running crc)
        self._map: mmap.mmap | None = None
        self._lock = threading.Lock()
        self.bytes_read = 0

    def map_all(self) -> dict[str, np.ndarray]:
        """Every block as a view of one private mapping of the file, not checked yet (see
        :meth:`verify`). The kernel starts reading the whole file now, in the background, so the
        disk streams it while the caller plans and computes; a view's pages are there, or arrive,
        when first touched. Writes to a view stay in this process (copy-on-write)."""
        if not self.blocks:
            return {}
        self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY)
        with contextlib.suppress(AttributeError, OSError):  # madvise: Python 3.8+ on Linux/BSD
            self._map.madvise(mmap.MADV_WILLNEED)
        return {b.name: np.frombuffer(self._map, b.dtype, count=int(np.prod(b.shape, dtype=np.int64)),
                                      offset=b.offset).reshape(b.shape) for b in self.blocks.values()}

    def verify(self, name: str, view: np.ndarray) -> None:
        """Check a mapped block against its CRC-32 (touching its pages: this is where it is read);
        :class:`ModelFileError` if it does not match."""
        b = self.blocks[name]
        if b.crc32 is not None and zlib.crc32(view.reshape(-1).view(np.uint8)) != b.crc32:
            raise ModelFileError(f"{self.path}: weight {name!r} fails its CRC-32 check: corrupt")
        self.bytes_read += b.nbytes

    def check_unchanged(self) -> None:
        """Raise if the file on disk was replaced, resized or touched since it was opened."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise ModelFileError(f"{self.path}: model file disappeared while in use ({e})") from e
        if (st.st_ino, st.st_size, st.st_mtime_ns) != self._identity:
            raise ModelFileError(f"{self.path}: model file changed while in use (inode/size/mtime "
                                 f"{self._identity} -> {(st.st_ino, st.st_size, st.st_mtime_ns)})")

    def read_into(self, name: str, out: np.ndarray, rows: tuple[int, int] | None = None) -> np.ndarray:
        """Read block ``name`` (or its first-axis ``rows`` range) into ``out``; returns ``out``'s
        leading bytes viewed with the block's dtype and (sliced) shape.

        ``out`` is any C-contiguous writable array with at least that many bytes.
        """
        b = self.blocks.get(name)
        if b is None:
            raise KeyError(f"{self.path}: no weight named {name!r}")
        r0, r1 = rows if rows is not None else (0, b.shape[0] if b.shape else 1)
        start, stop = (r0 * b.row_bytes, r1 * b.row_bytes) if b.shape else (0, b.nbytes)
        if not (0 <= start <= stop <= b.nbytes):
            raise ValueError(f"rows {rows} outside weight {name!r} of shape {b.shape}")
        n = stop - start
        dst = out.reshape(-1).view(np.uint8)
        if not out.flags.c_contiguous or not out.flags.writeable or dst.nbytes < n:
            raise ValueError(f"buffer for {name!r} must be contiguous, writable and hold {n} bytes")
        dst = dst[:n]
        if start == 0:
            self.check_unchanged()
        self._read_exact(b, dst, b.offset + start)
        self._check_crc(b, dst, start, stop)
        self.bytes_read += n
        shape = (r1 - r0, *b.shape[1:]) if b.shape else ()
        return dst.view(b.dtype).reshape(shape)

    def _read_exact(self, b: Block, dst: np.ndarray, offset: int) -> None:
        view, done = memoryview(dst), 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got == 0:
                raise ModelFileError(f"{self.path}: weight {b.name!r} truncated: file ended at byte "
                                     f"{offset + done}")
            done += got
        if self.drop_cache and done:
            os.posix_fadvise(self._fd, offset, done, os.POSIX_FADV_DONTNEED)

    def _check_crc(self, b: Block, data: np.ndarray, start: int, stop: int) -> None:
        if b.crc32 is None:
            return
        with self._lock:
            expect, crc = self._progress.pop(b.name, (0, 0))
            if start != 0 and start != expect:
                return  # out of order: this pass cannot be checked (documented)
            crc = zlib.crc32(data, crc if start else 0)
            if stop < b.nbytes:
                self._progress[b.name] = (stop, crc)
                return
        if crc != b.crc32:
            raise ModelFileError(f"{self.path}: weight {b.name!r} fails its checksum (crc32 {crc:#010x}, "
                                 f"header says {b.crc32:#010x}): corrupt or changed on disk")

    def evict(self) -> None:
        """Advise the kernel to drop the whole file from the page cache (a cold read follows)."""
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> WeightLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
