"""The cloud store's own tables, in a DuckDB schema of their own, out of the devices' namespace.

Devices name the tables their rows go to (``main.<table>``, ``main.<table>_online``); the store's bookkeeping
lives in the schema :data:`SCHEMA` (``tunnel.batches``, ``tunnel.offsets``, ``tunnel.dead_letter``,
``tunnel.registry``, ``tunnel.online_marks``, ``tunnel.gaps``), which no batch can name: a batch's table is a
plain identifier, so it always lands in ``main``. Every statement names these tables fully
(catalog.schema.table: a database file called ``tunnel.duckdb`` would make ``tunnel.x`` ambiguous) and every
insert lists its columns, so nothing a device adds to a table of its own can change what they mean.

A store written before (its tables ``main.tunnel_batches``, ...) is moved over when it is opened, in one
transaction: the known columns of each old table are copied, the old table dropped (:func:`migrate`).

Example:
    >>> import duckdb
    >>> con = duckdb.connect()
    >>> tables = Tables(con)
    >>> tables.create()
    >>> tables.name("offsets")
    '"memory"."tunnel"."offsets"'
    >>> con.execute(f"SELECT count(*) FROM {tables.name('gaps')}").fetchone()
    (0,)
"""

from __future__ import annotations

import logging

import duckdb

from connectors.sql import quote_identifier, quoted_list, scalar

log = logging.getLogger("streamflow.cloud")

SCHEMA = "tunnel"
#: table → its columns and types (the order of every internal INSERT's column list)
COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {
    # one row per batch accounted for: stored (outcome 'stored') or refused after verification ('dead')
    "batches": (("device_id", "VARCHAR"), ("first_seq", "BIGINT"), ("n_rows", "BIGINT"), ("mac", "BLOB"),
                ("table_name", "VARCHAR"), ("ingested_at", "TIMESTAMP"), ("outcome", "VARCHAR")),
    # append-only: one row per partition per transaction (cheaper than an upsert); the newest row counts
    "offsets": (("topic", "VARCHAR"), ("kafka_partition", "INTEGER"), ("next_offset", "BIGINT")),
    "dead_letter": (("topic", "VARCHAR"), ("kafka_partition", "INTEGER"), ("kafka_offset", "BIGINT"),
                    ("device_id", "VARCHAR"), ("reason", "VARCHAR"), ("detail", "VARCHAR"), ("raw", "BLOB"),
                    ("refused_at", "TIMESTAMP"), ("resolved_at", "TIMESTAMP")),
    "registry": (("device_id", "VARCHAR"), ("kind", "TINYINT"), ("id", "BLOB"), ("body", "BLOB"),
                 ("registered_at", "TIMESTAMP")),
    # append-only: with a deferred online upsert, the newest ingested_at of the rows each upsert applied
    "online_marks": (("table_name", "VARCHAR"), ("applied_through", "TIMESTAMP")),
    # a per-device sequence gap: noticed, then filled or given up (see connectors.tunnel.ledger)
    "gaps": (("device_id", "VARCHAR"), ("from_seq", "BIGINT"), ("to_seq", "BIGINT"), ("noticed_at", "TIMESTAMP"),
             ("closed_at", "TIMESTAMP"), ("outcome", "VARCHAR"), ("missing_rows", "BIGINT")),
}
#: the names these tables had in ``main`` before they moved
_OLD_NAMES = {"batches": "tunnel_batches", "offsets": "tunnel_offsets", "dead_letter": "tunnel_dead_letter",
              "registry": "tunnel_registry", "online_marks": "tunnel_online_marks"}


class Tables:
    """The internal tables of the store open on ``con``: their full names and their creation."""

    def __init__(self, con: duckdb.DuckDBPyConnection):
        self._con = con
        catalog = scalar(con, "SELECT current_database()")
        self._prefix = f"{quote_identifier(catalog)}.{quote_identifier(SCHEMA)}"

    def name(self, table: str) -> str:
        """The fully qualified, quoted name of the internal table ``table`` (a key of :data:`COLUMNS`)."""
        if table not in COLUMNS:
            raise KeyError(table)
        return f"{self._prefix}.{quote_identifier(table)}"

    def insert(self, table: str, rows: int = 1) -> str:
        """``INSERT INTO <table> (<its columns>) VALUES (?, ...)`` for ``rows`` rows."""
        columns = COLUMNS[table]
        one = "(" + ", ".join("?" * len(columns)) + ")"
        return f"INSERT INTO {self.name(table)} ({quoted_list(c for c, _ in columns)}) VALUES " + ", ".join(
            [one] * rows)

    def create(self) -> None:
        """Create the schema and its tables (and the columns later versions added), then move an old store's."""
        con = self._con
        con.execute(f"CREATE SCHEMA IF NOT EXISTS {self._prefix}")
        for table, columns in COLUMNS.items():
            con.execute(f"CREATE TABLE IF NOT EXISTS {self.name(table)} ("
                        + ", ".join(f"{quote_identifier(c)} {t}" for c, t in columns) + ")")
            for column, type_ in columns:
                con.execute(f"ALTER TABLE {self.name(table)} ADD COLUMN IF NOT EXISTS "
                            f"{quote_identifier(column)} {type_}")
        migrate(con, self)


def migrate(con: duckdb.DuckDBPyConnection, tables: Tables) -> None:
    """Move the tables of a store written before the schema :data:`SCHEMA` existed (``main.tunnel_*``) into it.

    Only the columns the store knows are copied (a device may have added columns to them before names were
    compared case-insensitively); the old tables are dropped in the same transaction.
    """
    present = {name.lower(): name for (name,) in con.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_catalog = current_database() AND "
        "table_schema = 'main'").fetchall()}
    old = {table: present[name] for table, name in _OLD_NAMES.items() if name in present}
    if not old:
        return
    con.execute("BEGIN")
    try:
        for table, name in old.items():
            source = quote_identifier(name)
            have = {c.lower() for (c,) in con.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_catalog = current_database() AND "
                "table_schema = 'main' AND table_name = ?", [name]).fetchall()}
            columns = [c for c, _ in COLUMNS[table] if c in have]
            if table == "batches" and "outcome" not in have:
                con.execute(f"INSERT INTO {tables.name(table)} ({quoted_list(columns)}, outcome) "
                            f"SELECT {quoted_list(columns)}, 'stored' FROM {source}")
            else:
                con.execute(f"INSERT INTO {tables.name(table)} ({quoted_list(columns)}) "
                            f"SELECT {quoted_list(columns)} FROM {source}")
            con.execute(f"DROP TABLE {source}")
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    log.info("cloud: moved the store's tables %s into the schema %s", ", ".join(sorted(old.values())), SCHEMA)
