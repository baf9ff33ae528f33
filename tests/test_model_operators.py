"""Infer and Train as stream operators: checked against PyTorch, and inside a job on the device runner."""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pytest

from connectors.storage import CollectiveStorage
from engine import GraphBuilder
from operators import Infer, Train, run_pipeline
from streamflow.job import load_job
from streamflow.runners.device import DeviceRunner
from streamflow.sources import open_source

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5  # float32, two small layers


def mlp_weights(seed: int = 0, d_in: int = 3, hidden: int = 5, d_out: int = 2):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape, dtype=np.float32) * 0.5
            for shape in ((d_in, hidden), (hidden,), (hidden, d_out), (d_out,))]


def engine_mlp(w1, b1, w2, b2):
    b = GraphBuilder("mlp")
    b.output(b.linear(b.relu(b.linear(b.input("x", (None, w1.shape[0])), w1, b1)), w2, b2))
    return b.build()


def torch_mlp(w1, b1, w2, b2):
    model = torch.nn.Sequential(torch.nn.Linear(*w1.shape), torch.nn.ReLU(), torch.nn.Linear(*w2.shape))
    with torch.no_grad():
        for layer, w, b in ((model[0], w1, b1), (model[2], w2, b2)):
            layer.weight.copy_(torch.from_numpy(w.T.copy()))
            layer.bias.copy_(torch.from_numpy(b))
    return model


ROWS = [{"a": float(a), "b": float(b), "c": float(c)}
        for a, b, c in np.random.default_rng(3).standard_normal((10, 3)).round(3)]


def features(row):
    return [row["a"], row["b"], row["c"]]


def test_infer_matches_pytorch_and_keeps_rows():
    weights = mlp_weights()
    out = run_pipeline([Infer(engine_mlp(*weights), features=features, into="y")], ROWS)
    expected = torch_mlp(*weights)(torch.tensor([features(r) for r in ROWS])).detach().numpy()
    assert [{k: v for k, v in r.items() if k != "y"} for r in out] == ROWS
    np.testing.assert_allclose(np.array([r["y"] for r in out]), expected, atol=TOL)


def test_infer_as_bytes_is_the_float32_vector():
    weights = mlp_weights()
    out = run_pipeline([Infer(engine_mlp(*weights), features=features, into="code", as_bytes=True)], ROWS[:2])
    plain = run_pipeline([Infer(engine_mlp(*weights), features=features, into="code")], ROWS[:2])
    assert all(len(r["code"]) == 2 * 4 for r in out)
    np.testing.assert_array_equal(np.frombuffer(out[0]["code"], np.float32), np.float32(plain[0]["code"]))


def test_reproducible_infer_computes_every_batch_with_one_engine_plan():
    """With ``reproducible=True`` every firing runs the warm engine (no cold path, no timed switch): each
    batch size's bytes equal the warm InferenceSession's, however the firings are timed."""
    from engine.session import InferenceSession

    weights = mlp_weights()
    infer = Infer(engine_mlp(*weights), features=features, into="code", as_bytes=True, reproducible=True)
    reference = InferenceSession(engine_mlp(*weights))
    for batch in (ROWS[:1], ROWS[:3], ROWS, ROWS[:3]):
        got = [r["code"] for r in run_pipeline([infer], batch)]
        want = reference.run({"x": np.asarray([features(r) for r in batch], np.float32)})
        assert got == [v.tobytes() for v in next(iter(want.values()))]
    assert isinstance(infer._session, InferenceSession)
    np.testing.assert_allclose(np.frombuffer(got[0], np.float32),
                               torch_mlp(*weights)(torch.tensor([features(ROWS[0])])).detach().numpy()[0], atol=TOL)


def test_infer_needs_rows():
    with pytest.raises(TypeError, match="works on rows"):
        run_pipeline([Infer(engine_mlp(*mlp_weights()), features=features)], [3.0])


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_train_steps_like_pytorch(optimizer):
    """Three steps of 4 rows each: the loss log and the exported weights match PyTorch step for step."""
    weights = mlp_weights(seed=1)
    label = lambda row: int(row["a"] + row["b"] > 0)  # noqa: E731
    train = Train(engine_mlp(*weights), features=features, label=label, optimizer=optimizer, lr=0.05,
                  momentum=0.9, batch_size=4)
    log = run_pipeline([train], ROWS[:6]) + run_pipeline([train], ROWS[6:] + ROWS[:2])

    model = torch_mlp(*weights)
    opt = (torch.optim.Adam(model.parameters(), lr=0.05) if optimizer == "adam"
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    batches = [ROWS[0:4], ROWS[4:8], ROWS[8:10] + ROWS[0:2]]
    torch_losses = []
    for batch in batches:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(torch.tensor([features(r) for r in batch])),
                                                 torch.tensor([label(r) for r in batch]))
        loss.backward()
        opt.step()
        torch_losses.append(loss.item())

    assert [r["step"] for r in log] == [1, 2, 3] and all(r["examples"] == 4 for r in log)
    np.testing.assert_allclose([r["loss"] for r in log], torch_losses, atol=TOL)
    trained = run_pipeline([Infer(train.export(), features=features, into="y")], ROWS)
    expected = model(torch.tensor([features(r) for r in ROWS])).detach().numpy()
    np.testing.assert_allclose(np.array([r["y"] for r in trained]), expected, atol=1e-4)


def test_model_operators_inside_a_job_on_the_device_runner(tmp_path):
    job = load_job(ROOT / "jobs" / "ipv_encoder.py")
    with CollectiveStorage(tmp_path / "f.duckdb") as storage:
        summary = DeviceRunner(job, storage).run(open_source(ROOT / "jobs" / "data" / "taobao_user_behavior_10k.csv"))
    assert summary.task_stats["ipv_encoded"].errors == summary.task_stats["purchase_model"].errors == 0
    with duckdb.connect(str(tmp_path / "f.duckdb"), read_only=True) as con:
        sizes = con.sql("SELECT octet_length(encoding), count(*) FROM ipv_encoded GROUP BY 1").fetchall()
        losses = [r[0] for r in con.sql("SELECT loss FROM purchase_model ORDER BY step").fetchall()]
    assert sizes == [(128, 10_000)]  # one 128-byte encoding per item-page visit
    assert len(losses) == 10_000 // 64 and all(np.isfinite(losses))
    # Stated margin: online training on the sample brings the loss of the last 50 steps below 70% of
    # the first 5 steps' (measured: 0.25 -> 0.14).
    assert np.mean(losses[-50:]) < 0.7 * np.mean(losses[:5])


def test_infer_budget_change_mid_job_takes_effect():
    """A runner deep-copies the operator; the shared MemoryBudget still reaches the copy, and the
    next batch runs under the new budget with the same outputs as the unbudgeted model."""
    import copy

    from operators.model import MemoryBudget

    rng = np.random.default_rng(5)
    weights = [(rng.standard_normal((3, 4096)) * 0.3).astype(np.float32), np.zeros(4096, np.float32),
               (rng.standard_normal((4096, 2)) * 0.03).astype(np.float32), np.zeros(2, np.float32)]
    graph = engine_mlp(*weights)
    budget = MemoryBudget("8MB")
    op = copy.deepcopy(Infer(graph, features=features, into="y", memory_budget=budget))
    first = run_pipeline([op], ROWS[:5])
    assert op._session.budget == 8 << 20
    budget.set(op._session.reserve() + 256 * 1024)
    second = run_pipeline([op], ROWS[5:])
    plan = op._session.plan_for({op._session.input_names[0]: (5, 3)})
    assert op._session.budget == budget.bytes and plan.budget <= 256 * 1024 + 4096
    # the weights are in the small arena: streamed, or (80 KB fit) read once and kept resident
    assert plan.peak_bytes() <= plan.budget and (plan.loads or plan.resident)
    plain = run_pipeline([Infer(graph, features=features, into="y")], ROWS)
    np.testing.assert_allclose(np.array([r["y"] for r in first + second]), np.array([r["y"] for r in plain]),
                               atol=1e-5)
