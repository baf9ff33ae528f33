"""Every kernel of every op against a reference (torch.nn.functional or plain numpy).

Tolerance: 1e-4 max abs on O(1) values (float32 accumulation order differs between kernels).
"""

import numpy as np
import pytest

from engine.builder import GraphBuilder
from engine.cost import Calibration
from engine.kernels import REGISTRY
from engine.session import InferenceSession

torch = pytest.importorskip("torch")
F = torch.nn.functional
TOL = 1e-4
CAL = Calibration()  # fixed rates: kernel choice must not depend on the machine in tests


def run(graph, x, **kernels):
    return InferenceSession(graph, kernels=kernels, calibration=CAL).run(x)[graph.outputs[0]]


CONV_CASES = [  # (cin, cout, k, stride, pad, dilation, group, hw)
    (3, 8, 3, 1, 1, 1, 1, 9),
    (4, 6, 3, 1, 0, 1, 1, 8),
    (5, 4, 3, 2, 1, 1, 1, 11),
    (4, 4, 1, 1, 0, 1, 1, 7),
    (4, 6, 1, 2, 0, 1, 1, 7),
    (3, 5, 5, 1, 2, 1, 1, 10),
    (4, 4, 3, 1, 2, 2, 1, 9),
    (6, 6, 3, 1, 1, 1, 6, 9),
    (6, 6, 3, 2, 1, 1, 6, 10),
    (8, 8, 5, 2, 2, 1, 8, 13),
    (4, 6, 3, 1, 1, 1, 2, 8),
    (3, 4, 7, 2, 3, 1, 1, 15),
]


def conv_graph(case, act=None):
    cin, cout, k, s, p, d, g, hw = case
    rng = np.random.default_rng(1)
    w = rng.standard_normal((cout, cin // g, k, k), dtype=np.float32) * 0.3
    bias = rng.standard_normal(cout, dtype=np.float32)
    b = GraphBuilder()
    y = b.conv(b.input("x", (None, cin, hw, hw)), w, bias, strides=s, pads=p, group=g, dilations=d)
    b.output({None: lambda t: t, "relu": b.relu, "hardswish": b.hard_swish}[act](y))
    return b.build(), w, bias


def applicable_pairs():
    from engine.kernels import NodeCtx
    from engine.ops import infer_shapes

    pairs = []
    for case in CONV_CASES:
        graph, _, _ = conv_graph(case)
        node = graph.nodes[0]
        infos, _ = infer_shapes(graph)
        ctx = NodeCtx(node, [infos[t] for t in node.inputs if t], [infos[node.outputs[0]]], graph.weights)
        pairs += [pytest.param(case, k.name, id="{}-c{}-{}k{}s{}p{}d{}g{}hw{}".format(k.name, *case))
                  for k in REGISTRY["Conv"] if k.applies(ctx)]
    return pairs


@pytest.mark.parametrize(("case", "kernel"), applicable_pairs())
@pytest.mark.parametrize("act", [None, "relu", "hardswish"])
def test_conv_kernels_match_torch(case, kernel, act):
    cin, cout, k, s, p, d, g, hw = case
    x = np.random.default_rng(1).standard_normal((2, cin, hw, hw), dtype=np.float32)
    graph, w, bias = conv_graph(case, act)
    ref = F.conv2d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(bias), s, p, d, g)
    ref = {None: lambda t: t, "relu": F.relu, "hardswish": F.hardswish}[act](ref).numpy()
    out = run(graph, x, Conv=kernel)
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)


def test_every_conv_kernel_is_exercised():
    assert {p.values[1] for p in applicable_pairs()} == {k.name for k in REGISTRY["Conv"]}


@pytest.mark.parametrize("kernel", [k.name for k in REGISTRY["Conv"] if "depthwise" not in k.name])
def test_conv_fused_batchnorm_residual_relu(kernel):
    rng = np.random.default_rng(2)
    k = 1 if kernel == "conv1x1_gemm" else 3
    x = rng.standard_normal((2, 4, 8, 8), dtype=np.float32)
    w = rng.standard_normal((4, 4, k, k), dtype=np.float32) * 0.3
    bn = [rng.random(4, dtype=np.float32) + 0.5, rng.standard_normal(4, dtype=np.float32),
          rng.standard_normal(4, dtype=np.float32) * 0.1, rng.random(4, dtype=np.float32) + 0.5]
    b = GraphBuilder()
    xi = b.input("x", (None, 4, 8, 8))
    y = b.batch_norm(b.conv(xi, w, pads=k // 2), *bn)
    b.output(b.relu(b.add(y, xi)))
    graph = b.build()
    sess = InferenceSession(graph, kernels={"Conv": kernel}, calibration=CAL)
    assert [n.op for n in sess.graph.nodes] == ["Conv"]  # BN, Add and Relu all fused
    t = F.conv2d(torch.from_numpy(x), torch.from_numpy(w), padding=k // 2)
    t = F.batch_norm(t, torch.from_numpy(bn[2]), torch.from_numpy(bn[3]), torch.from_numpy(bn[0]),
                     torch.from_numpy(bn[1]), eps=1e-5)
    ref = F.relu(t + torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(sess.run(x)[graph.outputs[0]], ref, atol=TOL, rtol=0)


@pytest.mark.parametrize(("op", "kw"), [("max", {"kernel": 3, "strides": 2, "pads": 1}),
                                        ("max", {"kernel": 2, "strides": 2}),
                                        ("avg", {"kernel": 3, "strides": 1, "pads": 1}),
                                        ("avg", {"kernel": 2, "strides": 2})])
def test_pools_match_torch(op, kw):
    x = np.random.default_rng(3).standard_normal((2, 3, 9, 9), dtype=np.float32)
    b = GraphBuilder()
    xi = b.input("x", (None, 3, 9, 9))
    b.output((b.max_pool if op == "max" else b.avg_pool)(xi, **kw))
    t = torch.from_numpy(x)
    p = kw.get("pads", 0)
    ref = (F.max_pool2d(t, kw["kernel"], kw["strides"], p) if op == "max"
           else F.avg_pool2d(t, kw["kernel"], kw["strides"], p, count_include_pad=False))
    np.testing.assert_allclose(run(b.build(), x), ref.numpy(), atol=TOL, rtol=0)


def test_global_pool_gemm_softmax_sigmoid_mul():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 6, 5, 5), dtype=np.float32)
    w = rng.standard_normal((6, 4), dtype=np.float32)
    bias = rng.standard_normal(4, dtype=np.float32)
    b = GraphBuilder()
    xi = b.input("x", (None, 6, 5, 5))
    gate = b.sigmoid(b.global_avg_pool(xi))
    y = b.flatten(b.global_avg_pool(b.mul(xi, gate)))
    b.output(b.softmax(b.hard_sigmoid(b.linear(y, w, bias), alpha=0.3, beta=0.4)))
    g = x.mean(axis=(2, 3), keepdims=True)
    z = (x * (1 / (1 + np.exp(-g)))).mean(axis=(2, 3)) @ w + bias
    z = np.clip(0.3 * z + 0.4, 0, 1)
    ref = np.exp(z - z.max(1, keepdims=True))
    ref /= ref.sum(1, keepdims=True)
    np.testing.assert_allclose(run(b.build(), x), ref, atol=TOL, rtol=0)


def test_standalone_batchnorm_and_relu6():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 4, 4), dtype=np.float32) * 5
    s, t, m, v = (rng.random(3, dtype=np.float32) + 0.5 for _ in range(4))
    b = GraphBuilder()
    xi = b.input("x", (None, 3, 4, 4))
    b.output(b.relu6(b.batch_norm(xi, s, t, m, v)))
    c = lambda a: a.reshape(1, 3, 1, 1)  # noqa: E731
    ref = np.clip((x - c(m)) / np.sqrt(c(v) + 1e-5) * c(s) + c(t), 0, 6)
    np.testing.assert_allclose(run(b.build(), x), ref, atol=TOL, rtol=0)


RASTER_CASES = [
    (lambda b, x: b.transpose(x, [0, 2, 3, 1]), lambda x: x.transpose(0, 2, 3, 1)),
    (lambda b, x: b.transpose(x, [3, 1, 0, 2]), lambda x: x.transpose(3, 1, 0, 2)),
    (lambda b, x: b.concat([x, b.relu(x), x], axis=1), lambda x: np.concatenate([x, np.maximum(x, 0), x], 1)),
    (lambda b, x: b.concat([x, x], axis=3), lambda x: np.concatenate([x, x], 3)),
    (lambda b, x: b.slice(x, [1, -4], [3, 100], [1, 3], [1, 2]), lambda x: x[:, 1:3, :, -4::2]),
    (lambda b, x: b.slice(x, [4], [0], [2], [-2]), lambda x: x[:, :, 4:0:-2]),
    (lambda b, x: b.pad(x, [0, 1, 2, 0, 0, 0, 1, 3], value=-1.5),
     lambda x: np.pad(x, ((0, 0), (1, 0), (2, 1), (0, 3)), constant_values=-1.5)),
    (lambda b, x: b.reshape(b.transpose(x, [0, 2, 1, 3]), [0, -1]), lambda x: x.transpose(0, 2, 1, 3).reshape(2, -1)),
]


@pytest.mark.parametrize(("build", "ref"), RASTER_CASES)
def test_layout_ops_through_raster(build, ref):
    x = np.random.default_rng(6).standard_normal((2, 3, 5, 6), dtype=np.float32)
    b = GraphBuilder()
    b.output(build(b, b.input("x", (None, 3, 5, 6))))
    np.testing.assert_array_equal(run(b.build(), x), ref(x))


def test_every_conv_kernel_declares_cost_scratch_and_transform():
    from engine.kernels import NodeCtx
    from engine.ops import infer_shapes

    b = GraphBuilder()
    b.output(b.conv(b.input("x", (1, 8, 16, 16)), np.ones((8, 8, 3, 3), np.float32), pads=1))
    g = b.build()
    infos, _ = infer_shapes(g)
    n = g.nodes[0]
    ctx = NodeCtx(n, [infos[t] for t in n.inputs if t], [infos[n.outputs[0]]], g.weights)
    for k in REGISTRY["Conv"]:
        if not k.applies(ctx):
            continue
        assert CAL.seconds(k.cost(ctx)) > 0
        assert k.scratch_bytes(ctx) >= 0
        assert isinstance(k.transform(ctx), dict)
    winograd = next(k for k in REGISTRY["Conv"] if k.name == "conv_winograd_f23")
    assert winograd.transform(ctx)["u"].shape == (16, 8, 8)


MERGE_CASES = [  # (build, reference, raster steps left after merging)
    (lambda b, x: b.slice(b.transpose(x, [0, 2, 3, 1]), [1, 2], [4, 5], [1, 3]),
     lambda x: x.transpose(0, 2, 3, 1)[:, 1:4, :, 2:5], 1),
    (lambda b, x: b.transpose(b.transpose(x, [0, 2, 3, 1]), [0, 3, 1, 2]), lambda x: x, 1),
    (lambda b, x: b.concat([b.slice(x, [0], [2], [1]), x], axis=1),
     lambda x: np.concatenate([x[:, :2], x], 1), 1),
    (lambda b, x: b.transpose(b.reshape(b.transpose(x, [0, 2, 1, 3]), [0, 5, 18]), [0, 2, 1]),
     lambda x: x.transpose(0, 2, 1, 3).reshape(2, 5, 18).transpose(0, 2, 1), 1),
    (lambda b, x: b.pad(b.slice(x, [1], [5], [2], [2]), [0, 0, 1, 1, 0, 0, 1, 1]),
     lambda x: np.pad(x[:, :, 1:5:2], ((0, 0), (0, 0), (1, 1), (1, 1))), 1),
    (lambda b, x: b.slice(b.pad(x, [0, 0, 1, 1, 0, 0, 1, 1]), [0], [3], [2]),  # pad fills: no merge
     lambda x: np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))[:, :, 0:3], 2),
]


@pytest.mark.parametrize(("build", "ref", "left"), MERGE_CASES)
def test_consecutive_rasters_merge(build, ref, left):
    x = np.random.default_rng(7).standard_normal((2, 3, 5, 6), dtype=np.float32)
    b = GraphBuilder()
    b.output(build(b, b.input("x", (None, 3, 5, 6))))
    graph = b.build()
    sess = InferenceSession(graph, calibration=CAL)
    np.testing.assert_array_equal(sess.run(x)[graph.outputs[0]], ref(x))
    plan = sess.plan_for({"x": x.shape})
    rasters = [s for s in plan.steps if s.kernel is not None and s.kernel.name == "raster"]
    assert len(rasters) == left
    assert left == 2 or rasters[0].reason.startswith("consecutive layout ops merged")


def _random_layout_op(data, b, name, arr):
    """Apply one random Transpose/Slice/Reshape to both the graph tensor and a numpy array."""
    from hypothesis import strategies as st

    kind = data.draw(st.sampled_from(["transpose", "slice", "reshape"]))
    if kind == "transpose":
        perm = data.draw(st.permutations(range(arr.ndim)))
        return b.transpose(name, perm), arr.transpose(perm)
    if kind == "slice":
        axis = data.draw(st.integers(0, arr.ndim - 1))
        n = arr.shape[axis]
        start = data.draw(st.integers(0, n - 1))
        step = data.draw(st.sampled_from([1, 2, -1]))
        end = data.draw(st.integers(start + 1, n)) if step > 0 else data.draw(st.integers(-n - 1, start - 1))
        idx = [slice(None)] * arr.ndim
        idx[axis] = slice(start, end, step)
        return b.slice(name, [start], [end], [axis], [step]), arr[tuple(idx)]
    shape = [arr.shape[0], -1] if arr.ndim > 2 else [-1]
    return b.reshape(name, shape), arr.reshape(shape)


def test_merged_raster_chains_match_numpy():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=60, deadline=None)
    @given(st.data())
    def check(data):
        x = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)
        b = GraphBuilder()
        name, ref = b.input("x", x.shape), x
        for _ in range(data.draw(st.integers(2, 4))):
            if ref.size == 0:
                break
            name, ref = _random_layout_op(data, b, name, ref)
        if name == "x":
            return
        b.output(name)
        graph = b.build()
        np.testing.assert_array_equal(InferenceSession(graph, calibration=CAL).run(x)[name], ref)

    check()
