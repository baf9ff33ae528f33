"""Graph IR, shape inference, builder API and the on-disk model format."""

import numpy as np
import pytest

from engine.builder import GraphBuilder
from engine.format import ModelFile, load_model, save_model
from engine.ir import Graph, GraphError, Node, TensorInfo
from engine.ops import infer_shapes


def small_cnn() -> GraphBuilder:
    rng = np.random.default_rng(0)
    b = GraphBuilder("small")
    x = b.input("x", (None, 3, 16, 16))
    y = b.relu(b.conv(x, rng.standard_normal((8, 3, 3, 3), dtype=np.float32), pads=1, strides=2))
    y = b.max_pool(y, 2, strides=2)
    y = b.flatten(b.global_avg_pool(y))
    b.output(b.softmax(b.linear(y, rng.standard_normal((8, 4), dtype=np.float32))))
    return b


def test_topological_order_sorts_shuffled_nodes():
    g = small_cnn().build()
    expected = [n.name for n in g.nodes]
    g.nodes = g.nodes[::-1]
    assert [n.name for n in g.topological_order()] == expected


def test_cycle_and_dangling_inputs_are_reported():
    g = Graph([TensorInfo("x", (1,))], ["b"], [Node("Relu", ["b"], ["a"], name="n1"),
                                                Node("Relu", ["a"], ["b"], name="n2")])
    with pytest.raises(GraphError, match="cycle"):
        g.topological_order()
    g = Graph([TensorInfo("x", (1,))], ["a"], [Node("Relu", ["nope"], ["a"], name="n1")])
    with pytest.raises(GraphError, match="nope"):
        g.validate()


def test_shape_inference_binds_batch():
    b = small_cnn()
    g = b.build()
    infos, _ = infer_shapes(g, {"x": (5, 3, 16, 16)})
    shapes = [infos[n.outputs[0]].shape for n in g.nodes]
    assert shapes == [(5, 8, 8, 8), (5, 8, 8, 8), (5, 8, 4, 4), (5, 8, 1, 1), (5, 8), (5, 4), (5, 4)]


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda b, x: b.transpose(x, [0, 2, 3, 1]), (2, 5, 6, 4)),
        (lambda b, x: b.concat([x, x], axis=1), (2, 8, 5, 6)),
        (lambda b, x: b.slice(x, [1, -4], [3, 100], [1, 3], [1, 2]), (2, 2, 5, 2)),
        (lambda b, x: b.pad(x, [0, 0, 1, 2, 0, 0, 3, 4]), (2, 4, 9, 12)),
        (lambda b, x: b.reshape(x, [0, -1]), (2, 120)),
        (lambda b, x: b.avg_pool(x, 3, strides=2, pads=1), (2, 4, 3, 3)),
        (lambda b, x: b.add(x, np.ones((4, 1, 1), np.float32)), (2, 4, 5, 6)),
    ],
)
def test_shape_inference_per_op(build, expected):
    b = GraphBuilder()
    x = b.input("x", (2, 4, 5, 6))
    b.output(build(b, x))
    g = b.build()
    assert infer_shapes(g)[0][g.outputs[0]].shape == expected


def test_shape_arithmetic_is_folded():
    b = GraphBuilder()
    x = b.input("x", (None, 4, 2, 2))
    s = b.op("Shape", [x])
    head = b.op("Slice", [s, np.array([0]), np.array([1])])
    spec = b.op("Concat", [head, np.array([-1], dtype=np.int64)], axis=0)
    b.output(b.op("Reshape", [x, spec]))
    g = b.build()
    infos, folded = infer_shapes(g, {"x": (3, 4, 2, 2)})
    assert infos[g.outputs[0]].shape == (3, 16)
    assert folded[spec].tolist() == [3, -1]


def test_unknown_op_is_named():
    g = Graph([TensorInfo("x", (1,))], ["y"], [Node("Frobnicate", ["x"], ["y"], name="f0")])
    with pytest.raises(GraphError, match="Frobnicate.*f0"):
        infer_shapes(g)


def test_model_file_roundtrip_is_memory_mapped(tmp_path):
    g = small_cnn().build()
    path = tmp_path / "m.sfe"
    size = save_model(g, path)
    assert path.stat().st_size == size
    loaded = load_model(path)
    assert [n.op for n in loaded.nodes] == [n.op for n in g.nodes]
    assert loaded.nodes[0].attrs == g.nodes[0].attrs
    for name, w in g.weights.items():
        assert isinstance(loaded.weights[name].base, np.memmap) or isinstance(loaded.weights[name], np.memmap)
        np.testing.assert_array_equal(loaded.weights[name], w)
        assert loaded.weights[name].dtype == w.dtype
        assert loaded.weights[name].ctypes.data % 64 == 0
    assert infer_shapes(loaded)[0][loaded.outputs[0]].shape == (1, 4)


def test_weights_readable_one_by_one(tmp_path):
    g = small_cnn().build()
    save_model(g, tmp_path / "m.sfe")
    mf = ModelFile(tmp_path / "m.sfe")
    assert mf.weight_names() == list(g.weights)
    for name, w in g.weights.items():
        assert mf.weight_info(name).shape == w.shape
        np.testing.assert_array_equal(mf.read_weight(name), w)


def test_bad_magic_is_rejected(tmp_path):
    (tmp_path / "junk").write_bytes(b"not a model at all")
    with pytest.raises(ValueError, match="magic"):
        ModelFile(tmp_path / "junk")
