"""The device runner's checkpoints: when one is due, where it goes, what resumes from it, and SIGTERM/SIGINT.

A :class:`Checkpointer` stores a run's state in the storage's DuckDB file, in one transaction with the rows
buffered since the previous checkpoint (:mod:`streamflow.checkpoint`). One is due every ``interval_s`` seconds
and whenever the storage's buffers are due a flush (the storage holds its rows for the checkpoint and says
so); SIGTERM and SIGINT make one due at once, after which the run stops (:meth:`Checkpointer.stop_if_signalled`).
The runner checks between blocks (never in the middle of a record) and says what its state is: the
checkpointer does not know what is in it, only the source position it was taken at.

Example:
    >>> import os, tempfile
    >>> from connectors import CollectiveStorage
    >>> store = CollectiveStorage(os.path.join(tempfile.mkdtemp(), "f.duckdb"))
    >>> checkpoints = Checkpointer(store, 60.0)
    >>> checkpoints.due, checkpoints.taken
    (False, 0)
    >>> checkpoints.make_due(); checkpoints.due
    True
    >>> store.close()
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from streamflow.checkpoint import Checkpoint, CheckpointError, has_checkpoint, job_fingerprint, load_checkpoint
from streamflow.sources import LineSource

if TYPE_CHECKING:
    from connectors.storage import CollectiveStorage
    from streamflow.job import Job, Task
    from streamflow.sources import SourcePosition, SourceReader

log = logging.getLogger("streamflow.device")


class Checkpointer:
    """A run's checkpoints in ``storage``, every ``interval_s`` seconds (see the module docstring)."""

    def __init__(self, storage: CollectiveStorage, interval_s: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"checkpoint_interval_s must be > 0 seconds, got {interval_s!r}")
        self.storage = storage
        self.interval_s = interval_s
        #: Checkpoints stored so far.
        self.taken = 0
        #: The identity of the source the run reads (:meth:`~streamflow.sources.LineSource.identity`), set by
        #: :meth:`resume`: a checkpoint resumes only over the same input.
        self.input: dict[str, Any] = {}
        self._next = float("inf")  # monotonic time of the next checkpoint
        self._stop_signal: int | None = None

    @staticmethod
    def check_tasks(tasks: Iterable[Task]) -> None:
        """Refuse tasks whose operators keep state between firings (``Train``): checkpoints do not cover it."""
        stateful = [f"{task.name}: {type(op).__name__}" for task in tasks for op in task.pipeline
                    if getattr(op, "keeps_state", False)]
        if stateful:
            raise ValueError(f"checkpoints do not cover operators that keep state between firings "
                             f"({', '.join(stateful)}); run this job without checkpoints")

    def resume(self, job: Job, source: Iterable[Any] | LineSource,
               restore: Callable[[dict[str, Any]], None]) -> SourceReader:
        """Hand ``restore`` the state of ``job``'s checkpoint, if there is one, hold the storage's rows for the
        checkpoints, and return the source's reader from the checkpoint's position on (the start without one)."""
        if not isinstance(source, LineSource):
            raise TypeError("a checkpointed run reads a file source (streamflow.sources.open_source), whose "
                            f"position it can checkpoint, not a {type(source).__name__}")
        self.input = source.identity()
        saved = load_checkpoint(self.storage, job.name)
        position = None
        if saved is not None:
            saved.check(job, self.input, self.storage.path)
            restore(saved.state)
            position = saved.state["source"]
            log.info("job %s resumes from its checkpoint after line %d of %s", job.name, saved.line, source.name)
        self.storage.hold(self.make_due)
        self._next = time.monotonic() + self.interval_s
        return source.read(position)

    def save(self, job: Job, position: SourcePosition, state: dict[str, Any] | None, complete: bool = False) -> None:
        """Store ``state`` (the run's, at ``position``) with the rows buffered so far, in one transaction;
        ``complete``: the input's end (no state, the job is done)."""
        saved = Checkpoint(job.name, job_fingerprint(job), self.input, complete, position.line, state)
        self.storage.commit(saved.save)
        self.taken += 1
        log.debug("checkpoint %d of job %s after line %d%s", self.taken, job.name, position.line,
                  " (complete)" if complete else "")
        self._next = time.monotonic() + self.interval_s

    @property
    def due(self) -> bool:
        """Whether a checkpoint is due (its interval passed, the storage wants a flush, or a signal came)."""
        return time.monotonic() >= self._next

    def make_due(self) -> None:
        """Make a checkpoint due at the next check (the storage calls this when its buffers are due a flush)."""
        self._next = float("-inf")

    @contextmanager
    def signals(self) -> Iterator[None]:
        """Meanwhile SIGTERM and SIGINT make a checkpoint due and the run stop after it (from the main thread;
        elsewhere signals are left as they are)."""
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def stop_if_signalled(self, job: Job) -> None:
        """After a checkpoint: stop the run if a signal asked for it (KeyboardInterrupt for SIGINT, else SystemExit)."""
        if self._stop_signal is not None:
            log.info("job %s stopped by signal %d after a checkpoint", job.name, self._stop_signal)
            if self._stop_signal == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + self._stop_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        # Only flags: the checkpoint is taken between records, never in the middle of one.
        self._stop_signal = signum
        self.make_due()


def refuse_resumable(storage: CollectiveStorage, job: Job) -> None:
    """For a run without checkpoints: refuse a storage holding a checkpoint of ``job`` (a run would duplicate its
    rows)."""
    if has_checkpoint(storage, job.name):
        raise CheckpointError(f"{storage.path} holds a checkpoint of job {job.name!r}: resume it "
                              f"with checkpoints on (--checkpoint-interval), or start over with --replace")


__all__ = ["Checkpointer", "refuse_resumable"]
