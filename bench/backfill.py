"""A backfill: the IPV job and the sliding-windows job over millions of lines, in the default mode.

``python -m bench.backfill [--quick] [--format jsonl]``

Recomputing a feature over weeks of logs before shipping it is where a user needs columnar speed and bounded memory.
The input is made from the shared Taobao sample by shifted copies (:func:`bench.peers.shifted_copies`: users and
times moved on per copy) to ~5M lines (``--quick``: 200k), with 0.1% bad lines mixed in
(:func:`bench.peers.with_bad_lines`). Each job runs once as a whole process, ``streamflow run JOB --events CSV``
with the default mode (``automatic``: batch where it applies), and once with ``--mode streaming`` over a prefix
(1M lines; ``--quick``: the whole input), whose tables the default mode's run over the same prefix must equal, row
for row in the order written. ``--format jsonl``: the same over the input's app events as JSON lines
(:func:`as_app_events`, 0.1% bad JSON lines), keys in ``backfill_jsonl.json``.

Keys: per job ``J`` in ``ipv|windows``: ``J_events_per_s`` (input lines per wall second, start-up included),
``J_peak_mb`` (the process's peak RSS), ``J_runtime_mode``, ``J_rows_equal_streaming``; and over both
``backfill_events_per_s`` (the slower job's), ``backfill_peak_mb`` (the larger peak),
``backfill_rows_equal_streaming`` (both equal). Issue 24's targets: ``backfill_events_per_s`` >= 1,000,000 and
``backfill_peak_mb`` <= 400.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import duckdb

from bench.common import REPO, TAOBAO_SAMPLE, finish, log, parse_args
from bench.peers import BAD_FRACTION, compile_sources, run_process, shifted_copies, streamflow_command, with_bad_lines
from streamflow.events import Event
from streamflow.sources import TaobaoBehaviorSource

#: Bad JSON lines mixed into ``--format jsonl``'s input (invalid JSON, a missing field, a wrong type, an absurd
#: timestamp, bad UTF-8): ``{u}`` a user of the line next to it.
BAD_JSON_LINES = ('{{"user_id": "{u}", "event_id": "pv", ', '{{"user_id": "{u}", "event_id": "pv", "page_id": "item"}}',
                  '{{"user_id": "{u}", "event_id": "pv", "page_id": "item", "ts": "x"}}',
                  '{{"user_id": "{u}", "event_id": "pv", "page_id": "item", "ts": 5}}',
                  '{{"user_id": "{u}\udcff", "event_id": "pv", "page_id": "item", "ts": 1511848900}}')


def as_app_events(csv: Path, path: Path, fraction: float = BAD_FRACTION, seed: int = 24) -> int:
    """The app events the Taobao CSV at ``csv`` makes (its bad lines dropped) as JSON lines at ``path``, with
    ``fraction`` of bad JSON lines (:data:`BAD_JSON_LINES`, in turn) at seeded random places; lines written."""
    lines = [json.dumps(record.to_dict()) for record in TaobaoBehaviorSource(csv) if isinstance(record, Event)]
    rng = random.Random(seed)
    for n, at in enumerate(sorted(rng.sample(range(len(lines)), max(1, round(len(lines) * fraction))), reverse=True)):
        lines.insert(at, BAD_JSON_LINES[n % len(BAD_JSON_LINES)].format(u=json.loads(lines[at])["user_id"]))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogateescape")
    return len(lines)


JOBS = {"ipv": (REPO / "jobs" / "ipv.py", ("ipv",)),
        "windows": (REPO / "jobs" / "activity_windows.py", ("activity", "late_events"))}
LINES = {False: 5_000_000, True: 200_000}
PREFIX = {False: 1_000_000, True: None}  # lines the streaming comparison runs over (None: all)


def tables(db: Path, names: tuple[str, ...]) -> dict[str, list[tuple[Any, ...]]]:
    """The tables ``names`` of ``db`` as written (physical order), plus its dead letters without the reason's clock."""
    with duckdb.connect(str(db), read_only=True) as con:
        found = {name: con.execute(f'SELECT * FROM "{name}"').fetchall() for name in names}
        found["dead_letter"] = con.execute("SELECT source, line FROM dead_letter").fetchall()
    return found


def main(argv: list[str] | None = None) -> None:
    args = parse_args("A backfill: the IPV and windows jobs over millions of lines in the default mode.", argv,
                      lambda parser: parser.add_argument(
                          "--format", choices=("csv", "jsonl"), default="csv",
                          help="the input: the Taobao CSV (default), or its app events as JSON lines (about as many "
                               "lines, made from half as many CSV lines; results in backfill_jsonl.json)"))
    jsonl = args.format == "jsonl"
    sample = [line for line in TAOBAO_SAMPLE.read_text(encoding="utf-8").splitlines() if line.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="streamflow-bench-backfill-"))
    compile_sources()
    metrics: dict[str, Any] = {}
    try:
        big = tmp / "backfill.csv"
        lines = shifted_copies(sample, -(-LINES[args.quick] // len(sample) // (2 if jsonl else 1)), big)
        lines += with_bad_lines(big)
        if jsonl:  # each CSV line is about two app events
            lines = as_app_events(big, tmp / "backfill.jsonl")
            big.unlink()
            big = tmp / "backfill.jsonl"
        prefix_lines = PREFIX[args.quick]
        prefix = big
        if prefix_lines is not None:
            prefix = tmp / f"prefix{big.suffix}"
            with open(big, encoding="utf-8") as source, open(prefix, "w", encoding="utf-8") as out:
                for _, line in zip(range(prefix_lines), source, strict=False):
                    out.write(line)
        log(f"input: {lines:,} lines ({big.stat().st_size / 1e6:.0f} MB), streaming check over "
            f"{prefix_lines or lines:,}")
        for name, (job, names) in JOBS.items():
            db = tmp / f"{name}.duckdb"
            wall, cpu, peak = run_process(streamflow_command(big, db, "automatic", job), tmp / f"{name}.log")
            mode = "batch" if "runtime mode     batch" in (tmp / f"{name}.log").read_text() else "streaming"
            db.unlink()
            log(f"{name}: {lines:,} lines in {wall:.2f} s (CPU {cpu:.2f} s), peak {peak:.0f} MiB, {mode}")
            dbs = {m: tmp / f"{name}_{m}.duckdb" for m in ("automatic", "streaming")}
            for m, path in dbs.items():
                run_process(streamflow_command(prefix, path, m, job), tmp / f"{name}_{m}.log")
            equal = tables(dbs["automatic"], names) == tables(dbs["streaming"], names)
            for path in dbs.values():
                path.unlink()
            log(f"{name}: default mode vs streaming over the prefix, tables equal: {equal}")
            metrics.update({f"{name}_events_per_s": round(lines / wall), f"{name}_cpu_s": round(cpu, 2),
                            f"{name}_peak_mb": round(peak, 1), f"{name}_runtime_mode": mode,
                            f"{name}_rows_equal_streaming": equal})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    metrics = {
        "backfill_events_per_s": min(metrics[f"{name}_events_per_s"] for name in JOBS),
        "backfill_peak_mb": max(metrics[f"{name}_peak_mb"] for name in JOBS),
        "backfill_rows_equal_streaming": all(metrics[f"{name}_rows_equal_streaming"] for name in JOBS),
        "target_events_per_s_met": min(metrics[f"{name}_events_per_s"] for name in JOBS) >= 1_000_000,
        "target_peak_mb_met": max(metrics[f"{name}_peak_mb"] for name in JOBS) <= 400,
        **metrics,
        "lines": lines,
        "quick": args.quick,
    }
    finish("backfill_jsonl" if jsonl else "backfill", metrics, quick=args.quick)


if __name__ == "__main__":
    main()
