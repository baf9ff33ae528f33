"""The IPV job end to end on the device runner, checked against an independent computation.

``reference_ipv`` reads the Taobao CSV with plain Python and applies the mapping documented in
``TaobaoBehaviorSource`` (pv enters an item page, a pv of the open item is a reload, fav/cart/buy are
clicks on the item's page and enter it if it is not open, the page is left when another item is
entered -- at that moment -- or after more than 30 minutes of inactivity -- at the last activity --
or at the end of the input) and the fields of ``jobs/ipv.py``. It shares no code with streamflow.
"""

from __future__ import annotations

import csv
import random
import re
import time
from collections import Counter
from pathlib import Path

import pytest

from connectors.storage import CollectiveStorage
from streamflow.job import load_job
from streamflow.runners.device import DeviceRunner
from streamflow.sources import open_source

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "jobs" / "data" / "taobao_user_behavior_10k.csv"
JOB = ROOT / "jobs" / "ipv.py"
COLUMNS = ["user_id", "trigger_ts", "item_id", "category_id", "enter_ts", "dwell_s", "n_reload", "n_fav", "n_cart",
           "n_buy"]
GAP_S = 1800
MIN_TS = 946_684_800  # 2000-01-01
BEHAVIORS = ("pv", "fav", "cart", "buy")


def reference_ipv(path: Path, gap_s: int = GAP_S) -> tuple[list[tuple], int]:
    """(IPV rows as tuples in COLUMNS order, number of rejected lines), straight from the CSV."""
    max_ts = time.time() + 86_400
    last_ts: dict[str, int] = {}
    pages: dict[str, dict] = {}
    rows: list[tuple] = []
    rejected = 0

    def leave(user: str, page: dict, at: int) -> None:
        n = page["n"]
        rows.append((user, float(at), page["item"], page["cat"], float(page["enter"]), float(at - page["enter"]),
                     n["pv"], n["fav"], n["cart"], n["buy"]))

    with open(path, newline="") as f:
        for record in csv.reader(f):
            if not record or not "".join(record).strip():
                continue
            if len(record) != 5:
                rejected += 1
                continue
            user, item, cat, behavior, ts_text = (x.strip() for x in record)
            if not (user and item and cat) or behavior not in BEHAVIORS or not re.fullmatch(r"-?[0-9]+", ts_text):
                rejected += 1
                continue
            ts = int(ts_text)
            if not MIN_TS <= ts <= max_ts or ts < last_ts.get(user, ts):
                rejected += 1
                continue
            last_ts[user] = ts
            page = pages.get(user)
            if page is not None and ts - page["last"] > gap_s:
                leave(user, page, page["last"])
                del pages[user]
                page = None
            if page is not None and page["item"] == item:
                page["last"] = ts
                page["n"][behavior] += 1  # a pv here is a reload
                continue
            if page is not None:
                leave(user, page, ts)
            page = pages[user] = {"item": item, "cat": cat, "enter": ts, "last": ts, "n": dict.fromkeys(BEHAVIORS, 0)}
            if behavior != "pv":
                page["n"][behavior] += 1  # the click that (implicitly) entered the page
    for user, page in pages.items():
        leave(user, page, page["last"])
    return rows, rejected


def run_ipv(events: Path, db: Path):
    job = load_job(JOB)
    with CollectiveStorage(db) as store:
        runner = DeviceRunner(job, store)
        summary = runner.run(open_source(events))
        runner.close()
        table = store.read("ipv")
    return summary, table


@pytest.fixture(scope="module")
def sample_run(tmp_path_factory):
    return run_ipv(SAMPLE, tmp_path_factory.mktemp("ipv") / "features.duckdb")


def test_ipv_job_definition():
    job = load_job(JOB)
    assert job.name == "ipv" and job.task_names() == ["ipv"]
    task = job.tasks[0]
    assert tuple(task.trigger) == ("item",) and task.input == "page" and task.sink == "ipv"


def test_ipv_on_the_sample_matches_the_independent_computation(sample_run):
    summary, table = sample_run
    expected, rejected = reference_ipv(SAMPLE)
    assert table.column_names == COLUMNS  # and no redundant fields
    got = [tuple(row[c] for c in COLUMNS) for row in table.to_pylist()]
    assert len(got) == len(expected)
    assert Counter(got) == Counter(expected)
    assert summary.rejected_total == rejected
    assert summary.rows_written["ipv"] == len(expected)
    assert summary.task_stats["ipv"].fired == summary.tasks_fired == len(expected)
    assert summary.task_stats["ipv"].errors == 0


def test_the_sample_exercises_the_mapping():
    """The comparison above is only as strong as the paths the sample takes through the mapping."""
    expected, _ = reference_ipv(SAMPLE)
    assert sum(1 for r in expected if r[7] + r[8] + r[9] > 0) > 100  # fav/cart/buy entering a page
    assert len({r[0] for r in expected}) > 100  # many users
    with open(SAMPLE, newline="") as f:
        records = list(csv.reader(f))
    gaps = sum(1 for a, b in zip(records, records[1:], strict=False)
               if a[0] == b[0] and int(b[4]) - int(a[4]) > GAP_S)
    assert gaps > 100  # pages left by inactivity, at their last activity


def test_ipv_on_the_sample_with_users_interleaved(tmp_path, sample_run):
    """Rows of all users mixed round-robin (each user's own order kept): the same IPV rows."""
    lines = SAMPLE.read_text().splitlines()
    by_user: dict[str, list[str]] = {}
    for line in lines:
        by_user.setdefault(line.split(",")[0], []).append(line)
    mixed = []
    queues = [list(reversed(v)) for v in by_user.values()]
    while queues:
        for q in queues:
            mixed.append(q.pop())
        queues = [q for q in queues if q]
    path = tmp_path / "mixed.csv"
    path.write_text("\n".join(mixed) + "\n")
    summary, table = run_ipv(path, tmp_path / "f.duckdb")
    expected, _ = reference_ipv(path)
    got = Counter(tuple(row[c] for c in COLUMNS) for row in table.to_pylist())
    assert got == Counter(expected) == Counter(reference_ipv(SAMPLE)[0])
    assert got == Counter(tuple(row[c] for c in COLUMNS) for row in sample_run[1].to_pylist())


def _synthetic(seed: int) -> list[str]:
    """Few users and items (reloads, repeated visits), big and small gaps, interleaving, bad lines."""
    rnd = random.Random(seed)
    clock = {u: 1511848894 + rnd.randrange(3600) for u in ("1", "2", "3", "4")}
    lines = []
    for _ in range(400):
        user = rnd.choice(list(clock))
        clock[user] += rnd.choice([0, 1, 5, 30, 300, 1799, 1800, 1801, 7200])
        item = rnd.choice(["10", "11", "12"])
        behavior = rnd.choices(BEHAVIORS, weights=[6, 1, 1, 1])[0]
        line = f"{user},{item},{int(item) % 3 + 100},{behavior},{clock[user]}"
        roll = rnd.random()
        if roll < 0.03:
            line = f"{user},{item},{item},{behavior},{clock[user] - 100}"  # backwards
        elif roll < 0.05:
            line = f"{user},{item},x,{behavior}"  # wrong field count
        elif roll < 0.06:
            line = f"{user},{item},x,like,{clock[user]}"  # unknown behaviour
        elif roll < 0.07:
            line = f"{user},{item},x,pv,0"  # absurd
        elif roll < 0.08:
            line = f"{user},{item},x,pv,{clock[user]}.0"  # not an integer
        lines.append(line)
    return lines


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_ipv_on_synthetic_input_with_reloads_gaps_and_bad_lines(seed, tmp_path):
    path = tmp_path / "synthetic.csv"
    path.write_text("\n".join(_synthetic(seed)) + "\n")
    summary, table = run_ipv(path, tmp_path / "f.duckdb")
    expected, rejected = reference_ipv(path)
    assert rejected > 0 and any(r[6] > 0 for r in expected)  # the input has bad lines and reloads
    got = Counter(tuple(row[c] for c in COLUMNS) for row in table.to_pylist())
    assert got == Counter(expected)
    assert summary.rejected_total == rejected
