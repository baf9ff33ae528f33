"""Without the `flink` extra the suite still collects: Flink tests skip with a reason, nothing errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLINK_TEST_FILES = tuple(f"tests/flink/test_flink_{name}.py" for name in ("cluster", "kafka", "parity"))


@pytest.mark.slow
def test_collection_without_pyflink_skips_flink_tests(tmp_path):
    # A pyflink package that fails to import shadows the installed one: as if the extra were missing
    # (or broken).
    (tmp_path / "pyflink").mkdir()
    (tmp_path / "pyflink" / "__init__.py").write_text('raise ImportError("no flink extra in this test")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert not [line for line in out.splitlines() if line.startswith("ERROR")], out
    for test_file in FLINK_TEST_FILES:
        assert re.search(rf"^SKIPPED \[\d+\] {test_file}:\d+: needs the flink extra", out, re.MULTILINE), out
        assert f"{test_file}::" not in out  # none of its tests collected
    assert "streamflow/flink/runner.py::" not in out  # its doctests need PyFlink: not collected
    assert "tests/test_layout.py::test_device_core_never_imports_flink" in out  # the rest still is
