"""Suite-wide collection rule."""

from pathlib import Path


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    # --doctest-modules (for the packages' docstring examples) would also import the suite's helper
    # modules; under tests/ only test_*.py files hold tests.
    if collection_path.suffix == ".py" and not collection_path.name.startswith(("test_", "conftest")):
        return True
    return None
