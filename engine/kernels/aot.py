"""The numba loops compiled ahead of time into an extension module, so a cold process runs them
without importing numba (loading the module takes milliseconds; numba's JIT, about a second).

The module is built for this CPU (``target_cpu="host"``) by numba's ``pycc`` in a separate, niced
process (``python -m engine.kernels.aot CACHE_DIR``, started in the background by the cold path when
the module is missing), once per CPU model/features and version of the loops' sources
(:func:`engine.cache.fingerprint.machine_key` of ``LOOP_SOURCES``). It is written atomically into
``CACHE_DIR/aot-<key>/``; its CRC-32 is kept in the engine cache, and a module whose bytes do not
match is deleted, not loaded.

The exported functions take C-contiguous arrays (the kernels pass arena views and contiguous weights).

>>> module = load("/nonexistent/cache")    # None until built
>>> module is None
True
"""

from __future__ import annotations

import contextlib
import importlib.util
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
from pathlib import Path
from types import ModuleType

MODULE = "sf_engine_aot"
STALE_LOCK_S = 600.0  # a build lock older than this belonged to a build that died
A1, A2, A3, A4, A6 = "f4[::1]", "f4[:,::1]", "f4[:,:,::1]", "f4[:,:,:,::1]", "f4[:,:,:,:,:,::1]"
BLOCKED = f"void({A4}, {A6}, {A2}, {A4}, b1, {A4}, i8, i8, i8, i8, i8, i8, i8, f8, f8)"
SIGNATURES = {
    "bias_act": f"void({A2}, {A1}, {A2}, b1, b1, i8, f8, f8)",
    "depthwise_taps": "i8[:,::1](i8, i8, i8, i8, i8, i8)",
    "depthwise": f"void({A3}, {A3}, {A1}, {A3}, b1, {A3}, {A3}, i8[:,::1], i8, i8, i8, i8, i8, f8, f8)",
    "winograd23_in": f"void({A3}, {A3}, i8, i8, i8, i8)",
    "winograd23_out": f"void({A3}, {A3}, {A1}, {A3}, b1, i8, i8, i8, f8, f8)",
    "nchwc_conv": BLOCKED,
    "nchwc_depthwise": f"void({A4}, {A4}, {A2}, {A4}, b1, {A4}, i8, i8, i8, i8, i8, i8, i8, f8, f8)",
    "nchwc_maxpool": f"void({A4}, {A4}, i8, i8, i8, i8, i8, i8, i8, i8)",
}


# What the compiled module is made of: a change elsewhere in the engine does not rebuild it.
LOOP_SOURCES = (
    "kernels/jit.py", "kernels/activation.py", "kernels/nchwc_loops.py", "kernels/aot.py", "kernels/accel.py",
)


def _key() -> str:
    from engine.cache.fingerprint import machine_key

    return f"aot-{machine_key(LOOP_SOURCES)}"


def _suffix() -> str:
    import importlib.machinery  # already loaded (sysconfig, the other source, costs ~4 ms to import)

    return importlib.machinery.EXTENSION_SUFFIXES[0]


def module_path(cache_dir: str | os.PathLike) -> Path:
    return Path(cache_dir) / _key() / (MODULE + _suffix())


def lock_path(cache_dir: str | os.PathLike) -> Path:
    """The file that says a build of this machine's module into ``cache_dir`` is under way."""
    return Path(cache_dir) / f".{_key()}.building"


def files(cache_dir: str | os.PathLike) -> list[Path]:
    """The files :func:`load` reads (to prefetch them): the module and its checksum entry."""
    from engine.cache.store import EntryStore

    return [module_path(cache_dir), EntryStore(cache_dir).path(_key())]


def check(cache_dir: str | os.PathLike) -> bool:
    """Whether the built module matches its checksum entry (read whole); a corrupt or unrecorded
    module is deleted (rebuilt, never loaded) with its seal."""
    from engine.cache.store import EntryStore

    path = module_path(cache_dir)
    entry = EntryStore(cache_dir).get(_key())
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as raw:
            crc, size = zlib.crc32(raw), len(raw)  # mapped: no copy of the module to check it
    except (OSError, ValueError):
        return False
    if entry is None or entry[1].get("crc32") != crc or entry[1].get("size") != size:
        shutil.rmtree(path.parent, ignore_errors=True)
        return False
    return True


def _seal_key(path: Path) -> str:
    from engine.memory.loader import seal_name

    return f"seal-{seal_name(path)}"


def load(cache_dir: str | os.PathLike) -> ModuleType | None:
    """The compiled module for this machine and engine version, if built and intact; else None. A
    module checked whole once is sealed (a link named by its file identity,
    :func:`engine.memory.loader.seal_name`): later loads of the same, unchanged file skip the
    checksum (~0.7 ms of a cold start); any write, replacement or tear changes the name and it is
    checked again. :func:`audit` checks a sealed module again off the critical path."""
    from engine.cache.store import EntryStore

    path = module_path(cache_dir)
    store = EntryStore(cache_dir)
    try:
        seal = _seal_key(path)
    except OSError:
        return None
    if store.link(seal) != store.path(_key()):
        if not check(cache_dir):
            return None
        with contextlib.suppress(OSError):  # a read-only cache: checked again next time
            store.put_link(seal, store.path(_key()))
    spec = importlib.util.spec_from_file_location(MODULE, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError:
        return None
    return module


def audit(cache_dir: str | os.PathLike) -> bool:
    """Check the loaded module's file against its checksum after the fact (a background thread): False
    (and module and seal deleted, so the next process rebuilds it) if it is corrupt."""
    from engine.cache.store import LINK_SUFFIX, EntryStore

    path = module_path(cache_dir)
    try:
        seal = _seal_key(path)
    except OSError:
        return True  # gone (evicted or rebuilt): nothing to vouch for
    if check(cache_dir):
        return True
    EntryStore(cache_dir).delete(seal, LINK_SUFFIX)
    return False


def build(cache_dir: str | os.PathLike) -> Path:
    """Compile the loops of :mod:`engine.kernels.jit` for this CPU into the cache (imports numba)."""
    with warnings.catch_warnings():  # pycc is "pending deprecation" with no replacement yet (numba 0.68)
        warnings.simplefilter("ignore")
        from numba.pycc import CC

    from engine.cache.store import EntryStore
    from engine.kernels import jit

    final = module_path(cache_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".build-") as tmp:
        cc = CC(MODULE)
        cc.output_dir = tmp
        cc.target_cpu = "host"
        cc.verbose = False
        for name, signature in SIGNATURES.items():
            cc.export(name, signature)(getattr(jit, name).py_func)
        cc.compile()
        (built,) = Path(tmp).glob(MODULE + "*")
        raw = built.read_bytes()
        os.replace(built, final)
    EntryStore(cache_dir).put(_key(), {}, meta={"crc32": zlib.crc32(raw), "size": len(raw), "file": final.name})
    return final


def copy_built(src_dir: str | os.PathLike, dest_dir: str | os.PathLike) -> None:
    """Copy this machine's compiled module (and its checksum entry) from one cache to another,
    building it in ``src_dir`` first if missing (e.g. seed a test's or a benchmark's fresh cache)."""
    lock = lock_path(src_dir)
    deadline = time.time() + STALE_LOCK_S
    while load(src_dir) is None and lock.exists() and time.time() < deadline:
        time.sleep(0.5)  # a background build of the same module is under way: wait for it, never race it
    if load(src_dir) is None:
        subprocess.run([sys.executable, "-m", "engine.kernels.aot", str(src_dir)], check=True,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    src = module_path(src_dir).parent
    Path(dest_dir).mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, Path(dest_dir) / src.name, dirs_exist_ok=True)
    shutil.copy2(Path(src_dir) / f"{src.name}.sfc", Path(dest_dir) / f"{src.name}.sfc")


def build_in_background(cache_dir: str | os.PathLike) -> subprocess.Popen | None:
    """Start :func:`build` in a niced child process unless a build is already running; returns it."""
    lock = lock_path(cache_dir)
    with contextlib.suppress(OSError):
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:  # a build that died: try again
            lock.unlink()
    try:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return None
    os.close(fd)
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-m", "engine.kernels.aot", str(cache_dir), str(lock)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def main(argv: list[str]) -> int:
    cache_dir, lock = argv[0], argv[1] if len(argv) > 1 else None
    with contextlib.suppress(OSError):
        os.nice(10)
    try:
        build(cache_dir)
    finally:
        if lock:
            Path(lock).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
