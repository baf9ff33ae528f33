"""The IPV job hand-written as a Bytewax 0.21.1 dataflow: the peer ``bench.peers`` measures us against.

Written the way a Bytewax user would: a :class:`~bytewax.connectors.files.FileSource` of CSV lines,
a stateless parse that drops bad lines (``filter_map``), the lines keyed by user, one
:class:`~bytewax.operators.StatefulLogic` per user that keeps the open item page and its counters
and emits a row when the page is left (another item entered, more than 30 minutes idle, or the end
of the input: ``on_eof``), and a sink that writes the rows into one DuckDB table in Arrow batches.

It computes what ``jobs/ipv.py`` computes on the device runner over
:class:`~streamflow.sources.TaobaoBehaviorSource` (same page-visit rules, same timestamp checks:
plausible, non-decreasing per user), but shares no code with streamflow, so the bench's row
comparison is a real check.

Run it:  python -m bytewax.run "bench.bytewax_ipv:build_flow('events.csv', 'out.duckdb')"
"""

from __future__ import annotations

import re
import time
from typing import Any

import duckdb
import pyarrow as pa
from bytewax import operators as op
from bytewax.connectors.files import FileSource
from bytewax.dataflow import Dataflow
from bytewax.operators import StatefulLogic
from bytewax.outputs import DynamicSink, StatelessSinkPartition

TABLE = "ipv"
GAP_S = 1800.0  # inactivity after which the open item page counts as left
MIN_TS = 946_684_800.0  # 2000-01-01
MAX_TS = time.time() + 86_400.0
COUNTER = {"pv": 4, "fav": 5, "cart": 6, "buy": 7}  # behaviour -> its counter's index in a page
_INTEGER = re.compile(r"-?[0-9]{1,15}")
SCHEMA = pa.schema([("user_id", pa.string()), ("trigger_ts", pa.float64()), ("item_id", pa.string()),
                    ("category_id", pa.string()), ("enter_ts", pa.float64()), ("dwell_s", pa.float64()),
                    ("n_reload", pa.int64()), ("n_fav", pa.int64()), ("n_cart", pa.int64()), ("n_buy", pa.int64())])

Row = tuple[str, str, str, str, float]  # user, item, category, behavior, ts


def parse(line: str) -> Row | None:
    """One CSV line as its fields, or None for a line the job cannot use."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 5 or not all(parts[:3]) or parts[3] not in COUNTER or not _INTEGER.fullmatch(parts[4]):
        return None
    ts = float(parts[4])
    if not MIN_TS <= ts <= MAX_TS:
        return None
    return parts[0], parts[1], parts[2], parts[3], ts


class ItemPage(StatefulLogic):
    """One user's open item page; a row per page visit when the page is left."""

    def __init__(self, resume: tuple[str, list[Any]] | None):
        # [item, category, enter_ts, last_ts, pv, fav, cart, buy]; the builder is not told the key
        self.user, self.page = resume if resume is not None else ("", None)

    def _row(self, exit_ts: float) -> dict[str, Any]:
        item, category, enter_ts, _, pv, fav, cart, buy = self.page
        return {"user_id": self.user, "trigger_ts": exit_ts, "item_id": item, "category_id": category,
                "enter_ts": enter_ts, "dwell_s": exit_ts - enter_ts,
                "n_reload": pv, "n_fav": fav, "n_cart": cart, "n_buy": buy}

    def on_item(self, value: Row) -> tuple[list[dict[str, Any]], bool]:
        self.user, item, category, behavior, ts = value
        page = self.page
        out = []
        if page is not None:
            last = page[3]
            if ts < last:
                return out, StatefulLogic.RETAIN  # time went backwards for this user: drop the line
            if ts - last > GAP_S:
                out.append(self._row(last))
                page = None
            elif page[0] == item:
                page[3] = ts
                page[COUNTER[behavior]] += 1
                return out, StatefulLogic.RETAIN
            else:
                out.append(self._row(ts))
        page = self.page = [item, category, ts, ts, 0, 0, 0, 0]
        if behavior != "pv":  # a click on an item page that was not open: the page is entered with it
            page[COUNTER[behavior]] += 1
        return out, StatefulLogic.RETAIN

    def on_eof(self) -> tuple[list[dict[str, Any]], bool]:
        return ([self._row(self.page[3])] if self.page is not None else []), StatefulLogic.DISCARD

    def snapshot(self) -> tuple[str, list[Any] | None]:
        return self.user, self.page


class _DuckDBPartition(StatelessSinkPartition):
    def __init__(self, path: str, table: str, schema: pa.Schema, batch_rows: int):
        self.con = duckdb.connect(path)
        self.table, self.schema, self.batch_rows = table, schema, batch_rows
        self.pending: list[dict[str, Any]] = []
        self.con.from_arrow(schema.empty_table()).create(table)

    def write_batch(self, items: list[dict[str, Any]]) -> None:
        self.pending.extend(items)
        if len(self.pending) >= self.batch_rows:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            self.con.from_arrow(pa.Table.from_pylist(self.pending, schema=self.schema)).insert_into(self.table)
            self.pending = []

    def close(self) -> None:
        self._flush()
        self.con.close()


class DuckDBSink(DynamicSink):
    """Rows (dicts) into DuckDB table ``table`` of file ``path`` (created with ``schema``), inserted as Arrow
    batches of ``batch_rows``."""

    def __init__(self, path: str, table: str = TABLE, schema: pa.Schema = SCHEMA, batch_rows: int = 4096):
        self.path, self.table, self.schema, self.batch_rows = path, table, schema, batch_rows

    def build(self, step_id: str, worker_index: int, worker_count: int) -> _DuckDBPartition:
        return _DuckDBPartition(self.path, self.table, self.schema, self.batch_rows)


def build_flow(events: str, db: str) -> Dataflow:
    """The IPV dataflow from the Taobao CSV ``events`` into table ``ipv`` of DuckDB file ``db``."""
    flow = Dataflow("ipv")
    lines = op.input("csv", flow, FileSource(events))
    rows = op.filter_map("parse", lines, parse)
    by_user = op.key_on("user", rows, lambda row: row[0])
    visits = op.stateful("item_pages", by_user, ItemPage)
    op.output("duckdb", op.key_rm("unkey", visits), DuckDBSink(db))
    return flow
