"""A static training program: forward, loss, backward and the optimizer update as one step list
for given shapes, with the lifetime of every tensor a step holds, planned into one arena.

Steps, for N computing nodes: forward ``f_i = i``, loss ``N``, backward ``b_i = 2N - i``, update
``2N + 1``. Every node runs through :meth:`GraphModel._node` (the trainer's own differentiable ops),
one node at a time, so gradients equal today's trainer; what each node's backward keeps (its saved
context) is measured once by :func:`calibrate` on small batches (bytes and time, on this machine)
and scaled linearly in the batch. A node in ``dropped`` frees its context after the forward and is
recomputed in the backward pass (from inputs kept, or recomputed in turn), Melon's recomputation.
A plan may stream its first nodes in chunks of rows with the whole batch's BatchNorm statistics
(:mod:`engine.training.stream`). Each parameter is updated as soon as its gradient is final (after
the backward of its first user), so gradients do not pile up until the end of the step.

The executor frees each array at the step where its planned lifetime ends; the budget covers what a
step adds beyond the model's weights and the input batch (the caller's): activations, saved
contexts, gradients, per-step scratch and the optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from engine.autograd import functions as F
from engine.autograd.graph import GraphModel
from engine.autograd.losses import cross_entropy, mse
from engine.autograd.optim import Optimizer
from engine.autograd.tensor import Function, Tensor
from engine.ir import GraphError, Node
from engine.ops import conv_attrs
from engine.planner import ArenaPlan, Buffer
from engine.training.calibrate import Calibration, NodeCost, calibrate
from engine.training.pool import compare, plan_pool
from engine.training.stream import (
    Segment,
    Stream,
    StreamRun,
    carried_of,
    consumers_of,
    kept_of,
    segment,
    working_sets,
)


class Span(NamedTuple):
    """A planned buffer (as :class:`~engine.planner.Buffer`, cheap to make while searching)."""

    name: str
    size: int
    start: int
    end: int


@dataclass
class StepPlan:
    """The planned program for one micro-batch size and one set of recomputed nodes."""

    batch: int
    micro_batches: int
    micro_batch: int
    dropped: frozenset[int]
    recompute_at: dict[int, int]  # dropped node -> backward step where it is recomputed
    ends: dict[str, int]  # executor name -> the step after which it is freed
    buffers: list[Span]
    arena: ArenaPlan
    pinned_bytes: int  # optimizer state (and gradient accumulators across micro-batches)
    names: list[str] = field(default_factory=list)
    stream: Stream | None = None
    updates: dict[int, list[str]] = field(default_factory=dict)  # node -> parameters updated after its backward

    @property
    def total_bytes(self) -> int:
        return self.arena.size + self.pinned_bytes

    def report(self) -> dict[str, int | float]:
        cmp = compare([Buffer(*b) for b in self.buffers])
        s = self.stream
        return {"batch": self.batch, "micro_batches": self.micro_batches, "recomputed_nodes": len(self.dropped),
                "streamed_nodes": s.end if s else 0, "stream_chunk": s.chunk if s else 0,
                "stream_segments": len(s.segments) if s else 0, "stream_parked_segments": len(s.parked) if s else 0,
                "stream_carried_segments": len(s.carried) if s else 0,
                "stream_parked_batchnorms": len(s.parked_bns) if s else 0,
                "stream_carried_batchnorms": len(s.carried_bns) if s else 0,
                "arena_bytes": self.arena.size, "pinned_bytes": self.pinned_bytes, "total_bytes": self.total_bytes,
                **cmp}

    def table(self) -> str:
        """What is recomputed, micro-batched, streamed and where each tensor lives (offset in the arena)."""
        rows = [f"batch {self.batch} as {self.micro_batches} micro-batch(es) of {self.micro_batch}; "
                f"{len(self.dropped)} node(s) recomputed; arena {self.arena.size / 2**20:.2f} MiB + pinned "
                f"{self.pinned_bytes / 2**20:.2f} MiB (live peak {self.arena.live_peak / 2**20:.2f} MiB)"]
        if self.stream:
            s = self.stream
            rows.append(f"streamed: the first {s.end} node(s) in chunks of {s.chunk} row(s), {len(s.segments)} "
                        f"segment(s) (BatchNorm statistics of the whole batch; * keeps its BatchNorms' inputs "
                        f"during its passes, ^ their output gradients during its backward): "
                        + ", ".join(f"{self.names[a]}..{self.names[b - 1]}{'*' if a in s.parked else ''}"
                                    f"{'^' if a in s.carried else ''}"
                                    for a, b in s.segments))
        rows.append(f"{'buffer':<48} {'offset':>12} {'bytes':>12} {'steps':>12}")
        for b in sorted(self.buffers, key=lambda b: (self.arena.offsets[b.name], b.start)):
            rows.append(f"{b.name[:48]:<48} {self.arena.offsets[b.name]:>12} {b.size:>12} {b.start:>5}-{b.end:<6}")
        for i in sorted(self.dropped):
            rows.append(f"recomputed: {self.names[i]} (at step {self.recompute_at[i]})")
        return "\n".join(rows)


_STUBS: dict[tuple[int, ...], np.ndarray] = {}


def _stub(a: np.ndarray) -> np.ndarray:
    """A zero-byte stand-in with ``a``'s shape, for tensors whose data the plan frees elsewhere
    (read-only views of one zero, cached per shape)."""
    stub = _STUBS.get(a.shape)
    if stub is None:
        stub = _STUBS[a.shape] = np.broadcast_to(np.zeros((), np.float32), a.shape)
    return stub


class _Output:
    """A node's output tensor (for its backward) and its data (for the executor to place/free)."""

    __slots__ = ("tensor", "data")

    def __init__(self, tensor: Tensor, data: np.ndarray) -> None:
        self.tensor, self.data = tensor, data


class Program:
    """The compiled step list of one model and loss; plans are made per batch/budget by callers.

    >>> prog = Program(GraphModel(graph), "cross_entropy", (1, 8))       # doctest: +SKIP
    >>> plan = prog.plan(batch=64, dropped=frozenset()); prog.run(plan, x, labels, opt)  # doctest: +SKIP
    """

    def __init__(self, model: GraphModel, loss: str, sample_shape: tuple[int, ...],
                 calibration: Calibration | None = None) -> None:
        if loss not in ("cross_entropy", "mse"):
            raise ValueError(f"loss must be 'cross_entropy' or 'mse', got {loss!r}")
        if len(model.graph.inputs) != 1 or len(model.graph.outputs) != 1:
            raise GraphError("a training program needs a model with one input and one output")
        self.model, self.loss, self.sample_shape = model, loss, tuple(sample_shape)
        self.input = model.graph.inputs[0].name
        self.output = model.graph.outputs[0]
        self.has_batchnorm = any(n.op == "BatchNormalization" for n in model.graph.nodes)
        if self.has_batchnorm:  # a streamed step's first use of these loops would load them mid-step
            F.warm_streamed_batchnorm()
        self._consts: dict[int, tuple[dict, dict]] = {}
        # recomputation replays BatchNorm forwards: their running statistics go to throwaway copies
        self._replay = GraphModel.__new__(GraphModel)
        self._replay.__dict__.update(model.__dict__)
        self._replay.buffers = {k: v.copy() for k, v in model.buffers.items()}
        # another program's calibration of the same graph, loss and shapes may be reused (no re-measuring)
        self.cal: Calibration = calibration if calibration is not None else calibrate(self)
        self.consumers = consumers_of(self.cal.nodes, {self.input, *(n.outputs[0] for n in self.cal.nodes)})
        self.segment_bytes: dict[tuple[int, int, int], tuple[int, int]] = {}  # (a, b, chunk) -> working sets
        self._sizes: dict[int, tuple[list[int], ...]] = {}
        self._segments: dict[tuple[int, int], Segment] = {}

    def segment(self, a: int, b: int) -> Segment:
        """The (cached) description of the streamed segment ``[a, b)``."""
        if (a, b) not in self._segments:
            self._segments[a, b] = segment(self.cal.nodes, a, b, self.input, self.output, self.consumers)
        return self._segments[a, b]

    def sizes(self, m: int) -> tuple[list[int], list[int], list[int], list[int]]:
        """Per node at batch ``m``: output, context, forward scratch and backward scratch bytes."""
        if m not in self._sizes:
            cs = self.cal.costs
            self._sizes[m] = tuple([NodeCost.at(getattr(c, k), m) for c in cs]
                                   for k in ("out_bytes", "context_bytes", "forward_scratch", "backward_scratch"))
        return self._sizes[m]

    @property
    def cut_positions(self) -> list[int]:
        """Positions one tensor crosses (between node q - 1 and q), and the network's end."""
        if not hasattr(self, "_cuts"):
            nodes, n = self.cal.nodes, len(self.cal.nodes)
            made = {self.input: 0, **{nd.outputs[0]: i + 1 for i, nd in enumerate(nodes)}}
            self._cuts = [q for q in range(1, n + 1) if q == n or sum(
                1 for t, users in self.consumers.items() if made.get(t, n + 1) <= q and max(users) >= q) == 1]
        return self._cuts

    def crossing_bytes(self, q: int, batch: int) -> int:
        """Bytes of the tensors made before node ``q`` and read from node ``q`` on (or the output)."""
        nodes, costs = self.cal.nodes, self.cal.costs
        return sum(NodeCost.at(costs[j].out_bytes, batch) for j in range(q)
                   if nodes[j].outputs[0] == self.output
                   or any(u >= q for u in self.consumers.get(nodes[j].outputs[0], ())))

    # -- shapes ------------------------------------------------------------------------------------
    def _infos(self, batch: int):
        return self.model._infer({self.input: (batch, *self.sample_shape)})

    def _shapes(self, batch: int) -> tuple[dict, dict]:
        """Tensor infos at ``batch`` and the constants (weights and folded tensors), cached."""
        if batch not in self._consts:
            infos, folded = self._infos(batch)
            self._consts[batch] = (infos, {**self.model.graph.weights, **folded})
        return self._consts[batch]

    def computing_nodes(self, batch: int) -> list[Node]:
        _, folded = self._infos(batch)
        return [n for n in self.model.graph.topological_order() if not all(o in folded for o in n.outputs)]

    # -- execution ---------------------------------------------------------------------------------
    def forward_node(self, node: Node, env: dict[str, np.ndarray], batch: int, replay: bool = False,
                     bn_stats: F.BatchStats | None = None, given: np.ndarray | None = None):
        """Run one node on arrays in ``env``; returns its output tensor and the activation leaves.
        A BatchNorm given ``bn_stats`` normalises with them (a chunk of a streamed batch); a Conv
        ``given`` its output (kept from an earlier pass) only sets up its backward."""
        infos, consts = self._shapes(batch)
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

        if bn_stats is not None:
            out = F.BatchNormGiven.apply(get(node.inputs[0]), get(node.inputs[1]), get(node.inputs[2]),
                                         stats=bn_stats)
        elif given is not None:
            assert node.op == "Conv", "only a Conv takes its output as given"
            w = get(node.inputs[1])
            c = conv_attrs(node, w.shape)
            b = get(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else \
                Tensor(np.zeros(w.shape[0], np.float32))
            out = F.Conv2d.apply(get(node.inputs[0]), w, b, stride=c["strides"], pads=c["pads"],
                                 dil=c["dilations"], group=c["group"], out=given)
        else:
            out = model._node(node, get, consts, infos, True)
        data = out.data
        for leaf in leaves.values():  # the inputs stay alive only through what the functions saved
            leaf.data = _stub(leaf.data)
        if not any(out is leaf for leaf in leaves.values()):
            out.data = _stub(data)  # and the output only as long as the plan says
        return _Output(out, data), leaves

    def gathered_batchnorm(self, node: Node, stats: F.BatchStats) -> None:
        """A streamed BatchNorm's batch statistics are complete: fix them and update the running ones
        as :class:`~engine.autograd.functions.BatchNorm` does for a whole batch."""
        mean, var = stats.finish(node.attrs.get("epsilon", 1e-5))
        momentum = 1 - node.attrs.get("momentum", 0.9)
        m = stats.count
        running_mean, running_var = self.model.buffers[node.inputs[3]], self.model.buffers[node.inputs[4]]
        running_mean *= 1 - momentum
        running_mean += momentum * mean
        running_var *= 1 - momentum
        running_var += momentum * var * m / max(m - 1, 1)

    def batchnorm_grads(self, node: Node, stats: F.BatchStats) -> None:
        """gamma's and beta's gradients of a streamed BatchNorm: the batch sums its backward gathered."""
        for name, g in ((node.inputs[1], stats.sum_gx), (node.inputs[2], stats.sum_g)):
            p = self.model.params.get(name)
            if p is not None and p.requires_grad:
                p.grad = g.copy() if p.grad is None else p.grad + g

    def backward_nodes(self, order, ctx: dict, grads: dict[str, np.ndarray]) -> None:
        """Back-propagate through the nodes ``order`` (descending) whose contexts are in ``ctx``,
        from and into the activation gradients ``grads``."""
        nodes = self.cal.nodes
        for i in order:
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

    def loss_grad(self, logits: np.ndarray, target: np.ndarray, scale: float) -> tuple[float, np.ndarray]:
        leaf = Tensor(logits, requires_grad=True)
        loss = cross_entropy(leaf, target) if self.loss == "cross_entropy" else mse(leaf, target)
        loss.backward(np.asarray(scale, np.float32))
        return float(loss.data), leaf.grad

    def plan(self, batch: int, dropped: frozenset[int] = frozenset(), micro_batches: int = 1,
             optimizer_state_bytes: int = 0, update_scratch_bytes: int = 0, stream: Stream | None = None) -> StepPlan:
        return plan_program(self, batch, dropped, micro_batches, optimizer_state_bytes, update_scratch_bytes,
                            stream=stream)

    def run(self, plan: StepPlan, x: np.ndarray, target: np.ndarray, opt: Optimizer) -> float:
        """One optimizer step on ``(x, target)`` following ``plan``; returns the batch's mean loss."""
        if len(x) != plan.batch:
            raise ValueError(f"the plan is for batch {plan.batch}, got {len(x)} rows")
        opt.zero_grad()
        fused = plan.micro_batches == 1
        if fused:
            opt.begin_step()
        total, n = 0.0, len(x)
        for k in range(plan.micro_batches):
            lo, hi = k * plan.micro_batch, min(n, (k + 1) * plan.micro_batch)
            if lo >= hi:
                break
            total += self._run_micro(plan, x[lo:hi], target[lo:hi], (hi - lo) / n, opt if fused else None) \
                * (hi - lo) / n
        if fused:  # parameters no node's backward reached (none, usually)
            for p in opt.params:
                if p.grad is not None:
                    opt.update(p)
                    p.grad = None
        else:
            opt.step()
        return total

    def _update_after(self, plan: StepPlan, opt: Optimizer | None, nodes_done: range) -> None:
        if opt is None:
            return
        for i in nodes_done:
            for name in plan.updates.get(i, ()):
                p = self.model.params[name]
                opt.update(p)
                p.grad = None

    def _run_micro(self, plan: StepPlan, x: np.ndarray, target: np.ndarray, scale: float,
                   opt: Optimizer | None) -> float:
        nodes, ends, m = self.cal.nodes, plan.ends, len(x)
        steps = len(nodes)
        first = plan.stream.end if plan.stream else 0
        env: dict[str, np.ndarray] = {self.input: x}
        ctx: dict[int, tuple[Tensor, dict[str, Tensor]]] = {}

        def free(step: int, store: dict, suffix: str = "") -> None:
            for name in [t for t in store if ends.get(t + suffix, -1) == step]:
                del store[name]

        streamed = None
        if first:
            streamed = StreamRun(self, plan, m, lambda a, b: self._update_after(plan, opt, range(a, b)))
            streamed.forward(env)
        for i in range(first, steps):
            res, leaves = self.forward_node(nodes[i], env, m)
            env[nodes[i].outputs[0]] = res.data
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
        for i in range(steps - 1, first - 1, -1):
            step = 2 * steps - i
            for j in sorted(by_step.get(step, ())):
                res, leaves = self.forward_node(nodes[j], {**env, **redo}, m, replay=True)
                redo[nodes[j].outputs[0]] = res.data
                ctx[j] = (res.tensor, leaves)
                del res, leaves
            self.backward_nodes((i,), ctx, grads)
            self._update_after(plan, opt, range(i, i + 1))
            free(step, env)
            free(step, redo, "#re")
        if streamed is not None:
            streamed.backward(env, grads)
        return loss


def plan_program(prog: Program, batch: int, dropped: frozenset[int], micro_batches: int,
                 optimizer_state_bytes: int, update_scratch_bytes: int, arena: bool = True,
                 stream: Stream | None = None) -> StepPlan:
    """Lifetimes of every tensor of one step, planned into one arena by the lifetime-aware pool."""
    cal = prog.cal
    nodes, costs = cal.nodes, cal.costs
    n = len(nodes)
    m = -(-batch // micro_batches)
    first = stream.end if stream else 0
    if stream and micro_batches != 1:
        raise ValueError("a streamed plan runs the whole batch (its chunks are the micro-batches)")
    if any(i < first for i in dropped):
        raise ValueError("streamed nodes are recomputed by their segment, not dropped one by one")
    producer = {node.outputs[0]: i for i, node in enumerate(nodes)}
    consumers = prog.consumers
    seg_of: dict[int, tuple[int, int]] = {}
    for a, b_ in stream.segments if stream else ():
        for i in range(a, b_):
            seg_of[i] = (a, b_)

    def b(i: int) -> int:
        return 2 * n - i

    def bwd_first(j: int) -> int:  # the first backward step of node j (of its segment when streamed)
        return 2 * n - seg_of[j][1] + 1 if j < first else b(j)

    def bwd_last(j: int) -> int:
        return 2 * n - seg_of[j][0] if j < first else b(j)

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
            buffers.append(Span(name, size, start, end))

    out_b, ctx_b, fs_b, bs_b = prog.sizes(m)
    names = [prog.input] + [node.outputs[0] for node in nodes]
    for t in names:
        i = producer.get(t)
        streamed = (i if i is not None else 0) < first
        users = consumers.get(t, ())
        if streamed and i is not None and t != prog.output and all(seg_of.get(j) == seg_of[i] for j in users):
            continue  # lives one chunk at a time inside its segment (its working set)
        size = out_b[i] if i is not None else 0  # the input batch is the caller's array (read, never copied)
        start = (seg_of[i][0] if streamed else i) if i is not None else 0
        end = start
        redo_end = -1
        for j in users:
            if j < first:  # a streamed segment reads it in every pass, forward and backward
                end = max(end, bwd_last(j))
                continue
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
        if i is not None and not streamed and costs[i].keeps_output:
            if i in dropped:
                redo_end = max(redo_end, b(i))
            else:
                end = max(end, b(i))
        add(t, size, start, end)
        if i is not None and i in dropped:
            add(t + "#re", size, recompute_at[i], max(redo_end, recompute_at[i]))
        if i is not None:  # its gradient: from its first consumer's backward (or the loss) to its own backward
            gstart = n if t == prog.output else min((bwd_first(j) for j in users), default=bwd_first(i))
            add(t + "#grad", size, gstart, bwd_last(i))
    for i in range(first, n):
        name = nodes[i].name or nodes[i].outputs[0]
        start = recompute_at.get(i, i)
        add(f"{name}#context", ctx_b[i], start, b(i))
        add(f"{name}#fscratch", fs_b[i], i, i)
        add(f"{name}#bscratch", bs_b[i], b(i), b(i))
        if i in dropped:
            add(f"{name}#rscratch", fs_b[i], recompute_at[i], recompute_at[i])
    for a, b_ in stream.segments if stream else ():
        key = (a, b_, min(stream.chunk, batch))
        if key not in prog.segment_bytes:
            prog.segment_bytes[key] = working_sets(cal, prog.segment(a, b_), key[2], consumers)
        fwd, bwd = prog.segment_bytes[key]
        label = nodes[a].name or nodes[a].outputs[0]
        add(f"{label}#segment-forward", fwd, a, b_ - 1)
        add(f"{label}#segment-backward", bwd, 2 * n - b_ + 1, 2 * n - a)
        seg = prog.segment(a, b_)
        for t in kept_of(nodes, seg, stream):  # BatchNorms' inputs, whole batch, during its own passes only
            add(f"{t}#kept-forward", out_b[producer[t]], a, b_ - 1)
            add(f"{t}#kept-backward", out_b[producer[t]], 2 * n - b_ + 1, 2 * n - a)
        for j in carried_of(nodes, seg, consumers, prog.output, stream):  # output gradients, during its backward
            add(f"{nodes[j].outputs[0]}#carried-grad", out_b[j], 2 * n - b_ + 1, 2 * n - a)
    add("loss#scratch", NodeCost.at(cal.loss_scratch, m), n, n)
    grad_bytes = 0
    updates: dict[int, list[str]] = {}
    update_steps = set()
    for p, size in cal.param_bytes.items():
        users = cal.param_users.get(p, [])
        if micro_batches > 1 or not users:
            grad_bytes += size  # accumulated over the micro-batches: held for the whole step
            continue
        updates.setdefault(min(users), []).append(p)  # final after its first user's backward: updated there
        add(f"{p}#grad", size, bwd_first(max(users)), bwd_last(min(users)))
        update_steps.add(bwd_last(min(users)))
    for s in sorted(update_steps):
        add(f"update@{s}#scratch", update_scratch_bytes, s, s)
    if micro_batches > 1 or grad_bytes:
        add("update#scratch", update_scratch_bytes, 2 * n + 1, 2 * n + 1)
    placed = plan_pool([Buffer(*b) for b in buffers]) if arena else ArenaPlan({}, {}, 0, 0, 0)
    return StepPlan(batch, micro_batches, m, frozenset(dropped), recompute_at, ends, buffers, placed,
                    optimizer_state_bytes + grad_bytes, [nd.name or nd.outputs[0] for nd in nodes], stream, updates)


__all__ = ["Calibration", "Function", "NodeCost", "Program", "StepPlan", "calibrate", "plan_program"]
