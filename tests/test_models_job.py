"""Issue 31: the README's models guide runs: jobs/models.py, inference in a live byte budget, training in one."""

from __future__ import annotations

import math
from pathlib import Path

import duckdb

from streamflow.cli import main

REPO = Path(__file__).resolve().parent.parent


def test_models_job_scores_in_a_budget_that_changes_mid_run_and_trains_in_one(tmp_path, capsys):
    db = tmp_path / "models.duckdb"
    assert main(["run", str(REPO / "jobs" / "models.py"), "--events",
                 str(REPO / "jobs" / "data" / "taobao_user_behavior_10k.csv"), "--db", str(db), "--show", "0"]) == 0
    out = capsys.readouterr().out
    for task, rows in (("scored", 10_000), ("scored_budgeted", 10_000), ("purchase_budgeted", 156)):
        assert f"task {task:<18} fired  10,000  rows {rows:>7,}  errors 0" in out
    with duckdb.connect(str(db), read_only=True) as con:
        budgets = con.sql("SELECT budget_bytes, count(*) FROM scored_budgeted GROUP BY 1 ORDER BY 1").fetchall()
        assert budgets == [(12 * 2**20, 5_001), (16 * 2**20, 4_999)]  # lowered after the 5,000th visit
        # the same model in and out of the budget: the same answers
        plain = con.sql("SELECT buy_likely FROM scored ORDER BY rowid").fetchall()
        assert plain == con.sql("SELECT buy_likely FROM scored_budgeted ORDER BY rowid").fetchall()
        assert 0 < sum(r[0] for r in plain) < len(plain)  # not a constant
        losses = [r[0] for r in con.sql("SELECT loss FROM purchase_budgeted ORDER BY step").fetchall()]
        assert all(math.isfinite(loss) for loss in losses) and sum(losses[-20:]) < sum(losses[:20])
