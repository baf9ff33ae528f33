"""Training under a memory budget (Melon): a static step program, a lifetime-aware pool,
micro-batches and calibrated recomputation, with plans cached per budget."""

from engine.training.budget import BudgetError, fit
from engine.training.pool import plan_pool
from engine.training.program import Program, StepPlan
from engine.training.trainer import BudgetedTrainer

__all__ = ["BudgetError", "BudgetedTrainer", "Program", "StepPlan", "fit", "plan_pool"]
