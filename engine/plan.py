"""Compile a graph for concrete input shapes: choose a kernel per node by cost, transform weights,
and plan every activation and scratch buffer into one arena.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from engine.cost import Calibration
from engine.ir import Graph, GraphError, Node, TensorInfo
from engine.kernels import Kernel, NodeCtx, by_name, candidates
from engine.measure import time_kernel
from engine.ops import VIEW_OPS, infer_shapes
from engine.planner import ArenaPlan, Buffer, plan_arena

FirstRunCost = Callable[[NodeCtx, Kernel], float]


@dataclass
class StepPlan:
    """One node: the chosen kernel, why (every candidate's estimate), and its memory."""

    ctx: NodeCtx
    kernel: Kernel | None  # None for a view (Reshape/Flatten...): no work, no memory
    estimates: dict[str, float] = field(default_factory=dict)  # kernel name -> expected seconds
    params: dict[str, np.ndarray] = field(default_factory=dict)
    scratch_bytes: int = 0
    weight_bytes: int = 0  # weights read by the kernel
    transformed_bytes: int = 0  # extra bytes of transformed weight copies (0 when they are views)
    forced: bool = False
    tuned: bool = False
    options: list[Kernel] = field(default_factory=list)  # every kernel that applies
    budgeted: bool = False  # moved off the fastest kernel to fit a memory budget
    cold: bool = False  # estimates include first-run costs (weight transform/read, numba load)
    prepared: bool = True  # params hold the transformed weights (False while deferred)

    @property
    def node(self) -> Node:
        return self.ctx.node

    @property
    def expected_s(self) -> float:
        return self.estimates.get(self.kernel.name, 0.0) if self.kernel else 0.0

    @property
    def reason(self) -> str:
        if self.kernel is None:
            return "view of its input"
        if self.forced:
            return "forced"
        if self.budgeted:
            return "least scratch, to fit the memory budget"
        if self.node.op == "Raster":
            return "consecutive layout ops merged into one region copy"
        if self.tuned:
            return "fastest measured: " + ", ".join(f"{k} {v * 1e3:.3f}ms" for k, v in
                                                    sorted(self.estimates.items(), key=lambda kv: kv[1]))
        if len(self.estimates) == 1:
            return "only kernel"
        alts = sorted(self.estimates.items(), key=lambda kv: kv[1])
        label = "cheapest first run: " if self.cold else "cheapest: "
        return label + ", ".join(f"{k} {v * 1e3:.3f}ms" for k, v in alts)


@dataclass
class ExecutionPlan:
    graph: Graph
    infos: dict[str, TensorInfo]
    consts: dict[str, np.ndarray]
    steps: list[StepPlan]
    aliases: dict[str, str]  # tensor -> tensor whose storage it views
    arena: ArenaPlan
    calibration: Calibration
    choices: dict[str, str] = field(default_factory=dict)  # node -> kernel, before rasters were merged

    def location(self, tensor: str) -> str:
        return self.aliases.get(tensor, tensor)

    @property
    def expected_s(self) -> float:
        return sum(s.expected_s for s in self.steps)

    def memory_report(self) -> dict[str, int | float]:
        weights = sum(int(np.asarray(w).nbytes) for w in self.graph.weights.values())
        extra = sum(s.transformed_bytes for s in self.steps)
        return {**self.arena.report(), "weight_bytes": weights, "transformed_weight_bytes": extra}

    def table(self) -> str:
        """Per-node kernel, memory and expected time, as printed by ``python -m engine plan``."""
        rows = [f"{'node':<34} {'op':<18} {'kernel':<18} {'out shape':<20} {'scratch KB':>10} "
                f"{'+weights KB':>11} {'exp ms':>8}  reason"]
        for s in self.steps:
            shape = "x".join(map(str, s.ctx.outs[0].shape))
            rows.append(f"{s.node.name[:34]:<34} {s.node.op:<18} {(s.kernel.name if s.kernel else 'view'):<18} "
                        f"{shape:<20} {s.scratch_bytes / 1024:>10.1f} {s.transformed_bytes / 1024:>11.1f} "
                        f"{s.expected_s * 1e3:>8.3f}  {s.reason}")
        m = self.memory_report()
        rows.append(f"expected total {self.expected_s * 1e3:.2f} ms; arena {m['arena_bytes'] / 2**20:.2f} MiB "
                    f"(live peak {m['live_peak_bytes'] / 2**20:.2f} MiB, no-reuse sum "
                    f"{m['sum_of_buffers_bytes'] / 2**20:.2f} MiB); weights {m['weight_bytes'] / 2**20:.2f} MiB "
                    f"+ transformed copies {m['transformed_weight_bytes'] / 2**20:.2f} MiB")
        return "\n".join(rows)


def _extra_bytes(params: dict[str, np.ndarray], originals: list[np.ndarray]) -> int:
    total = 0
    for p in params.values():
        p = np.asarray(p)
        if p.size > 1 and not any(np.shares_memory(p, o) for o in originals):
            total += p.nbytes
    return total


def compile_plan(graph: Graph, input_shapes: dict[str, tuple[int, ...]], calibration: Calibration,
                 overrides: dict[str, str] | None = None, tune: bool = False,
                 memory_budget: int | None = None, first_run: FirstRunCost | None = None,
                 transform: bool = True, recorded: RecordedPlan | None = None) -> ExecutionPlan:
    """Plan ``graph`` (already optimised) for ``input_shapes``.

    ``recorded`` replays an earlier plan of the same graph, shapes and costs (:func:`record_plan`,
    e.g. persisted by the cold path): each node gets its recorded kernel without estimating every
    candidate, and the arena its recorded offsets when the buffers are the same; a kernel that no
    longer exists or applies raises :class:`GraphError` (plan again without it).

    ``first_run`` plans for a single (cold) run: it returns a kernel's extra first-run seconds on a
    node (transforming or reading its weights, loading numba), added to each estimate, so a kernel
    whose preparation costs more than it saves on one run loses. ``transform=False`` leaves the
    weight transforms to the caller (:func:`prepare_step`, e.g. on a preparation thread).

    ``overrides`` maps a node name or an op type to a kernel name, to force a choice. ``tune``
    times every candidate kernel on the node's real shapes and keeps the fastest (the estimates
    then hold measured times). ``memory_budget`` (bytes) caps the arena: kernels with less scratch
    replace the fastest ones where needed, or :class:`GraphError` says why it cannot fit.
    """
    overrides = overrides or {}
    infos, folded = infer_shapes(graph, input_shapes)
    consts: dict[str, np.ndarray] = {**graph.weights, **folded}
    aliases: dict[str, str] = {}
    steps: list[StepPlan] = []
    for node in graph.topological_order():
        if all(o in consts for o in node.outputs):
            continue
        ctx = NodeCtx(node, [infos[t] for t in node.inputs if t], [infos[t] for t in node.outputs], consts)
        if node.op in VIEW_OPS:
            src = node.inputs[0]
            if src in consts:
                consts[node.outputs[0]] = np.asarray(consts[src]).reshape(infos[node.outputs[0]].shape)
                continue
            aliases[node.outputs[0]] = aliases.get(src, src)
            steps.append(StepPlan(ctx, None))
            continue
        if recorded is not None:
            kernel = _recorded_kernel(recorded, ctx)
            estimates = {kernel.name: recorded.expected_s.get(node.name, 0.0)}
            steps.append(_use(StepPlan(ctx, kernel, estimates, cold=first_run is not None), kernel, transform))
            continue
        kernels = candidates(ctx)
        if not kernels:
            raise GraphError(f"no kernel for op '{node.op}' at node '{node.name}' with inputs "
                             f"{[i.shape for i in ctx.ins]}")
        forced = overrides.get(node.name) or overrides.get(node.op)
        if tune and len(kernels) > 1 and not forced:
            estimates = {k.name: time_kernel(k, ctx) for k in kernels}
        else:
            estimates = {k.name: calibration.seconds(k.cost(ctx), k.name) for k in kernels}
        if first_run is not None and not tune:
            estimates = {k.name: estimates[k.name] + first_run(ctx, k) for k in kernels}
        if forced:
            kernel = by_name(forced)
            if not kernel.applies(ctx) or node.op not in kernel.ops:
                raise GraphError(f"kernel {forced!r} does not apply to node '{node.name}' ({node.op})")
        else:
            kernel = min(kernels, key=lambda k: estimates[k.name])
        step = StepPlan(ctx, kernel, estimates, forced=bool(forced), tuned=tune and len(kernels) > 1 and not forced,
                        options=kernels, cold=first_run is not None)
        steps.append(_use(step, kernel, transform))
    choices = {s.node.name: s.kernel.name for s in steps if s.kernel is not None}
    steps = merge_rasters(steps, graph, aliases, calibration)
    buffers = _buffers(graph, steps, consts, aliases, infos)
    arena = (recorded.arena_for(buffers) if recorded is not None else None) or plan_arena(buffers)
    if memory_budget is not None:
        arena = _fit_budget(steps, memory_budget, arena, lambda: plan_arena(_buffers(graph, steps, consts, aliases,
                                                                                     infos)))
        choices.update({s.node.name: s.kernel.name for s in steps if s.budgeted})
    return ExecutionPlan(graph, infos, consts, steps, aliases, arena, calibration, choices)


@dataclass
class RecordedPlan:
    """What :func:`compile_plan` decided, as plain data (JSON-able): per node its kernel and expected
    seconds, and the arena's offsets. Replaying it (``compile_plan(recorded=...)``) skips estimating
    every candidate kernel and placing every buffer."""

    kernels: dict[str, str]  # node name -> kernel name
    expected_s: dict[str, float]
    offsets: dict[str, int]
    sizes: dict[str, int]  # buffer name -> bytes, to check the arena still fits the buffers
    arena_size: int
    live_peak: int

    def as_dict(self) -> dict:
        return {"kernels": self.kernels, "expected_s": self.expected_s, "offsets": self.offsets,
                "sizes": self.sizes, "arena_size": self.arena_size, "live_peak": self.live_peak}

    @classmethod
    def from_dict(cls, d: dict) -> RecordedPlan:
        return cls(**{k: d[k] for k in ("kernels", "expected_s", "offsets", "sizes", "arena_size", "live_peak")})

    def arena_for(self, buffers: list[Buffer]) -> ArenaPlan | None:
        """The recorded arena if ``buffers`` are the recorded ones (names and sizes), else None."""
        if len(buffers) != len(self.sizes) or any(self.sizes.get(b.name) != b.size for b in buffers):
            return None
        return ArenaPlan(dict(self.offsets), {b.name: b for b in buffers}, self.arena_size,
                         sum(b.size for b in buffers), self.live_peak)


def record_plan(plan: ExecutionPlan) -> RecordedPlan:
    """The decisions of ``plan`` as a :class:`RecordedPlan` (the kernel of every node, before raster
    steps were merged: a replay merges them again, the same way)."""
    a = plan.arena
    return RecordedPlan(dict(plan.choices), {s.node.name: s.expected_s for s in plan.steps if s.kernel is not None},
                        dict(a.offsets), {n: b.size for n, b in a.buffers.items()}, a.size, a.live_peak)


def _recorded_kernel(recorded: RecordedPlan, ctx: NodeCtx) -> Kernel:
    name = recorded.kernels.get(ctx.node.name)
    try:
        kernel = by_name(name) if name else None
    except KeyError:
        kernel = None
    if kernel is None or ctx.node.op not in kernel.ops or not kernel.applies(ctx):
        raise GraphError(f"recorded plan: kernel {name!r} does not apply to node '{ctx.node.name}'")
    return kernel


def _use(step: StepPlan, kernel: Kernel, transform: bool = True) -> StepPlan:
    """Make ``kernel`` the step's kernel: size its scratch and (unless deferred) transform its weights."""
    step.kernel, step.params, step.prepared = kernel, {}, False
    step.scratch_bytes = kernel.scratch_bytes(step.ctx)
    if transform:
        prepare_step(step)
    return step


def prepare_step(step: StepPlan, params: dict[str, np.ndarray] | None = None) -> StepPlan:
    """Give the step its transformed weights: ``params`` (e.g. read from a cache) or the kernel's
    :meth:`~engine.kernels.Kernel.transform` of the node's weights."""
    ctx = step.ctx
    originals = [np.asarray(ctx.consts[t]) for t in ctx.node.inputs if t in ctx.consts]
    step.params = step.kernel.transform(ctx) if params is None else params
    step.weight_bytes = sum(o.nbytes for o in originals)
    step.transformed_bytes = _extra_bytes(step.params, originals)
    step.prepared = True
    return step


def _fit_budget(steps: list[StepPlan], budget: int, arena: ArenaPlan, replan) -> ArenaPlan:
    """Trade speed for memory until the arena fits ``budget`` bytes: repeatedly move the step with
    the largest scratch to its applicable kernel with the least scratch (the fastest among those)."""
    while arena.size > budget:
        movable = [(s.scratch_bytes, i) for i, s in enumerate(steps) if s.kernel is not None and not s.forced
                   and any(k.scratch_bytes(s.ctx) < s.scratch_bytes for k in s.options)]
        if not movable:
            raise GraphError(f"the plan needs {arena.size} bytes, over the {budget}-byte budget, and no kernel "
                             f"with less scratch is left (at its peak step {arena.live_peak} bytes are live)")
        step = steps[max(movable)[1]]
        least = min(k.scratch_bytes(step.ctx) for k in step.options)
        kernel = min((k for k in step.options if k.scratch_bytes(step.ctx) == least),
                     key=lambda k: step.estimates[k.name])
        _use(step, kernel).budgeted = True
        arena = replan()
    return arena


def merge_rasters(steps: list[StepPlan], graph: Graph, aliases: dict[str, str],
                  calibration: Calibration) -> list[StepPlan]:
    """Fold a raster step into the raster step reading its output (Transpose then Slice, Pad then
    Concat, ...): the intermediate tensor is never written. Views in between are transparent
    because regions address tensors by flat element offsets."""
    outputs = {aliases.get(o, o) for o in graph.outputs}
    merged = True
    while merged:
        merged = False
        producer = {t: s for s in steps if s.kernel is not None for t in s.node.outputs}
        reads: dict[str, int] = {}  # reads by computing steps (views do no work)
        for s in steps:
            for t in s.node.inputs if s.kernel is not None else ():
                if t:
                    reads[aliases.get(t, t)] = reads.get(aliases.get(t, t), 0) + 1
        for b in steps:
            if b.kernel is None or b.kernel.name != "raster":
                continue
            for i, t in enumerate(b.node.inputs):
                root = aliases.get(t, t)
                a = producer.get(root)
                if a is None or a.kernel.name != "raster" or reads.get(root) != 1 or root in outputs:
                    continue
                step = _merge(a, b, i, calibration)
                if step is not None:
                    steps = [step if s is b else s for s in steps if s is not a]
                    merged = True
                    break
            if merged:
                break
    return steps


def _merge(a: StepPlan, b: StepPlan, index: int, calibration: Calibration) -> StepPlan | None:
    """One raster step doing ``b`` straight from ``a``'s input, if ``a`` is one plain region."""
    from engine.kernels.raster import compile_regions, compose

    inner, fill = compile_regions(a.ctx)
    if fill is not None or len(inner) != 1:
        return None
    outer, b_fill = compile_regions(b.ctx)
    regions = []
    for r in outer:
        c = compose(r, inner[0], a.ctx.outs[0].shape) if r.src == index else r
        if c is None:
            return None
        regions.append(c)
    inputs = [a.node.inputs[0] if k == index else t for k, t in enumerate(b.node.inputs)]
    node = Node("Raster", inputs, list(b.node.outputs), {"regions": regions, "fill": b_fill},
                f"{a.node.name}+{b.node.name}")
    ins = [a.ctx.ins[0] if k == index else info for k, info in enumerate(b.ctx.ins)]
    ctx = NodeCtx(node, ins, b.ctx.outs, b.ctx.consts)
    return StepPlan(ctx, b.kernel, {b.kernel.name: calibration.seconds(b.kernel.cost(ctx), b.kernel.name)})


def _buffers(graph, steps, consts, aliases, infos) -> list[Buffer]:
    """Lifetimes (in step indices) of every arena tensor and every kernel's scratch."""
    start: dict[str, int] = {t.name: 0 for t in graph.inputs}
    end: dict[str, int] = dict.fromkeys(start, 0)
    buffers = []
    for i, s in enumerate(steps):
        for t in s.node.inputs:
            if t and t not in consts:
                root = aliases.get(t, t)
                end[root] = max(end.get(root, i), i)
        if s.kernel is None:
            continue
        for t in s.node.outputs:
            start[t], end[t] = i, max(end.get(t, i), i)
        if s.scratch_bytes:
            buffers.append(Buffer(f"{s.node.name}#scratch", s.scratch_bytes, i, i))
    for o in graph.outputs:
        root = aliases.get(o, o)
        if root in end:
            end[root] = len(steps)
    for t, st in start.items():
        buffers.append(Buffer(t, infos[t].nbytes_for(), st, end[t]))
    return buffers
