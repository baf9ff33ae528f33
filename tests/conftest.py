"""Suite-wide collection rule and the property-test profile."""

import os
from pathlib import Path

from hypothesis import settings

# CI explores the same examples on every run (a red CI then means a change broke something, not that
# a new random example turned up); locally the examples vary, so edge cases keep being looked for.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    # --doctest-modules (for the packages' docstring examples) would also import the suite's helper
    # modules; under tests/ only test_*.py files hold tests.
    if collection_path.suffix == ".py" and not collection_path.name.startswith(("test_", "conftest")):
        return True
    return None
