"""A trainer whose steps follow a static program fitted to a memory budget that may change while
training runs: plans are cached per (batch, budget), so a change costs a lookup (or one planning)
and takes effect at the next step; the math does not depend on the budget."""

from __future__ import annotations

import numpy as np

from engine.autograd.graph import GraphModel
from engine.autograd.optim import Optimizer
from engine.training.budget import fit
from engine.training.calibrate import Calibration
from engine.training.program import Program, StepPlan


class BudgetedTrainer:
    """One optimizer step per :meth:`step`, within ``memory_budget`` bytes (None: unbudgeted).

    >>> trainer = BudgetedTrainer(GraphModel(graph), SGD(params, lr=0.1), memory_budget=64 << 20)  # doctest: +SKIP
    >>> loss = trainer.step(x, labels); trainer.set_budget(32 << 20); trainer.step(x, labels)     # doctest: +SKIP
    """

    def __init__(self, model: GraphModel, optimizer: Optimizer, loss: str = "cross_entropy",
                 memory_budget: int | None = None, micro_batches: int | None = None,
                 calibration: Calibration | None = None) -> None:
        self.model, self.optimizer, self.loss = model, optimizer, loss
        self.budget = memory_budget
        self.micro_batches = micro_batches
        self.program: Program | None = None
        self.plans: dict[tuple[int, int | None], StepPlan] = {}
        self.last_plan: StepPlan | None = None
        self.calibration = calibration  # of the same graph and loss (e.g. another trainer's): not measured again

    def _program(self, sample_shape: tuple[int, ...]) -> Program:
        if self.program is None:
            if self.micro_batches and self.micro_batches > 1 and any(
                    n.op == "BatchNormalization" for n in self.model.graph.nodes):
                fit_error = ("micro-batching is refused for a model with BatchNorm: its batch statistics (and "
                             "the running mean/variance) would be computed per micro-batch and change the result")
                raise ValueError(fit_error)
            self.program = Program(self.model, self.loss, sample_shape, self.calibration)
        elif self.program.sample_shape != tuple(sample_shape):
            raise ValueError(f"rows of shape {tuple(sample_shape)}; this trainer's program is for "
                             f"{self.program.sample_shape}")
        return self.program

    def set_budget(self, budget: int | None) -> None:
        """Takes effect at the next step (plans for a budget already seen are reused)."""
        if budget is not None and budget <= 0:
            raise ValueError(f"memory budget must be positive bytes or None, got {budget}")
        self.budget = budget

    def plan_for(self, batch: int, sample_shape: tuple[int, ...], budget: int | None = None) -> StepPlan:
        """The (cached) plan for ``batch`` rows under ``budget`` (default: the current budget)."""
        budget = self.budget if budget is None else budget
        key = (batch, budget)
        if key not in self.plans:
            prog = self._program(sample_shape)
            self.plans[key] = fit(prog, batch, budget, self.optimizer.state_bytes(), self.optimizer.scratch_bytes(),
                                  self.micro_batches)
        return self.plans[key]

    def prepare(self, batch: int, sample_shape: tuple[int, ...], budgets: list[int]) -> None:
        """Plan a ladder of budgets ahead, so that switching between them costs a lookup."""
        for b in budgets:
            self.plan_for(batch, sample_shape, b)

    def step(self, x: np.ndarray, target: np.ndarray) -> float:
        """Forward, backward and update on ``(x, target)`` under the current budget; returns the loss."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        plan = self.plan_for(len(x), x.shape[1:])
        self.last_plan = plan
        assert self.program is not None
        return self.program.run(plan, x, np.asarray(target), self.optimizer)
