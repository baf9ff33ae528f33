"""Fit a training step into a memory budget: micro-batches (models without BatchNorm), then
calibrated progressive recomputation (Melon), re-planning after every choice.

While the live peak (then the planned arena) is over the budget, the node whose saved state is live
at the peak step with the best ``(bytes freed x steps freed) / recompute seconds`` is dropped and
recomputed in the backward pass. If nothing more helps, :class:`BudgetError` names the smallest
budget the search reached.
"""

from __future__ import annotations

import numpy as np

from engine.training.program import NodeCost, Program, StepPlan, plan_program

HEADROOM = 0.1  # of the budget, for what the calibration does not see (allocator rounding, small temporaries)


class BudgetError(ValueError):
    """The step cannot fit the budget; ``smallest`` is the least total bytes any plan reached."""

    def __init__(self, message: str, smallest: int) -> None:
        super().__init__(message)
        self.smallest = smallest


def live_profile(plan_buffers, steps: int) -> np.ndarray:
    """Bytes live at every step (the lower bound for any placement)."""
    diff = np.zeros(steps + 2, np.int64)
    for b in plan_buffers:
        diff[b.start] += b.size
        diff[b.end + 1] -= b.size
    return np.cumsum(diff)[:-1]


def fit_recompute(prog: Program, batch: int, budget: int, micro_batches: int, state_bytes: int,
                  update_bytes: int) -> StepPlan:
    """The plan at ``batch`` with the fewest recomputations (chosen greedily) that fits ``budget``."""
    nodes, costs = prog.cal.nodes, prog.cal.costs
    n = len(nodes)
    m = -(-batch // micro_batches)
    dropped: set[int] = set()
    producer = {node.outputs[0]: i for i, node in enumerate(nodes)}
    consumers: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for t in dict.fromkeys(node.inputs):
            consumers.setdefault(t, []).append(i)

    def size_of(t: str) -> int:
        i = producer.get(t)
        return NodeCost.at(costs[i].out_bytes, m) if i is not None else 0

    best: tuple[int, frozenset[int]] | None = None
    refused: set[int] = set()  # dropping them did not lower the peak
    last_peak: int | None = None
    last_drop = -1
    for _ in range(2 * n + 2):
        plan = plan_program(prog, batch, frozenset(dropped), micro_batches, state_bytes, update_bytes, arena=False)
        live = live_profile(plan.buffers, 2 * n + 1)
        peak = int(live.max()) + plan.pinned_bytes
        if last_peak is not None and peak > last_peak:
            dropped.discard(last_drop)
            refused.add(last_drop)
            plan = plan_program(prog, batch, frozenset(dropped), micro_batches, state_bytes, update_bytes,
                                arena=False)
            live = live_profile(plan.buffers, 2 * n + 1)
            peak = int(live.max()) + plan.pinned_bytes
        last_peak = peak
        if best is None or peak < best[0]:
            best = (peak, frozenset(dropped))
        if peak <= budget:
            full = plan_program(prog, batch, frozenset(dropped), micro_batches, state_bytes, update_bytes)
            if full.total_bytes <= budget:
                return full
        at = int(live.argmax())
        scored = []
        for i, c in enumerate(costs):
            if i in dropped or i in refused or not i <= at < 2 * n - i:  # its state must be freed across the peak
                continue
            freed = NodeCost.at(c.context_bytes, m) + (NodeCost.at(c.out_bytes, m) if c.keeps_output else 0)
            for t in c.keeps_inputs:  # an input only it keeps for its backward is freed after the forward
                if all(j == i or j in dropped or t not in costs[j].keeps_inputs for j in consumers.get(t, ())):
                    freed += size_of(t)
            if freed <= 0:
                continue
            seconds = max(c.forward_s[0] + c.forward_s[1] * m, 1e-6)
            scored.append((freed * (2 * n - 2 * i) / seconds, i))
        if not scored:
            break
        last_drop = max(scored)[1]
        dropped.add(last_drop)
    assert best is not None
    smallest = plan_program(prog, batch, best[1], micro_batches, state_bytes, update_bytes).total_bytes
    raise BudgetError(f"batch {batch} ({micro_batches} micro-batch(es)) does not fit {budget} bytes: the smallest "
                      f"plan found needs {smallest} bytes ({len(best[1])} node(s) recomputed)", smallest)


def fit(prog: Program, batch: int, budget: int | None, state_bytes: int, update_bytes: int,
        micro_batches: int | None = None) -> StepPlan:
    """Micro-batches first (without BatchNorm: k = 1, 2, 4, ...), recomputation within each."""
    if micro_batches is not None and micro_batches > 1 and prog.has_batchnorm:
        raise ValueError("micro-batching is refused for a model with BatchNorm: its batch statistics (and the "
                         "running mean/variance) would be computed per micro-batch and change the result")
    if budget is None:
        return plan_program(prog, batch, frozenset(), micro_batches or 1, state_bytes, update_bytes)
    budget = int(budget * (1 - HEADROOM))
    choices = [micro_batches] if micro_batches else [1] if prog.has_batchnorm else \
        [k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256) if k <= batch]
    error: BudgetError | None = None
    for k in choices:
        try:
            return fit_recompute(prog, batch, budget, k, state_bytes, update_bytes)
        except BudgetError as e:
            if error is None or e.smallest < error.smallest:
                error = e
    assert error is not None
    why = "" if len(choices) > 1 else (" (micro-batching is off: the model has BatchNorm)"
                                       if prog.has_batchnorm else "")
    smallest = -(-error.smallest * 10 // 9)  # what the plan needs, plus the headroom
    raise BudgetError(f"batch {batch} does not fit a {int(budget / (1 - HEADROOM))}-byte budget{why}; the smallest "
                      f"feasible budget found is {smallest} bytes", smallest)
