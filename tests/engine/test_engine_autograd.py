"""Autograd: every op's gradient against PyTorch, optimizers step for step, a whole MobileNetV2
gradient, and BatchNorm running statistics.

Tolerances: 1e-4 max abs for single ops on O(1) values; whole-network gradients within 1e-3 of
the largest gradient (float32 through ~50 layers).
"""

import numpy as np
import pytest

from engine.autograd import SGD, Adam, GraphModel, Tensor, cross_entropy, mse
from engine.autograd import functions as F
from engine.session import InferenceSession

torch = pytest.importorskip("torch")
TF = torch.nn.functional
TOL = 1e-4


def check(ours, theirs, *shapes, seed=0, tol=TOL):
    """Compare forward values and input gradients of ``sum(out * r)`` for a random ``r``."""
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    ts = [Tensor(x.copy(), requires_grad=True) for x in xs]
    out = ours(*ts)
    r = rng.standard_normal(out.shape, dtype=np.float32)
    (out * Tensor(r)).sum().backward()
    tt = [torch.tensor(x, requires_grad=True) for x in xs]
    ref = theirs(*tt)
    (ref * torch.from_numpy(r)).sum().backward()
    np.testing.assert_allclose(out.data, ref.detach().numpy(), atol=tol, rtol=0)
    for t, u in zip(ts, tt, strict=True):
        np.testing.assert_allclose(t.grad, u.grad.numpy(), atol=tol * 10, rtol=1e-4)


CONVS = [  # (x shape, w shape, stride, pad, dilation, group)
    ((2, 3, 7, 7), (4, 3, 3, 3), 1, 1, 1, 1),
    ((2, 4, 8, 8), (6, 4, 3, 3), 2, 1, 1, 1),
    ((1, 4, 9, 9), (4, 4, 3, 3), 1, 2, 2, 1),
    ((2, 4, 6, 6), (6, 2, 3, 3), 1, 1, 1, 2),
    ((2, 6, 9, 9), (6, 1, 3, 3), 2, 1, 1, 6),
    ((2, 5, 6, 6), (3, 5, 1, 1), 1, 0, 1, 1),
    ((1, 4, 10, 10), (4, 1, 5, 5), 1, 2, 1, 4),
    ((2, 8, 6, 6), (8, 1, 3, 3), 1, 1, 1, 8),  # the fused 3x3 depthwise rows: stride 1, 2 (even width), width 2
    ((2, 4, 8, 8), (4, 1, 3, 3), 2, 1, 1, 4),
    ((1, 3, 2, 2), (3, 1, 3, 3), 1, 1, 1, 3),
]


@pytest.mark.parametrize(("xs", "ws", "s", "p", "d", "g"), CONVS)
def test_conv_gradients(xs, ws, s, p, d, g):
    check(lambda x, w, b: F.Conv2d.apply(x, w, b, stride=(s, s), pads=(p,) * 4, dil=(d, d), group=g),
          lambda x, w, b: TF.conv2d(x, w, b, s, p, d, g), xs, ws, (ws[0],))


@pytest.mark.parametrize(("ours", "theirs"), [
    (F.Relu.apply, TF.relu),
    (lambda x: F.Clip.apply(x * Tensor(np.float32(4)), lo=0.0, hi=6.0), lambda x: TF.relu6(x * 4)),
    (lambda x: F.HardSwish.apply(x * Tensor(np.float32(3))), lambda x: TF.hardswish(x * 3)),
    (lambda x: F.HardSigmoid.apply(x * Tensor(np.float32(3)), alpha=1 / 6, beta=0.5),
     lambda x: TF.hardsigmoid(x * 3)),
    (F.Sigmoid.apply, torch.sigmoid),
    (lambda x: F.Softmax.apply(x, axis=1), lambda x: torch.softmax(x, 1)),
    (lambda x: F.MaxPool2d.apply(x, k=(3, 3), stride=(2, 2), pads=(1, 1, 1, 1)), lambda x: TF.max_pool2d(x, 3, 2, 1)),
    (lambda x: F.MaxPool2d.apply(x, k=(2, 2), stride=(2, 2)), lambda x: TF.max_pool2d(x, 2, 2)),
    (lambda x: F.AvgPool2d.apply(x, k=(3, 3), stride=(1, 1), pads=(1, 1, 1, 1)),
     lambda x: TF.avg_pool2d(x, 3, 1, 1, count_include_pad=False)),
    (lambda x: F.AvgPool2d.apply(x, k=(2, 2), stride=(2, 2)), lambda x: TF.avg_pool2d(x, 2, 2)),
    (F.GlobalAvgPool.apply, lambda x: x.mean((2, 3), keepdim=True)),
    (lambda x: F.Reshape.apply(x, shape=(2, -1)), lambda x: x.reshape(2, -1)),
    (lambda x: F.Transpose.apply(x, perm=(0, 2, 3, 1)), lambda x: x.permute(0, 2, 3, 1)),
    (lambda x: F.Concat.apply(x, F.Relu.apply(x), axis=1), lambda x: torch.cat([x, TF.relu(x)], 1)),
    (lambda x: F.Slice.apply(x, index=(slice(None), slice(1, 3), slice(None, None, 2))), lambda x: x[:, 1:3, ::2]),
    (lambda x: F.Pad.apply(x, pads=(0, 1, 2, 0, 0, 0, 1, 3), value=0.5),
     lambda x: TF.pad(x, (0, 3, 2, 1, 1, 0), value=0.5)),
])
def test_elementwise_pool_and_layout_gradients(ours, theirs):
    check(ours, theirs, (2, 3, 6, 6))


def test_binary_broadcast_and_matmul_gradients():
    check(lambda a, b: F.Add.apply(a, b), lambda a, b: a + b, (2, 3, 4, 4), (1, 3, 1, 1))
    check(lambda a, b: F.Mul.apply(a, b), lambda a, b: a * b, (2, 3, 4, 4), (1, 3, 1, 1))
    check(lambda a, b: F.MatMul.apply(a, b), lambda a, b: a @ b, (5, 7), (7, 3))
    check(lambda x, w, b: F.linear(x, w, b), lambda x, w, b: x @ w + b, (4, 6), (6, 3), (3,))


def test_batchnorm_training_gradients_and_running_stats():
    rm, rv = np.zeros(3, np.float32), np.ones(3, np.float32)
    check(lambda x, g, b: F.BatchNorm.apply(x, g, b, running_mean=rm, running_var=rv, momentum=0.1),
          lambda x, g, b: TF.batch_norm(x, torch.zeros(3), torch.ones(3), g, b, training=True),
          (4, 3, 5, 5), (3,), (3,))
    x = np.random.default_rng(0).standard_normal((4, 3, 5, 5), dtype=np.float32)
    trm, trv = torch.zeros(3), torch.ones(3)
    TF.batch_norm(torch.from_numpy(x), trm, trv, training=True, momentum=0.1)
    np.testing.assert_allclose(rm, trm.numpy(), atol=1e-6)
    np.testing.assert_allclose(rv, trv.numpy(), atol=1e-5)


def test_losses_match_torch():
    rng = np.random.default_rng(3)
    logits, labels = rng.standard_normal((6, 5), dtype=np.float32), rng.integers(0, 5, 6)
    t = Tensor(logits.copy(), requires_grad=True)
    loss = cross_entropy(t, labels)
    loss.backward()
    tt = torch.tensor(logits, requires_grad=True)
    ref = TF.cross_entropy(tt, torch.from_numpy(labels))
    ref.backward()
    assert abs(float(loss.data) - ref.item()) < 1e-5
    np.testing.assert_allclose(t.grad, tt.grad.numpy(), atol=1e-6)
    y, target = rng.standard_normal((4, 3), dtype=np.float32), rng.standard_normal((4, 3), dtype=np.float32)
    t = Tensor(y.copy(), requires_grad=True)
    mse(t, target).backward()
    tt = torch.tensor(y, requires_grad=True)
    TF.mse_loss(tt, torch.from_numpy(target)).backward()
    np.testing.assert_allclose(t.grad, tt.grad.numpy(), atol=1e-6)


@pytest.mark.parametrize(("ours", "theirs"), [
    (lambda p: SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01)),
    (lambda p: Adam(p, lr=0.05), lambda p: torch.optim.Adam(p, lr=0.05)),
])
def test_optimizers_follow_torch_step_for_step(ours, theirs):
    w0 = np.random.default_rng(4).standard_normal(5, dtype=np.float32)
    w = Tensor(w0.copy(), requires_grad=True)
    tw = torch.tensor(w0, requires_grad=True)
    opt, topt = ours([w]), theirs([tw])
    for _ in range(5):
        opt.zero_grad()
        ((w * w) * Tensor(np.float32(0.5)) + w).sum().backward()
        opt.step()
        topt.zero_grad()
        (tw**2 * 0.5 + tw).sum().backward()
        topt.step()
    np.testing.assert_allclose(w.data, tw.detach().numpy(), atol=1e-5, rtol=1e-5)


def test_whole_mobilenetv2_gradient_matches_torch(tmp_path):
    pytest.importorskip("onnx")
    import engine_zoo

    from engine.onnx_import import from_onnx

    model = engine_zoo.build("mobilenetv2", width=0.35, classes=10)
    path = engine_zoo.export(model, str(tmp_path / "m.onnx"), size=64, fold=False)
    ours = GraphModel(from_onnx(path))
    rng = np.random.default_rng(5)
    x, labels = rng.standard_normal((4, 3, 64, 64), dtype=np.float32), rng.integers(0, 10, 4)
    loss = cross_entropy(ours(x)["y"], labels)
    loss.backward()
    model.train()
    ref = TF.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(labels))
    ref.backward()
    assert abs(float(loss.data) - ref.item()) < 1e-3
    named = dict(model.named_parameters())
    assert len(ours.params) == len(named)
    scale = max(float(np.abs(p.grad.numpy()).max()) for p in named.values())
    for name, p in ours.params.items():
        np.testing.assert_allclose(p.grad, named[name].grad.numpy(), atol=1e-3 * scale, rtol=0, err_msg=name)
    for m_name, buf in model.named_buffers():
        if m_name in ours.buffers:
            np.testing.assert_allclose(ours.buffers[m_name], buf.numpy(), atol=1e-4, err_msg=m_name)


def test_global_max_pool_and_reduce_mean_gradients():
    check(F.GlobalMaxPool.apply, lambda x: x.amax((2, 3), keepdim=True), (2, 3, 5, 5))
    check(lambda x: F.ReduceMean.apply(x, axes=(1, 3), keepdims=False), lambda x: x.mean((1, 3)), (2, 3, 4, 5))


def test_graph_model_gradients_through_every_graph_op():
    from engine.builder import GraphBuilder

    rng = np.random.default_rng(6)
    w = rng.standard_normal((4, 3, 3, 3), dtype=np.float32) * 0.3
    bias = rng.standard_normal(4, dtype=np.float32)
    fc = rng.standard_normal((5, 8), dtype=np.float32) * 0.3  # (out, in): Gemm with transB
    c1, c2 = np.float32(0.25), np.full((1, 4, 1, 1), 2.0, np.float32)
    b = GraphBuilder()
    y = b.conv(b.input("x", (None, 3, 6, 6)), w, bias, pads=1)
    y = b.op("Div", [b.op("Sub", [y, np.array(c1)]), c2])
    z = b.concat([y, b.transpose(y, [0, 1, 3, 2])], axis=1)
    z = b.pad(b.slice(z, [1], [5], [2]), [0, 0, 1, 0, 0, 0, 0, 1])
    pooled = b.add(b.op("GlobalMaxPool", [z]), b.op("ReduceMean", [z], axes=[2, 3], keepdims=1))
    b.output(b.op("Gemm", [b.flatten(pooled), fc], transB=1))
    graph = b.build()
    model = GraphModel(graph)
    x = rng.standard_normal((2, 3, 6, 6), dtype=np.float32)
    r = rng.standard_normal((2, 5), dtype=np.float32)
    out = model(x)[graph.outputs[0]]
    (out * Tensor(r)).sum().backward()

    tw, tb, tfc = (torch.tensor(a, requires_grad=True) for a in (w, bias, fc))
    t = (TF.conv2d(torch.from_numpy(x), tw, tb, padding=1) - 0.25) / 2.0
    t = torch.cat([t, t.transpose(2, 3)], 1)[:, :, 1:5]
    t = TF.pad(t, (0, 1, 1, 0))
    t = (t.amax((2, 3)) + t.mean((2, 3))) @ tfc.T
    (t * torch.from_numpy(r)).sum().backward()
    np.testing.assert_allclose(out.data, t.detach().numpy(), atol=TOL)
    for name, ref in zip([graph.nodes[0].inputs[1], graph.nodes[0].inputs[2], graph.nodes[-1].inputs[1]],
                         (tw, tb, tfc), strict=True):
        np.testing.assert_allclose(model.params[name].grad, ref.grad.numpy(), atol=1e-4, err_msg=name)
    served = InferenceSession(model.to_graph()).run(x)[graph.outputs[0]]
    np.testing.assert_allclose(served, out.data, atol=TOL)
