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


def _build_of(module: str) -> str:
    """Where a library is installed and when: changes with every (re)install, found without
    importing it (importing numba costs half a second; ``importlib.metadata`` scans every dist)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return "-"
    return f"{spec.origin}@{os.stat(spec.origin).st_mtime_ns}"


def _engine_sources() -> list[Path]:
    """Every engine source file, found without listing ``__pycache__`` (numba's cache files fill it)."""
    found = []
    for top, dirs, files in os.walk(ENGINE_DIR):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        found += [Path(top) / f for f in sorted(files) if f.endswith(".py")]
    return found


def sources_digest(paths: list[Path]) -> str:
    """A digest of these source files (name, size, modification time: any edit or reinstall changes
    it, without reading them) and the numeric libraries the engine runs on."""
    h = hashlib.blake2b(digest_size=8)
    for path in paths:
        st = path.stat()
        h.update(f"{path.relative_to(ENGINE_DIR)}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(f"numpy={np.__version__} numba={_build_of('numba')}".encode())
    return h.hexdigest()


@functools.cache
def engine_version() -> str:
    """:func:`sources_digest` of every engine source: a change to a kernel, a pass or the planner
    makes older cached plans and weights stale."""
    return sources_digest(_engine_sources())


@functools.cache
def machine_key(sources: tuple[str, ...] | None = None) -> str:
    """CPU model + CPU features + engine version (or, given ``sources``, the digest of just those
    engine files, e.g. the compiled loops'), as one short digest."""
    version = engine_version() if sources is None else sources_digest([ENGINE_DIR / s for s in sources])
    return _digest(cpu_model(), cpu_features(), version, platform.python_version())
