"""Train with a memory budget that changes while the pipeline runs: the loss log equals an
unbudgeted Train's step for step, and each step follows the plan of the budget in force."""

from __future__ import annotations

import numpy as np

from engine import GraphBuilder
from operators import Train, run_pipeline


def mlp(seed: int = 0):
    rng = np.random.default_rng(seed)
    b = GraphBuilder("mlp")
    h = b.relu(b.linear(b.input("x", (None, 3)), rng.standard_normal((3, 64), dtype=np.float32), np.zeros(64, "f4")))
    b.output(b.linear(h, rng.standard_normal((64, 2), dtype=np.float32) * 0.3, np.zeros(2, "f4")))
    return b.build()


ROWS = [{"a": float(a), "b": float(b), "c": float(c)}
        for a, b, c in np.random.default_rng(3).standard_normal((96, 3)).round(3)]


def features(row):
    return [row["a"], row["b"], row["c"]]


def label(row):
    return int(row["a"] + row["b"] > 0)


def test_budget_change_from_a_control_row_keeps_the_loss_curve():
    plain = Train(mlp(), features=features, label=label, optimizer="sgd", lr=0.05, momentum=0.9, batch_size=16)
    expected = run_pipeline([plain], ROWS)
    big, small = 1 << 20, 12_000
    control = [{"budget": small}]
    budgeted = Train(mlp(), features=features, label=label, optimizer="sgd", lr=0.05, momentum=0.9, batch_size=16,
                     memory_budget=big, budget_control=lambda row: row.get("budget"))
    log = run_pipeline([budgeted], ROWS[:48]) + run_pipeline([budgeted], control + ROWS[48:])
    np.testing.assert_allclose([r["loss"] for r in log], [r["loss"] for r in expected], atol=1e-5, rtol=0)
    trainer = budgeted._trainer
    assert set(trainer.plans) == {(16, big), (16, small)}
    assert trainer.last_plan is trainer.plans[(16, small)]
    assert trainer.last_plan.total_bytes <= small < trainer.plans[(16, big)].total_bytes
    np.testing.assert_allclose(budgeted.export().weights[next(iter(budgeted._graph_model.params))],
                               plain.export().weights[next(iter(plain._graph_model.params))], atol=1e-5, rtol=0)
