"""Collection rules for the whole repository (the suite's fixtures are in tests/conftest.py)."""

import importlib


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


# The doctest modules of streamflow/flink/ need PyFlink (the `flink` extra). Without it they are not
# collected, and the Flink test files skip themselves with a reason: collection never fails.
HAS_PYFLINK = _importable("pyflink")
collect_ignore_glob = [] if HAS_PYFLINK else ["streamflow/flink/*.py"]


def pytest_report_header(config) -> str | None:
    if HAS_PYFLINK:
        return None
    return "pyflink is not importable (no `flink` extra): streamflow/flink doctests not collected, Flink tests skip"
