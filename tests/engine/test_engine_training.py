"""Training converges on real data: a small CNN learns scikit-learn's handwritten digits (8x8 scans
shipped inside the package), then serves from the inference engine with the same predictions.

Stated margins: the last epoch's mean loss is below 30% of the first batch's loss, and held-out
accuracy is at least 85%.
"""

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
