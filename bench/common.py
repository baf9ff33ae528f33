"""Helpers shared by the benchmarks: arguments, progress, repeated timing, the final JSON line.

Conventions (see ARCHITECTURE.md): ``python -m bench.NAME`` runs the full measurement, ``--quick``
finishes within a minute; the machine is shared and noisy, so every figure is the median of a few
rounds measured side by side in the same run; the last line printed is one JSON object of named
metrics, also written to ``bench/results/NAME.json`` (``--quick``: ``bench/results/quick/NAME.json``, not
tracked, so a quick run never overwrites a full run's committed figures). Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
TAOBAO_SAMPLE = REPO / "jobs" / "data" / "taobao_user_behavior_10k.csv"


def parse_args(description: str, argv: list[str] | None = None,
               extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """``--quick`` (under a minute), ``--rounds`` (default 5 full / 3 quick), ``--seed``, plus ``extra``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a smaller run that finishes within 60 s")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per variant (default 5, quick 3)")
    parser.add_argument("--seed", type=int, default=7, help="random seed for generated inputs")
    if extra is not None:
        extra(parser)
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 3 if args.quick else 5
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    return args


def log(message: str) -> None:
    """A progress line on stderr (stdout ends with the JSON line)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    """A progress bar on a terminal; otherwise a log line per item (use for coarse steps only)."""
    if sys.stderr.isatty():
        yield from tqdm(items, desc=desc, total=total, leave=False)
        return
    for index, item in enumerate(items, start=1):
        log(f"{desc}: {index}/{total if total is not None else '?'}")
        yield item


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """(wall seconds, result) of one call."""
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of an already sorted list."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), int(-(-q * len(sorted_values) // 100))))
    return sorted_values[rank - 1]


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def results_path(name: str, quick: bool) -> Path:
    """Where a run's metrics go: ``bench/results/NAME.json``, a ``--quick`` run's under ``quick/`` (git-ignored)."""
    return (RESULTS / "quick" if quick else RESULTS) / f"{name}.json"


def finish(name: str, metrics: dict[str, Any], *, quick: bool) -> None:
    """Write the metrics to :func:`results_path` and print them as the last line of stdout."""
    path = results_path(name, quick)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(metrics, sort_keys=False)
    path.write_text(line + "\n", encoding="utf-8")
    log(f"results written to {path}")
    print(line, flush=True)


class GcPauses:
    """The garbage collector's pauses in this process from now on (a latency benchmark's process: a pause
    shows up in its tail)."""

    def __init__(self) -> None:
        self.pauses_ms: list[float] = []
        self._started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses_ms.append((time.perf_counter() - self._started) * 1000.0)

    def summary(self) -> dict[str, float]:
        gc.callbacks.remove(self._on_gc)
        return {"collections": len(self.pauses_ms), "max_ms": round(max(self.pauses_ms, default=0.0), 2),
                "over_5ms": sum(p > 5.0 for p in self.pauses_ms)}
