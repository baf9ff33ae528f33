"""The static arena planner: no two live buffers collide, and runs allocate nothing beyond the plan."""


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.builder import GraphBuilder
from engine.cost import Calibration
from engine.ir import GraphError
from engine.planner import Buffer, plan_arena
from engine.session import InferenceSession

buffers = st.lists(
    st.tuples(st.integers(1, 5000), st.integers(0, 30), st.integers(0, 10)).map(
        lambda t: (t[0], t[1], t[1] + t[2])),
    min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(buffers)
def test_plan_never_overlaps_live_buffers_and_beats_no_reuse(specs):
    bufs = [Buffer(f"b{i}", size, s, e) for i, (size, s, e) in enumerate(specs)]
    plan = plan_arena(bufs)
    plan.check()
    assert plan.live_peak <= plan.size
    assert plan.size <= sum(-(-b.size // 64) * 64 for b in bufs)


def test_disjoint_lifetimes_share_memory():
    plan = plan_arena([Buffer("a", 1000, 0, 1), Buffer("b", 1000, 2, 3), Buffer("c", 10, 0, 3)])
    assert plan.offsets["a"] == plan.offsets["b"]
    assert plan.size == 1024 + 64
    assert plan.report()["arena_vs_sum"] < 1


def chain_model():
    rng = np.random.default_rng(0)
    b = GraphBuilder()
    y = b.input("x", (None, 8, 64, 64))
    for i in range(6):
        w = rng.standard_normal((8, 8, 3, 3), dtype=np.float32) * 0.2
        y = b.relu(b.conv(y, w, pads=1)) if i % 2 else b.hard_swish(b.conv(y, w, pads=1))
    y = b.concat([y, b.avg_pool(y, 3, 1, 1)], axis=1)
    b.output(b.softmax(b.flatten(b.global_avg_pool(y))))
    return b.build()


def test_run_allocates_nothing_beyond_the_arena(traced_peak):
    sess = InferenceSession(chain_model(), calibration=Calibration())
    x = np.random.default_rng(1).standard_normal((2, 8, 64, 64), dtype=np.float32)
    sess.run(x)  # plan, bind, allocate the arena
    plan = sess.plan_for({"x": x.shape})
    plan.arena.check()
    outputs = sum(plan.infos[o].nbytes_for() for o in plan.graph.outputs)
    peak = traced_peak(lambda: sess.run(x))
    # Only the returned output copies and numpy's fixed-size ufunc iteration buffers (8192 elements
    # per operand), whatever the tensor sizes: no activation-sized temporary.
    assert peak <= outputs + 256 * 1024, peak
    assert peak < plan.arena.size / 10


def test_kernel_choice_is_inspectable_and_tunable():
    rng = np.random.default_rng(2)
    b = GraphBuilder()
    b.output(b.relu(b.conv(b.input("x", (1, 16, 20, 20)), rng.standard_normal((16, 16, 3, 3), dtype=np.float32),
                           pads=1)))
    graph = b.build()
    x = rng.standard_normal((1, 16, 20, 20), dtype=np.float32)
    plain = InferenceSession(graph, calibration=Calibration(), blocked=False)  # the NCHW conv kernels' choice
    step = plain.plan_for({"x": x.shape}).steps[0]
    assert {"conv_im2col", "conv_direct"} <= set(step.estimates)
    assert step.kernel.name == min(step.estimates, key=step.estimates.get)
    assert step.reason.startswith("cheapest")
    tuned = InferenceSession(graph, calibration=Calibration(), tune=True, blocked=False)
    tstep = tuned.plan_for({"x": x.shape}).steps[0]
    assert tstep.reason.startswith("fastest measured")
    assert tstep.kernel.name == min(tstep.estimates, key=tstep.estimates.get)
    np.testing.assert_allclose(tuned.run(x)[graph.outputs[0]], plain.run(x)[graph.outputs[0]], atol=1e-4)


def test_memory_budget_trades_kernels_for_scratch():
    rng = np.random.default_rng(3)
    b = GraphBuilder()
    y = b.input("x", (1, 32, 40, 40))
    for _ in range(3):
        y = b.relu(b.conv(y, rng.standard_normal((32, 32, 3, 3), dtype=np.float32) * 0.1, pads=1))
    b.output(y)
    graph = b.build()
    x = rng.standard_normal((1, 32, 40, 40), dtype=np.float32)
    free = InferenceSession(graph, calibration=Calibration(), blocked=False)  # NCHW kernels: some need scratch
    free_plan = free.plan_for({"x": x.shape})
    # the least memory any kernel choice reaches: tap-by-tap convs keep one window, not nine
    budget = InferenceSession(graph, calibration=Calibration(), kernels={"Conv": "conv_direct"}) \
        .plan_for({"x": x.shape}).arena.size
    activations = 2 * x.nbytes
    tight = InferenceSession(graph, calibration=Calibration(), memory_budget=budget, blocked=False)
    plan = tight.plan_for({"x": x.shape})
    assert plan.arena.size <= budget < free_plan.arena.size
    assert any(s.budgeted and s.reason.startswith("least scratch") for s in plan.steps)
    np.testing.assert_allclose(tight.run(x)[graph.outputs[0]], free.run(x)[graph.outputs[0]], atol=1e-4)
    with pytest.raises(GraphError, match="budget"):
        InferenceSession(graph, calibration=Calibration(), memory_budget=activations // 2, blocked=False).run(x)
