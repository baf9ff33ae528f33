"""Stream operators shared by every runner: written once, unaware of who executes them.

Example:
    >>> from operators import Aggregate, Count, Filter, KeyBy, run_pipeline
    >>> run_pipeline([Filter(lambda r: r["ok"]), KeyBy("k"), Aggregate(n=Count())],
    ...              [{"k": 1, "ok": True}, {"k": 1, "ok": False}])
    [{'k': 1, 'n': 1}]
"""

from operators.aggregate import Aggregate
from operators.aggregations import (
    Aggregation,
    Count,
    CountBy,
    CountDistinct,
    Distinct,
    First,
    Last,
    LastN,
    Max,
    Min,
    Sum,
)
from operators.base import ElementStep, Group, Operator, get_field, run_pipeline
from operators.filter import Filter
from operators.keyby import KeyBy
from operators.map import Map
from operators.model import Infer, MemoryBudget, Train
from operators.process import (
    KeyedProcessFunction,
    ListStateDescriptor,
    MapStateDescriptor,
    Process,
    ValueStateDescriptor,
)
from operators.serve import Serve
from operators.window import CountWindow, SessionWindow, TimeWindow, window_starts

__all__ = [
    "Aggregate", "Aggregation", "Count", "CountBy", "CountDistinct", "CountWindow", "Distinct", "ElementStep", "Filter",
    "First",
    "Group", "Infer", "KeyBy", "KeyedProcessFunction", "Last", "LastN", "ListStateDescriptor", "Map",
    "MapStateDescriptor", "Max", "MemoryBudget", "Min", "Operator", "Process", "Serve", "SessionWindow", "Sum",
    "TimeWindow", "Train", "ValueStateDescriptor", "get_field", "run_pipeline", "window_starts",
]
