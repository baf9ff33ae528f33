"""What a run did, counted the same way by every runner."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from connectors.storage import DEAD_LETTER_TABLE

TASK_ERRORS_TABLE = "task_errors"
LATE_EVENTS_TABLE = "late_events"
#: Tables the runner itself writes: refused records, task failures, events too late for any window.
SYSTEM_TABLES = (DEAD_LETTER_TABLE, TASK_ERRORS_TABLE, LATE_EVENTS_TABLE)


@dataclass
class TaskStats:
    fired: int = 0
    rows: int = 0
    errors: int = 0
    consecutive_errors: int = 0
    quarantined: bool = False
    #: How a stream task's keyed step ran in batch mode (:mod:`streamflow.runners.batch_streams`); "" otherwise.
    mode: str = ""


@dataclass
class RunSummary:
    """What a run did; ``str()`` is the human-readable report the CLI prints."""

    db_path: str
    events_in: int = 0
    tasks_fired: int = 0
    rows_written: dict[str, int] = field(default_factory=dict)
    #: Rows each table refused (a value no column could take); they are in the dead-letter table.
    refused_rows: dict[str, int] = field(default_factory=dict)
    rejected: Counter[str] = field(default_factory=Counter)
    task_stats: dict[str, TaskStats] = field(default_factory=dict)
    elapsed_s: float = 0.0
    #: Users (keys) whose state was dropped to stay under the runner's cap on users held in memory.
    evicted_users: int = 0
    #: How the device runner ran: ``streaming`` (event by event) or ``batch`` (column by column, see
    #: :mod:`streamflow.runners.batch`).
    runtime_mode: str = "streaming"

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    @property
    def quarantined(self) -> list[str]:
        return [name for name, s in self.task_stats.items() if s.quarantined]

    def __str__(self) -> str:
        rate = self.events_in / self.elapsed_s if self.elapsed_s > 0 else 0.0
        lines = [
            f"events in        {self.events_in:,}  ({rate:,.0f} events/s)",
            f"tasks fired      {self.tasks_fired:,}",
            f"rows written     {sum(n for t, n in self.rows_written.items() if t not in SYSTEM_TABLES):,}  "
            f"to {self.db_path}",
        ]
        for name, stats in self.task_stats.items():
            state = "  QUARANTINED" if stats.quarantined else ""
            lines.append(f"  task {name:<18} fired {stats.fired:>7,}  rows {stats.rows:>7,}  "
                         f"errors {stats.errors:,}{state}")
        lines.append("runtime mode     batch  (the bounded input column by column)" if self.runtime_mode == "batch"
                     else "runtime mode     streaming  (event by event)")
        lines.extend(f"  task {name:<18} {stats.mode}" for name, stats in self.task_stats.items() if stats.mode)
        late = self.rows_written.get(LATE_EVENTS_TABLE, 0)
        if late:
            lines.append(f"late events      {late:,}  (too late for every window: in table {LATE_EVENTS_TABLE})")
        if self.evicted_users:
            lines.append(f"evicted users    {self.evicted_users:,}  (state dropped: over the cap on users in memory)")
        lines.append(f"rejected records {self.rejected_total:,}" +
                     (f"  (in table {DEAD_LETTER_TABLE})" if self.rejected_total else ""))
        for reason, n in self.rejected.most_common():
            lines.append(f"  {n:>7,}  {reason}")
        if self.refused_rows:
            lines.append(f"rows refused     {sum(self.refused_rows.values()):,}  (in table {DEAD_LETTER_TABLE})")
            lines.extend(f"  {n:>7,}  by table {table}" for table, n in self.refused_rows.items())
        errors = sum(s.errors for s in self.task_stats.values())
        if errors:
            lines.append(f"task errors      {errors:,}  (in table {TASK_ERRORS_TABLE})")
        return "\n".join(lines)
