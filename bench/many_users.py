"""Peak memory of the IPV job over a stream of many distinct users, with and without a state TTL.

Run by ``bench.device`` (``peak_mb_1m_users``), each variant in its own process:
``python -m bench.many_users USERS TTL_S|none`` prints one JSON line
``{"users", "events_in", "rows", "peak_mb", "baseline_mb", "users_held_at_end", "seconds"}``.

The stream is made on the fly (never held in memory) from the Taobao sample's behaviour: user ``i``
gets a copy of one sample user's rows (cycling through the sample's users), with user id ``i`` and
timestamps moved so that one new user starts every ``ARRIVAL_S`` seconds, kept in time order across
users as a live device or a log sorted by time delivers them. With a TTL of the 30-minute page
inactivity gap, a user's state is dropped once idle that long; without it, every user's last
timestamp and open page stay in memory until the end of the input.
"""

from __future__ import annotations

import heapq
import json
import resource
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench.common import TAOBAO_SAMPLE
from connectors.storage import CollectiveStorage
from streamflow import load_job
from streamflow.runners.device import DeviceRunner
from streamflow.sources import TaobaoBehaviorSource

REPO = Path(__file__).resolve().parent.parent
ARRIVAL_S = 2  # a new user every 2 s of event time
MAX_ROWS_PER_USER = 2  # each user: the first rows of a sample user (a short visit: ~5 app events)


def sample_users() -> list[list[tuple[str, str, str, int]]]:
    """Each sample user's first rows as (item, category, behavior, seconds since their first row)."""
    users: dict[str, list[tuple[str, str, str, int]]] = {}
    for line in TAOBAO_SAMPLE.read_text(encoding="utf-8").splitlines():
        user, item, category, behavior, ts = line.split(",")
        rows = users.setdefault(user, [])
        if len(rows) < MAX_ROWS_PER_USER:
            rows.append((item, category, behavior, int(ts)))
    out = []
    for rows in users.values():
        rows.sort(key=lambda row: row[3])
        start = rows[0][3]
        # squeeze each history into minutes so the visits stay short
        out.append([(item, cat, beh, min(ts - start, 60 * i)) for i, (item, cat, beh, ts) in enumerate(rows)])
    return out


def stream(n_users: int, start_ts: int = 1_600_000_000) -> Iterator[str]:
    """CSV lines of ``n_users`` users in time order (a heap merges the overlapping users)."""
    templates = sample_users()
    pending: list[tuple[int, int, int]] = []  # (ts, user, row index)
    for user in range(n_users):
        arrival = start_ts + user * ARRIVAL_S
        while pending and pending[0][0] < arrival:
            yield from _pop(pending, templates)
        heapq.heappush(pending, (arrival, user, 0))
    while pending:
        yield from _pop(pending, templates)


def _pop(pending: list[tuple[int, int, int]], templates: list) -> Iterator[str]:
    ts, user, i = heapq.heappop(pending)
    rows = templates[user % len(templates)]
    item, category, behavior, offset = rows[i]
    yield f"{user},{item},{category},{behavior},{ts}"
    if i + 1 < len(rows):
        heapq.heappush(pending, (ts - offset + rows[i + 1][3], user, i + 1))


def run(n_users: int, ttl_s: float | None) -> dict[str, float | int]:
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="streamflow-bench-users-") as tmp:
        source = TaobaoBehaviorSource.from_lines(stream(n_users), state_ttl_s=ttl_s)  # type: ignore[arg-type]
        with CollectiveStorage(Path(tmp) / "users.duckdb") as storage:
            runner = DeviceRunner(load_job(REPO / "jobs" / "ipv.py"), storage, state_ttl_s=ttl_s)
            summary = runner.run(source)
            runner.close()
            held = runner.guard.users_held
    return {"users": n_users, "events_in": summary.events_in, "rows": summary.rows_written.get("ipv", 0),
            "peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "baseline_mb": round(baseline, 1), "users_held_at_end": held,
            "seconds": round(time.perf_counter() - started, 2)}


if __name__ == "__main__":
    users, ttl = int(sys.argv[1]), sys.argv[2]
    print(json.dumps(run(users, None if ttl == "none" else float(ttl))))
