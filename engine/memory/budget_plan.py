"""Preload-aware planning of one inference inside a byte budget (FlexNN's time x offset plan).

The timeline is a list of compute *units*: one per computing step of an
:class:`~engine.plan.ExecutionPlan`, or one per slice of a sliced step (a Conv split along its
output channels, a ``transB`` Gemm along its output features, each slice writing its rows of the
output in place). Every streamed weight (or weight slice) a unit needs is a *load*; the loader
performs loads in order, each into a range of the one arena of exactly ``budget`` bytes:

    [ activations + scratch (offsets from plan_arena) ...   weight slices ...   pinned weights ]
    0                                                                                       budget

Activations keep their ``plan_arena`` offsets at the low end; small weights stay resident at the
top ("pinned"); below them, big weights that fit in what the activations never use stay resident
across inferences too (read once, on the first run: at a large budget nothing is streamed);
loads go in between, each placed as high as possible and started as early as memory allows: a
load may start at unit ``t`` (once units before ``t`` are done) if its range is free of every
activation live from ``t`` to its use and of every load in flight then. If a plan does not fit,
slices get finer; if no preloading plan fits, every load waits for its own unit (no preload); if
even that fails, :class:`BudgetError` names the smallest feasible budget.

Which weights stay resident: the last-used ones first. The time a run must wait on the disk is
set by its tail (for ResNet-50 the last stage and the classifier hold 2/3 of the weights and 1/6
of the compute): at unit ``u`` at most the memory free then can hold weights of the units after
it, the rest must be read while those compute (:func:`stream_bound`). Keeping a tail weight
resident takes as much memory from that preload room as it saves, keeping an earlier one takes
room and saves nothing there; both save reading time overall.

Several execution plans may be offered (e.g. the engine's fastest kernels with their transformed
weights streamed, and kernels that read the original weights in place, which stream fewer bytes):
each is planned and the one with the least expected time wins, the expected time simulating one
loader at ``load_bps`` against compute at the plan's estimates times ``compute_scale``.

>>> bp = plan_budget(exec_plan, streamed, pinned_bytes, 8 << 20, load_bps=2e9)  # doctest: +SKIP
>>> print(bp.table())                                                           # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from engine.ir import GraphError
from engine.memory.loader import DIRECT_ALIGN, direct_len
from engine.plan import ExecutionPlan, StepPlan

ALIGN = 64
LOAD_ALIGN = DIRECT_ALIGN
MIN_SLICE_BYTES = 32 * 1024  # finer slices cost more in per-call overhead than they save
# Each read costs a request's latency on top of its bytes (a direct read waits for the disk; ~0.2-0.5
# ms on the 2-core VM this was measured on): without it the plans favoured many small slices, which
# read at half the rate of few big ones.
LOAD_OVERHEAD_S = 3e-4
LOOKAHEAD = 12  # a load starts at most this many units before its use (bounds planning time)


class BudgetError(GraphError):
    """No plan fits the budget; ``smallest`` is the smallest budget (bytes) that would."""

    def __init__(self, message: str, smallest: int) -> None:
        super().__init__(message)
        self.smallest = smallest


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _up_load(n: int) -> int:
    """A load's slot: 4096-aligned and rounded up to 4096, so the loader can read it with direct I/O."""
    return direct_len(n)


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
    resident: dict[str, int]  # streamed blocks kept in memory across runs -> offset (read on the first run)
    resident_bytes: int
    act_top: list[int]  # per unit: the top of the activations live then
    preload: bool
    slice_bytes: float  # the slice size cap used (inf: no slicing)
    expected_s: float
    compute_s: float
    load_s: float
    load_bps: float
    compute_scale: float = 1.0  # compute's slowdown against the calibration assumed when planning
    held: int = 0  # bytes under the resident weights never touched: kept for objects growing with units and loads

    @property
    def sliced_steps(self) -> int:
        return len({u.step for u in self.units if u.parts > 1})

    def peak_bytes(self) -> int:
        """The plan's own accounting: max over units of live activations + loads in flight + pinned."""
        live = list(self.act_top)
        for ld in self.loads:
            for u in range(ld.start_unit, ld.unit + 1):
                live[u] += _up_load(ld.nbytes)
        return max(live, default=0) + self.pinned_bytes + self.resident_bytes

    @property
    def load_top(self) -> int:
        """The top of the room loads share with activations (below resident and pinned weights)."""
        return ((self.budget // ALIGN * ALIGN - self.pinned_bytes) // LOAD_ALIGN * LOAD_ALIGN - self.resident_bytes
                - self.held)

    def report(self) -> dict[str, float | int | bool]:
        return {"budget_bytes": self.budget, "plan_peak_bytes": self.peak_bytes(),
                "activation_arena_bytes": self.exec_plan.arena.size, "pinned_bytes": self.pinned_bytes,
                "resident_bytes": self.resident_bytes, "resident_blocks": len(self.resident),
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
                    f"resident {self.resident_bytes / 2**20:.2f} MiB ({len(self.resident)} weights, read on the "
                    f"first run), streamed {m['streamed_bytes'] / 2**20:.2f} MiB in {m['loads']} loads, "
                    f"{m['sliced_steps']} steps sliced")
        return "\n".join(rows)


def _rows(r: tuple[int, int] | None) -> str:
    return "" if r is None else f"[{r[0]}:{r[1]}]"


def sliceable(step: StepPlan, streamed: set[str]) -> bool:
    """Conv (group 1) along output channels (a blocked conv along blocks of 16), ``transB`` Gemm along
    output features, when the output slice is contiguous (batch 1) and only the weight (and bias)
    are streamed."""
    node = step.node
    if step.kernel is None or len(node.inputs) < 2 or node.inputs[1] not in streamed:
        return False
    if any(t in streamed for t in node.inputs[:1] + node.inputs[3:]):
        return False
    out = step.ctx.outs[0].shape
    if node.op == "Conv":
        return node.attrs.get("group", 1) == 1 and out[0] == 1
    if node.op == "NchwcConv":  # (N, C/16, H, W, 16): along output-channel blocks
        return out[0] == 1
    if node.op == "Gemm":
        return bool(node.attrs.get("transB")) and len(out) == 2 and out[0] == 1
    return False


def _weight_rows(step: StepPlan) -> int:
    return int(step.ctx.consts[step.node.inputs[1]].shape[0])


BlocksOf = Callable[[StepPlan], list[str]]


def streamed_inputs(streamed: set[str]) -> BlocksOf:
    """The default: a step reads the streamed weights among its inputs, as stored."""
    return lambda step: list(dict.fromkeys(t for t in step.node.inputs if t in streamed))


EXACT_ROWS = {"Conv": 16, "Gemm": 16}  # slice starts on multiples of these: OpenBLAS sums a row alike


def _slice_bounds(rows: int, k: int, row_bytes: list[int], exact: int = 1) -> list[int]:
    """``k`` near-equal row ranges, their starts on multiples of rows whose bytes are 4096-aligned in
    every block (then each slice is a direct read), unless that granule leaves far fewer slices; and
    always on multiples of ``exact`` (an OpenBLAS GEMM sliced at other rows groups a row's products
    differently: ResNet-50's FC sliced at 125 rows was 1e-3 off the unsliced model, at multiples of 8
    or 16 bitwise equal), with fewer slices if need be."""
    if exact > 1 and rows > exact:
        k = max(1, min(k, rows // exact))
    granule = exact
    for rb in row_bytes:
        g = LOAD_ALIGN // math.gcd(rb, LOAD_ALIGN) if rb else 1
        granule = granule * g // math.gcd(granule, g)
    even = np.linspace(0, rows, k + 1)
    if granule > 1 and rows // granule >= k:
        inner = {int(round(b / granule)) * granule for b in even[1:-1]}
        bounds = sorted({0, rows, *(b for b in inner if 0 < b < rows)})
        if len(bounds) - 1 >= max(1, k * 3 // 4):
            return bounds
    if exact > 1:
        inner = {int(round(b / exact)) * exact for b in even[1:-1]}
        return sorted({0, rows, *(b for b in inner if 0 < b < rows)})
    return [int(b) for b in even.round().astype(int)]


def build_units(plan: ExecutionPlan, blocks_of: BlocksOf, weight_bytes: dict[str, int], slice_bytes: float,
                streamed: set[str], resident: set[str] = frozenset(),
                compute_scale: float = 1.0) -> tuple[list[Unit], list[Load]]:
    """Split sliceable steps so no slice of their blocks exceeds ``slice_bytes``; list the loads
    (every block a step reads, all sliced along their first axis, the output channels; resident
    blocks are not loaded, and a step with all its blocks resident is not sliced)."""
    units: list[Unit] = []
    loads: list[Load] = []
    for i, step in enumerate(plan.steps):
        if step.kernel is None:
            continue
        names = [n for n in blocks_of(step) if n not in resident]
        k = 1
        if names and sliceable(step, streamed):
            rows = _weight_rows(step)
            k = max(1, min(rows, math.ceil(max(weight_bytes[n] for n in names) / slice_bytes)))
        expected = step.expected_s * compute_scale
        if k == 1:
            u = Unit(i, None, 1, expected_s=expected)
            for name in names:
                u.loads.append(len(loads))
                loads.append(Load(name, None, weight_bytes[name], len(units)))
            units.append(u)
            continue
        bounds = _slice_bounds(rows, k, [weight_bytes[n] // rows for n in names], EXACT_ROWS.get(step.node.op, 1))
        k = len(bounds) - 1
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            u = Unit(i, (int(a), int(b)), k, expected_s=expected * (b - a) / rows)
            for name in names:  # weight (or its transformed copy) and, when streamed, bias
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
            start = (cursor - need) // LOAD_ALIGN * LOAD_ALIGN
            if start >= max(hi, floor):
                return start
        cursor = min(cursor, lo)
    start = (cursor - need) // LOAD_ALIGN * LOAD_ALIGN
    return start if start >= floor else None


def place_loads(loads: list[Load], act_top: list[int], top: int, preload: bool) -> bool:
    """Give every load an offset and a start unit (as early as memory allows, at most ``LOOKAHEAD``
    units ahead of its use); False if one cannot fit."""
    active: list[tuple[int, int, int]] = []  # (unit using it, lo, hi)
    prev = 0
    for ld in loads:
        need, u = _up_load(ld.nbytes), ld.unit
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
            loader_free = load_end[nxt] = start + LOAD_OVERHEAD_S + ld.nbytes / load_bps
            nxt += 1
        ready = max((load_end[i] for i in u.loads), default=0.0)
        unit_end.append(max(unit_end[-1] if unit_end else 0.0, ready) + u.expected_s)
    return (unit_end[-1] if unit_end else 0.0, sum(u.expected_s for u in units),
            sum(ld.nbytes for ld in loads) / load_bps)


def _levels(plan: ExecutionPlan, blocks_of: BlocksOf, weight_bytes: dict[str, int], streamed: set[str],
            resident: set[str], room: float = math.inf) -> list[float]:
    """Slice size caps to try: unsliced, then halving from half the biggest block, no finer than
    ``room / 64`` (finer slices of a room that size only add calls) nor ``MIN_SLICE_BYTES``."""
    big = max((max((weight_bytes[n] for n in blocks_of(s) if n not in resident), default=0)
               for s in plan.steps if s.kernel is not None and sliceable(s, streamed)), default=0)
    levels, s = [math.inf], big / 2
    while s >= max(MIN_SLICE_BYTES, room / 64):
        levels.append(s)
        s /= 2
    return levels


def stream_bound(units: list[Unit], loads: list[Load], act_top: list[int], load_top: int,
                 unit_seconds: list[float], bps: float) -> float:
    """A lower bound on one run's seconds with these units, loads and memory, whatever the schedule:
    when unit ``u`` starts (no earlier than the compute before it), weights of units ``>= u`` in
    memory fit in what the activations leave free then; the rest must still be read, at ``bps``,
    and the last unit with a load computes after its load."""
    n = len(units)
    after = [0] * (n + 1)  # bytes of loads used by units >= u
    for ld in loads:
        after[ld.unit] += ld.nbytes
    for u in range(n - 1, -1, -1):
        after[u] += after[u + 1]
    last = max((ld.unit for ld in loads), default=n)
    tail = sum(unit_seconds[last:])
    before, bound = 0.0, sum(unit_seconds)
    for u in range(n):
        rest = after[u] - max(0, load_top - act_top[u])
        if rest > 0:
            bound = max(bound, before + rest / bps + tail)
        before += unit_seconds[u]
    return bound


def _resident_order(plan: ExecutionPlan, blocks_of: BlocksOf) -> list[list[str]]:
    """Per computing step, last first: the blocks it reads (kept resident together or not at all)."""
    return [blocks_of(s) for s in reversed(plan.steps) if s.kernel is not None and blocks_of(s)]


def _fill(order: list[list[str]], weight_bytes: dict[str, int], room: int) -> tuple[dict[str, int], int]:
    """Resident blocks, last-used first (first fit), within ``room`` bytes; offsets from the top down."""
    chosen: dict[str, int] = {}
    used = 0
    for names in order:
        need = sum(_up_load(weight_bytes[n]) for n in names if n not in chosen)
        if used + need > room:
            continue
        for n in names:
            if n not in chosen:
                used += _up_load(weight_bytes[n])
                chosen[n] = used  # distance below the top; made an offset by the caller
    return chosen, used


def _held(unit_bytes: int, units: list[Unit], loads: list[Load]) -> int:
    """The bytes a plan of these units and loads keeps untouched for objects that grow with them."""
    return _up_load(unit_bytes * (len(units) + len(loads))) if unit_bytes else 0


def _resident_room(plan: ExecutionPlan, blocks_of: BlocksOf, weight_bytes: dict[str, int], streamed: set[str],
                   top: int, order: list[list[str]], unit_bytes: int = 0) -> int:
    """The most bytes of resident weights (last-used first) that leave every unit room for its own
    loads at the finest slices (a no-preload plan then fits): a binary search on that check."""
    finest = _levels(plan, blocks_of, weight_bytes, streamed, set(), top)[-1]
    units, loads = build_units(plan, blocks_of, weight_bytes, finest, streamed)
    act_top = _activation_top(plan, _unit_ranges(plan, units), len(units))
    top -= _held(unit_bytes, units, loads)

    def fits(room: int) -> bool:
        chosen, used = _fill(order, weight_bytes, room)
        return all(act_top[j] + used + sum(_up_load(loads[i].nbytes) for i in u.loads
                                           if loads[i].weight not in chosen)
                   <= top for j, u in enumerate(units))

    lo, hi = 0, top - max(act_top, default=0)
    if hi <= 0 or fits(hi):
        return max(hi, 0)
    while hi - lo > max(MIN_SLICE_BYTES, hi // 64):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _plan_one(plan: ExecutionPlan, blocks_of: BlocksOf, streamed: set[str], weight_bytes: dict[str, int],
              top: int, resident: set[str], modes: tuple[bool, ...], load_bps: float,
              compute_scale: float, unit_bytes: int = 0
              ) -> tuple[float, list[Unit], list[Load], list[int], bool, float, int] | None:
    """The fastest expected (slicing level, preload or not) for this plan and resident set below ``top``,
    less ``unit_bytes`` per unit and load left untouched (the last item: those bytes)."""
    levels = _levels(plan, blocks_of, weight_bytes, streamed, resident, top)
    for mode in modes:
        best = None
        for s in levels:
            units, loads = build_units(plan, blocks_of, weight_bytes, s, streamed, resident, compute_scale)
            act_top = _activation_top(plan, _unit_ranges(plan, units), len(units))
            held = _held(unit_bytes, units, loads)
            if max(act_top, default=0) > top - held or not place_loads(loads, act_top, top - held, mode):
                continue
            total = simulate(units, loads, load_bps)[0]
            if best is not None and total >= best[0] * 0.999:
                break  # finer slices stopped paying off
            best = (total, units, loads, act_top, mode, s, held)
        if best is not None:
            return best
    return None


def plan_budget(plans: list[ExecutionPlan], streamed: set[str], weight_bytes: dict[str, int],
                pinned: dict[str, int], budget: int, load_bps: float, preload: bool = True,
                blocks_of: BlocksOf | None = None, compute_scale: float = 1.0,
                fallbacks: list[ExecutionPlan] = (), unit_bytes: int = 0) -> BudgetPlan:
    """The fastest expected plan of ``plans`` (e.g. fastest kernels, fewest streamed bytes) within
    ``budget``; ``fallbacks`` (e.g. least scratch) are planned only when none of those fits.

    Per plan: the weights kept resident (last-used first, in what the activations never use; halved
    while nothing fits), every slice size with preloading, then no preload (``preload=False``: only
    that, the load-on-demand baseline). :class:`BudgetError` with the smallest feasible budget if
    no plan fits. ``blocks_of(step)`` names the blocks a step reads (default: its streamed inputs).
    ``unit_bytes``: per unit and load of a plan, bytes of the budget it leaves untouched (for the
    caller's objects that grow with them: :attr:`BudgetPlan.held`), counted in the smallest too.
    """
    memo: dict[int, list[str]] = {}
    given = blocks_of or streamed_inputs(streamed)

    def blocks_of(step: StepPlan) -> list[str]:
        if id(step) not in memo:
            memo[id(step)] = given(step)
        return memo[id(step)]

    pinned_offsets, pinned_bytes = {}, 0
    for name, n in pinned.items():
        pinned_bytes += _up(n)
        pinned_offsets[name] = budget // ALIGN * ALIGN - pinned_bytes
    top = (budget // ALIGN * ALIGN - pinned_bytes) // LOAD_ALIGN * LOAD_ALIGN  # loads and resident blocks
    modes = (True, False) if preload else (False,)
    best: BudgetPlan | None = None
    smallest = None
    for plan in [*plans, *fallbacks]:
        if best is not None and any(plan is f for f in fallbacks):
            break
        order = _resident_order(plan, blocks_of)
        room = _resident_room(plan, blocks_of, weight_bytes, streamed, top, order, unit_bytes) if preload else 0
        found = None
        # the most resident weights that leave room for the rest (also trying half as many, for more
        # preload room, doubled the planning time of a budget change for no gain measurable here)
        r = room
        for attempt in range(4):  # fewer resident weights while nothing fits: halved twice, then none
            chosen, used = _fill(order, weight_bytes, r)
            got = _plan_one(plan, blocks_of, streamed, weight_bytes, top - used, set(chosen), modes, load_bps,
                            compute_scale, unit_bytes)
            if got is not None or not chosen:
                break
            r = used // 2 if attempt < 2 else 0
        if got is not None:
            found = (got, chosen, used)
        if found is not None:
            (total, units, loads, act_top, mode, s, held), chosen, used = found
            resident = {n: top - d for n, d in chosen.items()}
            comp = sum(u.expected_s for u in units)
            cand = BudgetPlan(budget, plan, units, loads, pinned_offsets, pinned_bytes, resident, used, act_top,
                              mode, s, float(total), float(comp), sum(ld.nbytes for ld in loads) / load_bps, load_bps,
                              compute_scale, held)
            if best is None or cand.expected_s < best.expected_s:
                best = cand
            continue
        # the least over slice sizes (the finest when units cost nothing; with unit_bytes, finer slices
        # need less room for loads but hold more bytes for their units)
        levels = _levels(plan, blocks_of, weight_bytes, streamed, set(), room=0)
        for s in levels[-1:] if not unit_bytes else levels:
            units, loads = build_units(plan, blocks_of, weight_bytes, s, streamed)
            act_top = _activation_top(plan, _unit_ranges(plan, units), len(units))
            need = [act_top[j] + sum(_up_load(loads[i].nbytes) for i in u.loads) for j, u in enumerate(units)]
            least = max(need, default=0) + pinned_bytes + LOAD_ALIGN + _held(unit_bytes, units, loads)
            smallest = least if smallest is None else min(smallest, least)
    if best is not None:
        return best
    raise BudgetError(f"no plan fits a budget of {budget} bytes ({budget / 2**20:.2f} MiB); the smallest "
                      f"feasible budget is {smallest} bytes ({smallest / 2**20:.2f} MiB), with the finest "
                      f"slices and no preloading", smallest or 0)
