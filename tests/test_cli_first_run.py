"""Issue 31: what a first run tells a new user: rows added to an earlier run's, late events, the mode, the query."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from streamflow.cli import main

REPO = Path(__file__).resolve().parent.parent
IPV = [str(REPO / "jobs" / "ipv.py"), "--events", str(REPO / "jobs" / "data" / "taobao_user_behavior_10k.csv")]
WINDOWS = [str(REPO / "jobs" / "activity_windows.py"), "--events", str(REPO / "tests" / "data" / "activity.jsonl")]


def test_a_second_run_without_replace_says_it_adds_to_the_earlier_rows(tmp_path, capsys):
    db = str(tmp_path / "ipv.duckdb")
    assert main(["run", *IPV, "--db", db, "--show", "0"]) == 0
    assert "already holds rows" not in capsys.readouterr().err
    assert main(["run", *IPV, "--db", db, "--show", "0"]) == 0
    assert (f"streamflow: note: {db} already holds rows of job ipv (ipv 10,000 rows); this run adds to them "
            "(--replace starts over)") in capsys.readouterr().err
    assert main(["run", *IPV, "--db", db, "--show", "0", "--replace"]) == 0
    assert "already holds rows" not in capsys.readouterr().err


def test_the_summary_counts_late_events_and_names_the_mode(tmp_path, capsys):
    assert main(["run", *WINDOWS, "--db", str(tmp_path / "w.duckdb"), "--show", "0", "--mode", "streaming"]) == 0
    out = capsys.readouterr().out
    assert "runtime mode     streaming  (event by event)" in out
    assert "late events      6  (too late for every window: in table late_events)" in out
    assert main(["run", *WINDOWS, "--db", str(tmp_path / "b.duckdb"), "--show", "0"]) == 0  # a bounded file
    out = capsys.readouterr().out
    assert ("runtime mode     batch  (the bounded input column by column)\n"
            "  task activity           columnar windows") in out
    assert "late events      6  (too late for every window: in table late_events)" in out


def test_the_query_hint_runs_with_the_interpreter_that_has_duckdb(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["run", *IPV, "--db", "ipv.duckdb", "--show", "0"]) == 0
    hint = capsys.readouterr().out.strip().splitlines()[-1]
    python = os.path.relpath(sys.executable)
    assert hint.startswith(f"query them: {python if not python.startswith('..') else sys.executable} -c ")
