"""What a persisted result depends on besides its own inputs: the CPU and the engine build.

>>> len(engine_version()) == 16 and len(machine_key()) == 16
True
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
from pathlib import Path

import numpy as np

ENGINE_DIR = Path(__file__).resolve().parent.parent


def _digest(*parts: str) -> str:
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=8).hexdigest()


@functools.cache
def cpu_model() -> str:
    """The CPU model name (``/proc/cpuinfo``), or the platform's processor string elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def cpu_features() -> str:
    """A digest of the CPU's instruction-set flags (code built for AVX-512 must not run without it)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return _digest(" ".join(sorted(line.split(":", 1)[1].split())))
    except OSError:
        pass
    return _digest(platform.machine())


@functools.cache
def find_spec(module: str):
    """A library's import spec, or None, found without importing it and looked up once per process (each
    lookup scans ``sys.path``, 0.1-0.5 ms, and a cold start asked for numba's five times: the engine version,
    the layout, the loops; :func:`engine.kernels.accel.available` asks here)."""
    return importlib.util.find_spec(module)


@functools.cache
def _build_of(module: str) -> str:
    """Where a library is installed and when: changes with every (re)install, found without
    importing it (importing numba costs half a second; ``importlib.metadata`` scans every dist)."""
    spec = find_spec(module)
    if spec is None or spec.origin is None:
        return "-"
    return f"{spec.origin}@{os.stat(spec.origin).st_mtime_ns}"


def _engine_sources() -> list[Path]:
    """Every engine source file, found without listing ``__pycache__`` (numba's cache files fill it)."""
    return [Path(p) for p, _ in _source_stats()]


def _source_stats() -> list[tuple[str, os.stat_result]]:
    """(path, stat) of every engine source file, in a fixed order: one directory listing per package
    and one ``stat`` per file (each system call costs microseconds in a VM: no more than needed)."""
    found, todo = [], [str(ENGINE_DIR)]
    while todo:
        top = todo.pop()
        with os.scandir(top) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            if e.name.endswith(".py") and e.is_file():
                found.append((e.path, e.stat()))
            elif e.is_dir() and e.name != "__pycache__":
                todo.append(e.path)
    return sorted(found)


def _digest_stats(stats: list[tuple[str, os.stat_result]]) -> str:
    h = hashlib.blake2b(digest_size=8)
    skip = len(str(ENGINE_DIR)) + 1
    h.update("".join(f"{p[skip:]}:{st.st_size}:{st.st_mtime_ns}" for p, st in stats).encode())
    h.update(f"numpy={np.__version__} numba={_build_of('numba')}".encode())
    return h.hexdigest()


def sources_digest(paths: list[Path]) -> str:
    """A digest of these source files (name, size, modification time: any edit or reinstall changes
    it, without reading them) and the numeric libraries the engine runs on."""
    return _digest_stats([(str(p), os.stat(p)) for p in paths])


@functools.cache
def engine_version() -> str:
    """:func:`sources_digest` of every engine source: a change to a kernel, a pass or the planner
    makes older cached plans and weights stale."""
    return _digest_stats(_source_stats())


@functools.cache
def machine_key(sources: tuple[str, ...] | None = None) -> str:
    """CPU model + CPU features + engine version (or, given ``sources``, the digest of just those
    engine files, e.g. the compiled loops'), as one short digest."""
    version = engine_version() if sources is None else sources_digest([ENGINE_DIR / s for s in sources])
    return _digest(cpu_model(), cpu_features(), version, platform.python_version())
