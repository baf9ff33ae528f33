"""Training under a memory budget (Melon, issue 13): the largest batch that fits a budget for ours
with the budgeted program (engine.training), ours without (today's trainer) and PyTorch, the
throughput at that batch against the unbudgeted trainer, the measured peak of every budgeted run,
the cost of a budget change, and the gradient difference to today's trainer.

    python -m bench.melon [--quick]

Models: MobileNetV2-0.35@96 (BatchNorm: only recomputation and the pool can help) and a VGG-style
CNN without BatchNorm (micro-batches too), SGD with momentum. Memory is the peak RSS growth of one
step after a warm-up step, each run in a fresh subprocess (glibc's mmap threshold fixed at 64 KiB so
freed arrays go back to the system); today's trainer's and PyTorch's growth is measured at two
batches and extrapolated linearly to the budget (their growth is linear in the batch). The last
line printed is one JSON object, also written to bench/results/melon.json.
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
import time  # noqa: E402

import numpy as np  # noqa: E402

from bench.common import finish  # noqa: E402
from bench.engine import ROOT  # noqa: E402

SIZE, WIDTH, CLASSES = 96, 0.35, 1000
MB = 2**20


def vgg_graph(seed: int = 0):
    """conv3x3-relu x2, maxpool, three times (16/32/64 channels) on 3x32x32, then a linear layer."""
    from engine.builder import GraphBuilder

    rng = np.random.default_rng(seed)
    b = GraphBuilder("vgg")
    y, cin = b.input("x", (None, 3, 32, 32)), 3
    for cout in (16, 32, 64):
        for _ in range(2):
            w = rng.standard_normal((cout, cin, 3, 3), dtype=np.float32) * np.float32(np.sqrt(2 / (9 * cin)))
            y, cin = b.relu(b.conv(y, w, np.zeros(cout, np.float32), pads=1)), cout
        y = b.max_pool(y, 2, strides=2)
    w = rng.standard_normal((64 * 16, 10), dtype=np.float32) * np.float32(1 / 32)
    b.output(b.linear(b.flatten(y), w, np.zeros(10, np.float32)))
    return b.build()


def torch_vgg():
    import torch

    layers, cin = [], 3
    for cout in (16, 32, 64):
        for _ in range(2):
            layers += [torch.nn.Conv2d(cin, cout, 3, padding=1), torch.nn.ReLU()]
            cin = cout
        layers.append(torch.nn.MaxPool2d(2))
    return torch.nn.Sequential(*layers, torch.nn.Flatten(), torch.nn.Linear(1024, 10))


def load(kind: str, onnx_path: str):
    """(graph, sample shape, classes) of the benchmark model."""
    if kind == "vgg":
        return vgg_graph(), (3, 32, 32), 10
    from engine.onnx_import import from_onnx

    return from_onnx(onnx_path), (3, SIZE, SIZE), CLASSES


def batch_data(batch: int, shape, classes: int):
    rng = np.random.default_rng(0)
    return rng.standard_normal((batch, *shape), dtype=np.float32), rng.integers(0, classes, batch)


def vanilla_step_fn(graph, x, labels):
    from engine.autograd import SGD, GraphModel, cross_entropy

    model = GraphModel(graph)
    opt = SGD(model.parameters(), lr=0.01, momentum=0.9)
    out = graph.outputs[0]

    def step(xb=x, lb=labels):
        opt.zero_grad()
        loss = cross_entropy(model(xb)[out], lb)
        loss.backward()
        opt.step()
        return float(loss.data)

    return step, model


def budgeted_trainer(graph, budget):
    from engine.autograd import SGD, GraphModel
    from engine.training import BudgetedTrainer

    model = GraphModel(graph)
    return BudgetedTrainer(model, SGD(model.parameters(), lr=0.01, momentum=0.9), memory_budget=budget), model


def child(framework: str, kind: str, batch: int, budget: int, onnx_path: str) -> None:
    """One warm-up step at batch 2, then the peak RSS growth of one step at ``batch`` (fresh process)."""
    from bench.engine import peak_rss_growth

    graph, shape, classes = load(kind, onnx_path)
    x, labels = batch_data(batch, shape, classes)
    result = {}
    if framework == "vanilla":
        step, _ = vanilla_step_fn(graph, x, labels)
        step(x[:2], labels[:2])
        fn = step
    elif framework == "ours":
        from engine.training import BudgetError

        trainer, _ = budgeted_trainer(graph, budget)
        trainer.step(x[:2], labels[:2])
        while True:  # this process's calibration may differ slightly from the parent's
            try:
                plan = trainer.plan_for(batch, shape)
                break
            except BudgetError:
                batch -= 1
        x, labels = x[:batch], labels[:batch]
        result.update(planned=plan.total_bytes, micro_batches=plan.micro_batches, recomputed=len(plan.dropped),
                      batch=batch)
        fn = lambda: trainer.step(x, labels)  # noqa: E731
    else:
        import torch

        torch.set_num_threads(1)
        if kind == "vgg":
            model = torch_vgg()
        else:
            sys.path.insert(0, os.path.join(ROOT, "tests", "engine"))
            import engine_zoo

            model = engine_zoo.build("mobilenetv2", width=WIDTH, classes=CLASSES).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        tx, tl = torch.from_numpy(x), torch.from_numpy(labels)

        def fn(xb=tx, lb=tl):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), lb).backward()
            opt.step()

        fn(tx[:2], tl[:2])
    t0 = time.perf_counter()
    result["rss_growth"] = peak_rss_growth(fn)
    result["step_s"] = time.perf_counter() - t0
    print(json.dumps(result))


def measure(framework: str, kind: str, batch: int, budget: int, onnx_path: str) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "bench.melon", "--child", framework, kind, str(batch), str(budget), onnx_path]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{framework} {kind} batch {batch}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def linear_max_batch(framework: str, kind: str, budget: int, onnx_path: str, probes: tuple[int, int]) -> int:
    """Largest batch whose extrapolated RSS growth fits ``budget`` (growth measured at two batches)."""
    a, b = (measure(framework, kind, p, 0, onnx_path)["rss_growth"] for p in probes)
    slope = max((b - a) / (probes[1] - probes[0]), 1.0)
    return max(0, int(probes[0] + (budget - a) // slope))


def ours_max_batch(kind: str, budget: int, onnx_path: str, start: int, cap: int) -> tuple[int, object]:
    """Largest batch up to ``cap`` the budgeted planner fits into ``budget`` (doubling, then bisection);
    the cap keeps the unbudgeted comparison run at that batch within the machine's memory."""
    from engine.training import BudgetError

    graph, shape, _ = load(kind, onnx_path)
    trainer, _ = budgeted_trainer(graph, budget)

    def fits(batch: int) -> bool:
        try:
            trainer.plan_for(batch, shape)
            return True
        except BudgetError:
            return False

    lo, hi = 0, max(start, 1)
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    if lo * 2 > cap and fits(cap):
        return cap, trainer
    hi = min(hi, cap)
    while hi - lo > max(1, lo // 16):  # within ~6%
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, trainer


def throughput(kind: str, batch: int, trainer, onnx_path: str, rounds: int) -> tuple[float, float]:
    """Samples/s of today's trainer (unbudgeted) and ours (budgeted, already planned) at ``batch``."""
    graph, shape, classes = load(kind, onnx_path)
    x, labels = batch_data(batch, shape, classes)
    vanilla, _ = vanilla_step_fn(graph, x, labels)
    vanilla(x[:2], labels[:2])
    trainer.step(x[:2], labels[:2])
    times: dict[str, list[float]] = {"vanilla": [], "ours": []}
    for _ in range(rounds):
        for name, fn in (("vanilla", vanilla), ("ours", lambda: trainer.step(x, labels))):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return batch / float(np.median(times["vanilla"])), batch / float(np.median(times["ours"]))


def grad_diff(kind: str, onnx_path: str, batch: int) -> float:
    """Max |grad| difference between today's trainer and ours under the tightest budget found."""
    from engine.training import BudgetError

    graph, shape, classes = load(kind, onnx_path)
    x, labels = batch_data(batch, shape, classes)
    step, ref = vanilla_step_fn(graph, x, labels)
    step()
    trainer, model = budgeted_trainer(graph, 1)
    try:
        trainer.plan_for(batch, shape)
    except BudgetError as e:
        trainer.set_budget(e.smallest)
    trainer.step(x, labels)
    return max(float(np.abs(ref.params[k].grad - model.params[k].grad).max()) for k in ref.params)


def budget_change(kind: str, onnx_path: str, batch: int, budgets: list[int]) -> dict[str, float]:
    """ms for a budget change: planned ahead (a lookup), planned on change, and stop-and-restart."""
    graph, shape, classes = load(kind, onnx_path)
    x, labels = batch_data(batch, shape, classes)
    trainer, _ = budgeted_trainer(graph, budgets[0])
    trainer.step(x, labels)
    t0 = time.perf_counter()
    trainer.prepare(batch, shape, budgets)
    t1 = time.perf_counter()
    trainer.set_budget(budgets[1])
    trainer.plan_for(batch, shape)
    t2 = time.perf_counter()
    trainer.plans.clear()
    t3 = time.perf_counter()
    trainer.set_budget(budgets[-1])
    trainer.plan_for(batch, shape)
    t4 = time.perf_counter()
    fresh, _ = budgeted_trainer(graph, budgets[-1])
    fresh.plan_for(batch, shape)
    t5 = time.perf_counter()
    return {"budget_change_ms": (t2 - t1) * 1e3, "budget_change_unplanned_ms": (t4 - t3) * 1e3,
            "ladder_planning_ms": (t1 - t0) * 1e3, "restart_ms": (t5 - t4) * 1e3}


def run_model(kind: str, budget: int, onnx_path: str, rounds: int, probes: tuple[int, int]) -> dict:
    r: dict = {}
    vanilla = linear_max_batch("vanilla", kind, budget, onnx_path, probes)
    torch_max = linear_max_batch("torch", kind, budget, onnx_path, probes)
    cap = 8 * max(vanilla, 1)
    ours, trainer = ours_max_batch(kind, budget, onnx_path, max(vanilla, 1), cap)
    print(f"{kind} @ {budget // MB} MB: max batch vanilla {vanilla}, torch {torch_max}, ours {ours}", flush=True)
    checked = measure("ours", kind, ours, budget, onnx_path)
    plan = trainer.plan_for(ours, load(kind, onnx_path)[1])
    r.update(capped=ours >= cap, vanilla_max_batch=vanilla, torch_max_batch=torch_max, ours_max_batch=ours,
             measured_batch=checked["batch"],  # the measuring process's own calibration may fit fewer
             max_batch_ratio_vs_vanilla=ours / max(vanilla, 1), peak_over_budget=checked["rss_growth"] / budget,
             ours_planned_mb=checked["planned"] / MB, ours_rss_growth_mb=checked["rss_growth"] / MB,
             micro_batches=plan.micro_batches, recomputed_nodes=len(plan.dropped), **{
                 k: v for k, v in plan.report().items() if k.endswith("_bytes") and k != "total_bytes"})
    print(f"  measured peak {checked['rss_growth'] / MB:.1f} MB (planned {checked['planned'] / MB:.1f} MB), "
          f"{plan.micro_batches} micro-batch(es), {len(plan.dropped)} recomputed", flush=True)
    v_sps, o_sps = throughput(kind, ours, trainer, onnx_path, rounds)
    r.update(vanilla_samples_per_s=v_sps, ours_samples_per_s=o_sps, throughput_ratio_vs_unbudgeted=o_sps / v_sps)
    return r


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one budget, fewer rounds (< 60 s)")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        fw, kind, batch, budget, path = args.child
        child(fw, kind, int(batch), int(budget), path)
        return {}
    budgets = [64 * MB] if args.quick else [64 * MB, 128 * MB]
    rounds = 1 if args.quick else 3
    results: dict = {"cpu_count": os.cpu_count(), "threads": 1, "budgets_mb": [b // MB for b in budgets],
                     "size": SIZE, "width": WIDTH}
    with tempfile.TemporaryDirectory() as tmp:
        sys.path.insert(0, os.path.join(ROOT, "tests", "engine"))
        import engine_zoo

        path = engine_zoo.export(engine_zoo.build("mobilenetv2", width=WIDTH, classes=CLASSES),
                                 os.path.join(tmp, "m.onnx"), size=SIZE, fold=False)
        peaks = []
        for budget in budgets:
            for kind, probes in (("mnv2", (2, 6)), ("vgg", (8, 32))):
                r = run_model(kind, budget, path, rounds, probes)
                for k, v in r.items():
                    results[f"{kind}_{budget // MB}mb_{k}"] = v
                peaks.append(r["peak_over_budget"])
        last = budgets[-1] // MB
        for kind, suffix in (("mnv2", ""), ("vgg", "_nobn")):
            results[f"max_batch_ratio_vs_vanilla{suffix}"] = results[f"{kind}_{last}mb_max_batch_ratio_vs_vanilla"]
            results[f"throughput_ratio_vs_unbudgeted{suffix}"] = \
                results[f"{kind}_{last}mb_throughput_ratio_vs_unbudgeted"]
        results["torch_max_batch"] = results[f"mnv2_{last}mb_torch_max_batch"]
        results["torch_max_batch_nobn"] = results[f"vgg_{last}mb_torch_max_batch"]
        results["peak_over_budget_max"] = max(peaks)
        results.update(budget_change("vgg", path, 64, [48 * MB, 32 * MB, 24 * MB]))
        results["max_abs_grad_diff"] = max(grad_diff("mnv2", path, 4), grad_diff("vgg", path, 16))
    results = {k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()}
    finish("melon", results)
    return results


if __name__ == "__main__":
    main()
