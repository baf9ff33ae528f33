"""Models as stateful stream operators, on the embedded tensor engine.

:class:`Infer` runs a model over the rows that reach it (one batched run per firing) and adds its
output to each row. :class:`Train` trains a model on the rows that reach it, one optimizer step per
``batch_size`` rows, and emits one row per step (the training log). The model, the inference
session (plan and arena) and the optimizer state live in the operator; a runner gives every task
its own copy, so tasks never share weights by accident.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from operators.base import Group, Operator

if TYPE_CHECKING:  # the engine (numba kernels, BLAS set-up) is imported on first use, not with operators
    from engine import Graph
    from engine.autograd import SGD, Adam, GraphModel
    from engine.coldstart.session import ColdSession
    from engine.memory.budgeted import BudgetedSession
    from engine.session import InferenceSession
    from engine.training import BudgetedTrainer

Features = Callable[[Any], Sequence[float]]


def _rows(groups: list[Group], op: str) -> list[Mapping[str, Any]]:
    rows = [item for _, items in groups for item in items]
    for row in rows:
        if not isinstance(row, Mapping):
            raise TypeError(f"{op} works on rows (dicts); put it after an Aggregate or a Map, got {row!r}")
    return rows


class MemoryBudget:
    """A byte budget that every copy of the operators given it shares, changeable while a job runs
    (a runner deep-copies operators per task; this knob stays one object).

    Example:
        >>> budget = MemoryBudget("8MB"); budget.set("4MB"); budget.bytes
        4194304
        >>> import pickle; pickle.loads(pickle.dumps(budget)).bytes  # a job shipped to Flink is pickled
        4194304
    """

    def __init__(self, nbytes: int | str) -> None:
        self._lock = threading.Lock()
        self.set(nbytes)

    def set(self, nbytes: int | str) -> None:
        from engine.memory.budgeted import parse_bytes

        value = parse_bytes(nbytes)
        if value <= 0:
            raise ValueError(f"a memory budget must be positive, got {nbytes!r}")
        with self._lock:
            self._bytes = value

    @property
    def bytes(self) -> int:
        return self._bytes

    def __getstate__(self) -> dict[str, int]:  # the lock stays behind: a job shipped to Flink is pickled
        return {"bytes": self._bytes}

    def __setstate__(self, state: dict[str, int]) -> None:
        self._lock = threading.Lock()
        self._bytes = state["bytes"]

    def __deepcopy__(self, memo: dict[int, Any]) -> MemoryBudget:
        return self

    def __copy__(self) -> MemoryBudget:
        return self


class Infer(Operator):
    """Add a model's output for every row: ``row[into] = model(features(row))``.

    ``model`` is an engine :class:`~engine.Graph` or a model file (``engine.save_model``); its
    first input takes a ``(rows, features)`` float32 batch. ``output`` names the model output
    (default: the first). ``as_bytes=True`` stores the float32 vector as bytes (a compact encoding).
    The first firing runs the model's cold path (:class:`engine.coldstart.session.ColdSession`:
    cached optimised graph and weights, no numba on the critical path); later firings switch to the
    warm kernels once a background thread has prepared them. When that switch lands depends on timing,
    and cold and warm kernels round differently, so the outputs' last bits can differ between runs.
    ``reproducible=True`` computes every row with the same kernels (the warm engine from the first
    firing, which then pays numba's load, about a second): the same bytes on every run and on both runners.

    Example:
        >>> import numpy as np
        >>> from engine import GraphBuilder
        >>> from operators import run_pipeline
        >>> b = GraphBuilder()
        >>> b.output(b.linear(b.input("x", (None, 2)), np.eye(2, dtype="float32"), np.ones(2, "float32")))
        >>> run_pipeline([Infer(b.build(), features=lambda r: [r["a"], r["b"]], into="y")], [{"a": 1.0, "b": 2.0}])
        [{'a': 1.0, 'b': 2.0, 'y': [2.0, 3.0]}]
    """

    def __init__(self, model: Graph | str | os.PathLike[str], features: Features, into: str = "prediction",
                 output: str | None = None, as_bytes: bool = False, threads: int = 1,
                 memory_budget: int | str | MemoryBudget | None = None, reproducible: bool = False):
        self.model = model
        self.reproducible = reproducible
        self.memory_budget = (memory_budget if memory_budget is None or isinstance(memory_budget, MemoryBudget)
                              else MemoryBudget(memory_budget))
        self.features = features
        self.into = into
        self.output = output
        self.as_bytes = as_bytes
        self.threads = threads
        # built on first use: copies stay cheap
        self._session: ColdSession | InferenceSession | BudgetedSession | None = None
        self._streamable: str | None = None

    def apply(self, groups: list[Group]) -> list[Group]:
        rows = _rows(groups, "Infer")
        if not rows:
            return groups
        session = self._ensure_session()
        x = np.asarray([self.features(row) for row in rows], dtype=np.float32)
        y = session.run({session.input_names[0]: x})[self.output or session.output_names[0]]
        values = iter([v.astype(np.float32).tobytes() if self.as_bytes else v.tolist() for v in y])
        return [(key, [{**row, self.into: next(values)} for row in items]) for key, items in groups]


    def _ensure_session(self) -> ColdSession | InferenceSession | BudgetedSession:
        if self.memory_budget is not None:
            return self._budgeted(self.memory_budget.bytes)
        if self._session is None and self.reproducible:
            from engine.session import InferenceSession

            self._session = InferenceSession(self.model, threads=self.threads)
        if self._session is None:  # the first firing takes the cold path, then warm kernels in the background
            from engine.coldstart.session import ColdSession

            self._session = ColdSession(self.model, threads=self.threads)
        return self._session

    def _budgeted(self, budget: int) -> BudgetedSession:
        from engine.memory.budgeted import BudgetedSession
        from engine.memory.streamable import save_streamable

        if self._session is None:
            if self._streamable is None:  # weights are streamed from a file laid out for it
                fd, self._streamable = tempfile.mkstemp(suffix=".sfe")
                os.close(fd)
                save_streamable(self.model, self._streamable)
            self._session = BudgetedSession(self._streamable, budget, threads=self.threads)
        session = self._session
        assert isinstance(session, BudgetedSession)  # an Infer with a memory budget only ever makes this one
        if session.budget != budget:
            session.set_budget(budget)
        return session


class Train(Operator):
    """Train a model on the rows that reach it; emit ``{"step", "loss", "examples"}`` per step.

    Rows are buffered; each time ``batch_size`` rows are in, one step of ``optimizer`` (``"adam"``
    or ``"sgd"``) runs on them with ``loss`` (``"cross_entropy"`` on integer ``label``s, or
    ``"mse"`` on vector ones). :meth:`export` gives the trained model as an inference graph, e.g.
    for :class:`Infer` or ``engine.save_model``.

    ``memory_budget`` (bytes) runs each step as a static program fitted to that budget
    (``engine.training``: micro-batches for models without BatchNorm, recomputation, a lifetime-aware
    arena); the math is unchanged. The budget changes while the job runs with :meth:`set_budget` or
    a control row: ``budget_control(row)`` returning bytes makes that row a budget change (taking
    effect at the next step) instead of a training example.

    Example:
        >>> import numpy as np
        >>> from engine import GraphBuilder
        >>> from operators import run_pipeline
        >>> b = GraphBuilder()
        >>> b.output(b.linear(b.input("x", (None, 1)), np.zeros((1, 2), "float32"), np.zeros(2, "float32")))
        >>> train = Train(b.build(), features=lambda r: [r["x"]], label=lambda r: int(r["x"] > 0), batch_size=2)
        >>> [round(r["loss"], 3) for r in run_pipeline([train], [{"x": 1.0}, {"x": -1.0}])]
        [0.693]
    """

    keeps_state = True  # the weights, the optimiser and the rows of the batch being filled

    def __init__(self, model: Graph | str | os.PathLike[str], features: Features, label: Callable[[Any], Any],
                 loss: str = "cross_entropy", optimizer: str = "adam", lr: float = 0.01, momentum: float = 0.0,
                 batch_size: int = 32, output: str | None = None, memory_budget: int | None = None,
                 budget_control: Callable[[Any], int | None] | None = None):
        if loss not in ("cross_entropy", "mse"):
            raise ValueError(f"loss must be 'cross_entropy' or 'mse', got {loss!r}")
        if optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.features = features
        self.label = label
        self.loss = loss
        self.optimizer = optimizer
        self.lr = lr
        self.momentum = momentum
        self.batch_size = batch_size
        self.output = output
        self.memory_budget = memory_budget
        self.budget_control = budget_control
        self._trainer: BudgetedTrainer | None = None
        self.steps = 0
        self._graph_model: GraphModel | None = None
        self._opt: SGD | Adam | None = None
        self._x: list[Sequence[float]] = []
        self._y: list[Any] = []

    def _ensure_model(self) -> GraphModel:
        if self._graph_model is None:
            from engine.autograd import SGD, Adam, GraphModel
            from engine.session import load_graph

            self._graph_model = GraphModel(load_graph(self.model))
            params = self._graph_model.parameters()
            self._opt = (Adam(params, lr=self.lr) if self.optimizer == "adam"
                         else SGD(params, lr=self.lr, momentum=self.momentum))
        return self._graph_model

    def set_budget(self, memory_budget: int | None) -> None:
        """Change the memory budget (bytes, or None for unbudgeted) from the next step on."""
        self.memory_budget = memory_budget
        if self._trainer is not None:
            self._trainer.set_budget(memory_budget)

    def apply(self, groups: list[Group]) -> list[Group]:
        log = []
        for row in _rows(groups, "Train"):
            budget = self.budget_control(row) if self.budget_control is not None else None
            if budget is not None:
                self.set_budget(int(budget))
                continue
            self._x.append(self.features(row))
            self._y.append(self.label(row))
            if len(self._x) >= self.batch_size:
                log.append(self._step())
        return [({}, log)]

    def _step(self) -> dict[str, Any]:
        model = self._ensure_model()
        from engine.autograd import cross_entropy, mse

        x = np.asarray(self._x, dtype=np.float32)
        if self.memory_budget is not None or self._trainer is not None:
            return self._budgeted_step(model, x)
        out = model(x)[self.output or model.graph.outputs[0]]
        if self.loss == "cross_entropy":
            loss = cross_entropy(out, np.asarray(self._y, dtype=np.int64))
        else:
            loss = mse(out, np.asarray(self._y, dtype=np.float32))
        assert self._opt is not None
        self._opt.zero_grad()
        loss.backward()
        self._opt.step()
        self.steps += 1
        self._x, self._y = [], []
        return {"step": self.steps, "loss": float(loss.data), "examples": len(x)}

    def _budgeted_step(self, model: GraphModel, x: NDArray[Any]) -> dict[str, Any]:
        if self._trainer is None:
            from engine.training import BudgetedTrainer

            if self.output not in (None, model.graph.outputs[0]) or len(model.graph.outputs) != 1:
                raise ValueError("a memory budget needs a model with one output (the one trained)")

            assert self._opt is not None
            self._trainer = BudgetedTrainer(model, self._opt, loss=self.loss, memory_budget=self.memory_budget)
        target = np.asarray(self._y, dtype=np.int64 if self.loss == "cross_entropy" else np.float32)
        loss = self._trainer.step(x, target)
        self.steps += 1
        self._x, self._y = [], []
        return {"step": self.steps, "loss": loss, "examples": len(x)}

    def export(self) -> Graph:
        """The model with its trained weights, as an inference graph."""
        return self._ensure_model().to_graph()
