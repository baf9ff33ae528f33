"""Calibration of a training program on this machine: per node, the bytes of its output and of the
context its backward keeps, the transient scratch of its forward and backward (tracemalloc), and
its forward time (perf_counter), each measured at two small batches and fitted as ``a + s * batch``.
"""

from __future__ import annotations

import time
import tracemalloc
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from engine.autograd.graph import GraphModel
from engine.autograd.tensor import Tensor
from engine.ir import Node

CALIBRATION_BATCHES = (2, 4)
# forward times are fitted on larger batches (the chunks a streamed step runs are ~8-20 rows) and the
# least of several interleaved rounds: on a loaded machine one round at 2 and 4 rows moved the
# fitted slopes, and with them the plans chosen, by several times
TIMING_BATCHES = (4, 16)
TIMING_ROUNDS = 5
BACKWARD_ROUNDS = 3  # backward times: the least of this many rounds on the same batches


class TrainingProgram(Protocol):
    """What calibration runs: a training program (:class:`engine.training.program.Program`, which calibrates
    itself when made) as seen from here, its computing nodes one at a time. A protocol, so that this module, which
    the program and the streamed step (:mod:`engine.training.stream`) import, imports neither."""

    model: GraphModel
    loss: str
    sample_shape: tuple[int, ...]
    input: str
    output: str

    def _infos(self, batch: int) -> tuple[dict, dict]: ...

    def computing_nodes(self, batch: int) -> list[Node]: ...

    def forward_node(self, node: Node, env: dict[str, np.ndarray], batch: int, replay: bool = False) -> Any: ...

    def loss_grad(self, logits: np.ndarray, target: np.ndarray, scale: float) -> tuple[float, np.ndarray]: ...


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
    # its backward alone (None: not measured, taken as a multiple of the forward): a depthwise conv's
    # backward takes ~5-7x its forward, a BatchNorm's or a Clip's about its forward or less
    backward_s: tuple[float, float] | None = None

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


def calibrate(prog: TrainingProgram) -> Calibration:
    """Run the program unplanned on two small batches, measuring per node the output and saved
    context bytes and the transient scratch (tracemalloc), and its forward on two more (the forward
    time, perf_counter: ``TIMING_BATCHES``, the least of ``TIMING_ROUNDS`` rounds)."""
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
        # one-off allocations (a lazy import, a JIT compile) land in some trace: keep each node's least
        first, second = _trace(prog, nodes, x, target), _trace(prog, nodes, x, target)
        for a, b in zip(first["nodes"], second["nodes"], strict=True):
            a["fscratch"], a["bscratch"] = min(a["fscratch"], b["fscratch"]), min(a["bscratch"], b["bscratch"])
        first["loss"] = min(first["loss"], second["loss"])
        samples.append(first)
    for p in prog.model.params.values():
        p.grad = None
    b1, b2 = CALIBRATION_BATCHES

    def fit(v1: float, v2: float) -> tuple[float, float]:
        s = max(0.0, (v2 - v1) / (b2 - b1))  # never shrinking with the batch (timer noise can say so)
        return max(0.0, v1 - s * b1), s

    xs = [rng.standard_normal((m, *prog.sample_shape)).astype(np.float32) for m in TIMING_BATCHES]
    t1, t2 = _time_forward(prog, nodes, xs)
    slopes = [max(0.0, (v2 - v1) / (TIMING_BATCHES[1] - TIMING_BATCHES[0])) for v1, v2 in zip(t1, t2, strict=True)]
    u1, u2 = _time_backward(prog, nodes, xs, rng)
    back_slopes = [max(0.0, (v2 - v1) / (TIMING_BATCHES[1] - TIMING_BATCHES[0])) for v1, v2 in zip(u1, u2, strict=True)]
    costs = []
    for i in range(len(nodes)):
        a, b = samples[0]["nodes"][i], samples[1]["nodes"][i]
        timed = (max(0.0, t1[i] - slopes[i] * TIMING_BATCHES[0]), slopes[i])
        back = (max(0.0, u1[i] - back_slopes[i] * TIMING_BATCHES[0]), back_slopes[i])
        costs.append(NodeCost(*(fit(a[k], b[k]) for k in ("out", "context", "fscratch", "bscratch")), timed,
                              keeps_inputs=a["keeps_inputs"] | b["keeps_inputs"],
                              keeps_output=a["keeps_output"] or b["keeps_output"], backward_s=back))
    users: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for t in n.inputs:
            if t in prog.model.params:
                users.setdefault(t, []).append(i)
    return Calibration(nodes, costs, fit(samples[0]["loss"], samples[1]["loss"]),
                       {k: p.data.nbytes for k, p in prog.model.params.items()}, users)


def _time_forward(prog: TrainingProgram, nodes: list[Node], xs: list[np.ndarray]) -> list[list[float]]:
    """Each node's forward time on each of ``xs`` (the least of ``TIMING_ROUNDS`` rounds, the
    batches in turns); each output is freed after its last reader."""
    last: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for t in node.inputs:
            last[t] = i
    best = [[float("inf")] * len(nodes) for _ in xs]
    for _ in range(TIMING_ROUNDS):
        for k, x in enumerate(xs):
            env = {prog.input: x}
            for i, node in enumerate(nodes):
                t0 = time.perf_counter()
                out, _ = prog.forward_node(node, env, len(x), replay=True)
                best[k][i] = min(best[k][i], time.perf_counter() - t0)
                env[node.outputs[0]] = out.data
                del out
                for t in set(node.inputs):
                    if last.get(t) == i and t != prog.input:
                        env.pop(t, None)
    return best


def _time_backward(prog: TrainingProgram, nodes: list[Node], xs: list[np.ndarray],
                   rng: np.random.Generator) -> list[list[float]]:
    """Each node's backward time on each of ``xs`` (the least of ``BACKWARD_ROUNDS`` rounds, the
    batches in turns): a forward keeping every context, the loss, then each node's backward timed."""
    best = [[float("inf")] * len(nodes) for _ in xs]
    try:
        for _ in range(BACKWARD_ROUNDS):
            for k, x in enumerate(xs):
                for p in prog.model.params.values():
                    p.grad = None
                env: dict[str, np.ndarray] = {prog.input: x}
                ctx = []
                for node in nodes:
                    out, leaves = prog.forward_node(node, env, len(x), replay=True)
                    env[node.outputs[0]] = out.data
                    ctx.append((out, leaves))
                logits = env[prog.output]
                target = (rng.integers(0, logits.shape[-1], len(x)) if prog.loss == "cross_entropy"
                          else rng.standard_normal(logits.shape).astype(np.float32))
                _, g = prog.loss_grad(logits, target, 1.0)
                del env
                grads = {prog.output: g}
                for i in range(len(nodes) - 1, -1, -1):
                    out, leaves = ctx[i]
                    ctx[i] = None
                    gi = grads.pop(nodes[i].outputs[0], None)
                    t0 = time.perf_counter()
                    _backward_node(out, leaves, gi, grads)
                    best[k][i] = min(best[k][i], time.perf_counter() - t0)
                    del out, leaves, gi
                del ctx, grads
    finally:
        for p in prog.model.params.values():
            p.grad = None
    return best


def _backward_node(out: Any, leaves: dict[str, Tensor], gi: np.ndarray | None, grads: dict[str, np.ndarray]) -> None:
    """One node's backward from its output gradient ``gi``, its inputs' gradients added into ``grads``."""
    if gi is not None and out.tensor._node is not None:
        out.tensor.backward(gi)
        for name, leaf in leaves.items():
            if leaf.grad is not None:
                grads[name] = grads[name] + leaf.grad if name in grads else leaf.grad
    elif gi is not None:
        for name, leaf in leaves.items():
            if leaf is out.tensor:
                grads[name] = gi


def _trace(prog: TrainingProgram, nodes: list[Node], x: np.ndarray, target: np.ndarray) -> dict:
    for p in prog.model.params.values():  # as after zero_grad: no accumulation into earlier gradients
        p.grad = None
    weights = [p.data for p in prog.model.params.values()]
    env: dict[str, np.ndarray] = {prog.input: x}
    per_node, ctx = [], []
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        for node in nodes:
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
                             "keeps_inputs": frozenset(keeps), "keeps_output": keeps_out})
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
            _backward_node(out, leaves, gi, grads)
            cur, peak = tracemalloc.get_traced_memory()
            per_node[i]["bscratch"] = max(0, peak - cur)
            del out, leaves
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return {"nodes": per_node, "loss": loss_scratch}
