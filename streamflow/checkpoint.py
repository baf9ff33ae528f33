"""Device checkpoints: a run's whole state in its own DuckDB file, stored with the rows it covers.

A checkpoint is one row of the table ``streamflow_checkpoints`` (one row per job, replaced by the
next checkpoint): the job's name and tasks fingerprint, the identity of the input file, whether the
run is complete, the source's line, and the pickled state (every keyed runtime, the timestamp
guard, the summary counters, the source's position). The device runner writes it with
:meth:`~connectors.storage.CollectiveStorage.commit`, in the same transaction as the feature rows
buffered since the previous checkpoint: the tables hold exactly the rows of the stored checkpoint.

**Trust**: the state is unpickled on resume. The checkpoint is our own file on the device, trusted as
the DuckDB file that holds it is (whoever can write it can write the feature rows too); never point a
run at a database file from elsewhere.

Example:
    >>> import os, tempfile
    >>> from connectors import CollectiveStorage
    >>> store = CollectiveStorage(os.path.join(tempfile.mkdtemp(), "f.duckdb"))
    >>> saved = Checkpoint("ipv", "f1", {"size": 1}, False, 7, {"n": 1})
    >>> store.hold(lambda: None)
    >>> store.write("ipv", [{"n": 1}])
    >>> store.commit(saved.save)
    >>> load_checkpoint(store, "ipv").state, store.query("SELECT n FROM ipv")
    ({'n': 1}, [(1,)])
"""

from __future__ import annotations

import hashlib
import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import duckdb

    from connectors.storage import CollectiveStorage
    from streamflow.job import Job

CHECKPOINT_TABLE = "streamflow_checkpoints"
_CREATE = (f"CREATE TABLE IF NOT EXISTS {CHECKPOINT_TABLE} (job VARCHAR PRIMARY KEY, fingerprint VARCHAR, "
           "input VARCHAR, complete BOOLEAN, line BIGINT, taken_at TIMESTAMP, state BLOB)")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed here (another job, another input, a finished run)."""


@dataclass
class Checkpoint:
    """One job's checkpoint, as stored."""

    job: str
    fingerprint: str
    input: dict[str, Any]
    complete: bool
    line: int
    state: Any

    def save(self, con: duckdb.DuckDBPyConnection) -> None:
        """Replace the job's checkpoint (run inside the storage's commit transaction)."""
        con.execute(_CREATE)
        con.execute(f"INSERT OR REPLACE INTO {CHECKPOINT_TABLE} VALUES (?, ?, ?, ?, ?, now(), ?)",
                    [self.job, self.fingerprint, json.dumps(self.input, sort_keys=True), self.complete, self.line,
                     pickle.dumps(self.state, protocol=pickle.HIGHEST_PROTOCOL)])

    def check(self, job: Job, input_id: dict[str, Any], db: Path) -> None:
        """``CheckpointError`` unless a run of ``job`` over the input ``input_id`` may resume from it."""
        fresh = "start over with --replace (replace=True), which drops the job's tables and this checkpoint"
        if self.complete:
            raise CheckpointError(f"job {self.job!r} already ran to completion into {db} (its checkpoint says "
                                  f"so); {fresh}")
        if self.fingerprint != job_fingerprint(job):
            raise CheckpointError(f"the checkpoint of job {self.job!r} in {db} was taken with other tasks "
                                  f"(fingerprint {self.fingerprint}, now {job_fingerprint(job)}); {fresh}")
        if self.input != input_id:
            raise CheckpointError(f"the checkpoint of job {self.job!r} in {db} was taken over another input "
                                  f"file ({_describe(self.input)}; this one: {_describe(input_id)}); resume it "
                                  f"over the same file, or {fresh}")


def load_checkpoint(storage: CollectiveStorage, job_name: str) -> Checkpoint | None:
    """The stored checkpoint of job ``job_name``, if any (its state unpickled: see the module docstring)."""
    if CHECKPOINT_TABLE not in storage.tables():
        return None
    rows = storage.query(f"SELECT job, fingerprint, input, complete, line, state FROM {CHECKPOINT_TABLE} "
                         "WHERE job = ?", [job_name])
    if not rows:
        return None
    job, fingerprint, input_id, complete, line, state = rows[0]
    return Checkpoint(job, fingerprint, json.loads(input_id), complete, line, pickle.loads(state))


def has_checkpoint(storage: CollectiveStorage, job_name: str) -> bool:
    """Whether the storage holds a checkpoint of job ``job_name`` (without reading it)."""
    return CHECKPOINT_TABLE in storage.tables() and bool(
        storage.query(f"SELECT 1 FROM {CHECKPOINT_TABLE} WHERE job = ?", [job_name]))


def discard_checkpoint(storage: CollectiveStorage, job_name: str) -> None:
    """Delete the checkpoint of job ``job_name`` (starting over)."""
    if CHECKPOINT_TABLE in storage.tables():
        storage.query(f"DELETE FROM {CHECKPOINT_TABLE} WHERE job = ?", [job_name])


def job_fingerprint(job: Job) -> str:
    """A digest of the job's name and tasks (names, triggers, inputs, sinks, history, operator kinds).

    Example:
        >>> from streamflow.job import Job, Task
        >>> from operators import Aggregate, Count
        >>> len(job_fingerprint(Job("j", [Task("t", ["fav"], [Aggregate(n=Count())])])))
        16
    """
    tasks = [[task.name, task.input, list(task.trigger or []), task.sink, task.history_events, task.history_s,
              [type(op).__name__ for op in task.pipeline]] for task in job.tasks]
    text = json.dumps([job.name, tasks], default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _describe(identity: dict[str, Any]) -> str:
    return f"{identity.get('size')} bytes, first MiB sha256 {str(identity.get('head_sha256'))[:12]}"
