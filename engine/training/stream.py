"""Streaming the first nodes of a training step in chunks of rows, with the whole batch's BatchNorm
statistics, so that the step still equals the whole batch's (micro-batching that BatchNorm allows).

The streamed prefix ``[0, end)`` is cut into segments ``[a, b)``. A tensor that crosses a segment
border is materialized (the whole batch, placed in the arena); a tensor used only inside its
segment exists one chunk at a time. A segment with BatchNorms ``j1 < ... < jq`` runs, over all its
chunks:

* forward: two passes ``k`` compute the chunks up to ``jk``'s input (``j1 .. j(k-1)`` normalising
  with the batch statistics already gathered) and gather ``jk``'s sum, then its squares around the
  mean (the float32 sums of the whole batch's BatchNorm, in its order: the step equals the whole
  batch's bitwise up to the weight gradients' sums over chunks); a last pass writes the segment's
  materialized outputs;
* backward: each pass recomputes the chunk's forward and back-propagates from the outputs'
  gradients; pass ``k`` (from ``jq`` down) stops at ``jk`` and gathers its ``sum(g)`` and
  ``sum(g * xhat)``; a last pass writes the gradients of the segment's inputs and parameters.

So a BatchNorm costs two more passes up to it forward (one when its input is the segment's input
or parked, see :func:`fold_of`) and one over its segment backward: the planner
(:mod:`engine.training.budget`) keeps segments short where memory allows. Without BatchNorm a
segment runs one pass each way (recomputation of its chunk's forward in the backward pass).

A parked segment (``Stream.parked``) keeps its BatchNorms' inputs for the whole batch during its
own passes only: forward, each node runs once (the statistics read the kept tensors); backward,
one pass refills them, then each pass recomputes only what follows them (a Conv whose output is
kept, or read by no later node of the segment, only sets up its backward). They are not held in
between, where a step's peak usually is (the whole-batch layers' backward).

A carried segment (``Stream.carried``) keeps, during its backward passes, the gradient of each
BatchNorm's output for the whole batch: the pass that gathers BatchNorm ``jk``'s sums stores the
gradient arriving at it, and the next pass starts there (``jk``'s input gradient, then down to
``j(k-1)``), so no pass back-propagates again through what a later one did: each node's backward
runs once per chunk (a BatchNorm's twice), each weight gradient is summed over the chunks in the
same order as before (bitwise the same step).

Where a whole segment cannot be parked or carried (its largest BatchNorm tensor does not fit the
budget, e.g. a MobileNetV2 block's expansion at full resolution), single BatchNorms can be
(``Stream.parked_bns``, ``Stream.carried_bns``): the carried ones cut the segment's backward into
stretches (see :func:`backward_passes`); within a stretch each other BatchNorm gets its own pass,
as in a segment carrying nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engine.autograd.functions import BatchStats
from engine.training.calibrate import Calibration, NodeCost


@dataclass(frozen=True)
class Stream:
    """Nodes ``[0, end)`` run in chunks of ``chunk`` rows, segment by segment (``segments`` cover
    ``[0, end)`` in order). The segments starting at ``parked`` keep their BatchNorms' inputs for
    the whole batch while their own passes run (forward, then again backward), see
    :func:`parked_inputs`; those starting at ``carried`` keep their BatchNorms' output gradients for
    the whole batch during their backward passes, see :func:`carried_grads`."""

    end: int
    chunk: int
    segments: tuple[tuple[int, int], ...]
    parked: tuple[int, ...] = ()
    carried: tuple[int, ...] = ()
    parked_bns: tuple[int, ...] = ()  # single BatchNorms (node indices) whose input is kept as a parked one
    carried_bns: tuple[int, ...] = ()  # single BatchNorms whose output gradient is carried

    @staticmethod
    def at(end: int, chunk: int, borders: list[int] | tuple[int, ...], parked: tuple[int, ...] = (),
           carried: tuple[int, ...] = (), parked_bns: tuple[int, ...] = (),
           carried_bns: tuple[int, ...] = ()) -> Stream:
        """The stream of ``[0, end)`` cut at ``borders`` (positions strictly inside)."""
        cuts = [0, *sorted(q for q in set(borders) if 0 < q < end), end]
        segments = tuple(zip(cuts[:-1], cuts[1:], strict=True))
        starts = {a for a, _ in segments}
        return Stream(end, chunk, segments, tuple(sorted(a for a in set(parked) if a in starts)),
                      tuple(sorted(a for a in set(carried) if a in starts)),
                      tuple(sorted(j for j in set(parked_bns) if 0 <= j < end)),
                      tuple(sorted(j for j in set(carried_bns) if 0 <= j < end)))

    @property
    def borders(self) -> tuple[int, ...]:
        return tuple(b for _, b in self.segments[:-1])


@dataclass
class Segment:
    """What the executor needs of one segment ``[a, b)``."""

    a: int
    b: int
    inputs: list[str]  # materialized tensors it reads (produced before ``a``, or the model input)
    outputs: list[str]  # tensors it produces that are read after ``b`` (or are the model output)
    bns: list[int]
    needs: dict[int, list[int]]  # BatchNorm j -> the nodes of [a, j) its input depends on, in order
    last_use: dict[str, int]  # tensor -> the last node of the segment reading it


def consumers_of(nodes, activations: set[str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for t in dict.fromkeys(node.inputs):
            if t in activations:
                out.setdefault(t, []).append(i)
    return out


def segment(nodes, a: int, b: int, input_name: str, output_name: str, consumers: dict[str, list[int]]) -> Segment:
    producer = {node.outputs[0]: i for i, node in enumerate(nodes)}
    inputs = list(dict.fromkeys(t for i in range(a, b) for t in nodes[i].inputs
                                if t == input_name or (t in producer and producer[t] < a)))
    outputs = [nodes[i].outputs[0] for i in range(a, b)
               if nodes[i].outputs[0] == output_name or any(j >= b for j in consumers.get(nodes[i].outputs[0], ()))]
    bns = [i for i in range(a, b) if nodes[i].op == "BatchNormalization"]
    needs = {}
    for j in bns:
        want, order = {nodes[j].inputs[0]}, []
        for i in range(j - 1, a - 1, -1):
            if nodes[i].outputs[0] in want:
                order.append(i)
                want.update(t for t in nodes[i].inputs if t in producer)
        needs[j] = order[::-1]
    last_use = {}
    for i in range(a, b):
        for t in nodes[i].inputs:
            last_use[t] = i
    return Segment(a, b, inputs, outputs, bns, needs, last_use)


def parked_inputs(nodes, seg: Segment) -> list[str]:
    """The inputs of ``seg``'s BatchNorms computed inside it: a parked segment keeps them for the
    whole batch during its forward passes and its backward passes (not in between), so that
    statistics passes read them instead of recomputing, and backward passes recompute only what
    follows them (a Conv whose output is kept only sets up its backward)."""
    made = {nodes[i].outputs[0] for i in range(seg.a, seg.b)}
    return list(dict.fromkeys(nodes[j].inputs[0] for j in seg.bns if nodes[j].inputs[0] in made))


def carried_grads(nodes, seg: Segment, consumers: dict[str, list[int]], output: str) -> list[str]:
    """The outputs of ``seg``'s BatchNorms, whose gradients a carried segment keeps for the whole
    batch during its backward passes, so that each pass back-propagates only from one BatchNorm down
    to the one before it (every node's backward runs once per chunk; a BatchNorm's twice: its sums,
    then its input gradient); [] when the segment does not allow it: some tensor other than a
    BatchNorm's output crosses it (a skip inside the segment, or an input also read after the
    segment: its gradient would be summed in another order), or an output of the segment comes from
    before its last BatchNorm. An input read only inside the segment may cross (a residual block's
    input read by its Add): each pass adds its part of that gradient to the whole batch's, which
    sums the parts in the same order as one pass would."""
    ok = carriable(nodes, seg, consumers, output)
    return [nodes[j].outputs[0] for j in seg.bns] if len(ok) == len(seg.bns) else []


def carriable(nodes, seg: Segment, consumers: dict[str, list[int]], output: str) -> list[int]:
    """The BatchNorms of ``seg`` whose output gradient may be carried on its own (see
    :func:`carried_grads`): their output is the only tensor that crosses them."""
    ok = []
    later = {t for t in seg.inputs if t == output or any(u >= seg.b for u in consumers.get(t, ()))}
    for p, j in enumerate(seg.bns):
        out = nodes[j].outputs[0]
        crossing = {t for t in later if any(j < u < seg.b for u in consumers.get(t, ()))}
        crossing |= {nodes[i].outputs[0] for i in range(seg.a, j + 1) if nodes[i].outputs[0] == output
                     or any(u > j for u in consumers.get(nodes[i].outputs[0], ()))}
        if crossing == {out} and not (p < len(seg.bns) - 1 and out in seg.outputs):
            ok.append(j)
    return ok


def kept_of(nodes, seg: Segment, stream: Stream) -> list[str]:
    """The BatchNorm inputs ``seg`` keeps for the whole batch during its own passes: all of them
    when it is parked, else those of its BatchNorms in ``stream.parked_bns``."""
    if seg.a in stream.parked:
        return parked_inputs(nodes, seg)
    made = {nodes[i].outputs[0] for i in range(seg.a, seg.b)}
    return list(dict.fromkeys(nodes[j].inputs[0] for j in seg.bns
                              if j in stream.parked_bns and nodes[j].inputs[0] in made))


def carried_of(nodes, seg: Segment, consumers: dict[str, list[int]], output: str, stream: Stream) -> list[int]:
    """The BatchNorms of ``seg`` whose output gradients its backward carries: all of them when it is
    carried (and allows it), else those in ``stream.carried_bns`` that allow it."""
    if seg.a in stream.carried and carried_grads(nodes, seg, consumers, output):
        return list(seg.bns)
    picked = [j for j in seg.bns if j in stream.carried_bns]
    if not picked:
        return []
    ok = set(carriable(nodes, seg, consumers, output))
    return [j for j in picked if j in ok]


def backward_passes(nodes, seg: Segment, carried: list[int], avail: set[str]) -> list[tuple]:
    """The passes of ``seg``'s backward, in order: ``(order, top, start, stop, kind)``: each runs
    the nodes ``order`` forward (keeping contexts from ``stop`` on), then back-propagates from
    ``top`` down to ``stop``, starting from the segment outputs' gradients (``start`` None) or the
    carried gradient of BatchNorm ``start``'s output. The carried BatchNorms cut the backward into
    stretches; within one, each other BatchNorm (top down) gets a pass gathering its sums
    (``"collect"``: frozen parameters, nothing written), then a last pass goes down to the carried
    BatchNorm below (``"carry"``: gathering its sums, storing the gradient at its output) or to the
    segment's start (``"final"``: writing the inputs' gradients); every node's weight gradient comes
    from that last pass. Without carried BatchNorms: a pass per BatchNorm, then one over the whole
    segment; with all of them carried: each node's backward once (a BatchNorm's twice)."""
    passes = []
    tops = sorted(carried, reverse=True)
    for start, low in zip([None, *tops], [*tops, None], strict=True):
        top = seg.b - 1 if start is None else start
        reads_to = top + 1

        def order(stop: int, reads_to: int = reads_to) -> list[int]:
            reads = {t for i in range(stop, reads_to) for t in nodes[i].inputs}
            return [*needed(nodes, seg.a, stop, reads, avail), *range(stop, reads_to)]

        inner = [j for j in seg.bns if j not in carried and (low is None or j > low) and (start is None or j < start)]
        for j in sorted(inner, reverse=True):
            passes.append((order(j), top, start, j, "collect"))
        stop = seg.a if low is None else low
        passes.append((order(stop), top, start, stop, "final" if low is None else "carry"))
    return passes


def needed(nodes, a: int, b: int, targets, available) -> list[int]:
    """The nodes of ``[a, b)`` that compute ``targets`` from ``available`` tensors, in order."""
    want, keep = set(targets), []
    for i in range(b - 1, a - 1, -1):
        t = nodes[i].outputs[0]
        if t in want and t not in available:
            keep.append(i)
            want.update(nodes[i].inputs)
    return keep[::-1]


def working_sets(cal: Calibration, seg: Segment, chunk: int, consumers: dict[str, list[int]]) -> tuple[int, int]:
    """Bytes one chunk of ``seg`` holds at most: in a forward pass (nothing kept for backward), and
    in a backward pass (its forward with every context kept, then its backward)."""
    costs, nodes = cal.costs, cal.nodes
    a, b = seg.a, seg.b
    length = b - a
    size = {nodes[i].outputs[0]: NodeCost.at(costs[i].out_bytes, chunk) for i in range(a, b)}
    inside = {i: [j for j in consumers.get(nodes[i].outputs[0], ()) if a <= j < b] for i in range(a, b)}
    forward = 0
    for i in range(a, b):
        live = sum(size[nodes[k].outputs[0]] for k in range(a, i + 1) if max([k, *inside[k]]) >= i)
        forward = max(forward, live + NodeCost.at(costs[i].context_bytes, chunk)
                      + NodeCost.at(costs[i].forward_scratch, chunk))

    def fwd(i: int) -> int:
        return i - a

    def bwd(i: int) -> int:
        return 2 * length - (i - a)

    diff = np.zeros(2 * length + 2, np.int64)

    def add(nbytes: int, start: int, end: int) -> None:
        diff[start] += nbytes
        diff[end + 1] -= nbytes

    for i in range(a, b):
        c, t = costs[i], nodes[i].outputs[0]
        end = max([fwd(i), *(fwd(j) for j in inside[i])])
        for j in inside[i]:
            if t in costs[j].keeps_inputs:
                end = max(end, bwd(j))
        if c.keeps_output:
            end = max(end, bwd(i))
        add(size[t], fwd(i), end)
        add(NodeCost.at(c.context_bytes, chunk), fwd(i), bwd(i))
        add(NodeCost.at(c.forward_scratch, chunk), fwd(i), fwd(i))
        add(NodeCost.at(c.backward_scratch, chunk), bwd(i), bwd(i))
        gstart = min((bwd(j) for j in inside[i]), default=length) if t in seg.outputs else \
            min((bwd(j) for j in inside[i]), default=bwd(i))
        add(size[t], min(gstart, bwd(i)), bwd(i))  # its gradient
    for t in seg.inputs:  # input gradients of the chunk, added to the batch's at the end of the pass
        users = [j for j in consumers.get(t, ()) if a <= j < b]
        if users and t in size:
            add(size[t], min(bwd(j) for j in users), 2 * length)
        elif users:
            i_bytes = max((NodeCost.at(costs[j].out_bytes, chunk) for j in users), default=0)
            add(i_bytes, min(bwd(j) for j in users), 2 * length)
    return forward, int(np.cumsum(diff).max())


def fold_of(prog, seg: Segment, batch: int) -> tuple[int, str, str] | None:
    """``(j, x, t)`` when the last pass of ``seg``'s forward can start at its last BatchNorm ``j``:
    the pass gathering ``j``'s statistics parks ``j``'s input ``x`` in the buffer of the output
    ``t`` (same shape), and only ``j`` and the nodes after it run again, reading ``x`` from there
    (the nodes after ``j`` read nothing computed before ``j`` but ``x``, and every output comes
    from them). None when the segment does not allow it."""
    if not seg.bns:
        return None
    nodes = prog.cal.nodes
    j = seg.bns[-1]
    x = nodes[j].inputs[0]
    made_before = {nodes[i].outputs[0] for i in range(seg.a, j)}
    if x not in made_before:
        return None
    for k in range(j, seg.b):
        if any(t in made_before and not (k == j and t == x) for t in nodes[k].inputs):
            return None
    if any(t in made_before for t in seg.outputs):
        return None
    infos, _ = prog._infos(batch)
    same = [t for t in seg.outputs if infos[t].shape == infos[x].shape]
    return (j, x, same[0]) if same else None


class StreamRun:
    """Runs the streamed prefix of one step: :meth:`forward` fills ``env`` with the materialized
    tensors, :meth:`backward` turns their gradients in ``grads`` into parameter gradients."""

    def __init__(self, prog, plan, batch: int, update: Callable[[int, int], None]) -> None:
        self.prog, self.plan, self.stream = prog, plan, plan.stream
        self.nodes = prog.cal.nodes
        self.update = update  # called with a segment's (a, b) once its parameters' gradients are final
        activations = {prog.input, *(n.outputs[0] for n in self.nodes)}
        self.consumers = consumers_of(self.nodes, activations)
        self.segments = [prog.segment(a, b) for a, b in self.stream.segments]
        self.spans = [(lo, min(batch, lo + self.stream.chunk)) for lo in range(0, batch, self.stream.chunk)]
        self.stats: dict[int, BatchStats] = {}
        self.batch = batch
        self.shapes = {t: info.shape for t, info in prog._infos(batch)[0].items()}

    # -- one chunk -----------------------------------------------------------------------------------
    def _forward_chunk(self, seg: Segment, env_full: dict, lo: int, hi: int, order, keep_from: int | None,
                       store: dict | None = None, copy: set[str] = frozenset(),
                       kept: dict | None = None, unread: frozenset[int] = frozenset()) -> tuple[dict, dict]:
        """Run ``order`` (node indices of ``seg``) on rows ``lo:hi``; contexts of nodes from
        ``keep_from`` on are kept for a backward; ``store`` receives the segment's outputs (inputs
        in ``copy`` are read as copies of their rows: their buffer is overwritten); ``kept`` holds
        whole-batch tensors computed before (a Conv in ``order`` whose output is kept only sets up
        its backward, as does one in ``unread``: a backward pass reads neither its output nor, with
        frozen weights, its input)."""
        env = {t: env_full[t][lo:hi].copy() if t in copy else env_full[t][lo:hi] for t in seg.inputs}
        kept = kept or {}
        for t, arr in kept.items():
            env[t] = arr[lo:hi]
        ctx: dict[int, tuple] = {}
        last = {}
        for i in order:
            for t in self.nodes[i].inputs:
                last[t] = i
        for i in order:
            node = self.nodes[i]
            assert node.op != "BatchNormalization" or i in self.stats, "streamed BatchNorms use gathered statistics"
            t = node.outputs[0]
            given = env[t] if t in kept and node.op == "Conv" else None
            if i in unread:
                given = np.broadcast_to(np.zeros((), np.float32), (hi - lo, *self.shapes[t][1:]))
            res, leaves = self.prog.forward_node(node, env, hi - lo, replay=True, bn_stats=self.stats.get(i),
                                                 given=given)
            env[t] = res.data
            if store is not None and t in store:
                store[t][lo:hi] = res.data
                if t not in last:  # read by later segments only
                    del env[t]
            if keep_from is not None and i >= keep_from:
                ctx[i] = (res.tensor, leaves)
            del res, leaves
            for s in node.inputs:
                if last.get(s) == i and s in env:
                    del env[s]
        return env, ctx

    def _input_grads(self, seg: Segment, grads: dict, grads_full: dict, lo: int, hi: int) -> None:
        """Add one chunk's gradients of the segment's inputs to the whole batch's."""
        for t in seg.inputs:
            g = grads.pop(t, None)
            if g is None or t == self.prog.input:
                continue
            if t not in grads_full:
                grads_full[t] = np.zeros((self.batch, *g.shape[1:]), np.float32)
            grads_full[t][lo:hi] += g

    def _kept_buffers(self, seg: Segment) -> dict[str, np.ndarray]:
        """Whole-batch buffers of the BatchNorm inputs a segment keeps (see :func:`kept_of`)."""
        kept = kept_of(self.nodes, seg, self.stream)
        if not kept:
            return {}
        infos, _ = self.prog._infos(self.batch)
        return {t: np.empty(infos[t].shape, np.float32) for t in kept}

    # -- the prefix --------------------------------------------------------------------------------
    def forward(self, env: dict) -> None:
        nodes = self.nodes
        infos, _ = self.prog._infos(self.batch)
        for seg in self.segments:
            kept = self._kept_buffers(seg)
            store = {t: kept[t] if t in kept else np.empty(infos[t].shape, np.float32) for t in seg.outputs}
            fold = None if kept else fold_of(self.prog, seg, self.batch)
            have: dict[str, np.ndarray] = {}  # kept tensors filled so far
            for j in seg.bns:
                st, x = BatchStats(), nodes[j].inputs[0]
                parked = fold is not None and j == fold[0]
                order = needed(nodes, seg.a, j, [x], {*seg.inputs, *have})
                for lo, hi in self.spans:  # its sum, then the squares around the mean (two passes)
                    out, _ = self._forward_chunk(seg, env, lo, hi, order, None, kept=have)
                    st.add(out[x])
                    if parked:
                        store[fold[2]][lo:hi] = out[x]
                    elif x in kept and x not in have:
                        kept[x][lo:hi] = out[x]
                    del out
                if x in kept:
                    have[x] = kept[x]
                for lo, hi in self.spans:
                    if parked or x in have:
                        st.add_centred((store[fold[2]] if parked else have[x])[lo:hi])
                        continue
                    out, _ = self._forward_chunk(seg, env, lo, hi, order, None, kept=have)
                    st.add_centred(out[x])
                    del out
                self.stats[j] = st
                self.prog.gathered_batchnorm(nodes[j], st)
            if fold is None:
                order = needed(nodes, seg.a, seg.b, seg.outputs, {*seg.inputs, *have})
                for lo, hi in self.spans:
                    self._forward_chunk(seg, env, lo, hi, order, None, store, kept=have)
            else:
                j, x, parked = fold
                for lo, hi in self.spans:
                    part = {**env, x: store[parked]}
                    tail = Segment(j, seg.b, [*seg.inputs, x], seg.outputs, [], {}, {})
                    self._forward_chunk(tail, part, lo, hi, range(j, seg.b), None, store, copy={x})
            env.update(store)
            del kept, have

    def backward(self, env: dict, grads: dict) -> None:
        n, ends, nodes = len(self.nodes), self.plan.ends, self.nodes
        for seg in reversed(self.segments):
            kept = self._kept_buffers(seg)
            if kept:  # recompute the kept tensors once: the passes below start from them
                order = needed(nodes, seg.a, seg.b, list(kept), set(seg.inputs))
                for lo, hi in self.spans:
                    self._forward_chunk(seg, env, lo, hi, order, None, store=kept)
            avail = {*seg.inputs, *kept}
            params = {t for i in range(seg.a, seg.b) for t in nodes[i].inputs if t in self.prog.model.params}
            read = {t for i in range(seg.a, seg.b) for t in nodes[i].inputs}
            unread = frozenset(i for i in range(seg.a, seg.b)  # convs only the next segments read
                               if nodes[i].op == "Conv" and nodes[i].outputs[0] not in read)
            carried = carried_of(nodes, seg, self.consumers, self.prog.output, self.stream)
            self._backward_passes(seg, env, grads, kept, backward_passes(nodes, seg, carried, avail), unread, params)
            del kept
            for j in seg.bns:
                self.prog.batchnorm_grads(nodes[j], self.stats[j])
            for t in seg.outputs:
                grads.pop(t, None)
            done = 2 * n - seg.a
            for t in [t for t in env if t in ends and ends[t] <= done]:
                del env[t]
            self.update(seg.a, seg.b)

    def _backward_passes(self, seg: Segment, env: dict, grads: dict, kept: dict, passes: list[tuple],
                         unread: frozenset[int], params: set[str]) -> None:
        """Run ``passes`` (:func:`backward_passes`) over the chunks: a pass from a carried BatchNorm
        starts from the whole-batch gradient of its output the pass down to it stored; a pass
        gathering a BatchNorm's sums runs with the segment's parameters frozen and writes nothing."""
        nodes = self.nodes
        infos, _ = self.prog._infos(self.batch)
        stored: dict[int, np.ndarray] = {}  # carried BatchNorm -> the gradient of its output, whole batch
        for order, top, start, stop, kind in passes:
            st = self.stats.get(stop) if kind != "final" else None
            if st is not None:
                st.begin_collect()
            below = np.empty(infos[nodes[stop].outputs[0]].shape, np.float32) if kind == "carry" else None
            frozen = [self.prog.model.params[p] for p in params] if kind == "collect" else []
            for p in frozen:
                p.requires_grad = False
            try:
                for lo, hi in self.spans:
                    _, ctx = self._forward_chunk(seg, env, lo, hi, order, stop, kept=kept, unread=unread)
                    if start is None:
                        g = {t: grads[t][lo:hi] for t in seg.outputs if t in grads}
                    else:
                        g = {nodes[start].outputs[0]: stored[start][lo:hi]}
                    if kind == "carry":
                        self.prog.backward_nodes(range(top, stop, -1), ctx, g)
                        below[lo:hi] = g[nodes[stop].outputs[0]]
                        self.prog.backward_nodes((stop,), ctx, g)  # gathers the BatchNorm's sums only
                    else:
                        self.prog.backward_nodes(range(top, stop - 1, -1), ctx, g)
                    if kind != "collect":
                        self._input_grads(seg, g, grads, lo, hi)  # (the inputs read by this pass's nodes)
                    del ctx, g
            finally:
                for p in frozen:
                    p.requires_grad = True
            if st is not None:
                st.end_collect()
            if start is not None and kind != "collect":
                del stored[start]
            if below is not None:
                stored[stop] = below
