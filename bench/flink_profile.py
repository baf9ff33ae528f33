"""Where the IPV job's time goes on Flink: streamflow's translated job vs the hand-written one (``bench.flink``).

``python -m bench.flink_profile [--quick]``

The Python operators run in the TaskManager's embedded interpreter (thread mode), out of reach of a
profiler in this process. This benchmark swaps each job's keyed operator for a subclass, defined here
and shipped by value, that measures inside the TaskManager:

- ``*_keyed_thread_cpu_s``: CPU time of the keyed operator's task thread from ``open`` to ``close``
  (Python and Java: input deserialisation, state calls, the chained DuckDB writer), median of the rounds;
- ``*_keyed_python_s``: wall time inside the keyed operator's ``process_element``;
- then one more round of each job under ``cProfile`` (the thread's Python only): the functions with the
  most own time are printed to stderr, and the share of the profiled time spent in PyFlink state calls,
  input conversion, our state layer (``streamflow/flink/keyed.py``) and storage is in the JSON line.

Same input as ``bench.flink`` (the Taobao sample replayed; quick: 1 replay and 1 round, full: 5 and 3).
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench.flink as flink_bench
import streamflow.flink.runner as runner
from bench.common import TAOBAO_SAMPLE, cpu_count, finish, log, median, parse_args
from bench.device import replay_csv, sample_period
from streamflow import load_job

REPLAYS = {False: 5, True: 1}
ROUNDS = {False: 3, True: 1}
_RESULTS: dict[str, Any] = {}


def measured(base: type, out_dir: str, tag: str, profile: bool) -> type:
    """``base`` with its task thread's CPU, its time in ``process_element`` and optionally a cProfile
    written to ``out_dir/tag.{json,prof}`` at ``close``."""

    class Measured(base):  # type: ignore[misc, valid-type]
        def open(self, runtime_context: Any) -> None:
            self._bench_cpu0, self._bench_py = time.thread_time(), 0.0
            self._bench_prof = cProfile.Profile() if profile else None
            if self._bench_prof is not None:
                self._bench_prof.enable()
            super().open(runtime_context)

        def process_element(self, value: Any, ctx: Any) -> Any:
            started = time.perf_counter()
            out = super().process_element(value, ctx)
            out = list(out) if out is not None else []
            self._bench_py += time.perf_counter() - started
            return out

        def close(self) -> None:
            cpu = time.thread_time() - self._bench_cpu0
            if self._bench_prof is not None:
                self._bench_prof.disable()
                self._bench_prof.dump_stats(os.path.join(out_dir, f"{tag}.prof"))
            super().close()
            Path(out_dir, f"{tag}.json").write_text(json.dumps({"cpu": cpu, "py": self._bench_py}), encoding="utf-8")

    Measured.__name__ = Measured.__qualname__ = f"Measured{base.__name__}"
    return Measured


def instrument(out_dir: str, profile: bool) -> None:
    """Swap the keyed operators of both jobs for measured ones."""
    runner.UserTasks = measured(ORIGINAL_USER_TASKS, out_dir, "streamflow", profile)

    def classes() -> tuple[type, type]:
        pages, sink = ORIGINAL_HANDWRITTEN()
        return measured(pages, out_dir, "handwritten", profile), sink

    flink_bench._handwritten_classes = classes


ORIGINAL_USER_TASKS = runner.UserTasks
ORIGINAL_HANDWRITTEN = flink_bench._handwritten_classes


def shares(prof_path: Path) -> dict[str, float]:
    """Own time of the profiled functions by area, as fractions of the total."""
    stats = pstats.Stats(str(prof_path)).stats  # type: ignore[attr-defined]
    total = sum(entry[2] for entry in stats.values()) or 1.0
    areas = {"pyflink_state_calls": "fn_execution/datastream/embedded/state_impl.py",
             "pyflink_input_conversion": "fn_execution/embedded/converters.py",
             "streamflow_state_layer": "streamflow/flink/keyed.py", "storage": "connectors/storage.py"}
    out = {name: 0.0 for name in areas}
    out["pickle"] = 0.0
    for (path, _, name), entry in stats.items():
        if path == "~" and "_pickle" in name:
            out["pickle"] += entry[2]
        for area, where in areas.items():
            if where in path:
                out[area] += entry[2]
    return {name: round(value / total, 3) for name, value in out.items()}


def main(argv: list[str] | None = None) -> None:
    args = parse_args("Where the IPV job's time goes on Flink (streamflow vs hand-written).", argv)
    quick = args.quick
    rounds = ROUNDS[quick]
    load_start = os.getloadavg()
    job = load_job(flink_bench.JOB_FILE)
    lines = [line for line in TAOBAO_SAMPLE.read_text(encoding="utf-8").splitlines() if line.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="streamflow-bench-flink-profile-"))
    try:
        csv_path = tmp / "replay.csv"
        replay_csv(lines, REPLAYS[quick], sample_period(lines), csv_path)
        flink_bench._time_execute()
        cpu: dict[str, list[float]] = {"streamflow": [], "handwritten": []}
        python: dict[str, list[float]] = {"streamflow": [], "handwritten": []}
        execute: dict[str, list[float]] = {"streamflow": [], "handwritten": []}
        events = 0
        for r in range(rounds + 1):  # round 0 warms the JVM up (not counted); then the timed rounds
            for which in ("handwritten", "streamflow") if r % 2 else ("streamflow", "handwritten"):
                out_dir = tmp / f"{which}_{r}"
                out_dir.mkdir()
                instrument(str(out_dir), profile=False)
                if which == "streamflow":
                    seconds, _, events = flink_bench.run_streamflow(job, csv_path, tmp / f"sf_{r}.duckdb")
                else:
                    seconds, _ = flink_bench.timed_handwritten(csv_path, tmp / f"hw_{r}.duckdb")
                if r:
                    measured_values = json.loads(Path(out_dir, f"{which}.json").read_text(encoding="utf-8"))
                    cpu[which].append(measured_values["cpu"])
                    python[which].append(measured_values["py"])
                    execute[which].append(seconds)
            if r:
                log(f"round {r}: " + ", ".join(f"{w} {execute[w][-1]:.2f} s execute, keyed thread CPU "
                                               f"{cpu[w][-1]:.2f} s" for w in cpu))
        profiles = {}
        for which in ("streamflow", "handwritten"):
            out_dir = tmp / f"{which}_profile"
            out_dir.mkdir()
            instrument(str(out_dir), profile=True)
            if which == "streamflow":
                flink_bench.run_streamflow(job, csv_path, tmp / "sf_profile.duckdb")
            else:
                flink_bench.timed_handwritten(csv_path, tmp / "hw_profile.duckdb")
            prof = out_dir / f"{which}.prof"
            print(f"\n== {which}: keyed operator's thread under cProfile, by own time", file=sys.stderr)
            pstats.Stats(str(prof), stream=sys.stderr).sort_stats("tottime").print_stats(14)
            profiles[which] = shares(prof)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = len(lines) * REPLAYS[quick]
    metrics = {
        "streamflow_keyed_thread_cpu_s": round(median(cpu["streamflow"]), 3),
        "handwritten_keyed_thread_cpu_s": round(median(cpu["handwritten"]), 3),
        "keyed_cpu_ratio": round(median(cpu["streamflow"]) / median(cpu["handwritten"]), 2),
        "streamflow_keyed_cpu_us_per_row": round(median(cpu["streamflow"]) / rows * 1e6, 1),
        "handwritten_keyed_cpu_us_per_row": round(median(cpu["handwritten"]) / rows * 1e6, 1),
        "streamflow_keyed_python_s": round(median(python["streamflow"]), 3),
        "handwritten_keyed_python_s": round(median(python["handwritten"]), 3),
        "streamflow_execute_s": round(median(execute["streamflow"]), 2),
        "handwritten_execute_s": round(median(execute["handwritten"]), 2),
        "ratio_vs_handwritten": round(median(execute["handwritten"]) / median(execute["streamflow"]), 3),
        "streamflow_profile_shares": profiles["streamflow"],
        "handwritten_profile_shares": profiles["handwritten"],
        "csv_rows": rows,
        "events": events,
        "rounds": rounds,
        "load_avg_1m_start": round(load_start[0], 2),
        "load_avg_1m_end": round(os.getloadavg()[0], 2),
        "cpu_count": cpu_count(),
        "quick": quick,
    }
    finish("flink_profile", metrics, quick=args.quick)


if __name__ == "__main__":
    main()
