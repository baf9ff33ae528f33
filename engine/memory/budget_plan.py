"""Preload-aware planning of one inference inside a byte budget (FlexNN's time x offset plan).

The timeline is a list of compute *units*: one per computing step of an
:class:`~engine.plan.ExecutionPlan`, or one per slice of a sliced step (a Conv split along its
output channels, a ``transB`` Gemm along its output features, each slice writing its rows of the
output in place). Every streamed weight (or weight slice) a unit needs is a *load*; the loader
performs loads in order, each into a range of the one arena of exactly ``budget`` bytes:

    [ activations + scratch (offsets from plan_arena) ...   weight slices ...   pinned weights ]
    0                                                                                       budget

Activations keep their ``plan_arena`` offsets at the low end; small weights stay resident at the
top ("pinned"); loads go in between, each placed as high as possible and started as early as
memory allows: a load may start at unit ``t`` (once units before ``t`` are done) if its range is
free of every activation live from ``t`` to its use and of every load in flight then. If a plan
does not fit, slices get finer; if no preloading plan fits, every load waits for its own unit
(no preload); if even that fails, :class:`BudgetError` names the smallest feasible budget.

>>> bp = plan_budget(exec_plan, streamed, pinned_bytes, 8 << 20, load_bps=2e9)  # doctest: +SKIP
>>> print(bp.table())                                                           # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from engine.ir import GraphError
from engine.plan import ExecutionPlan, StepPlan

ALIGN = 64
MIN_SLICE_BYTES = 32 * 1024  # finer slices cost more in per-call overhead than they save
LOOKAHEAD = 12  # a load starts at most this many units before its use (bounds planning time)


class BudgetError(GraphError):
    """No plan fits the budget; ``smallest`` is the smallest budget (bytes) that would."""

    def __init__(self, message: str, smallest: int) -> None:
        super().__init__(message)
        self.smallest = smallest


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class Load:
    """Read ``rows`` of ``weight`` (None: all of it) into ``[offset, offset + nbytes)``; the
    loader may start once units ``< start_unit`` are done; unit ``unit`` computes with it."""

    weight: str
    rows: tuple[int, int] | None
    nbytes: int
    unit: int
    start_unit: int = -1
    offset: int = -1


@dataclass
class Unit:
    """One kernel call: step ``step`` of the execution plan, its output rows ``rows`` (None: all)."""

    step: int
    rows: tuple[int, int] | None
    parts: int
    loads: list[int] = field(default_factory=list)
    expected_s: float = 0.0


@dataclass
class BudgetPlan:
    """A complete budgeted plan: units, loads with offsets and start units, expected timing."""

    budget: int
    exec_plan: ExecutionPlan
    units: list[Unit]
    loads: list[Load]
    pinned_offsets: dict[str, int]
    pinned_bytes: int
    act_top: list[int]  # per unit: the top of the activations live then
    preload: bool
    slice_bytes: float  # the slice size cap used (inf: no slicing)
    expected_s: float
    compute_s: float
    load_s: float
    load_bps: float

    @property
    def sliced_steps(self) -> int:
        return len({u.step for u in self.units if u.parts > 1})

    def peak_bytes(self) -> int:
        """The plan's own accounting: max over units of live activations + loads in flight + pinned."""
        live = list(self.act_top)
        for ld in self.loads:
            for u in range(ld.start_unit, ld.unit + 1):
                live[u] += _up(ld.nbytes)
        return max(live, default=0) + self.pinned_bytes

    def report(self) -> dict[str, float | int | bool]:
        return {"budget_bytes": self.budget, "plan_peak_bytes": self.peak_bytes(),
                "activation_arena_bytes": self.exec_plan.arena.size, "pinned_bytes": self.pinned_bytes,
                "streamed_bytes": sum(ld.nbytes for ld in self.loads), "units": len(self.units),
                "loads": len(self.loads), "sliced_steps": self.sliced_steps, "preload": self.preload,
                "expected_ms": round(self.expected_s * 1e3, 3), "compute_ms": round(self.compute_s * 1e3, 3),
                "load_ms": round(self.load_s * 1e3, 3)}

    def table(self) -> str:
        """Per unit: what is loaded (and from when), computed and freed, with expected times."""
        steps = self.exec_plan.steps
        by_start: dict[int, list[Load]] = {}
        for ld in self.loads:
            by_start.setdefault(ld.start_unit, []).append(ld)
        act_end = _activation_ends(self.exec_plan, _unit_ranges(self.exec_plan, self.units))
        rows = [f"arena {self.budget} bytes ({self.budget / 2**20:.2f} MiB): "
                f"{'preload' if self.preload else 'no preload (loads wait for their own unit)'}, "
                f"slices <= {'unsliced' if math.isinf(self.slice_bytes) else f'{self.slice_bytes / 1024:.0f} KiB'}",
                f"{'unit':>5} {'loads (start here)':<44} {'computes':<44} {'frees':<30} {'exp ms':>7}"]
        for i, u in enumerate(self.units):
            loads = ", ".join(f"{ld.weight}{_rows(ld.rows)}@{ld.offset}" for ld in by_start.get(i, []))
            step = steps[u.step]
            comp = f"{step.node.name}{_rows(u.rows)} [{step.kernel.name}]"
            frees = [f"{self.loads[j].weight}{_rows(self.loads[j].rows)}" for j in u.loads]
            frees += act_end.get(i, [])
            rows.append(f"{i:>5} {loads[:44]:<44} {comp[:44]:<44} {', '.join(frees)[:30]:<30} "
                        f"{u.expected_s * 1e3:>7.3f}")
        m = self.report()
        rows.append(f"expected {m['expected_ms']:.2f} ms (compute {m['compute_ms']:.2f} ms, loading "
                    f"{m['load_ms']:.2f} ms at {self.load_bps / 1e9:.2f} GB/s, overlapped); plan peak "
                    f"{m['plan_peak_bytes'] / 2**20:.2f} MiB of {self.budget / 2**20:.2f} MiB: activations "
                    f"{m['activation_arena_bytes'] / 2**20:.2f} MiB, pinned {self.pinned_bytes / 2**20:.3f} MiB, "
                    f"streamed {m['streamed_bytes'] / 2**20:.2f} MiB in {m['loads']} loads, "
                    f"{m['sliced_steps']} steps sliced")
        return "\n".join(rows)


def _rows(r: tuple[int, int] | None) -> str:
    return "" if r is None else f"[{r[0]}:{r[1]}]"


def sliceable(step: StepPlan, streamed: set[str]) -> bool:
    """Conv (group 1) along output channels, ``transB`` Gemm along output features, when the output
    slice is contiguous (batch 1) and only the weight (and bias) are streamed."""
    node = step.node
    if step.kernel is None or len(node.inputs) < 2 or node.inputs[1] not in streamed:
        return False
    if any(t in streamed for t in node.inputs[:1] + node.inputs[3:]):
        return False
    out = step.ctx.outs[0].shape
    if node.op == "Conv":
        return node.attrs.get("group", 1) == 1 and out[0] == 1
    if node.op == "Gemm":
        return bool(node.attrs.get("transB")) and len(out) == 2 and out[0] == 1
    return False


def _weight_rows(step: StepPlan) -> int:
    return int(step.ctx.consts[step.node.inputs[1]].shape[0])


def build_units(plan: ExecutionPlan, streamed: set[str], weight_bytes: dict[str, int],
                slice_bytes: float) -> tuple[list[Unit], list[Load]]:
    """Split sliceable steps so no slice of their weight exceeds ``slice_bytes``; list the loads."""
    units: list[Unit] = []
    loads: list[Load] = []
    for i, step in enumerate(plan.steps):
        if step.kernel is None:
            continue
        node = step.node
        names = list(dict.fromkeys(t for t in node.inputs if t in streamed))
        k = 1
        if sliceable(step, streamed):
            rows = _weight_rows(step)
            k = max(1, min(rows, math.ceil(weight_bytes[node.inputs[1]] / slice_bytes)))
        if k == 1:
            u = Unit(i, None, 1, expected_s=step.expected_s)
            for name in names:
                u.loads.append(len(loads))
                loads.append(Load(name, None, weight_bytes[name], len(units)))
            units.append(u)
            continue
        bounds = np.linspace(0, rows, k + 1).round().astype(int)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            u = Unit(i, (int(a), int(b)), k, expected_s=step.expected_s * (b - a) / rows)
            for name in names:  # weight and, when streamed, bias: both sliced along axis 0
                u.loads.append(len(loads))
                loads.append(Load(name, (int(a), int(b)), weight_bytes[name] * int(b - a) // rows, len(units)))
            units.append(u)
    return units, loads


def _unit_ranges(plan: ExecutionPlan, units: list[Unit]) -> list[tuple[int, int]]:
    """Per plan step, its first and last unit (a view step maps to the next unit: conservative)."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for j, u in enumerate(units):
        first.setdefault(u.step, j)
        last[u.step] = j
    out, nxt = [], 0
    for i in range(len(plan.steps) + 1):
        if i in first:
            out.append((first[i], last[i]))
            nxt = last[i] + 1
        else:
            n = min(nxt, len(units) - 1)
            out.append((n, n))
    return out


def _activation_top(plan: ExecutionPlan, ranges: list[tuple[int, int]], n_units: int) -> list[int]:
    top = [0] * n_units
    arena = plan.arena
    for name, buf in arena.buffers.items():
        hi = arena.offsets[name] + _up(buf.size)
        a, b = ranges[buf.start][0], ranges[min(buf.end, len(ranges) - 1)][1]
        if buf.end >= len(plan.steps):
            b = n_units - 1
        for u in range(a, b + 1):
            if top[u] < hi:
                top[u] = hi
    return top


def _activation_ends(plan: ExecutionPlan, ranges: list[tuple[int, int]]) -> dict[int, list[str]]:
    ends: dict[int, list[str]] = {}
    for name, buf in plan.arena.buffers.items():
        if buf.end < len(plan.steps):
            ends.setdefault(ranges[buf.end][1], []).append(name)
    return ends


def _highest_fit(busy: list[tuple[int, int]], floor: int, top: int, need: int) -> int | None:
    cursor = top
    for lo, hi in sorted(busy, reverse=True):
        if hi <= cursor:
            start = (cursor - need) // ALIGN * ALIGN
            if start >= max(hi, floor):
                return start
        cursor = min(cursor, lo)
    start = (cursor - need) // ALIGN * ALIGN
    return start if start >= floor else None


def place_loads(loads: list[Load], act_top: list[int], top: int, preload: bool) -> bool:
    """Give every load an offset and a start unit (as early as memory allows, at most ``LOOKAHEAD``
    units ahead of its use); False if one cannot fit."""
    active: list[tuple[int, int, int]] = []  # (unit using it, lo, hi)
    prev = 0
    for ld in loads:
        need, u = _up(ld.nbytes), ld.unit
        earliest = max(prev, u - LOOKAHEAD) if preload else max(prev, u)
        active = [a for a in active if a[0] >= earliest]
        best, floor = None, 0
        for t in range(u, earliest - 1, -1):
            floor = max(floor, act_top[t])
            off = _highest_fit([(lo, hi) for used, lo, hi in active if used >= t], floor, top, need)
            if off is None:
                break
            best = (t, off)
        if best is None:
            return False
        ld.start_unit, ld.offset = best
        active.append((u, best[1], best[1] + need))
        prev = best[0]
    return True


def simulate(units: list[Unit], loads: list[Load], load_bps: float) -> tuple[float, float, float]:
    """Expected (total, compute, load) seconds with one loader and one compute thread."""
    unit_end: list[float] = []
    load_end = [0.0] * len(loads)
    loader_free = 0.0
    nxt = 0
    for j, u in enumerate(units):
        while nxt < len(loads) and loads[nxt].unit <= j:
            ld = loads[nxt]
            start = max(loader_free, unit_end[ld.start_unit - 1] if ld.start_unit > 0 else 0.0)
            loader_free = load_end[nxt] = start + ld.nbytes / load_bps
            nxt += 1
        ready = max((load_end[i] for i in u.loads), default=0.0)
        unit_end.append(max(unit_end[-1] if unit_end else 0.0, ready) + u.expected_s)
    return (unit_end[-1] if unit_end else 0.0, sum(u.expected_s for u in units),
            sum(ld.nbytes for ld in loads) / load_bps)


def _levels(plan: ExecutionPlan, streamed: set[str], weight_bytes: dict[str, int]) -> list[float]:
    big = max((weight_bytes[s.node.inputs[1]] for s in plan.steps if sliceable(s, streamed)), default=0)
    levels, s = [math.inf], big / 2
    while s >= MIN_SLICE_BYTES:
        levels.append(s)
        s /= 2
    return levels


def plan_budget(plans: list[ExecutionPlan], streamed: set[str], weight_bytes: dict[str, int],
                pinned: dict[str, int], budget: int, load_bps: float, preload: bool = True) -> BudgetPlan:
    """The fastest expected plan of ``plans`` (activation layouts, fastest first) within ``budget``.

    Tries every slice size with preloading and keeps the fastest expected; falls back to no
    preload (``preload=False``: only that, the load-on-demand baseline); raises
    :class:`BudgetError` with the smallest feasible budget if nothing fits.
    """
    pinned_offsets, pinned_bytes = {}, 0
    for name, n in pinned.items():
        pinned_bytes += _up(n)
        pinned_offsets[name] = budget // ALIGN * ALIGN - pinned_bytes
    top = budget // ALIGN * ALIGN - pinned_bytes
    smallest = None
    for plan in plans:
        levels = _levels(plan, streamed, weight_bytes)
        for mode in (True, False) if preload else (False,):
            best = None
            for s in levels:
                units, loads = build_units(plan, streamed, weight_bytes, s)
                act_top = _activation_top(plan, _unit_ranges(plan, units), len(units))
                if max(act_top, default=0) > top or not place_loads(loads, act_top, top, mode):
                    continue
                total, comp, load = simulate(units, loads, load_bps)
                if best is not None and total >= best.expected_s * 0.999:
                    break  # finer slices stopped paying off
                best = BudgetPlan(budget, plan, units, loads, pinned_offsets, pinned_bytes, act_top, mode,
                                  s, float(total), float(comp), float(load), load_bps)
            if best is not None:
                return best
        units, loads = build_units(plan, streamed, weight_bytes, levels[-1])
        act_top = _activation_top(plan, _unit_ranges(plan, units), len(units))
        need = [act_top[j] + sum(_up(loads[i].nbytes) for i in u.loads) for j, u in enumerate(units)]
        least = max(need, default=0) + pinned_bytes + ALIGN
        smallest = least if smallest is None else min(smallest, least)
    raise BudgetError(f"no plan fits a budget of {budget} bytes ({budget / 2**20:.2f} MiB); the smallest "
                      f"feasible budget is {smallest} bytes ({smallest / 2**20:.2f} MiB), with the finest "
                      f"slices and no preloading", smallest or 0)
