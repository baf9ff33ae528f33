"""One SGD step (forward, cross-entropy, backward, momentum update) of MobileNetV2 width 0.35 at
96x96, batch 16: our autograd vs PyTorch, plus peak memory of one step at batch 16/32/64.

    python -m bench.train [--quick]

Peak memory is the growth of the peak resident set during one step, each (framework, batch) in a
fresh subprocess so one measurement cannot hide in another's freed heap; for ours the numpy
allocations traced by tracemalloc are reported too (full run only). The last line printed is one JSON object,
also written to bench/results/train.json.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import tracemalloc  # noqa: E402

import numpy as np  # noqa: E402

from bench.common import finish  # noqa: E402
from bench.engine import ROOT, interleaved_median_ms, peak_rss_growth  # noqa: E402

SIZE, WIDTH, CLASSES = 96, 0.35, 1000


def make_models(tmp: str):
    import engine_zoo
    import torch

    from engine.autograd import GraphModel
    from engine.onnx_import import from_onnx

    torch.set_num_threads(1)
    model = engine_zoo.build("mobilenetv2", width=WIDTH, classes=CLASSES)
    path = engine_zoo.export(model, os.path.join(tmp, "m.onnx"), size=SIZE, fold=False)
    return GraphModel(from_onnx(path)), model.train()


def ours_step(model, opt, x, labels):
    from engine.autograd import cross_entropy

    opt.zero_grad()
    loss = cross_entropy(model(x)["y"], labels)
    loss.backward()
    opt.step()
    return float(loss.data)


def torch_step(model, opt, x, labels):
    import torch

    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), labels)
    loss.backward()
    opt.step()
    return loss.item()


def batch_data(batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((batch, 3, SIZE, SIZE), dtype=np.float32), rng.integers(0, CLASSES, batch)


def ours_step_fn(model, batch: int):
    from engine.autograd import SGD

    x, labels = batch_data(batch)
    opt = SGD(model.parameters(), lr=0.01, momentum=0.9)
    return lambda: ours_step(model, opt, x, labels)


def torch_step_fn(model, batch: int):
    import torch

    x, labels = batch_data(batch)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    tx, tl = torch.from_numpy(x), torch.from_numpy(labels)
    return lambda: torch_step(model, opt, tx, tl)


def child(framework: str, batch: int, onnx_path: str, traced: bool) -> None:
    """Print the peak memory of one training step of ``framework`` at ``batch`` (fresh process)."""
    if framework == "ours":
        from engine.autograd import GraphModel
        from engine.onnx_import import from_onnx

        fn = ours_step_fn(GraphModel(from_onnx(onnx_path)), batch)
    else:
        import engine_zoo
        import torch

        torch.set_num_threads(1)
        fn = torch_step_fn(engine_zoo.build("mobilenetv2", width=WIDTH, classes=CLASSES).train(), batch)
    result = {"rss_growth_mb": peak_rss_growth(fn) / 2**20}
    if traced:
        tracemalloc.start()
        fn()
        result["traced_mb"] = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
    print(json.dumps(result))


def measure_memory(framework: str, batch: int, onnx_path: str, traced: bool) -> dict:
    cmd = [sys.executable, "-m", "bench.train", "--child", framework, str(batch), onnx_path]
    out = subprocess.run(cmd + (["--traced"] if traced else []), cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 timed steps, memory at batch 16 only (< 60 s)")
    parser.add_argument("--child", nargs=3, metavar=("FRAMEWORK", "BATCH", "ONNX"), help=argparse.SUPPRESS)
    parser.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2], args.traced)
        return {}
    runs = 2 if args.quick else 10
    results: dict = {"cpu_count": os.cpu_count(), "threads": 1, "batch": 16, "size": SIZE, "width": WIDTH,
                     "runs": runs}
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = make_models(tmp)
        ours_fn, torch_fn = ours_step_fn(ours, 16), torch_step_fn(theirs, 16)
        ms = interleaved_median_ms({"ours": ours_fn, "torch": torch_fn}, runs, warmup=1)
        results["step_ms"], results["torch_step_ms"] = ms["ours"], ms["torch"]
        results["step_ratio_vs_torch"] = results["step_ms"] / results["torch_step_ms"]
        print(f"step: ours {results['step_ms']:.0f} ms, torch {results['torch_step_ms']:.0f} ms", flush=True)
        for batch in (16,) if args.quick else (16, 32, 64):
            for fw in ("ours", "torch"):
                m = measure_memory(fw, batch, os.path.join(tmp, "m.onnx"), traced=fw == "ours" and not args.quick)
                results[f"{fw}_peak_mb_b{batch}"] = m["rss_growth_mb"]
                if "traced_mb" in m:
                    results[f"ours_traced_peak_mb_b{batch}"] = m["traced_mb"]
            print(f"batch {batch}: ours {results[f'ours_peak_mb_b{batch}']:.0f} MB, "
                  f"torch {results[f'torch_peak_mb_b{batch}']:.0f} MB", flush=True)
    results = {k: round(v, 3) if isinstance(v, float) else v for k, v in results.items()}
    finish("train", results, quick=args.quick)
    return results


if __name__ == "__main__":
    main()
