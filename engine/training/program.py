"""A static training program: forward, loss, backward and the optimizer update as one step list
for given shapes, with the lifetime of every tensor a step holds, planned into one arena.

Steps, for N computing nodes: forward ``f_i = i``, loss ``N``, backward ``b_i = 2N - i``, update
``2N + 1``. Every node runs through :meth:`GraphModel._node` (the trainer's own differentiable ops),
one node at a time, so gradients equal today's trainer; what each node's backward keeps (its saved
context) is measured once by :func:`calibrate` on small batches (bytes and time, on this machine)
and scaled linearly in the batch. A node in ``dropped`` frees its context after the forward and is
recomputed in the backward pass (from inputs kept, or recomputed in turn), Melon's recomputation.

The executor frees each array at the step where its planned lifetime ends; the budget covers what a
step adds beyond the model's weights: activations, saved contexts, gradients, per-step scratch and
the optimizer state.
"""

from __future__ import annotations

import time
import tracemalloc
from dataclasses import dataclass, field

import numpy as np

from engine.autograd.graph import GraphModel
from engine.autograd.losses import cross_entropy, mse
from engine.autograd.optim import SGD, Adam, Optimizer
from engine.autograd.tensor import Function, Tensor
from engine.ir import GraphError, Node
from engine.planner import ArenaPlan, Buffer
from engine.training.pool import compare, plan_pool

CALIBRATION_BATCHES = (2, 4)


@dataclass
class NodeCost:
    """What one node costs at batch ``b``: ``a + s * b`` for each measured quantity."""

    out_bytes: tuple[float, float]
    context_bytes: tuple[float, float]  # saved for backward, beyond its inputs/output/weights
    forward_scratch: tuple[float, float]
    backward_scratch: tuple[float, float]
    forward_s: tuple[float, float]
    keeps_inputs: frozenset[str]  # input activations its saved context references
    keeps_output: bool

    @staticmethod
    def at(pair: tuple[float, float], batch: int) -> int:
        return max(0, int(round(pair[0] + pair[1] * batch)))


@dataclass
class Calibration:
    nodes: list[Node]
    costs: list[NodeCost]
    loss_scratch: tuple[float, float]
    param_bytes: dict[str, int]
    param_users: dict[str, list[int]]
    forward_step_s: tuple[float, float] = (0.0, 0.0)


@dataclass
class StepPlan:
    """The planned program for one micro-batch size and one set of recomputed nodes."""

    batch: int
    micro_batches: int
    micro_batch: int
    dropped: frozenset[int]
    recompute_at: dict[int, int]  # dropped node -> backward step where it is recomputed
    ends: dict[str, int]  # executor name -> the step after which it is freed
    buffers: list[Buffer]
    arena: ArenaPlan
    pinned_bytes: int  # optimizer state (and gradient accumulators across micro-batches)
    names: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return self.arena.size + self.pinned_bytes

    def report(self) -> dict[str, int | float]:
        cmp = compare(self.buffers)
        return {"batch": self.batch, "micro_batches": self.micro_batches, "recomputed_nodes": len(self.dropped),
                "arena_bytes": self.arena.size, "pinned_bytes": self.pinned_bytes, "total_bytes": self.total_bytes,
                **cmp}

    def table(self) -> str:
        """What is recomputed, micro-batched and where each tensor lives (offset in the arena)."""
        rows = [f"batch {self.batch} as {self.micro_batches} micro-batch(es) of {self.micro_batch}; "
                f"{len(self.dropped)} node(s) recomputed; arena {self.arena.size / 2**20:.2f} MiB + pinned "
                f"{self.pinned_bytes / 2**20:.2f} MiB (live peak {self.arena.live_peak / 2**20:.2f} MiB)",
                f"{'buffer':<48} {'offset':>12} {'bytes':>12} {'steps':>12}"]
        for b in sorted(self.buffers, key=lambda b: (self.arena.offsets[b.name], b.start)):
            rows.append(f"{b.name[:48]:<48} {self.arena.offsets[b.name]:>12} {b.size:>12} {b.start:>5}-{b.end:<6}")
        for i in sorted(self.dropped):
            rows.append(f"recomputed: {self.names[i]} (at step {self.recompute_at[i]})")
        return "\n".join(rows)


def _stub(a: np.ndarray) -> np.ndarray:
    """A zero-byte stand-in with ``a``'s shape, for tensors whose data the plan frees elsewhere."""
    return np.broadcast_to(np.zeros((), np.float32), a.shape)


class _Output:
    """A node's output tensor (for its backward) and its data (for the executor to place/free)."""

    __slots__ = ("tensor", "data")

    def __init__(self, tensor: Tensor, data: np.ndarray) -> None:
        self.tensor, self.data = tensor, data


def _root(a: object) -> object:
    while getattr(a, "base", None) is not None:
        a = a.base
    return a


def _saved_arrays(out: Tensor) -> list[np.ndarray]:
    """Every array the functions behind ``out`` saved for their backward."""
    found, stack, seen = [], [out._ctx], set()
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        for k, v in vars(fn).items():
            if k == "parents":
                stack.extend(p._ctx for p in v)
                continue
            for a in v if isinstance(v, list | tuple) else (v,):
                if isinstance(a, np.ndarray) and a.size > 1:
                    found.append(a)
    return found


class Program:
    """The compiled step list of one model and loss; plans are made per batch/budget by callers.

    >>> prog = Program(GraphModel(graph), "cross_entropy", (1, 8))       # doctest: +SKIP
    >>> plan = prog.plan(batch=64, dropped=frozenset()); prog.run(plan, x, labels, opt)  # doctest: +SKIP
    """

    def __init__(self, model: GraphModel, loss: str, sample_shape: tuple[int, ...]) -> None:
        if loss not in ("cross_entropy", "mse"):
            raise ValueError(f"loss must be 'cross_entropy' or 'mse', got {loss!r}")
        if len(model.graph.inputs) != 1 or len(model.graph.outputs) != 1:
            raise GraphError("a training program needs a model with one input and one output")
        self.model, self.loss, self.sample_shape = model, loss, tuple(sample_shape)
        self.input = model.graph.inputs[0].name
        self.output = model.graph.outputs[0]
        self.has_batchnorm = any(n.op == "BatchNormalization" for n in model.graph.nodes)
        # recomputation replays BatchNorm forwards: their running statistics go to throwaway copies
        self._replay = GraphModel.__new__(GraphModel)
        self._replay.__dict__.update(model.__dict__)
        self._replay.buffers = {k: v.copy() for k, v in model.buffers.items()}
        self.cal = calibrate(self)

    # -- shapes ------------------------------------------------------------------------------------
    def _infos(self, batch: int):
        return self.model._infer({self.input: (batch, *self.sample_shape)})

    def computing_nodes(self, batch: int) -> list[Node]:
        _, folded = self._infos(batch)
        return [n for n in self.model.graph.topological_order() if not all(o in folded for o in n.outputs)]

    # -- execution ---------------------------------------------------------------------------------
    def forward_node(self, node: Node, env: dict[str, np.ndarray], batch: int, replay: bool = False):
        """Run one node on arrays in ``env``; returns its output tensor and the activation leaves."""
        infos, folded = self._infos(batch)
        consts = {**self.model.graph.weights, **folded}
        model = self._replay if replay else self.model
        leaves: dict[str, Tensor] = {}

        def get(name: str) -> Tensor:
            if name in env:
                if name not in leaves:
                    leaves[name] = Tensor(env[name], requires_grad=name != self.input)
                return leaves[name]
            if name in model.params:
                return model.params[name]
            return Tensor(np.asarray(consts[name]))

        out = model._node(node, get, consts, infos, True)
        data = out.data
        for leaf in leaves.values():  # the inputs stay alive only through what the functions saved
            leaf.data = _stub(leaf.data)
        if not any(out is leaf for leaf in leaves.values()):
            out.data = _stub(data)  # and the output only as long as the plan says
        return _Output(out, data), leaves

    def loss_grad(self, logits: np.ndarray, target: np.ndarray, scale: float) -> tuple[float, np.ndarray]:
        leaf = Tensor(logits, requires_grad=True)
        loss = cross_entropy(leaf, target) if self.loss == "cross_entropy" else mse(leaf, target)
        loss.backward(np.asarray(scale, np.float32))
        return float(loss.data), leaf.grad

    def plan(self, batch: int, dropped: frozenset[int] = frozenset(), micro_batches: int = 1,
             optimizer_state_bytes: int = 0, update_scratch_bytes: int = 0) -> StepPlan:
        return plan_program(self, batch, dropped, micro_batches, optimizer_state_bytes, update_scratch_bytes)

    def run(self, plan: StepPlan, x: np.ndarray, target: np.ndarray, opt: Optimizer) -> float:
        """One optimizer step on ``(x, target)`` following ``plan``; returns the batch's mean loss."""
        if len(x) != plan.batch:
            raise ValueError(f"the plan is for batch {plan.batch}, got {len(x)} rows")
        opt.zero_grad()
        total, n = 0.0, len(x)
        for k in range(plan.micro_batches):
            lo, hi = k * plan.micro_batch, min(n, (k + 1) * plan.micro_batch)
            if lo >= hi:
                break
            total += self._run_micro(plan, x[lo:hi], target[lo:hi], (hi - lo) / n) * (hi - lo) / n
        opt.step()
        return total

    def _run_micro(self, plan: StepPlan, x: np.ndarray, target: np.ndarray, scale: float) -> float:
        nodes, ends, m = self.cal.nodes, plan.ends, len(x)
        steps = len(nodes)
        env: dict[str, np.ndarray] = {self.input: x}
        ctx: dict[int, tuple[Tensor, dict[str, Tensor]]] = {}

        def free(step: int, store: dict, suffix: str = "") -> None:
            for name in [t for t in store if ends.get(t + suffix, -1) == step]:
                del store[name]

        for i, node in enumerate(nodes):
            res, leaves = self.forward_node(node, env, m)
            env[node.outputs[0]] = res.data
            if i not in plan.dropped:
                ctx[i] = (res.tensor, leaves)
            del res, leaves
            free(i, env)
        loss, grads = self.loss_grad(env[self.output], target, scale)
        grads = {self.output: grads}
        free(steps, env)
        redo: dict[str, np.ndarray] = {}
        by_step: dict[int, list[int]] = {}
        for i, s in plan.recompute_at.items():
            by_step.setdefault(s, []).append(i)
        for i in range(steps - 1, -1, -1):
            step = 2 * steps - i
            for j in sorted(by_step.get(step, ())):
                res, leaves = self.forward_node(nodes[j], {**env, **redo}, m, replay=True)
                redo[nodes[j].outputs[0]] = res.data
                ctx[j] = (res.tensor, leaves)
                del res, leaves
            out, leaves = ctx.pop(i)
            g = grads.pop(nodes[i].outputs[0], None)
            if g is not None:
                if out._node is None:  # a pass-through (Identity): the output is an input leaf
                    for name, leaf in leaves.items():
                        if leaf is out:
                            grads[name] = grads[name] + g if name in grads else g
                else:
                    out.backward(g)
                    for name, leaf in leaves.items():
                        if leaf.grad is not None:
                            grads[name] = grads[name] + leaf.grad if name in grads else leaf.grad
            del out, leaves, g
            free(step, env)
            free(step, redo, "#re")
        return loss


def calibrate(prog: Program) -> Calibration:
    """Run the program unplanned on two small batches, measuring per node the output and saved
    context bytes, the transient scratch (tracemalloc) and the forward time (perf_counter)."""
    rng = np.random.default_rng(0)
    samples: list[dict] = []
    nodes: list[Node] = []
    for batch in CALIBRATION_BATCHES:
        nodes = prog.computing_nodes(batch)
        x = rng.standard_normal((batch, *prog.sample_shape)).astype(np.float32)
        _, folded = prog._infos(batch)
        out_shape = prog._infos(batch)[0][prog.output].shape
        target = (rng.integers(0, out_shape[-1], batch) if prog.loss == "cross_entropy"
                  else rng.standard_normal(out_shape).astype(np.float32))
        times = _time_forward(prog, nodes, x)
        # one-off allocations (a lazy import, a JIT compile) land in some trace: keep each node's least
        first, second = _trace(prog, nodes, x, target, times), _trace(prog, nodes, x, target, times)
        for a, b in zip(first["nodes"], second["nodes"], strict=True):
            a["fscratch"], a["bscratch"] = min(a["fscratch"], b["fscratch"]), min(a["bscratch"], b["bscratch"])
        first["loss"] = min(first["loss"], second["loss"])
        samples.append(first)
    for p in prog.model.params.values():
        p.grad = None
    b1, b2 = CALIBRATION_BATCHES

    def fit(v1: float, v2: float) -> tuple[float, float]:
        s = (v2 - v1) / (b2 - b1)
        return v1 - s * b1, s

    costs = []
    for i in range(len(nodes)):
        a, b = samples[0]["nodes"][i], samples[1]["nodes"][i]
        costs.append(NodeCost(*(fit(a[k], b[k]) for k in ("out", "context", "fscratch", "bscratch", "time")),
                              keeps_inputs=a["keeps_inputs"] | b["keeps_inputs"],
                              keeps_output=a["keeps_output"] or b["keeps_output"]))
    users: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for t in n.inputs:
            if t in prog.model.params:
                users.setdefault(t, []).append(i)
    return Calibration(nodes, costs, fit(samples[0]["loss"], samples[1]["loss"]),
                       {k: p.data.nbytes for k, p in prog.model.params.items()}, users)


def _time_forward(prog: Program, nodes: list[Node], x: np.ndarray) -> list[float]:
    best = [float("inf")] * len(nodes)
    for _ in range(2):
        env = {prog.input: x}
        for i, node in enumerate(nodes):
            t0 = time.perf_counter()
            out, _ = prog.forward_node(node, env, len(x), replay=True)
            best[i] = min(best[i], time.perf_counter() - t0)
            env[node.outputs[0]] = out.data
    return best


def _trace(prog: Program, nodes: list[Node], x: np.ndarray, target: np.ndarray, times: list[float]) -> dict:
    for p in prog.model.params.values():  # as after zero_grad: no accumulation into earlier gradients
        p.grad = None
    weights = [p.data for p in prog.model.params.values()]
    env: dict[str, np.ndarray] = {prog.input: x}
    per_node, ctx = [], []
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        for i, node in enumerate(nodes):
            tracemalloc.reset_peak()
            out, leaves = prog.forward_node(node, env, len(x), replay=True)
            cur, peak = tracemalloc.get_traced_memory()
            env[node.outputs[0]] = out.data
            inputs = {t: env[t] for t in node.inputs if t in env}
            keeps, keeps_out, private = set(), False, {}
            for a in _saved_arrays(out.tensor) if out.tensor._ctx is not None else ():
                hit = [t for t, arr in inputs.items() if np.may_share_memory(a, arr)]
                if hit:
                    keeps.update(hit)
                elif np.may_share_memory(a, out.data):
                    keeps_out = True
                elif not any(np.may_share_memory(a, w) for w in weights):
                    r = _root(a)
                    private[id(r)] = r.nbytes if isinstance(r, np.ndarray) else a.nbytes
            per_node.append({"out": out.data.nbytes, "context": sum(private.values()), "fscratch": max(0, peak - cur),
                             "time": times[i], "keeps_inputs": frozenset(keeps), "keeps_output": keeps_out})
            ctx.append((out, leaves))
        tracemalloc.reset_peak()
        _, g = prog.loss_grad(env[prog.output], target, 1.0)
        cur, peak = tracemalloc.get_traced_memory()
        loss_scratch = max(0, peak - cur)
        grads = {prog.output: g}
        for i in range(len(nodes) - 1, -1, -1):
            out, leaves = ctx[i]
            ctx[i] = None
            gi = grads.pop(nodes[i].outputs[0], None)
            tracemalloc.reset_peak()
            if gi is not None and out.tensor._node is not None:
                out.tensor.backward(gi)
                for name, leaf in leaves.items():
                    if leaf.grad is not None:
                        grads[name] = grads[name] + leaf.grad if name in grads else leaf.grad
            elif gi is not None:
                for name, leaf in leaves.items():
                    if leaf is out.tensor:
                        grads[name] = gi
            cur, peak = tracemalloc.get_traced_memory()
            per_node[i]["bscratch"] = max(0, peak - cur)
            del out, leaves
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return {"nodes": per_node, "loss": loss_scratch}


def plan_program(prog: Program, batch: int, dropped: frozenset[int], micro_batches: int,
                 optimizer_state_bytes: int, update_scratch_bytes: int, arena: bool = True) -> StepPlan:
    """Lifetimes of every tensor of one step, planned into one arena by the lifetime-aware pool."""
    cal = prog.cal
    nodes, costs = cal.nodes, cal.costs
    n = len(nodes)
    m = -(-batch // micro_batches)
    producer = {node.outputs[0]: i for i, node in enumerate(nodes)}
    consumers: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for t in dict.fromkeys(node.inputs):
            if t in producer or t == prog.input:
                consumers.setdefault(t, []).append(i)

    def b(i: int) -> int:
        return 2 * n - i

    recompute_at: dict[int, int] = {}
    for i in sorted(dropped, reverse=True):
        at = b(i)
        for j in consumers.get(nodes[i].outputs[0], ()):
            if j in dropped:
                at = min(at, recompute_at[j])
        recompute_at[i] = at
    buffers: list[Buffer] = []
    ends: dict[str, int] = {}

    def add(name: str, size: int, start: int, end: int) -> None:
        ends[name] = end
        if size > 0:
            buffers.append(Buffer(name, size, start, end))

    names = [prog.input] + [node.outputs[0] for node in nodes]
    for t in names:
        i = producer.get(t)
        size = NodeCost.at(costs[i].out_bytes, m) if i is not None else int(np.prod(prog.sample_shape)) * 4 * m
        start = i if i is not None else 0
        end = start
        redo_end = -1
        for j in consumers.get(t, ()):
            end = max(end, j)
            if t in costs[j].keeps_inputs:
                if j in dropped:
                    redo_end = max(redo_end, b(j))
                else:
                    end = max(end, b(j))
            if j in dropped:  # its recomputation reads t
                if i is not None and i in dropped:
                    redo_end = max(redo_end, recompute_at[j])
                else:
                    end = max(end, recompute_at[j])
        if t == prog.output:
            end = max(end, n)
        if i is not None and costs[i].keeps_output:
            if i in dropped:
                redo_end = max(redo_end, b(i))
            else:
                end = max(end, b(i))
        add(t, size, start, end)
        if i is not None and i in dropped:
            add(t + "#re", size, recompute_at[i], max(redo_end, recompute_at[i]))
        if i is not None:  # its gradient: from its first consumer's backward (or the loss) to its own backward
            users = consumers.get(t, ())
            gstart = n if t == prog.output else min((b(j) for j in users), default=b(i))
            add(t + "#grad", size, gstart, b(i))
    for i, c in enumerate(costs):
        name = nodes[i].name or nodes[i].outputs[0]
        start = recompute_at.get(i, i)
        add(f"{name}#context", NodeCost.at(c.context_bytes, m), start, b(i))
        add(f"{name}#fscratch", NodeCost.at(c.forward_scratch, m), i, i)
        add(f"{name}#bscratch", NodeCost.at(c.backward_scratch, m), b(i), b(i))
        if i in dropped:
            add(f"{name}#rscratch", NodeCost.at(c.forward_scratch, m), recompute_at[i], recompute_at[i])
    add("loss#scratch", NodeCost.at(cal.loss_scratch, m), n, n)
    add("update#scratch", update_scratch_bytes, 2 * n + 1, 2 * n + 1)
    grad_bytes = 0
    for p, size in cal.param_bytes.items():
        users = cal.param_users.get(p, [])
        if micro_batches > 1 or not users:
            grad_bytes += size  # accumulated over the micro-batches: held for the whole step
        else:
            add(f"{p}#grad", size, b(max(users)), 2 * n + 1)
    placed = plan_pool(buffers) if arena else ArenaPlan({}, {}, 0, 0, 0)
    return StepPlan(batch, micro_batches, m, frozenset(dropped), recompute_at, ends, buffers, placed,
                    optimizer_state_bytes + grad_bytes, [nd.name or nd.outputs[0] for nd in nodes])


def optimizer_bytes(opt: Optimizer) -> tuple[int, int]:
    """(state bytes, update scratch bytes) of ``opt``: momentum / Adam moments, and the
    temporaries of one parameter's update (the largest)."""
    total = sum(p.data.nbytes for p in opt.params)
    largest = max((p.data.nbytes for p in opt.params), default=0)
    if isinstance(opt, Adam):
        return 2 * total, 5 * largest
    if isinstance(opt, SGD):
        return (total if opt.momentum else 0), 3 * largest
    return 0, 3 * largest


__all__ = ["Calibration", "Function", "NodeCost", "Program", "StepPlan", "calibrate", "optimizer_bytes",
           "plan_program"]
