"""Training under a memory budget (engine/training): the static program, recomputation and
micro-batches give the same updates as today's trainer (<= 1e-5) and PyTorch (<= 1e-4); budgets
are enforced (RSS growth measured in a subprocess) and can change between steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.autograd import SGD, Adam, GraphModel, cross_entropy, mse
from engine.builder import GraphBuilder
from engine.planner import Buffer
from engine.training import BudgetedTrainer, BudgetError, Program, plan_pool
from engine.training.pool import compare
from engine.training.stream import Stream

ROOT = Path(__file__).resolve().parents[2]


def mlp_cnn(batchnorm: bool = False, seed: int = 0):
    """conv(+BN)-relu-maxpool-conv-relu-flatten-linear on 1x8x8 inputs (no conv bias before the BN:
    its gradient would be rounding noise, which Adam turns into full-size steps)."""
    rng = np.random.default_rng(seed)
    b = GraphBuilder("small")
    x = b.input("x", (None, 1, 8, 8))
    y = b.conv(x, rng.standard_normal((8, 1, 3, 3), dtype=np.float32) * 0.5,
               None if batchnorm else np.zeros(8, np.float32), pads=1)
    if batchnorm:
        y = b.batch_norm(y, np.ones(8, np.float32), np.zeros(8, np.float32), np.zeros(8, np.float32),
                         np.ones(8, np.float32))
    y = b.max_pool(b.relu(y), 2, strides=2)
    y = b.relu(b.conv(y, rng.standard_normal((8, 8, 3, 3), dtype=np.float32) * 0.2, np.zeros(8, np.float32), pads=1))
    w = rng.standard_normal((128, 10), dtype=np.float32) * np.float32(1 / np.sqrt(128))
    b.output(b.linear(b.flatten(y), w, np.zeros(10, np.float32)))
    return b.build()


def bn_resnet(seed: int = 0):
    """conv-BN-relu, a depthwise/pointwise residual block with BatchNorms (a MobileNetV2 block),
    maxpool, conv-BN-relu, global pool and a transB Gemm, on 1x8x8 inputs; convs before a
    BatchNorm have no bias (as in real models: such a bias's gradient is only rounding noise)."""
    rng = np.random.default_rng(seed)
    b = GraphBuilder("bn_resnet")

    def bn(y, c):
        return b.batch_norm(y, (1 + 0.1 * rng.standard_normal(c)).astype(np.float32),
                            (0.1 * rng.standard_normal(c)).astype(np.float32), np.zeros(c, np.float32),
                            np.ones(c, np.float32))

    def w(*shape, scale):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)

    x = b.input("x", (None, 1, 8, 8))
    h = b.relu(bn(b.conv(x, w(8, 1, 3, 3, scale=0.5), pads=1), 8))
    r = b.relu6(bn(b.conv(h, w(8, 1, 3, 3, scale=0.5), pads=1, group=8), 8))
    h = b.max_pool(b.add(h, bn(b.conv(r, w(8, 8, 1, 1, scale=0.3)), 8)), 2, strides=2)
    h = b.relu(bn(b.conv(h, w(16, 8, 3, 3, scale=0.2), pads=1), 16))
    b.output(b.op("Gemm", [b.flatten(b.global_avg_pool(h)), w(10, 16, scale=0.25), np.zeros(10, np.float32)],
                  transB=1))
    return b.build()


def data(batch: int = 16, seed: int = 1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, batch)


def reference_steps(graph, x, labels, steps, make_opt):
    model = GraphModel(graph)
    opt = make_opt(model.parameters())
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = cross_entropy(model(x)[graph.outputs[0]], labels)
        loss.backward()
        opt.step()
        losses.append(float(loss.data))
    return model, losses


def max_param_diff(a: GraphModel, b: GraphModel) -> float:
    return max(float(np.abs(a.params[k].data - b.params[k].data).max()) for k in a.params)


def assert_three_steps_equal(prog, plan, x, labels, opt, ref, ref_losses) -> None:
    """Three steps of ``plan`` give the reference's losses, parameters and running statistics (within 1e-5)."""
    losses = [prog.run(plan, x, labels, opt) for _ in range(3)]
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=0)
    assert max_param_diff(ref, prog.model) <= 1e-5
    for k in ref.buffers:
        np.testing.assert_allclose(prog.model.buffers[k], ref.buffers[k], atol=1e-5, rtol=0)


@pytest.mark.parametrize("make_opt", [lambda p: SGD(p, lr=0.1, momentum=0.9), lambda p: Adam(p, lr=0.01)],
                         ids=["sgd", "adam"])
def test_program_equals_todays_trainer_unbudgeted_and_under_a_tight_budget(make_opt):
    graph = mlp_cnn(batchnorm=True)
    x, labels = data(batch=128)
    ref, ref_losses = reference_steps(graph, x, labels, 3, make_opt)
    model = GraphModel(graph)
    trainer = BudgetedTrainer(model, make_opt(model.parameters()))
    free = trainer.plan_for(128, (1, 8, 8))
    losses = [trainer.step(x, labels)]
    with pytest.raises(BudgetError) as err:
        trainer.set_budget(1000)
        trainer.plan_for(128, (1, 8, 8))
    trainer.set_budget(err.value.smallest)
    tight = trainer.plan_for(128, (1, 8, 8))
    assert tight.dropped or tight.stream, "a smaller budget must recompute or stream something"
    assert tight.total_bytes < free.total_bytes
    losses += [trainer.step(x, labels), trainer.step(x, labels)]
    np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=0)
    assert max_param_diff(ref, model) <= 1e-5
    for k in ref.buffers:  # recomputation must not touch BatchNorm's running statistics twice
        np.testing.assert_allclose(model.buffers[k], ref.buffers[k], atol=1e-6, rtol=0)


def test_micro_batches_update_equals_the_full_batch():
    graph = mlp_cnn()
    x, labels = data(batch=18)
    ref, _ = reference_steps(graph, x, labels, 2, lambda p: Adam(p, lr=0.01))
    for k in (2, 4):
        model = GraphModel(graph)
        trainer = BudgetedTrainer(model, Adam(model.parameters(), lr=0.01), micro_batches=k)
        trainer.step(x, labels)
        trainer.step(x, labels)
        assert trainer.last_plan.micro_batches == k
        assert max_param_diff(ref, model) <= 1e-5


def test_budget_picks_micro_batches_without_batchnorm_and_refuses_them_with_batchnorm():
    x, labels = data(batch=32)
    model = GraphModel(mlp_cnn())
    full = BudgetedTrainer(model, SGD(model.parameters(), lr=0.1)).plan_for(32, (1, 8, 8))
    trainer = BudgetedTrainer(model, SGD(model.parameters(), lr=0.1), memory_budget=full.total_bytes // 2)
    trainer.step(x, labels)
    assert trainer.last_plan.micro_batches > 1 and trainer.last_plan.total_bytes <= full.total_bytes // 2
    bn = GraphModel(mlp_cnn(batchnorm=True))
    with pytest.raises(ValueError, match="BatchNorm: its batch statistics"):
        BudgetedTrainer(bn, SGD(bn.parameters(), lr=0.1), micro_batches=2).step(x, labels)


STREAMS = [(3, 6, (), (), ()), (3, 7, (1, 2), (), ()), (8, 3, (3,), (), ()), (11, 5, (3,), (), ()),
           (16, 20, (), (), ()), (16, 3, (3, 9, 12), (), ()), (16, 1, tuple(range(1, 16)), (), ()),
           # parked segments: their BatchNorms' inputs kept for the whole batch during their own passes
           (16, 3, (3, 9, 12), (0, 3, 9, 12), ()), (11, 5, (3,), (3,), ()), (16, 20, (), (0,), ()),
           (16, 7, (9,), (0,), ()),
           # carried segments: their BatchNorms' output gradients kept for the whole batch during their backward
           (3, 6, (), (), (0,)), (8, 3, (3,), (), (0, 3)), (8, 3, (3,), (3,), (0, 3)), (16, 3, (3, 9, 12), (), (0, 9)),
           (16, 3, (3, 9, 12), (0, 3, 9, 12), (0, 3, 9, 12)), (16, 1, tuple(range(1, 16)), (), tuple(range(16))),
           # ... a residual block's (its input's gradient summed over the passes) and three BatchNorms'
           (16, 3, (3, 9, 12), (), (3,)), (12, 4, (3,), (3,), (3,)), (12, 7, (3,), (), (3,))]


@pytest.mark.parametrize("make_opt", [lambda p: SGD(p, lr=0.1, momentum=0.9), lambda p: Adam(p, lr=0.01)],
                         ids=["sgd", "adam"])
@pytest.mark.parametrize(("end", "chunk", "borders", "parked", "carried"), STREAMS)
def test_streamed_batchnorm_step_equals_the_whole_batch(make_opt, end, chunk, borders, parked, carried):
    """Chunks of rows through BatchNorms with the whole batch's statistics: the same losses,
    updates and running statistics as today's trainer on the whole batch (one chunk of a row, too;
    parked and carried segments too)."""
    graph = bn_resnet()
    x, labels = data(batch=20)
    ref, ref_losses = reference_steps(graph, x, labels, 3, make_opt)
    model = GraphModel(graph)
    opt = make_opt(model.parameters())
    prog = Program(model, "cross_entropy", (1, 8, 8))
    plan = prog.plan(20, stream=Stream.at(end, chunk, borders, parked, carried),
                     optimizer_state_bytes=opt.state_bytes())
    assert len(plan.stream.segments) == len(borders) + 1 and plan.stream.parked == parked
    if parked:
        assert any(b.name.endswith("#kept-backward") for b in plan.buffers)
    if carried:
        assert any(b.name.endswith("#carried-grad") for b in plan.buffers)
    assert_three_steps_equal(prog, plan, x, labels, opt, ref, ref_losses)


@pytest.mark.parametrize(("end", "chunk", "borders", "parked_bns", "carried_bns"), [
    (16, 3, (), (4,), (1,)), (16, 3, (), (1, 7), (11,)), (16, 7, (), (4, 11), (1, 11)),
    (16, 7, (9,), (4,), (1,)), (12, 4, (3,), (7,), (4,)), (12, 4, (3,), (), (7,)), (12, 1, (3,), (4, 7), (4, 11)),
    (16, 1, (3, 9, 12), (4,), (7,))])
def test_single_batchnorms_parked_and_carried_equal_the_whole_batch(end, chunk, borders, parked_bns, carried_bns):
    """Some of a segment's BatchNorms keep their input for the whole batch during its passes, or
    carry their output gradient during its backward (not all of them, as a parked or carried segment
    does): the same losses, updates and running statistics as today's trainer on the whole batch."""
    graph = bn_resnet()
    x, labels = data(batch=20)
    make_opt = lambda p: SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    ref, ref_losses = reference_steps(graph, x, labels, 3, make_opt)
    model = GraphModel(graph)
    opt = make_opt(model.parameters())
    prog = Program(model, "cross_entropy", (1, 8, 8))
    plan = prog.plan(20, stream=Stream.at(end, chunk, borders, parked_bns=parked_bns, carried_bns=carried_bns),
                     optimizer_state_bytes=opt.state_bytes())
    assert any(b.name.endswith("#carried-grad") for b in plan.buffers)
    if parked_bns:
        assert any(b.name.endswith("#kept-backward") for b in plan.buffers)
    assert_three_steps_equal(prog, plan, x, labels, opt, ref, ref_losses)


@pytest.mark.parametrize("chunks", [(3, 3, 2), (1,) * 8, (5, 3), (8,)])
def test_batch_statistics_gathered_in_chunks_equal_batchnorm_bitwise(chunks):
    """BatchStats sums each chunk's rows into the running float32 sums in row order, as numpy
    reduces the whole batch: the mean, 1/std and the backward's sums are BatchNorm's, bit for bit
    (inputs far from centred, where a differently rounded variance moves every gradient)."""
    from engine.autograd import Tensor
    from engine.autograd import functions as F

    rng = np.random.default_rng(3)
    x = (rng.standard_normal((8, 6, 12, 12), dtype=np.float32) * 0.3 + 40).astype(np.float32)
    g = rng.standard_normal(x.shape, dtype=np.float32)
    gamma, beta = rng.standard_normal(6, dtype=np.float32), rng.standard_normal(6, dtype=np.float32)
    whole = F.BatchNorm(())
    y = whole.forward(x, gamma, beta, eps=1e-5)
    dx, dgamma, dbeta = whole.backward(g)
    spans = np.cumsum((0, *chunks))
    st = F.BatchStats()
    for lo, hi in zip(spans[:-1], spans[1:], strict=True):
        st.add(x[lo:hi])
    for lo, hi in zip(spans[:-1], spans[1:], strict=True):
        st.add_centred(x[lo:hi])
    mean, _ = st.finish(1e-5)
    assert np.array_equal(mean, x.mean(axis=(0, 2, 3))) and np.array_equal(st.inv, whole.inv)
    for collect in (True, False):
        if collect:
            st.begin_collect()
        for lo, hi in zip(spans[:-1], spans[1:], strict=True):
            xs = Tensor(x[lo:hi], requires_grad=True)
            out = F.BatchNormGiven.apply(xs, Tensor(gamma), Tensor(beta), stats=st)
            out.backward(g[lo:hi])
            if not collect:
                assert np.array_equal(out.data, y[lo:hi]) and np.array_equal(xs.grad, dx[lo:hi])
        if collect:
            st.end_collect()
    assert np.array_equal(st.sum_gx, dgamma) and np.array_equal(st.sum_g, dbeta)


def test_streamed_mobilenetv2_gradients_equal_todays_trainer(tmp_path):
    """MobileNetV2's first blocks streamed in chunks of 3 rows: every gradient within 1e-5 of today's
    trainer on the whole batch (its gradients reach ~9; a variance summed in another order than the
    whole batch's moved them by ~1e-4)."""
    pytest.importorskip("torch")
    pytest.importorskip("onnx")
    import engine_zoo

    from engine.onnx_import import from_onnx

    graph = from_onnx(engine_zoo.export(engine_zoo.build("mobilenetv2", width=0.35, classes=10),
                                        str(tmp_path / "m.onnx"), size=48, fold=False))
    rng = np.random.default_rng(0)
    x, labels = rng.standard_normal((8, 3, 48, 48), dtype=np.float32), rng.integers(0, 10, 8)
    ref = GraphModel(graph)
    cross_entropy(ref(x)[graph.outputs[0]], labels).backward()
    model = GraphModel(graph)
    opt = SGD(model.parameters(), lr=1.0)  # its update is the gradient (the program frees gradients once applied)
    prog = Program(model, "cross_entropy", (3, 48, 48))
    for stream in [(16, 3, (8,)), (25, 3, (8, 16)), (25, 3, (8, 16), (0, 8, 16)), (25, 3, (8, 16), (), (0, 8, 16)),
                   (25, 3, (8, 16), (0, 8, 16), (0, 8, 16))]:
        before = {k: p.data.copy() for k, p in model.params.items()}
        prog.run(prog.plan(8, stream=Stream.at(*stream)), x, labels, opt)
        for k, p in model.params.items():
            np.testing.assert_allclose(before[k] - p.data, ref.params[k].grad, atol=1e-5, rtol=0, err_msg=k)
            p.data[...] = before[k]


def test_a_tight_budget_streams_a_batchnorm_model_and_matches_pytorch():
    torch = pytest.importorskip("torch")
    graph = bn_resnet()
    x, labels = data(batch=64)
    model = GraphModel(graph)
    trainer = BudgetedTrainer(model, SGD(model.parameters(), lr=0.1, momentum=0.9))
    free = trainer.plan_for(64, (1, 8, 8))
    trainer.set_budget(free.total_bytes // 3)
    plan = trainer.plan_for(64, (1, 8, 8))
    assert plan.stream is not None and plan.total_bytes <= free.total_bytes // 3
    names = list(model.params)
    w = {k: torch.tensor(np.array(graph.weights[k]), requires_grad=True) for k in names}
    stats = {k: torch.tensor(np.array(v)) for k, v in model.buffers.items()}
    opt = torch.optim.SGD(list(w.values()), lr=0.1, momentum=0.9)
    bn_nodes = [n for n in graph.nodes if n.op == "BatchNormalization"]
    convs = [n for n in graph.nodes if n.op == "Conv"]
    gemm = next(n for n in graph.nodes if n.op == "Gemm")
    tf = torch.nn.functional

    def torch_bn(h, node):
        return tf.batch_norm(h, stats[node.inputs[3]], stats[node.inputs[4]], w[node.inputs[1]], w[node.inputs[2]],
                             training=True, momentum=0.1, eps=node.attrs["epsilon"])

    for _ in range(2):
        trainer.step(x, labels)
        opt.zero_grad()
        c = [w[n.inputs[1]] for n in convs]
        h = torch.relu(torch_bn(tf.conv2d(torch.from_numpy(x), c[0], padding=1), bn_nodes[0]))
        r = torch.clamp(torch_bn(tf.conv2d(h, c[1], padding=1, groups=8), bn_nodes[1]), 0, 6)
        h = tf.max_pool2d(h + torch_bn(tf.conv2d(r, c[2]), bn_nodes[2]), 2)
        h = torch.relu(torch_bn(tf.conv2d(h, c[3], padding=1), bn_nodes[3]))
        logits = h.mean(dim=(2, 3)) @ w[gemm.inputs[1]].T + w[gemm.inputs[2]]
        tf.cross_entropy(logits, torch.from_numpy(labels)).backward()
        opt.step()
    assert trainer.last_plan is plan
    for k in names:
        np.testing.assert_allclose(model.params[k].data, w[k].detach().numpy(), atol=1e-4, rtol=0)
    for k, v in stats.items():
        np.testing.assert_allclose(model.buffers[k], v.numpy(), atol=1e-4, rtol=0)


def test_an_impossible_budget_names_the_smallest_feasible_one():
    model = GraphModel(mlp_cnn(batchnorm=True))
    trainer = BudgetedTrainer(model, SGD(model.parameters(), lr=0.1), memory_budget=1000)
    with pytest.raises(BudgetError, match=r"smallest feasible budget found is \d+ bytes") as err:
        trainer.plan_for(16, (1, 8, 8))
    trainer.set_budget(err.value.smallest)
    assert trainer.plan_for(16, (1, 8, 8)).total_bytes <= err.value.smallest


def test_program_matches_pytorch_gradients_and_updates():
    torch = pytest.importorskip("torch")
    graph = mlp_cnn()
    x, labels = data()
    model = GraphModel(graph)
    trainer = BudgetedTrainer(model, SGD(model.parameters(), lr=0.1, momentum=0.9))
    w = {k: torch.tensor(np.array(v), requires_grad=True) for k, v in graph.weights.items()
         if k in model.params}
    names = list(model.params)
    opt = torch.optim.SGD(list(w.values()), lr=0.1, momentum=0.9)
    conv1_w, conv1_b, conv2_w, conv2_b, fc_w, fc_b = (w[n] for n in names)
    for _ in range(2):
        trainer.step(x, labels)
        opt.zero_grad()
        h = torch.relu(torch.nn.functional.conv2d(torch.from_numpy(x), conv1_w, conv1_b, padding=1))
        h = torch.relu(torch.nn.functional.conv2d(torch.nn.functional.max_pool2d(h, 2), conv2_w, conv2_b, padding=1))
        loss = torch.nn.functional.cross_entropy(h.flatten(1) @ fc_w + fc_b, torch.from_numpy(labels))
        loss.backward()
        opt.step()
    for n in names:
        np.testing.assert_allclose(model.params[n].data, w[n].detach().numpy(), atol=1e-4, rtol=0)


def test_mse_loss_program_equals_trainer():
    rng = np.random.default_rng(0)
    b = GraphBuilder("reg")
    h = b.relu(b.linear(b.input("x", (None, 6)), rng.standard_normal((6, 16), dtype=np.float32), np.zeros(16, "f4")))
    graph = (b.output(b.linear(h, rng.standard_normal((16, 3), dtype=np.float32), np.zeros(3, "f4"))), b.build())[1]
    x, y = rng.standard_normal((10, 6), dtype=np.float32), rng.standard_normal((10, 3), dtype=np.float32)
    ref = GraphModel(graph)
    ropt = SGD(ref.parameters(), lr=0.05)
    ropt.zero_grad()
    mse(ref(x)[graph.outputs[0]], y).backward()
    ropt.step()
    model = GraphModel(graph)
    BudgetedTrainer(model, SGD(model.parameters(), lr=0.05), loss="mse", micro_batches=3).step(x, y)
    assert max_param_diff(ref, model) <= 1e-5


def test_pool_reports_against_the_live_peak_and_never_collides():
    rng = np.random.default_rng(0)
    bufs = [Buffer(f"t{i}", int(rng.integers(1, 5000)), s, s + int(rng.integers(0, 20)))
            for i, s in enumerate(rng.integers(0, 50, 200))]
    plan = plan_pool(bufs)
    plan.check()
    report = compare(bufs)
    assert plan.live_peak <= plan.size <= min(report["pool_arena_bytes"], report["greedy_arena_bytes"])


CHILD = """
import json, sys, numpy as np
sys.path.insert(0, {tests!r})
from test_engine_melon import mlp_cnn, data
from engine.autograd import GraphModel, SGD
from engine.training import BudgetedTrainer, BudgetError
from bench.engine import peak_rss_growth
mode, bn = sys.argv[1], sys.argv[2] == "bn"
model = GraphModel(mlp_cnn(batchnorm=bn))
x, labels = data(batch=2048)
trainer = BudgetedTrainer(model, SGD(model.parameters(), lr=0.1, momentum=0.9))
trainer.step(x[:16], labels[:16])  # compile, calibrate, warm up
unbudgeted = trainer.plan_for(2048, (1, 8, 8)).total_bytes
if mode == "tight":
    try:
        trainer.set_budget(unbudgeted // 8)
        trainer.plan_for(2048, (1, 8, 8))
    except BudgetError as e:
        trainer.set_budget(e.smallest)
    trainer.plan_for(2048, (1, 8, 8))
growth = peak_rss_growth(lambda: trainer.step(x, labels))
print(json.dumps({{"growth": growth, "planned": trainer.last_plan.total_bytes, "budget": trainer.budget,
                  "unbudgeted_plan": unbudgeted, "streamed": trainer.last_plan.stream is not None}}))
"""


@pytest.mark.parametrize("kind", ["bn", "nobn"])
def test_rss_growth_of_a_budgeted_step_stays_under_the_budget(kind):
    """With BatchNorm, recomputation and streaming with the whole batch's statistics; without it,
    micro-batches too."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536", "OPENBLAS_NUM_THREADS": "1"}

    def run(mode):
        out = subprocess.run([sys.executable, "-c", CHILD.format(tests=str(ROOT / "tests" / "engine")), mode, kind],
                             capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    free, tight = run("free"), run("tight")
    if kind == "nobn":  # micro-batches: far below what the unbudgeted step grows by
        assert tight["budget"] < free["growth"] / 4, (tight, free)
    else:
        assert tight["streamed"] and tight["budget"] < free["unbudgeted_plan"] / 4, (tight, free)
    assert tight["planned"] <= tight["budget"]
    assert tight["growth"] <= tight["budget"], (tight, free)


def test_cli_prints_the_training_plan(tmp_path, capsys):
    from engine.__main__ import main
    from engine.format import save_model

    path = tmp_path / "small.engine"
    save_model(mlp_cnn(batchnorm=True), str(path))
    assert main(["plan", str(path), "--train", "--batch", "64", "--json"]) == 0
    out = capsys.readouterr().out
    assert "micro-batch" in out and "conv_1#context" in out and json.loads(out.strip().splitlines()[-1])["batch"] == 64
    assert main(["plan", str(path), "--train", "--batch", "64", "--budget", "1000"]) == 2
    assert "smallest feasible budget" in capsys.readouterr().err
