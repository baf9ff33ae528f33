"""What the device runner hands its batch modes: a public plan of the run, and the few calls they make back.

:meth:`DeviceRunner.plan() <streamflow.runners.device.DeviceRunner.plan>` gives a :class:`RunPlan`: the job's
trigger tasks with their own pipelines (each Filter and Map lowered once to its
:class:`~operators.base.ElementStep`), its stream tasks' running steps, the timestamp guard and what the run asks
for that only streaming honours. The batch modes (:mod:`streamflow.runners.batch` for trigger tasks,
:mod:`streamflow.runners.batch_streams` for stream tasks) read that plan and call the runner only through
:class:`BatchHost`, so they read no runner internals. Imports go one way: ``runners/device.py`` imports the batch
modules and this one; the batch modules import this one, never the device runner.

Example:
    >>> import os, tempfile
    >>> from connectors import CollectiveStorage
    >>> from operators import Aggregate, Count, Map
    >>> from streamflow import Job, Task
    >>> from streamflow.runners import DeviceRunner
    >>> task = Task("n", ["item"], [Aggregate(n=Count()), Map(lambda r: {"twice": 2 * r["n"]})], input="page")
    >>> runner = DeviceRunner(Job("j", [task]), CollectiveStorage(os.path.join(tempfile.mkdtemp(), "f.duckdb")))
    >>> plan = runner.plan()
    >>> [step.kind for step in plan.triggers["n"].steps], plan.default_guard, plan.checkpoint_interval_s
    (['map'], True, None)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from operators import Aggregate, Operator
from operators.base import ElementStep

if TYPE_CHECKING:
    from connectors.storage import CollectiveStorage
    from streamflow.events import Event, Rejected, TimestampGuard
    from streamflow.job import Task
    from streamflow.sources import LineSource, SourceReader
    from streamflow.summary import RunSummary
    from streamflow.windowing import StreamTaskRun


@dataclass(frozen=True)
class TriggerTaskPlan:
    """A trigger task as a batch mode reads it: the task and its own pipeline (the copy the streaming run
    compiled), with its leading :class:`~operators.Aggregate` and the element steps after it.

    Example:
        >>> from operators import Aggregate, Count, Filter
        >>> from streamflow.job import Task
        >>> pipeline = (Aggregate(n=Count()), Filter(bool))
        >>> plan = TriggerTaskPlan(Task("t", ["item"], list(pipeline)), pipeline)
        >>> type(plan.aggregate).__name__, [step.kind for step in plan.steps]
        ('Aggregate', ['filter'])
    """

    task: Task
    pipeline: tuple[Operator, ...]

    @property
    def aggregate(self) -> Aggregate | None:
        """The pipeline's first operator when it is an :class:`~operators.Aggregate`, else ``None``."""
        first = self.pipeline[0] if self.pipeline else None
        return first if type(first) is Aggregate else None

    @property
    def steps(self) -> tuple[ElementStep, ...] | None:
        """The element steps after the first operator, or ``None`` if one of them is not a Filter or Map."""
        after = self.pipeline[1:]
        steps = tuple(op.element_step for op in after if op.element_step is not None)
        return steps if len(steps) == len(after) else None


@dataclass(frozen=True)
class RunPlan:
    """A device runner's run as its batch modes take it (:meth:`DeviceRunner.plan()
    <streamflow.runners.device.DeviceRunner.plan>`; see the module docstring for an example)."""

    #: The job's name.
    job: str
    #: The trigger tasks by name, in the order they run.
    triggers: Mapping[str, TriggerTaskPlan]
    #: The stream tasks by name, in the order they run: their steps as the streaming run holds them.
    streams: Mapping[str, StreamTaskRun]
    #: The runner's timestamp guard, and whether it is the runner's default one (no guard was given).
    guard: TimestampGuard
    default_guard: bool
    #: What the run asks for that only streaming honours: checkpoints, a state TTL, a cap on users, the tunnel,
    #: latency recording.
    checkpoint_interval_s: float | None
    state_ttl_s: float | None
    max_users: int | None
    tunnel: bool
    record_latency: bool
    #: A task swap is pending or a safe-point hook watches the events.
    swaps_or_hooks: bool
    #: ``run_task(name, firing event, items)``: the task's rows as the streaming run makes them (its compiled
    #: pipeline), or the exception it raised.
    run_task: Callable[[str, Event, list[Any]], list[dict[str, Any]] | Exception]


class BatchHost(Protocol):
    """What a batch mode calls on the runner it runs for (:class:`~streamflow.runners.device.DeviceRunner` is one):
    the plan, the records in blocks, where counts, dead letters and rows go, and the streaming run's own steps
    (``process_block``, ``finish``: the rest of a file batch mode stops computing midway streams)."""

    summary: RunSummary
    storage: CollectiveStorage

    def plan(self) -> RunPlan: ...

    def blocks(self, records: Iterable[Event | Rejected] | LineSource | SourceReader,
               progress: Callable[[Iterable[Any]], Iterator[Any]] | None = None
               ) -> Iterator[list[Event | Rejected]]: ...

    def accepted(self, records: list[Event | Rejected]) -> list[Event]: ...

    def reject(self, record: Rejected) -> None: ...

    def process_block(self, records: list[Event | Rejected]) -> None: ...

    def finish(self) -> None: ...

    def write(self, table: str, rows: list[dict[str, Any]]) -> None: ...

    def count_stream(self, stream: StreamTaskRun, rows: int, sides: list[tuple[str, dict[str, Any]]]) -> None: ...

    def stream_failed(self, stream: StreamTaskRun, event: Event | None, exc: Exception) -> None: ...


__all__ = ["BatchHost", "RunPlan", "TriggerTaskPlan"]
