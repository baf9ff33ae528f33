"""Issue 31: what a new user's first runs leave behind: quick benchmark results and run reports stay out of git."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from bench import common

REPO = Path(__file__).resolve().parent.parent


def test_quick_bench_results_do_not_overwrite_the_committed_ones(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    (tmp_path / "x.json").write_text('{"full": 1}\n')
    common.finish("x", {"quick": 1}, quick=True)
    assert json.loads((tmp_path / "x.json").read_text()) == {"full": 1}
    assert json.loads((tmp_path / "quick" / "x.json").read_text()) == {"quick": 1}
    assert capsys.readouterr().out.strip().splitlines()[-1] == '{"quick": 1}'
    common.finish("x", {"full": 2}, quick=False)
    assert json.loads((tmp_path / "x.json").read_text()) == {"full": 2}


def test_quick_results_and_flink_run_reports_are_ignored_by_git():
    paths = ["bench/results/quick/device.json", "streamflow.flink-run.json", "out/ipv_flink.flink-run.json"]
    ignored = subprocess.run(["git", "check-ignore", *paths], cwd=REPO, capture_output=True, text=True).stdout
    assert ignored.split() == paths
    tracked = subprocess.run(["git", "check-ignore", "bench/results/device.json"], cwd=REPO, capture_output=True)
    assert tracked.returncode == 1  # the full runs' results stay tracked
