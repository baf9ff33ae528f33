"""Training under a memory budget (Melon, issues 13 and 28): the largest batch that fits a budget for
ours with the budgeted program (engine.training; no cap: doubling from today's trainer's max batch
while the planner fits the budget, then bisection to within ~3%, so the ratio is the true one up to
that step; a search limit of 1024x today's batch is reported as ``capped``), ours without (today's
trainer) and PyTorch; the throughput at the issue's target batch (8x today's trainer's max batch,
or ours' max batch if smaller) against the unbudgeted trainer (today's trainer; also against our
static program without a budget at the same batch, and both in CPU time as well as wall time:
medians of runs in turns), the measured peak of every budgeted run at that same target batch
(``peak_batch``: a step at the max batch, thousands of rows in chunks of a few under the fixed mmap
threshold, took over 8 CPU minutes; the max batch's plan is the planner's, its peak not measured),
the cost of a budget change, and the gradient difference to today's trainer. The
top-level ``max_batch_ratio_vs_vanilla`` and ``throughput_ratio_vs_unbudgeted_program`` are the
worst of both models and both budgets.

    python -m bench.melon [--quick]

Models: MobileNetV2-0.35@96 (BatchNorm: recomputation, the pool, and streaming its first layers in
chunks with the whole batch's statistics) and a VGG-style CNN without BatchNorm (micro-batches too),
SGD with momentum. Memory is the peak RSS growth of one step after a warm-up step (the kernel's
high-water mark, reset before the step), each run in a fresh subprocess (glibc's mmap threshold
fixed at 64 KiB so freed arrays go back to the system), plus for ours the numpy allocation peak
(tracemalloc) against the plan; today's trainer's and PyTorch's growth is measured at two batches
and extrapolated linearly to the budget (their growth is linear in the batch). ``--quick``: one
budget (64 MB), ours probed at 8x/5x today's max batch instead of a search (so its ratio reads at
most 8), one timed step each at that batch, timed in the measuring process, no tracemalloc pass.
The last line printed is one JSON object, also written to bench/results/melon.json.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import functools  # noqa: E402
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
PROBES = {"mnv2": (2, 6), "vgg": (8, 32)}  # batches at which the baselines' RSS growth is measured
TARGET_RATIO = 8  # the max-batch target (x today's trainer): the throughput is read at that batch
SEARCH_LIMIT = 1024  # x today's trainer's max batch: the max-batch search stops there (reported as capped)
TRACE_STEP_S = 20.0  # the numpy allocation peak (tracemalloc) is read only when the measured step took less


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


@functools.cache
def load(kind: str, onnx_path: str):
    """(graph, sample shape, classes) of the benchmark model (one graph per process, so that its
    calibration is measured once)."""
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


def budgeted_trainer(graph, budget, calibration=None):
    from engine.autograd import SGD, GraphModel
    from engine.training import BudgetedTrainer

    model = GraphModel(graph)
    return BudgetedTrainer(model, SGD(model.parameters(), lr=0.01, momentum=0.9), memory_budget=budget,
                           calibration=calibration), model


def torch_step_fn(kind: str, x: np.ndarray, labels: np.ndarray):
    import torch

    torch.set_num_threads(1)
    if kind == "vgg":
        model = torch_vgg()
    else:
        sys.path.insert(0, os.path.join(ROOT, "tests", "engine"))
        import engine_zoo

        model = engine_zoo.build("mobilenetv2", width=WIDTH, classes=CLASSES).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def fn(xb=x, lb=labels):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.from_numpy(xb)), torch.from_numpy(lb)).backward()
        opt.step()

    return fn


def child(framework: str, kind: str, batches: list[int], onnx_path: str, plan_file: str, quick: bool) -> None:
    """One warm-up step at batch 2, then the peak RSS growth of one step at each of ``batches``
    (fresh process); ours runs the plan (and calibration) the parent pickled to ``plan_file`` and
    then reports the numpy allocation peak of a further step (tracemalloc, slow; only after a step
    shorter than ``TRACE_STEP_S``) or, ``quick``,
    the time of today's trainer's step at the same batch (for the throughput ratio)."""
    import pickle
    import tracemalloc

    from bench.engine import exact_peak_rss_growth

    graph, shape, classes = load(kind, onnx_path)
    result: dict = {"rss_growth": []}
    if framework == "ours":
        from engine.autograd import SGD, GraphModel
        from engine.training import Program

        with open(plan_file, "rb") as f:
            calibration, plan = pickle.load(f)
        model = GraphModel(graph)
        opt = SGD(model.parameters(), lr=0.01, momentum=0.9)
        prog = Program(model, "cross_entropy", shape, calibration)
        x, labels = batch_data(plan.batch, shape, classes)
        prog.run(prog.plan(2), x[:2], labels[:2], opt)
        result.update(planned=plan.total_bytes, batch=plan.batch)
        fn = lambda: prog.run(plan, x, labels, opt)  # noqa: E731
        t0 = time.perf_counter()
        result["rss_growth"] = exact_peak_rss_growth(fn)
        result["ours_step_s"] = time.perf_counter() - t0
        if quick:
            del prog, model, opt
            step = vanilla_step_fn(graph, x, labels)[0]
            step(x[:2], labels[:2])
            t0 = time.perf_counter()
            step()
            result["vanilla_step_s"] = time.perf_counter() - t0
        elif result["ours_step_s"] < TRACE_STEP_S:  # the traced step is slower: skipped after a long step
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            fn()
            result["traced_peak"] = tracemalloc.get_traced_memory()[1] - base
            tracemalloc.stop()
    else:
        result["rss_growth"] = baseline_growth(framework, kind, batches, onnx_path)
    print(json.dumps(result))


def baseline_growth(framework: str, kind: str, batches: list[int], onnx_path: str) -> list[int]:
    """Peak RSS growth of today's trainer's or PyTorch's step at each of ``batches`` (after a
    warm-up step at batch 2), in this process."""
    from bench.engine import exact_peak_rss_growth

    graph, shape, classes = load(kind, onnx_path)
    x, labels = batch_data(2, shape, classes)
    step = vanilla_step_fn(graph, x, labels)[0] if framework == "vanilla" else torch_step_fn(kind, x, labels)
    step(x, labels)
    growth = []
    for batch in batches:  # smallest first: each step's growth is above what the previous one freed
        x, labels = batch_data(batch, shape, classes)
        growth.append(exact_peak_rss_growth(lambda x=x, labels=labels: step(x, labels)))
    return growth


def measure(framework: str, kind: str, batches: list[int], onnx_path: str, plan_file: str = "-",
            quick: bool = False) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "bench.melon", "--child", framework, kind, ",".join(map(str, batches)), onnx_path,
           plan_file, *(["--quick"] if quick else [])]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{framework} {kind} batch {batches}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def linear_max_batch(framework: str, kind: str, budget: int, onnx_path: str, probes: tuple[int, int],
                     measured: dict | None = None) -> int:
    """Largest batch whose extrapolated RSS growth fits ``budget`` (growth measured at two batches,
    each in a fresh process, unless ``measured`` already holds them: framework -> kind -> growths)."""
    if measured is not None:
        a, b = measured[framework][kind]
    else:
        a, b = (measure(framework, kind, [p], onnx_path)["rss_growth"][0] for p in probes)
    slope = max((b - a) / (probes[1] - probes[0]), 1.0)
    return max(0, int(probes[0] + (budget - a) // slope))


def ours_max_batch(kind: str, budget: int, onnx_path: str, start: int, cap: int,
                   probes: tuple[float, ...] | None = None, calibration=None) -> tuple[int, object]:
    """Largest batch up to ``cap`` the budgeted planner fits into ``budget`` (doubling from ``start``
    until a batch does not fit, then bisection to within ~3%; or the largest of ``probes`` x
    ``start`` that fits)."""
    from engine.training import BudgetError

    graph, shape, _ = load(kind, onnx_path)
    trainer, _ = budgeted_trainer(graph, budget, calibration)

    def fits(batch: int) -> bool:
        try:
            trainer.plan_for(batch, shape)
            return True
        except BudgetError:
            return False

    if probes:
        for p in sorted(probes, reverse=True):
            batch = min(cap, max(1, int(p * start)))
            if fits(batch):
                return batch, trainer
        return 0, trainer
    lo, hi = 0, max(start, 1)
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    if lo * 2 > cap and fits(cap):
        return cap, trainer
    hi = min(hi, cap)
    while hi - lo > max(1, lo // 32):  # within ~3%
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, trainer


def throughput(kind: str, batch: int, trainer, onnx_path: str, rounds: int) -> dict[str, float]:
    """Samples/s at ``batch`` of today's trainer (unbudgeted), ours (budgeted, already planned) and
    ours without a budget (the static program, nothing recomputed or streamed), run in turns; the
    median wall time of each, and the median CPU time (less disturbed by other processes)."""
    graph, shape, classes = load(kind, onnx_path)
    x, labels = batch_data(batch, shape, classes)
    vanilla, _ = vanilla_step_fn(graph, x, labels)
    program, _ = budgeted_trainer(graph, None, trainer.program.cal)
    runs = {"vanilla": vanilla, "ours": lambda: trainer.step(x, labels), "program": lambda: program.step(x, labels)}
    vanilla(x[:2], labels[:2])
    trainer.step(x[:2], labels[:2])
    program.step(x[:2], labels[:2])
    trainer.plan_for(batch, shape)  # planned before the timed rounds (the search may not have planned this batch)
    program.plan_for(batch, shape)
    wall: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    sps = {k: batch / float(np.median(v)) for k, v in wall.items()}
    cpu_sps = {k: batch / float(np.median(v)) for k, v in cpu.items()}
    return {"vanilla_samples_per_s": sps["vanilla"], "ours_samples_per_s": sps["ours"],
            "program_samples_per_s": sps["program"],
            "throughput_ratio_vs_unbudgeted_cpu": cpu_sps["ours"] / cpu_sps["vanilla"],
            "throughput_ratio_vs_unbudgeted_program": sps["ours"] / sps["program"],
            "throughput_ratio_vs_unbudgeted_program_cpu": cpu_sps["ours"] / cpu_sps["program"]}


def _update_as_gradient(model, step) -> dict[str, np.ndarray]:
    """Gradients as one SGD step of rate 1 without momentum applies them (the trainer frees each
    gradient once its parameter is updated): ``w_before - w_after``."""
    before = {k: p.data.copy() for k, p in model.params.items()}
    step()
    return {k: before[k] - p.data for k, p in model.params.items()}


def todays_gradients(graph, x, labels) -> dict[str, np.ndarray]:
    from engine.autograd import GraphModel, cross_entropy

    ref = GraphModel(graph)
    cross_entropy(ref(x)[graph.outputs[0]], labels).backward()
    return {k: p.grad for k, p in ref.params.items()}


def grad_diff(kind: str, onnx_path: str, batch: int, stream=None, calibration=None) -> float:
    """Max |gradient| difference between today's trainer and ours: the plan recomputing the most
    (micro-batches when allowed), or the one following ``stream`` (end, chunk, borders)."""
    from engine.autograd import SGD, GraphModel
    from engine.training import BudgetError, Program
    from engine.training.budget import fit_recompute
    from engine.training.stream import Stream

    graph, shape, classes = load(kind, onnx_path)
    x, labels = batch_data(batch, shape, classes)
    ref = todays_gradients(graph, x, labels)
    model = GraphModel(graph)
    opt = SGD(model.parameters(), lr=1.0)
    prog = Program(model, "cross_entropy", shape, calibration)
    if stream is None:
        k = 1 if prog.has_batchnorm else 4
        try:
            plan = fit_recompute(prog, batch, 1, k, 0, opt.scratch_bytes())
        except BudgetError as e:
            plan = fit_recompute(prog, batch, e.smallest, k, 0, opt.scratch_bytes())
    else:
        plan = prog.plan(batch, stream=Stream.at(*stream))
    got = _update_as_gradient(model, lambda: prog.run(plan, x, labels, opt))
    return max(float(np.abs(ref[k] - got[k]).max()) for k in ref)


def grad_noise_floor(kind: str, onnx_path: str, batch: int) -> float:
    """Max |gradient| change of today's trainer when the input moves by one float32 rounding
    (x * (1 + 1e-7)): how far apart two correct float32 computations of this model can be."""
    graph, shape, classes = load(kind, onnx_path)
    x, labels = batch_data(batch, shape, classes)
    a, b = todays_gradients(graph, x, labels), todays_gradients(graph, x * np.float32(1 + 1e-7), labels)
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def budget_change(kind: str, onnx_path: str, batch: int, budgets: list[int], calibration) -> dict[str, float]:
    """ms for a budget change: planned ahead (a lookup), planned on change, and stop-and-restart
    (a new trainer: calibration and planning)."""
    graph, shape, classes = load(kind, onnx_path)
    x, labels = batch_data(batch, shape, classes)
    trainer, _ = budgeted_trainer(graph, budgets[0], calibration)
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


def run_model(kind: str, budget: int, onnx_path: str, rounds: int, probes: tuple[int, int], quick: bool,
              calibrations: dict, baselines: dict | None) -> dict:
    import pickle

    r: dict = {}
    t0 = time.perf_counter()
    vanilla = linear_max_batch("vanilla", kind, budget, onnx_path, probes, baselines)
    t1 = time.perf_counter()
    torch_max = linear_max_batch("torch", kind, budget, onnx_path, probes, baselines)
    t2 = time.perf_counter()
    cap = SEARCH_LIMIT * max(vanilla, 1)
    ours, trainer = ours_max_batch(kind, budget, onnx_path, max(vanilla, 1), cap,
                                   probes=(TARGET_RATIO, 5) if quick else None, calibration=calibrations.get(kind))
    calibrations[kind] = trainer.program.cal
    t3 = time.perf_counter()
    print(f"{kind} @ {budget // MB} MB: max batch vanilla {vanilla} ({t1 - t0:.1f} s), torch {torch_max} "
          f"({t2 - t1:.1f} s), ours {ours} ({t3 - t2:.1f} s)", flush=True)
    at = min(ours, TARGET_RATIO * max(vanilla, 1))  # the target batch: peak and throughput read there
    plan = trainer.plan_for(at, load(kind, onnx_path)[1])
    with tempfile.NamedTemporaryFile(suffix=".pkl") as f:  # the measuring process runs this very plan
        pickle.dump((trainer.program.cal, plan), f)
        f.flush()
        checked = measure("ours", kind, [at], onnx_path, f.name, quick)
    if "traced_peak" in checked:
        traced = checked["traced_peak"]
        r.update(traced_over_budget=traced / budget, ours_traced_peak_mb=traced / MB,
                 traced_over_planned=traced / checked["planned"])
    r.update(capped=ours >= cap, vanilla_max_batch=vanilla, torch_max_batch=torch_max, ours_max_batch=ours,
             peak_batch=at,
             max_batch_ratio_vs_vanilla=ours / max(vanilla, 1), peak_over_budget=checked["rss_growth"] / budget,
             ours_planned_mb=checked["planned"] / MB, ours_rss_growth_mb=checked["rss_growth"] / MB,
             rss_over_planned=checked["rss_growth"] / checked["planned"], micro_batches=plan.micro_batches,
             recomputed_nodes=len(plan.dropped), **{
                 k: v for k, v in plan.report().items() if k.startswith("stream") or (
                     k.endswith("_bytes") and k != "total_bytes")})
    print(f"  measured peak {checked['rss_growth'] / MB:.1f} MB RSS, {checked.get('traced_peak', 0) / MB:.1f} MB "
          f"allocated (planned {checked['planned'] / MB:.1f} MB), {plan.micro_batches} micro-batch(es), "
          f"{len(plan.dropped)} recomputed, {plan.stream.end if plan.stream else 0} streamed "
          f"({time.perf_counter() - t3:.1f} s)",
          flush=True)
    t4 = time.perf_counter()
    if quick:  # one step each, timed in the measuring process
        v_sps, o_sps = at / checked["vanilla_step_s"], at / checked["ours_step_s"]
        r.update(vanilla_samples_per_s=v_sps, ours_samples_per_s=o_sps, throughput_batch=at)
    else:  # at the target batch (the unbudgeted program must run there too)
        r.update(throughput(kind, at, trainer, onnx_path, rounds), throughput_batch=at)
        v_sps, o_sps = r["vanilla_samples_per_s"], r["ours_samples_per_s"]
    print(f"  throughput at batch {r['throughput_batch']}: today's {v_sps:.1f}/s, ours {o_sps:.1f}/s "
          f"({time.perf_counter() - t4:.1f} s)", flush=True)
    r["throughput_ratio_vs_unbudgeted"] = o_sps / v_sps
    return r


def exported_mobilenet(tmp: str) -> str:
    """The benchmark's MobileNetV2 as ONNX, exported once per zoo source and torch version into
    ``$STREAMFLOW_BENCH_CACHE`` (default ``~/.cache/streamflow/bench``): the export is deterministic
    (seeded weights), and skipping it spares the parent a torch import."""
    import hashlib
    import importlib.metadata
    import shutil

    zoo = os.path.join(ROOT, "tests", "engine", "engine_zoo.py")
    with open(zoo, "rb") as f:
        key = hashlib.sha256(f.read() + f"{WIDTH}-{SIZE}-{CLASSES}-{importlib.metadata.version('torch')}".encode())
    cache = os.environ.get("STREAMFLOW_BENCH_CACHE", os.path.expanduser("~/.cache/streamflow/bench"))
    cached = os.path.join(cache, f"mobilenetv2-{key.hexdigest()[:16]}.onnx")
    if not os.path.exists(cached):
        sys.path.insert(0, os.path.dirname(zoo))
        import engine_zoo

        fresh = engine_zoo.export(engine_zoo.build("mobilenetv2", width=WIDTH, classes=CLASSES),
                                  os.path.join(tmp, "m.onnx"), size=SIZE, fold=False)
        os.makedirs(cache, exist_ok=True)
        shutil.copyfile(fresh, cached + ".part")
        os.replace(cached + ".part", cached)
    return cached


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one budget, fewer rounds (< 60 s)")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        fw, kind, batches, path, plan_file = args.child
        if "+" in kind:  # several models' baseline probes: {kind: growths}
            print(json.dumps({"rss_growth": {k: baseline_growth(fw, k, list(PROBES[k]), path)
                                             for k in kind.split("+")}}))
            return {}
        child(fw, kind, [int(b) for b in batches.split(",")], path, plan_file, args.quick)
        return {}
    budgets = [64 * MB] if args.quick else [64 * MB, 128 * MB]
    rounds = 1 if args.quick else 5
    started = time.perf_counter()
    results: dict = {"cpu_count": os.cpu_count(), "threads": 1, "budgets_mb": [b // MB for b in budgets],
                     "size": SIZE, "width": WIDTH, "quick": args.quick, "loadavg_1m_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as tmp:
        path = exported_mobilenet(tmp)
        print(f"exported MobileNetV2 ({time.perf_counter() - started:.1f} s)", flush=True)
        peaks, traced, calibrations = [], [], {}
        baselines = None
        if args.quick:  # each framework's probes of both models in one process (one import of torch)
            baselines = {fw: measure(fw, "+".join(PROBES), [0], path)["rss_growth"] for fw in ("vanilla", "torch")}
        for budget in budgets:
            for kind, probes in PROBES.items():
                r = run_model(kind, budget, path, rounds, probes, args.quick, calibrations, baselines)
                for k, v in r.items():
                    results[f"{kind}_{budget // MB}mb_{k}"] = v
                peaks.append(r["peak_over_budget"])
                traced.append(r.get("traced_over_budget", 0.0))
        last = budgets[-1] // MB
        keys = ("max_batch_ratio_vs_vanilla", "throughput_ratio_vs_unbudgeted", "throughput_ratio_vs_unbudgeted_cpu",
                "throughput_ratio_vs_unbudgeted_program", "throughput_ratio_vs_unbudgeted_program_cpu")
        for key in keys:  # the worst of both models and every budget (the targets), then per model
            found = [results[f"{kind}_{b // MB}mb_{key}"] for kind in PROBES for b in budgets
                     if f"{kind}_{b // MB}mb_{key}" in results]
            if found:
                results[key] = min(found)
            for kind, suffix in (("mnv2", "_mnv2"), ("vgg", "_nobn")):
                found = [results[f"{kind}_{b // MB}mb_{key}"] for b in budgets
                         if f"{kind}_{b // MB}mb_{key}" in results]
                if found:
                    results[f"{key}{suffix}"] = min(found)
        results["max_batch_capped_any"] = any(results[f"{kind}_{b // MB}mb_capped"] for kind in PROBES for b in budgets)
        results["torch_max_batch"] = results[f"mnv2_{last}mb_torch_max_batch"]
        results["torch_max_batch_nobn"] = results[f"vgg_{last}mb_torch_max_batch"]
        results["peak_over_budget_max"] = max(peaks)
        if not args.quick and any(traced):
            results["traced_over_budget_max"] = max(traced)
        t0 = time.perf_counter()
        results.update(budget_change("vgg", path, 64, [48 * MB, 32 * MB, 24 * MB], calibrations["vgg"]))
        t1 = time.perf_counter()
        exact = {"max_abs_grad_diff_recompute_mnv2": grad_diff("mnv2", path, 4, calibration=calibrations["mnv2"]),
                 "max_abs_grad_diff_micro_batches_vgg": grad_diff("vgg", path, 16, calibration=calibrations["vgg"])}
        streamed = grad_diff("mnv2", path, 8, stream=(16, 3, (8,)), calibration=calibrations["mnv2"])
        results.update(exact, max_abs_grad_diff_streamed_mnv2=streamed,
                       grad_noise_floor_mnv2=grad_noise_floor("mnv2", path, 8))
        results["max_abs_grad_diff"] = max(*exact.values(), streamed)
        print(f"budget change {t1 - t0:.1f} s, gradient checks {time.perf_counter() - t1:.1f} s", flush=True)
    results["wall_s"] = time.perf_counter() - started
    results = {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in results.items()}
    finish("melon", results, quick=args.quick)
    return results


if __name__ == "__main__":
    main()
