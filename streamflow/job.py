"""The job API: a job is a set of tasks; a task is a trigger condition plus a pipeline.

Example:
    >>> from operators import Aggregate, Count
    >>> job = Job("demo")
    >>> task = job.task("buys_on_page", trigger=["item"], input="page",
    ...                 pipeline=[Aggregate(buys=Count(where=lambda e: e.event_id == "buy"))])
    >>> [t.name for t in job.tasks]
    ['buys_on_page']

A job file is a Python module that defines ``job = Job(...)``; :func:`load_job` loads it.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import traceback
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from operators import Operator, Process, TimeWindow
from streamflow.trie import normalize_condition
from streamflow.windowing import StreamPlan

TaskInput = Literal["page", "recent", "pages", "stream"]
TASK_INPUTS: tuple[str, ...] = ("page", "recent", "pages", "stream")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


@dataclass(init=False)
class Task:
    """A trigger condition and the pipeline it runs over the user's recent events.

    ``input`` says what the pipeline receives when the trigger fires:

    - ``"page"``: the events of the current page visit up to the triggering event (for a page-exit
      trigger, the whole visit from enter to exit);
    - ``"recent"``: the user's time-level sequence, the last ``history_events`` events no older
      than ``history_s`` seconds before the trigger;
    - ``"pages"``: the user's page-level sequence (:class:`~streamflow.sequences.PageVisit` items),
      bounded the same way;
    - ``"stream"``: no trigger; the pipeline runs continuously over every event, closing event-time
      windows as the watermark passes them (see :mod:`streamflow.windowing` for its shape and
      semantics).

    The rows the pipeline returns are written to table ``sink`` (default: the task's name): a trigger
    task's with the ``user_id`` and the triggering event's ``trigger_ts`` in front; a stream task's as its
    keyed step makes them (a window's: the key, ``window_start``, ``window_end`` (not for a count window)
    and the aggregates; a ``Process``'s: what it emits), through the steps after it. When the runner has a
    tunnel (``streamflow run --tunnel kafka``) they are also shipped to the cloud, unless
    ``tunnel=False`` keeps them on the device.

    ``columns`` (optional) declares the task's output row, in order: column name -> type, one of
    ``"string"``, ``"bigint"``, ``"double"``, ``"boolean"`` (see :data:`COLUMN_TYPES`). The names are the full
    row the task writes: a trigger task's include ``user_id`` (``"string"``) and ``trigger_ts``
    (``"double"``). A sink that needs a fixed schema when the job is built (the Flink runner's
    ``--sink parquet:DIR``) requires it of every shipped task (``tunnel=True``); a row that does not fit it
    (a missing or extra key, a value of another type; an int widens to ``"double"`` when a double holds it
    exactly, nothing else converts) is a dead letter there. Other sinks ignore it.

    Example:
        >>> from operators import Aggregate, Count
        >>> task = Task("buys", ["item"], [Aggregate(n=Count())],
        ...             columns={"user_id": "string", "trigger_ts": "double", "n": "bigint"})
        >>> list(task.columns)
        ['user_id', 'trigger_ts', 'n']
        >>> Task("buys", ["item"], [Aggregate(n=Count())], columns={"user_id": "string", "n": "int"})
        Traceback (most recent call last):
        ...
        ValueError: task 'buys': column 'n' has type 'int'; expected one of string, bigint, double, boolean
    """

    # Once made, a task's trigger is a normalized condition (``()`` for a stream task) and its sink a table
    # name; ``None`` for either is only what the constructor takes.
    name: str
    trigger: Sequence[str]
    pipeline: Sequence[Operator]
    input: TaskInput = "page"
    history_s: float | None = None
    history_events: int = 256
    sink: str = ""
    tunnel: bool = True
    columns: dict[str, str] | None = None

    def __init__(self, name: str, trigger: Sequence[str] | None, pipeline: Sequence[Operator],
                 input: TaskInput = "page", history_s: float | None = None, history_events: int = 256,
                 sink: str | None = None, tunnel: bool = True, columns: Mapping[str, str] | None = None) -> None:
        self.name, self.pipeline, self.input, self.history_s = name, pipeline, input, history_s
        self.history_events, self.tunnel = history_events, tunnel
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"task name {self.name!r} must be letters, digits and underscores")
        if self.input not in TASK_INPUTS:
            raise ValueError(f"task {self.name!r}: input must be one of {', '.join(TASK_INPUTS)}, got {self.input!r}")
        self.pipeline = list(self.pipeline)
        for op in self.pipeline:
            if not isinstance(op, Operator):
                raise TypeError(f"task {self.name!r}: pipeline step {op!r} is not an operator "
                                "(KeyBy, TimeWindow, Filter, Map, Aggregate, ...)")
        if self.input == "stream":
            if trigger:
                raise ValueError(f"stream task {self.name!r} runs over every event: it takes no trigger")
            self.trigger = ()
            StreamPlan.of(self.name, self.pipeline)
        else:
            self.trigger = normalize_condition(trigger or ())
            _refuse_stream_only_options(self.name, self.pipeline)
        if self.history_events < 1:
            raise ValueError(f"task {self.name!r}: history_events must be >= 1")
        self.sink = sink or self.name
        if not _NAME.match(self.sink):
            raise ValueError(f"task {self.name!r}: sink {self.sink!r} must be letters, digits and underscores")
        self.columns = None if columns is None else _checked_columns(self.name, self.input, columns)


#: The column types a task's ``columns`` may declare.
COLUMN_TYPES: tuple[str, ...] = ("string", "bigint", "double", "boolean")
#: The columns a trigger task's rows start with, and their types.
TRIGGER_COLUMNS: dict[str, str] = {"user_id": "string", "trigger_ts": "double"}


def _checked_columns(task: str, input: str, columns: Mapping[str, str]) -> dict[str, str]:
    """A task's declared ``columns`` as a dict, or ``ValueError`` naming the task and what is wrong."""
    if not isinstance(columns, Mapping) or not columns:
        raise ValueError(f"task {task!r}: columns must be a non-empty mapping of column name to type "
                         f"({', '.join(COLUMN_TYPES)}), got {columns!r}")
    for name, kind in columns.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"task {task!r}: column name {name!r} must be letters, digits and underscores")
        if kind not in COLUMN_TYPES:
            raise ValueError(f"task {task!r}: column {name!r} has type {kind!r}; expected one of "
                             f"{', '.join(COLUMN_TYPES)}")
    if input != "stream":
        for name, kind in TRIGGER_COLUMNS.items():
            if columns.get(name) != kind:
                raise ValueError(f"task {task!r}: a trigger task's rows carry user_id and trigger_ts: columns "
                                 f"must declare {name!r} as {kind!r}, got {columns.get(name)!r}")
    return dict(columns)


def _refuse_stream_only_options(task: str, pipeline: list[Operator]) -> None:
    """A trigger task's pipeline has no watermark: refuse what would be silently ignored or cannot run there."""
    for op in pipeline:
        if isinstance(op, Process):
            raise TypeError(f"task {task!r}: Process keeps state across events and fires timers, so it runs in a "
                            "stream task (input='stream'), not over a trigger task's finite list")
        if not isinstance(op, TimeWindow):
            continue
        for option in ("allowed_lateness", "out_of_orderness"):
            if getattr(op, option):
                raise ValueError(
                    f"task {task!r}: TimeWindow({option}={getattr(op, option)}) has no effect in a trigger task: "
                    "its pipeline runs over a finite sequence once per firing, so there is no watermark and "
                    "nothing is late; drop the option, or make it a stream task (input=\"stream\") where "
                    "windows close as event time passes")



class Job:
    """A named set of tasks, the unit a runner executes.

    Example:
        >>> from operators import Aggregate, Count
        >>> Job("j", [Task("t", ["fav"], [Aggregate(n=Count())])]).task_names()
        ['t']
    """

    def __init__(self, name: str, tasks: Sequence[Task] = (), description: str = ""):
        self.name = name
        self.description = description
        self.tasks: list[Task] = []
        #: The module a job file was loaded as (set by :func:`load_job`); a distributed runner ships
        #: it by value, since the workers cannot import it by name.
        self.module: str | None = None
        for task in tasks:
            self.add(task)

    def add(self, task: Task) -> Task:
        if any(t.name == task.name for t in self.tasks):
            raise ValueError(f"job {self.name!r} already has a task named {task.name!r}")
        self.tasks.append(task)
        return task

    def task(self, name: str, trigger: Sequence[str] | None, pipeline: Sequence[Operator], **options: Any) -> Task:
        """Define and add a task; see :class:`Task` for ``options``."""
        return self.add(Task(name, trigger, pipeline, **options))

    def task_names(self) -> list[str]:
        return [t.name for t in self.tasks]

    @property
    def trigger_tasks(self) -> list[Task]:
        return [t for t in self.tasks if t.input != "stream"]

    @property
    def stream_tasks(self) -> list[Task]:
        return [t for t in self.tasks if t.input == "stream"]


class JobLoadError(Exception):
    """A job file that cannot be loaded; the message says which file and why."""


def load_job(path: str | Path, module_name: str | None = None, source: bytes | None = None,
             namespace: Mapping[str, object] | None = None) -> Job:
    """Execute a job file and return the :class:`Job` it defines (as ``job``, or its only Job).

    A job file is the user's own code, run as any Python script they run is. It is imported as
    ``module_name`` (default: ``streamflow_job_<file stem>``; a deployed bundle gives each version
    a name of its own, so two versions of a job live side by side).

    With ``source``, those bytes are compiled and run as the module (``__file__`` is ``path``, which
    is not read): what a deployed bundle verified is exactly what runs, and no bytecode is written.
    ``namespace``: names set in the module before it runs (a bundle's verified files, ``__bundle__``).
    """
    path = Path(path)
    if source is None and not path.is_file():
        raise JobLoadError(f"job file not found: {path}")
    module_name = module_name or f"streamflow_job_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}"
    loader = None
    if source is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise JobLoadError(f"cannot load {path}: not a Python file")
        loader = spec.loader
        module = importlib.util.module_from_spec(spec)
    else:
        module = types.ModuleType(module_name)
        module.__file__ = str(path)
    vars(module).update(namespace or {})
    sys.modules[module_name] = module
    try:
        if source is not None:
            exec(compile(source, str(path), "exec", dont_inherit=True), module.__dict__)
        elif loader is not None:
            loader.exec_module(module)
    except SyntaxError as exc:
        raise JobLoadError(f"cannot load job file {path}: syntax error at line {exc.lineno}: {exc.msg}") from exc
    except (Exception, SystemExit) as exc:  # a job file calling sys.exit() is a load error too
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(path)]
        where = f" at line {frames[-1].lineno}" if frames else ""
        raise JobLoadError(f"cannot load job file {path}: {type(exc).__name__}{where}: {exc}") from exc
    job = getattr(module, "job", None)
    if not isinstance(job, Job):
        jobs = [v for v in vars(module).values() if isinstance(v, Job)]
        if len(jobs) != 1:
            raise JobLoadError(f"job file {path} must define `job = Job(...)` "
                               f"(found {len(jobs)} Job objects)")
        job = jobs[0]
    job.module = module_name
    return job
