"""Models in a job under the engine's budgets: inference in a byte budget that changes while the job runs,
training in one, and a fast cold start.

Three tasks fire on every item-page exit, each on top of the IPV feature of ``jobs/ipv.py``:

- ``scored``: ``Infer`` with no budget. Its first firing takes the engine's cold path (the optimised graph and
  weights cached on disk, no JIT on the critical path); the warm kernels take over once a background thread
  has them ready.
- ``scored_budgeted``: the same model under a byte budget (``Infer(memory_budget=BUDGET)``): its weights are
  streamed from a file, layers sliced to fit, so the model runs in less memory than its weights take.
  ``BUDGET`` is one ``MemoryBudget`` shared by every copy of the operator; ``BUDGET.set(...)`` from anywhere
  (an app's memory-pressure callback, another thread) takes effect at the next firing. Here the job itself
  lowers it once it has scored ``SWITCH_AFTER`` visits, to show the change mid-run.
- ``purchase_budgeted``: ``Train`` under a byte budget (micro-batches, recomputation, one planned arena;
  the math unchanged), one Adam step per 64 visits, a row per step. A budget too small for a batch is a
  task error naming the smallest budget that fits.

Run it:  streamflow run jobs/models.py --events jobs/data/taobao_user_behavior_10k.csv --db out/models.duckdb
"""

import math
from pathlib import Path

import numpy as np

from engine import GraphBuilder
from operators import Infer, Map, MemoryBudget, Train
from streamflow import Job, Task, load_job

IPV = load_job(Path(__file__).with_name("ipv.py")).tasks[0]
N_FEATURES = 8
WIDTH = 1024  # a 1024 x 1024 hidden layer: 4 MiB of weights, more than the budget leaves for them
BUDGET = MemoryBudget("16MB")
LOWER_BUDGET = "12MB"
SWITCH_AFTER = 5_000


def features(row: dict) -> list[float]:
    """The IPV row as numbers (without ``n_buy``, the purchase model's label)."""
    day = 2 * math.pi * (row["enter_ts"] % 86_400) / 86_400
    return [math.log1p(row["dwell_s"]), math.log1p(row["n_reload"]), row["n_fav"], row["n_cart"],
            math.sin(day), math.cos(day), float(row["dwell_s"] == 0), (int(row["category_id"]) % 97) / 97]


def mlp(seed: int, width: int = WIDTH):
    """8 features -> width -> width -> 2, seeded."""
    rng = np.random.default_rng(seed)
    b = GraphBuilder(f"mlp_{width}")
    h = b.relu(b.linear(b.input("ipv", (None, N_FEATURES)),
                        rng.standard_normal((N_FEATURES, width), dtype=np.float32) * 0.3, np.zeros(width, np.float32)))
    h = b.relu(b.linear(h, rng.standard_normal((width, width), dtype=np.float32) / math.sqrt(width),
                        np.zeros(width, np.float32)))
    b.output(b.linear(h, rng.standard_normal((width, 2), dtype=np.float32) * 0.1, np.zeros(2, np.float32)))
    return b.build()


class LowerBudgetAfter:
    """A pipeline step that passes rows through and lowers ``BUDGET`` once it has seen ``n`` of them."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.seen = 0

    def __call__(self, row: dict) -> dict:
        self.seen += 1
        if self.seen == self.n:
            BUDGET.set(LOWER_BUDGET)
        return {**row, "budget_bytes": BUDGET.bytes}


def decision(row: dict) -> dict:
    """The model's answer for the visit. The score itself is not stored: the cold and the warm kernels, and a
    budget's sliced layers, round its last bits differently (the answer is the same)."""
    return {"item_id": row["item_id"], "buy_likely": row["score"][1] > row["score"][0],
            **({"budget_bytes": row["budget_bytes"]} if "budget_bytes" in row else {})}


MODEL = mlp(seed=0)

scored = Task("scored", trigger=IPV.trigger, input="page", pipeline=[
    *IPV.pipeline, Infer(MODEL, features=features, into="score"), Map(decision)])

scored_budgeted = Task("scored_budgeted", trigger=IPV.trigger, input="page", pipeline=[
    *IPV.pipeline, Map(LowerBudgetAfter(SWITCH_AFTER)),
    Infer(MODEL, features=features, into="score", memory_budget=BUDGET), Map(decision)])

purchase_budgeted = Task("purchase_budgeted", trigger=IPV.trigger, input="page", pipeline=[
    *IPV.pipeline,
    Train(mlp(seed=1, width=256), features=features, label=lambda row: int(row["n_buy"] > 0), batch_size=64,
          lr=0.001, memory_budget=8_000_000)])

job = Job("models", [scored, scored_budgeted, purchase_budgeted],
          description="inference in a live byte budget, training in one, a cold start")
