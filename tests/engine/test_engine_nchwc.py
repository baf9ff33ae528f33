"""The channel-blocked (NCHWc) layout: its generated loops, every blocked kernel (numba and numpy)
against torch, and the layout pass against the NCHW engine.

Tolerance: 1e-4 max abs on O(1) values, as for every kernel (tests/engine/test_engine_kernels.py).
"""

import numpy as np
import pytest

from engine.builder import GraphBuilder
from engine.cost import Calibration
from engine.kernels import accel, nchwc_gen
from engine.layout import to_nchwc
from engine.passes import optimize
from engine.session import InferenceSession

torch = pytest.importorskip("torch")
F = torch.nn.functional
TOL = 1e-4
CAL = Calibration()
NUMBA = accel.available()
KERNELS = {"numba": {"NchwcConv": "nchwc_conv", "NchwcDepthwiseConv": "nchwc_depthwise",
                     "NchwcMaxPool": "nchwc_maxpool"},
           "numpy": {"NchwcConv": "nchwc_conv_numpy", "NchwcDepthwiseConv": "nchwc_depthwise_numpy",
                                  "NchwcMaxPool": "nchwc_maxpool_numpy"}}
ACTS = {None: (lambda t: t), "relu": F.relu, "relu6": lambda t: F.hardtanh(t, 0.0, 6.0),
        "hardswish": F.hardswish, "hardsigmoid": lambda t: torch.clamp(t * 0.2 + 0.5, 0, 1), "sigmoid": torch.sigmoid}


def blocked_session(graph, kernels: str) -> InferenceSession:
    """The graph optimised and blocked here (so the numpy kernels can be forced on the blocked ops)."""
    if kernels == "numba" and not NUMBA:
        pytest.skip("numba is not installed")
    blocked = to_nchwc(optimize(graph))
    return InferenceSession(blocked, optimize_graph=False, calibration=CAL, kernels=KERNELS[kernels])


def builder_act(b: GraphBuilder, act, t):
    return {None: lambda v: v, "relu": b.relu, "relu6": b.relu6, "hardswish": b.hard_swish,
            "hardsigmoid": b.hard_sigmoid, "sigmoid": b.sigmoid}[act](t)


def test_generated_loops_are_the_generators_output():
    assert nchwc_gen.TARGET.read_text() == nchwc_gen.source(), "run: python -m engine.kernels.nchwc_gen"


CONV_CASES = [  # (cin, cout, k, stride, pad, dilation, hw): stems (cin <= 4), padded channel blocks, odd sizes
    (3, 16, 3, 2, 1, 1, 17),
    (3, 20, 7, 2, 3, 1, 23),
    (20, 36, 3, 1, 1, 1, 9),
    (16, 32, 1, 1, 0, 1, 10),
    (32, 16, 1, 2, 0, 1, 9),
    (24, 40, 3, 2, 1, 1, 13),
    (17, 33, 5, 1, 2, 2, 11),
    (64, 48, 3, 1, 1, 1, 7),
    (48, 64, 3, 1, 0, 1, 5),
    (32, 32, 3, 1, 1, 1, 1),
]


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: "c{}-{}k{}s{}p{}d{}hw{}".format(*c))
def test_blocked_conv_matches_torch(case, act, kernels):
    cin, cout, k, s, p, d, hw = case
    rng = np.random.default_rng(cin * 100 + cout)
    w = rng.standard_normal((cout, cin, k, k), dtype=np.float32) * np.float32(1.0 / np.sqrt(cin * k * k))
    bias = rng.standard_normal(cout, dtype=np.float32)
    x = rng.standard_normal((2, cin, hw, hw), dtype=np.float32)
    b = GraphBuilder()
    b.output(builder_act(b, act, b.conv(b.input("x", (None, cin, hw, hw)), w, bias, strides=s, pads=p,
                                        dilations=d)))
    graph = b.build()
    sess = blocked_session(graph, kernels)
    assert {n.op for n in sess.graph.nodes} >= {"NchwcConv", "ReorderOutput"}
    ref = ACTS[act](F.conv2d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(bias), s, p, d)).numpy()
    np.testing.assert_allclose(sess.run(x)[graph.outputs[0]], ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
@pytest.mark.parametrize("act", ["relu", "hardswish", None])
@pytest.mark.parametrize("case", [(24, 3, 1, 1, 1, 12), (40, 5, 2, 2, 1, 15), (20, 3, 1, 2, 2, 9),
                                  (16, 3, 2, 1, 1, 8), (48, 5, 1, 2, 1, 7)],
                         ids=lambda c: "c{}k{}s{}p{}d{}hw{}".format(*c))
def test_blocked_depthwise_with_residual_matches_torch(case, act, kernels):
    """Depthwise conv; the second conv of the same shape is added as the fused residual."""
    c, k, s, p, d, hw = case
    rng = np.random.default_rng(c)
    w1 = rng.standard_normal((c, 1, k, k), dtype=np.float32) * 0.3
    w2 = rng.standard_normal((c, 1, k, k), dtype=np.float32) * 0.3
    b1, b2 = (rng.standard_normal(c, dtype=np.float32) for _ in range(2))
    x = rng.standard_normal((2, c, hw, hw), dtype=np.float32)
    b = GraphBuilder()
    xi = b.input("x", (None, c, hw, hw))
    y1 = b.conv(xi, w1, b1, strides=s, pads=p, group=c, dilations=d)
    y2 = b.conv(xi, w2, b2, strides=s, pads=p, group=c, dilations=d)
    b.output(builder_act(b, act, b.add(y1, y2)))
    graph = b.build()
    sess = blocked_session(graph, kernels)
    ops = [n.op for n in sess.graph.nodes]
    assert ops.count("NchwcDepthwiseConv") == 2 and "Add" not in ops  # the add is fused as a residual
    tx = torch.from_numpy(x)
    conv = [F.conv2d(tx, torch.from_numpy(wi), torch.from_numpy(bi), s, p, d, groups=c)
            for wi, bi in ((w1, b1), (w2, b2))]
    np.testing.assert_allclose(sess.run(x)[graph.outputs[0]], ACTS[act](conv[0] + conv[1]).numpy(), atol=TOL, rtol=0)


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
@pytest.mark.parametrize("case", [(3, 2, 1, 0, 12), (2, 2, 0, 0, 9), (3, 2, 1, 1, 10), (3, 1, 1, 0, 7)],
                         ids=lambda c: "k{}s{}p{}ceil{}hw{}".format(*c))
def test_blocked_maxpool_matches_torch(case, kernels):
    k, s, p, ceil, hw = case
    c = 20
    rng = np.random.default_rng(k + hw)
    w = rng.standard_normal((c, 3, 1, 1), dtype=np.float32)
    x = rng.standard_normal((2, 3, hw, hw), dtype=np.float32)
    b = GraphBuilder()
    y = b.conv(b.input("x", (None, 3, hw, hw)), w)
    b.output(b.op("MaxPool", [y], kernel_shape=[k, k], strides=[s, s], pads=[p] * 4, ceil_mode=ceil))
    graph = b.build()
    sess = blocked_session(graph, kernels)
    assert "NchwcMaxPool" in {n.op for n in sess.graph.nodes}
    ref = F.max_pool2d(F.conv2d(torch.from_numpy(x), torch.from_numpy(w)), k, s, p, ceil_mode=bool(ceil)).numpy()
    np.testing.assert_allclose(sess.run(x)[graph.outputs[0]], ref, atol=TOL, rtol=0)


def mixed_graph() -> tuple:
    """Blocked regions broken by ops that need NCHW: an SE block (pool, convs, broadcast Mul), a
    per-channel constant, a grouped conv, a Concat, a Div by a tensor, a Flatten and a Gemm."""
    rng = np.random.default_rng(7)

    def w(*shape):
        return rng.standard_normal(shape, dtype=np.float32) * 0.3

    b = GraphBuilder()
    x = b.input("x", (None, 3, 16, 16))
    a = b.hard_swish(b.conv(x, w(24, 3, 3, 3), w(24), strides=2, pads=1))  # stem: reads NCHW
    se = b.hard_sigmoid(b.conv(b.relu(b.conv(b.global_avg_pool(a), w(8, 24, 1, 1), w(8))), w(24, 8, 1, 1), w(24)))
    a = b.mul(a, se)
    a = b.add(a, w(1, 24, 1, 1))
    g = b.conv(a, w(24, 6, 3, 3), pads=1, group=4)  # grouped: stays NCHW
    c = b.concat([b.conv(a, w(8, 24, 1, 1)), g], axis=1)  # Concat: NCHW
    c = b.relu(b.conv(c, w(32, 32, 3, 3), w(32), pads=1))
    c = b.op("Div", [c, b.add(b.relu(c), np.ones(1, np.float32))])  # Div by a tensor: NCHW
    m = b.max_pool(c, 2, 2)
    b.output(b.linear(b.flatten(b.global_avg_pool(m)), w(10, 32).T.copy(), w(10)))
    return b.build()


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_layout_pass_keeps_a_mixed_graph_equal_to_nchw(kernels):
    graph = mixed_graph()
    sess = blocked_session(graph, kernels)
    ops = [n.op for n in sess.graph.nodes]
    assert ops.count("NchwcConv") == 5 and "Conv" in ops and "NchwcGlobalAveragePool" in ops
    assert ops.count("ReorderInput") >= 1 and ops.count("ReorderOutput") >= 2
    x = np.random.default_rng(0).standard_normal((3, 3, 16, 16), dtype=np.float32)
    nchw = InferenceSession(graph, calibration=CAL, blocked=False)
    assert not any(n.op.startswith(("Nchwc", "Reorder")) for n in nchw.graph.nodes)
    out = graph.outputs[0]
    np.testing.assert_allclose(sess.run(x)[out], nchw.run(x)[out], atol=TOL, rtol=0)


@pytest.mark.skipif(not NUMBA, reason="numba is not installed")
def test_reference_models_block_end_to_end_with_reorders_only_at_the_edges(onnx_models):
    """A session blocks by default; ResNet-18 and MobileNetV2 run blocked from the stem (which
    reads the image as NCHW) to the pooled features: one reorder, before the classifier."""
    for name in ("resnet18", "mobilenetv2"):
        ops = [n.op for n in InferenceSession(onnx_models[name]).graph.nodes]
        assert "Conv" not in ops and "ReorderInput" not in ops and ops.count("ReorderOutput") == 1, name


def test_blocked_graph_round_trips_through_the_model_file(tmp_path):
    """Packed weights are saved and loaded as they are (a cached graph needs no transform)."""
    from engine.format import load_model, save_model

    graph = to_nchwc(optimize(mixed_graph()))
    save_model(graph, tmp_path / "m.sfe")
    loaded = load_model(tmp_path / "m.sfe")
    x = np.random.default_rng(1).standard_normal((1, 3, 16, 16), dtype=np.float32)
    out = graph.outputs[0]
    a = InferenceSession(graph, optimize_graph=False, calibration=CAL, kernels=KERNELS["numpy"]).run(x)[out]
    b = InferenceSession(loaded, optimize_graph=False, calibration=CAL, kernels=KERNELS["numpy"]).run(x)[out]
    np.testing.assert_array_equal(a, b)
