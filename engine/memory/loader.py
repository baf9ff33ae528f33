"""Read weight blocks of an engine model file into buffers the caller owns.

One loader serves every runtime that streams weights from disk (budgeted inference, cold start).
It never maps the file: each read is one ``preadv`` straight into the caller's buffer (the GIL is
released meanwhile, so a background thread overlaps with numpy compute). When the read's file
offset and the buffer are 4096-aligned and the buffer has room for the read rounded up to 4096
(files from ``save_streamable`` align every block; the budgeted planner aligns its slots), it uses
direct I/O (``O_DIRECT``): the disk writes into the buffer, with no page-cache copy to make and
drop, which takes about 2.5x less CPU than a buffered read (ResNet-50's 159 MB: 17 vs 44 ms on a
2-core VM), CPU the compute thread needs on a busy machine. Otherwise it reads through the page
cache and calls ``posix_fadvise(DONTNEED)`` on the range just read so the cache keeps no copy.

Or, for a runtime that keeps every weight (the cold start), :meth:`WeightLoader.map_all` maps the
whole file once (private, copy-on-write: writeable views, no copy) and starts the kernel reading it
in the background (``MADV_WILLNEED``); :meth:`WeightLoader.verify` checks a mapped block's checksum
before its first use.

A file verified whole once can be *sealed* (:func:`seal_name`: a name for the file as it
is on disk now, from its device, inode, size, modification and change times; the runtime keeps the
seal, e.g. as a link in its cache): a later loader of the same file identity sets ``trusted`` and
:meth:`verify` then costs nothing, so checking leaves a cold start's critical path. Any write to the
file changes its change time (``st_ctime``, which no user call can set back), a replaced file has
another inode, a torn or truncated one another size: each gets another seal name and is checked
block by block again before use. What a seal cannot see (the medium rotting under an unchanged
inode) :meth:`audit` finds: it checks every block off the critical path.

Every block (one weight) carries a checksum in the file header (CRC-32C when both the writer and
this process have the ``crc32c`` package: hardware speed; else zlib's CRC-32, which costs about a
quarter of the read time). Reading a block whole, or its row ranges in order (slice 0, 1, ...,
last), checks it when the last byte arrives; a mismatch, a short read, or a file replaced or
resized since it was opened raises :class:`ModelFileError` naming the block and the reason. Files
written before checksums existed are checked for size only.

>>> loader = WeightLoader("model.sfe")                                 # doctest: +SKIP
>>> buf = np.empty(loader.blocks["conv1.w"].nbytes, np.uint8)           # doctest: +SKIP
>>> w = loader.read_into("conv1.w", buf)          # typed view of buf   # doctest: +SKIP
>>> part = loader.read_into("conv1.w", buf, rows=(0, 16))  # first 16 output channels  # doctest: +SKIP
"""

from __future__ import annotations

import _thread
import atexit
import contextlib
import errno
import functools
import hashlib
import math
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.format import ModelFile, checksum_fn

DIRECT_ALIGN = 4096  # offsets, addresses and lengths of direct reads (the largest logical block size)


def seal_name(path: str | os.PathLike, st: os.stat_result | None = None) -> str:
    """A short name for a file as it is now (its real path, device, inode, size, modification and
    change times; ``st``: as that stat saw it): a seal kept under this name after the file was checked
    whole vouches for exactly these bytes. Any write changes the change time, which no user call can
    set back; a replaced file has another inode; a torn one another size: each gets another name."""
    st = st or os.stat(path)
    parts = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return hashlib.blake2b(repr(parts).encode(), digest_size=12).hexdigest()


_WINDOWS: dict[int, int] = {}  # device -> bytes one WILLNEED reads at most (willneed_window)


def willneed_window(fd: int) -> int:
    """The most one ``WILLNEED`` (``posix_fadvise``/``madvise``) on this file makes the kernel read: its
    device's readahead window or largest request, whichever is larger (Linux caps the advice there:
    ``max(read_ahead_kb, max_sectors_kb)``, 8 MB on the VM measured, 128 KB-1.25 MB by default
    elsewhere); 128 KB when the device says nothing. Read from sysfs once per device."""
    dev = os.fstat(fd).st_dev
    if dev not in _WINDOWS:
        kb = [128]
        ident = f"{os.major(dev)}:{os.minor(dev)}"
        for sysfs in (f"/sys/class/bdi/{ident}/read_ahead_kb", f"/sys/dev/block/{ident}/queue/max_sectors_kb",
                      f"/sys/dev/block/{ident}/../queue/max_sectors_kb"):  # a disk, or the disk of a partition
            with contextlib.suppress(OSError, ValueError), open(sysfs, "rb") as f:
                kb.append(int(f.read()))
        _WINDOWS[dev] = max(kb) << 10
    return _WINDOWS[dev]


def background(fn: Callable[[], None], finish_at_exit: bool = False) -> threading.Event:
    """Run ``fn`` on a new thread and return at once an event set when it is done (``finish_at_exit``:
    the process waits for it at exit, up to a minute). Not ``threading.Thread.start``, which waits
    until the new thread runs: on a busy machine that new thread may then hold the GIL for a switch
    interval (5 ms) before the caller, whose output is ready, gets it back (measured: a median 5.4 ms
    per start at load 5)."""
    done = threading.Event()
    at_exit = functools.partial(done.wait, 60)
    if finish_at_exit:
        atexit.register(at_exit)

    def body() -> None:
        try:
            fn()
        finally:
            done.set()
            if finish_at_exit:
                atexit.unregister(at_exit)

    _thread.start_new_thread(body, ())
    return done


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+
_libc = None


def populate_behind(base: int, length: int) -> threading.Event | None:
    """Fault ``length`` bytes of a file mapping at address ``base`` (page-aligned) in on a new thread
    (``madvise(MADV_POPULATE_READ)`` through ctypes: one call, the GIL released for all of it): the
    kernel reads the pages through its page-fault read-around, as first touches would (large folios,
    a readahead window at a time), and maps them for this process, so the caller's own first touches
    neither wait for the disk nor fault. Returns an event set when done, or None where libc cannot be
    loaded. On kernels before 5.14 the call fails and nothing is read ahead (the caller's touches
    read the pages as before)."""
    global _libc
    if length <= 0:
        return None
    try:
        if _libc is None:
            import ctypes

            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    except (OSError, AttributeError):
        return None
    return background(lambda: _libc.madvise(base, length, _MADV_POPULATE_READ))


def direct_len(n: int) -> int:
    """Bytes a direct read of ``n`` bytes writes: ``n`` rounded up to ``DIRECT_ALIGN``."""
    return -(-n // DIRECT_ALIGN) * DIRECT_ALIGN


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
    checksum: int | None
    checksum_kind: str = ""
    checksum_fn: Callable[[object, int], int] | None = None

    @property
    def row_bytes(self) -> int:
        """Bytes per index of the first axis (a Conv's output channel, a transposed Gemm's row)."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


class WeightLoader:
    """Reads blocks of one model file; safe to call from one background thread while others compute.

    ``drop_cache`` (default True) advises the kernel to drop the pages just read; ``direct`` (default
    True) uses direct I/O for aligned reads where the file system supports it.
    """

    def __init__(self, path: str | os.PathLike, *, drop_cache: bool = True, direct: bool = True) -> None:
        self.path = Path(path)
        self._fd = self._dfd = -1
        try:
            mf = ModelFile(self.path)
        except (ValueError, OSError) as e:  # bad magic, truncated or garbled header
            raise ModelFileError(f"{self.path}: unreadable model header ({e})") from e
        self.header = mf.header
        self.drop_cache = drop_cache
        self._fd = os.open(self.path, os.O_RDONLY)
        if direct and drop_cache and hasattr(os, "O_DIRECT"):
            try:
                self._dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except OSError:  # e.g. tmpfs: buffered reads only
                self._dfd = -1
        st = os.fstat(self._fd)
        self._size = st.st_size
        self._identity = (st.st_ino, st.st_size, st.st_mtime_ns)
        self._stat = st
        self.trusted = False  # sealed: verify() skips the checksums (module doc)
        self.blocks: dict[str, Block] = {}
        for e in self.header["weights"]:
            kind, fn = checksum_fn(e) or ("", None)
            b = Block(e["name"], np.dtype(e["dtype"]), tuple(e["shape"]), mf.data_start + e["offset"],
                      e["nbytes"], e.get(kind), kind, fn)
            if b.offset + b.nbytes > st.st_size:
                self.close()
                raise ModelFileError(f"{self.path}: weight {b.name!r} ends at byte {b.offset + b.nbytes}, "
                                     f"past the end of the file ({st.st_size} bytes): truncated")
            self.blocks[b.name] = b
        self._progress: dict[str, tuple[int, int]] = {}  # block -> (next byte expected, running crc)
        self._map: mmap.mmap | None = None
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.direct_bytes = 0  # of bytes_read, read with direct I/O

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
        return {b.name: np.frombuffer(self._map, b.dtype, count=math.prod(b.shape),
                                      offset=b.offset).reshape(b.shape) for b in self.blocks.values()}

    def populate_behind(self, start: int | None = None) -> threading.Event | None:
        """:func:`populate_behind` of the mapping (:meth:`map_all`) from byte ``start`` (rounded down to
        a page; default: past the first :func:`willneed_window`, which one ``WILLNEED`` of the whole
        file brings in, the kernel capping the advice there) to the end, so the rest arrives ahead of
        the layers that use it. None when there is nothing past ``start``."""
        start = willneed_window(self._fd) if start is None else start
        if self._map is None or start >= self._size:
            return None
        start -= start % mmap.PAGESIZE
        base = np.frombuffer(self._map, np.uint8, count=1).ctypes.data
        return populate_behind(base + start, self._size - start)

    def seal_name(self, now: bool = False) -> str:
        """:func:`seal_name` of this file as it was when opened (``now``: as it is now): a seal kept
        under it after :meth:`audit` passed vouches for exactly these bytes."""
        return seal_name(self.path, None if now else self._stat)

    def verify(self, name: str, view: np.ndarray) -> None:
        """Check a mapped block against its checksum (touching its pages: this is where it is read);
        :class:`ModelFileError` if it does not match. Nothing to do when the file is ``trusted``."""
        b = self.blocks[name]
        if b.checksum_fn is not None and not self.trusted:
            crc = b.checksum_fn(view.reshape(-1).view(np.uint8), 0)
            if crc != b.checksum:
                raise ModelFileError(f"{self.path}: weight {name!r} fails its checksum ({b.checksum_kind} "
                                     f"{crc:#010x}, header says {b.checksum:#010x}): corrupt")
        self.bytes_read += b.nbytes

    def audit(self, views: dict[str, np.ndarray] | None = None, chunk: int = 1 << 20) -> int:
        """Check every block's checksum, ``chunk`` bytes at a time (the GIL is free between and
        during chunks: a thread doing this leaves the caller's compute alone), from ``views`` (a
        mapping's views, :meth:`map_all`) or else read through a small buffer. Raises
        :class:`ModelFileError` naming the first bad block; returns the bytes checked."""
        done = 0
        for b in sorted(self.blocks.values(), key=lambda b: b.offset):
            if b.checksum_fn is None or not b.nbytes:
                continue
            if views is not None and b.name in views:
                flat = views[b.name].reshape(-1).view(np.uint8)
                crc = 0
                for start in range(0, b.nbytes, chunk):
                    crc = b.checksum_fn(flat[start : start + chunk], crc)
            else:
                buf = np.empty(min(chunk, b.nbytes), np.uint8)
                crc = 0
                for start in range(0, b.nbytes, chunk):
                    part = buf[: min(chunk, b.nbytes - start)]
                    self._read_exact(b, part, b.offset + start)
                    crc = b.checksum_fn(part, crc)
            if crc != b.checksum:
                raise ModelFileError(f"{self.path}: weight {b.name!r} fails its checksum ({b.checksum_kind} "
                                     f"{crc:#010x}, header says {b.checksum:#010x}): corrupt")
            done += b.nbytes
        return done

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
        if start == 0:
            self.check_unchanged()
        whole = dst
        dst = dst[:n]
        if not self._read_direct(b, whole, b.offset + start, n):
            self._read_exact(b, dst, b.offset + start)
        self._check_crc(b, dst, start, stop)
        self.bytes_read += n
        shape = (r1 - r0, *b.shape[1:]) if b.shape else ()
        return dst.view(b.dtype).reshape(shape)

    def _read_direct(self, b: Block, buf: np.ndarray, offset: int, n: int) -> bool:
        """Read ``n`` bytes at ``offset`` into ``buf`` with direct I/O if everything is aligned and
        ``buf`` (and the file) hold the rounded-up length; False if it cannot (then read buffered)."""
        size = direct_len(n)
        if (self._dfd < 0 or n == 0 or offset % DIRECT_ALIGN or buf.ctypes.data % DIRECT_ALIGN
                or buf.nbytes < size or offset + size > self._size):
            return False
        view, done = memoryview(buf[:size]), 0
        try:
            while done < n:
                got = os.preadv(self._dfd, [view[done:]], offset + done)
                if got == 0:
                    raise ModelFileError(f"{self.path}: weight {b.name!r} truncated: file ended at byte "
                                         f"{offset + done}")
                done += got
        except OSError as e:
            if done or e.errno != errno.EINVAL:
                raise
            os.close(self._dfd)  # the file system refuses these reads after all: buffered from now on
            self._dfd = -1
            return False
        self.direct_bytes += n
        return True

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
        if b.checksum_fn is None:
            return
        with self._lock:
            expect, crc = self._progress.pop(b.name, (0, 0))
            if start != 0 and start != expect:
                return  # out of order: this pass cannot be checked (documented)
        crc = b.checksum_fn(data, crc if start else 0)  # outside the lock: it releases the GIL
        if stop < b.nbytes:
            with self._lock:
                self._progress[b.name] = (stop, crc)
            return
        if crc != b.checksum:
            raise ModelFileError(f"{self.path}: weight {b.name!r} fails its checksum ({b.checksum_kind} {crc:#010x}, "
                                 f"header says {b.checksum:#010x}): corrupt or changed on disk")

    def verify_blocks(self, names: Iterable[str], chunk: int = 1 << 20) -> tuple[int, float]:
        """Read blocks ``names`` whole, in file order, ``chunk`` bytes at a time through one small
        buffer (direct reads where aligned, the page cache dropped first and after), checking each
        one's checksum: :class:`ModelFileError` names the first corrupt one. Returns (bytes read,
        seconds): the disk's streaming rate, as runs see it.

        A runtime that reads only some blocks per plan checks the rest here, at open: otherwise a
        corrupt block would be found only by a plan that reads it, and which plan runs depends on
        the budget and on this machine's calibration.
        """
        todo = sorted((self.blocks[n] for n in names), key=lambda b: b.offset)
        todo = [b for b in todo if b.nbytes]
        if not todo:
            return 0, 0.0
        widest = max(direct_len(b.row_bytes if b.shape else b.nbytes) for b in todo)
        # the buffer is an anonymous mapping of its own, unmapped on return: from the heap, glibc kept its
        # pages (its mmap threshold had grown past 1 MiB), 0.7 MiB resident for the process's life that
        # a budgeted session would count against its budget
        area = mmap.mmap(-1, direct_len(max(chunk, widest) + DIRECT_ALIGN))
        try:
            buf = np.frombuffer(area, np.uint8)  # page-aligned with room: direct reads, as runs do
            self.evict()
            done, t = 0, time.perf_counter()
            for b in todo:
                if not b.shape:
                    done += self.read_into(b.name, buf).nbytes
                    continue
                granule = DIRECT_ALIGN // math.gcd(b.row_bytes, DIRECT_ALIGN) if b.row_bytes else 1
                step = max(1, chunk // max(b.row_bytes, 1))
                step = step // granule * granule or step  # slices that keep the next offset 4096-aligned
                for r in range(0, b.shape[0], step):
                    done += self.read_into(b.name, buf, rows=(r, min(r + step, b.shape[0]))).nbytes
            seconds = time.perf_counter() - t
        finally:
            buf = None
            with contextlib.suppress(BufferError):  # an error's traceback still holds a view: unmapped with it
                area.close()
        return done, seconds

    def evict(self) -> None:
        """Advise the kernel to drop the whole file from the page cache (a cold read follows)."""
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._dfd >= 0:
            os.close(self._dfd)
            self._dfd = -1

    def __enter__(self) -> WeightLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
