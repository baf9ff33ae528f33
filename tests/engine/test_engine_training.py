"""Training converges on real data: a small CNN learns scikit-learn's handwritten digits (8x8 scans
shipped inside the package), then serves from the inference engine with the same predictions.

Stated margins: the last epoch's mean loss is below 30% of the first batch's loss, and held-out
accuracy is at least 85%.
"""

from pathlib import Path

import numpy as np
import pytest

from engine.autograd import Adam, GraphModel, cross_entropy
from engine.builder import GraphBuilder
from engine.session import InferenceSession

datasets = pytest.importorskip("sklearn.datasets")


def small_cnn() -> GraphBuilder:
    rng = np.random.default_rng(0)
    b = GraphBuilder("digits")
    x = b.input("x", (None, 1, 8, 8))
    y = b.relu(b.conv(x, rng.standard_normal((8, 1, 3, 3), dtype=np.float32) * 0.5, np.zeros(8, np.float32),
                      pads=1))
    y = b.max_pool(y, 2, strides=2)
    y = b.flatten(y)
    w = rng.standard_normal((128, 10), dtype=np.float32) * np.float32(1 / np.sqrt(128))
    b.output(b.linear(y, w, np.zeros(10, np.float32)))
    return b.build()


def test_cnn_learns_digits_and_serves_from_the_engine():
    digits = datasets.load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]
    labels = digits.target
    order = np.random.default_rng(1).permutation(len(x))
    train, test = order[:1400], order[1400:]
    model = GraphModel(small_cnn())
    opt = Adam(model.parameters(), lr=0.01)
    first, epoch_losses = None, []
    for _ in range(4):
        losses = []
        for start in range(0, len(train), 64):
            idx = train[start : start + 64]
            opt.zero_grad()
            loss = cross_entropy(model(x[idx])[model.graph.outputs[0]], labels[idx])
            loss.backward()
            opt.step()
            losses.append(float(loss.data))
            first = losses[0] if first is None else first
        epoch_losses.append(np.mean(losses))
    assert epoch_losses[-1] < 0.3 * first, (first, epoch_losses)
    logits = model(x[test], training=False)[model.graph.outputs[0]].data
    assert (logits.argmax(1) == labels[test]).mean() >= 0.85
    served = InferenceSession(model.to_graph()).run(x[test])[model.graph.outputs[0]]
    np.testing.assert_allclose(served, logits, atol=1e-4, rtol=0)


TAOBAO = Path(__file__).resolve().parents[2] / "jobs" / "data" / "taobao_user_behavior_10k.csv"


def ipv_features(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per (user, item) pair: what the user did on the item's page before any purchase, plus user
    and category context; label: the user bought the item. Returns (features, labels, user ids)."""
    rows = np.genfromtxt(path, delimiter=",", dtype=None, encoding=None)
    pairs: dict[tuple[int, int], dict] = {}
    user_pv: dict[int, int] = {}
    cat_pv: dict[tuple[int, int], int] = {}
    for user, item, cat, behavior, ts in rows:
        p = pairs.setdefault((user, item), {"pv": 0, "cart": 0, "fav": 0, "buy": 0, "cat": cat, "t0": ts, "t1": ts})
        if p["buy"]:
            continue  # only what happened before the purchase is a feature
        p[behavior] += 1
        p["t1"] = ts
        if behavior == "pv":
            user_pv[user] = user_pv.get(user, 0) + 1
            cat_pv[(user, cat)] = cat_pv.get((user, cat), 0) + 1
    keys = list(pairs)
    feats = np.array([[np.log1p(pairs[k]["pv"]), pairs[k]["cart"], pairs[k]["fav"], np.log1p(user_pv.get(k[0], 0)),
                       np.log1p(cat_pv.get((k[0], pairs[k]["cat"]), 0)), np.log1p(pairs[k]["t1"] - pairs[k]["t0"])]
                      for k in keys], dtype=np.float32)
    feats = (feats - feats.mean(0)) / (feats.std(0) + 1e-6)
    labels = np.array([pairs[k]["buy"] > 0 for k in keys], dtype=np.int64)
    return feats, labels, np.array([k[0] for k in keys])


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    ranks = np.empty(len(scores))
    ranks[np.argsort(scores)] = np.arange(1, len(scores) + 1)
    pos = labels == 1
    return float((ranks[pos].sum() - pos.sum() * (pos.sum() + 1) / 2) / (pos.sum() * (~pos).sum()))


@pytest.mark.skipif(not TAOBAO.exists(), reason="the Taobao sample ships in jobs/data")
def test_mlp_learns_purchases_from_taobao_ipv_features():
    """Stated margins: training loss ends below 60% of where it started and below 70% of the best
    feature-less (base-rate) loss, and on users never seen in training the model ranks buyers above
    non-buyers with AUC >= 0.75 (measured here: loss 1.91 -> 0.036, base rate loss ~0.12, AUC 0.96)."""
    x, y, users = ipv_features(TAOBAO)
    test_users = np.unique(users)[::4]  # a quarter of the users, held out whole
    test = np.isin(users, test_users)
    rng = np.random.default_rng(0)
    b = GraphBuilder("purchase")
    h = b.relu(b.linear(b.input("x", (None, x.shape[1])), rng.standard_normal((x.shape[1], 16), dtype=np.float32)
                        * 0.4, np.zeros(16, np.float32)))
    b.output(b.linear(h, rng.standard_normal((16, 2), dtype=np.float32) * 0.4, np.zeros(2, np.float32)))
    model = GraphModel(b.build())
    opt = Adam(model.parameters(), lr=0.02)
    out = model.graph.outputs[0]
    losses = []
    for _ in range(150):
        opt.zero_grad()
        loss = cross_entropy(model(x[~test])[out], y[~test])
        loss.backward()
        opt.step()
        losses.append(float(loss.data))
    rate = y[~test].mean()
    prior = -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate))  # best loss without features
    assert losses[-1] < 0.6 * losses[0] and losses[-1] < 0.7 * prior, (losses[0], losses[-1], prior)
    logits = InferenceSession(model.to_graph()).run(x[test])[out]
    assert auc(logits[:, 1] - logits[:, 0], y[test]) >= 0.75
