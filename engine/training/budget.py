"""Fit a training step into a memory budget: micro-batches (models without BatchNorm), calibrated
progressive recomputation (Melon), and, for models with BatchNorm, streaming the first nodes in
chunks of rows with the whole batch's statistics, re-planning after every choice.

While the live peak (then the planned arena) is over the budget, the step takes the best of two
kinds of moves, each scored ``(bytes freed x steps freed) / seconds added`` from this machine's
calibration: drop a full-batch node's saved state and recompute it in the backward pass, or merge
two streamed segments (their border tensor is no longer kept for the whole batch; the merged
segment's BatchNorms each cost more passes over it). If nothing more helps,
:class:`BudgetError` names the smallest budget the search reached.
"""

from __future__ import annotations

import itertools

import numpy as np

from engine.training.calibrate import NodeCost
from engine.training.program import Program, StepPlan, plan_program
from engine.training.stream import (
    Stream,
    backward_passes,
    carriable,
    carried_grads,
    carried_of,
    fold_of,
    kept_of,
    needed,
    parked_inputs,
)

HEADROOM = 0.1  # of the budget, for what the calibration does not see (allocator rounding, small temporaries)
BACKWARD_FACTOR = 3.0  # a node's forward and backward take about this many times its forward
# a streamed BatchNorm's passes over its segment: one backward (forward and backward) and a second
# forward one for its variance, relative to the backward one alone
PASS_FACTOR = (BACKWARD_FACTOR + 1) / BACKWARD_FACTOR
MOVES_PER_PLAN = 8  # at most this many moves between two re-plans (while far over the budget)


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


def _seconds(prog: Program, i: int, m: int) -> float:
    f = prog.cal.costs[i].forward_s
    return max(f[0] + f[1] * m, 1e-6)


def _backward_seconds(prog: Program, i: int, m: int, calls: int = 1) -> float:
    """Node ``i``'s backward alone at batch ``m``, ``calls`` times: as calibrated, or (an older
    calibration) ``BACKWARD_FACTOR - 1`` times its forward."""
    c = prog.cal.costs[i]
    f = c.backward_s
    if f is None:
        f = tuple((BACKWARD_FACTOR - 1) * v for v in c.forward_s)
    return calls * max(f[0] + f[1] * m, 1e-6)


def _step_seconds(prog: Program, i: int, m: int) -> float:
    """Node ``i``'s forward and backward at batch ``m``."""
    return _seconds(prog, i, m) + _backward_seconds(prog, i, m)


def _merge_scores(prog: Program, batch: int, stream: Stream, at: int) -> list[tuple[float, int, int]]:
    """(score, bytes freed, border) of removing each border of ``stream`` whose tensors are live at
    step ``at``."""
    nodes, costs, n = prog.cal.nodes, prog.cal.costs, len(prog.cal.nodes)
    scores = []
    segs = stream.segments
    for k in range(len(segs) - 1):
        (a, q), (_, b) = segs[k], segs[k + 1]
        seg = prog.segment(q, b)
        freed = 0
        for t in seg.inputs:
            i = next((j for j in range(a, q) if nodes[j].outputs[0] == t), None)
            if i is None or any(j >= b for j in prog.consumers.get(t, ())) or t == prog.output:
                continue  # produced before the left segment, or still read after the merged one
            if not a <= at <= 2 * n - a:
                continue
            freed += NodeCost.at(costs[i].out_bytes, batch)
        if freed <= 0:
            continue
        t1 = sum(_step_seconds(prog, i, batch) for i in range(a, q))
        t2 = sum(_step_seconds(prog, i, batch) for i in range(q, b))
        q1 = sum(nodes[i].op == "BatchNormalization" for i in range(a, q))
        q2 = sum(nodes[i].op == "BatchNormalization" for i in range(q, b))
        added = max((q2 * t1 + q1 * t2) * PASS_FACTOR, 1e-6)
        scores.append((freed * (2 * n - 2 * a) / added, freed, q))
    return scores


def _split_gain(prog: Program, batch: int, stream: Stream, at: int) -> tuple[float, int]:
    """(seconds saved per byte added, bytes added) of a new border at ``at`` inside its segment."""
    nodes = prog.cal.nodes
    a, b = next((a, b) for a, b in stream.segments if a < at < b)
    t1 = sum(_step_seconds(prog, i, batch) for i in range(a, at))
    t2 = sum(_step_seconds(prog, i, batch) for i in range(at, b))
    q1 = sum(nodes[i].op == "BatchNormalization" for i in range(a, at))
    q2 = sum(nodes[i].op == "BatchNormalization" for i in range(at, b))
    added = sum(NodeCost.at(prog.cal.costs[j].out_bytes, batch) for j in range(a, at)
                if any(at <= u < b for u in prog.consumers.get(nodes[j].outputs[0], ()))
                and not any(u >= b for u in prog.consumers.get(nodes[j].outputs[0], ())))
    return (q2 * t1 + q1 * t2) * PASS_FACTOR / max(added, 1), added


def split_segments(prog: Program, plan: StepPlan, budget: int, state_bytes: int, update_bytes: int,
                   tries: int = 4) -> StepPlan:
    """Speed a fitting streamed plan up: add borders (fewer passes over shorter segments, one
    more tensor kept for the whole batch), the best seconds-per-byte first, while it still fits."""
    stream = plan.stream
    # besides one-tensor positions, right before a BatchNorm: its statistics then come from a
    # materialized tensor (no pass recomputing the segment up to it)
    cuts = set(prog.cut_positions) | {q for q, nd in enumerate(prog.cal.nodes) if nd.op == "BatchNormalization"}
    if stream is None:
        return plan
    while True:
        gains = sorted(((_split_gain(prog, plan.batch, stream, q)[0], q) for q in range(1, stream.end)
                        if q in cuts and q not in stream.borders), reverse=True)
        accepted = None
        for gain, q in gains[:tries]:
            if gain <= 0:
                break
            trial = Stream.at(stream.end, stream.chunk, [*stream.borders, q])
            candidate = plan_program(prog, plan.batch, plan.dropped, 1, state_bytes, update_bytes, arena=False,
                                     stream=trial)
            if int(live_profile(candidate.buffers, 2 * len(prog.cal.nodes) + 1).max()) + candidate.pinned_bytes \
                    <= budget:
                accepted = trial
                break
        if accepted is None:
            break
        stream = accepted
    if stream == plan.stream:
        return plan
    full = plan_program(prog, plan.batch, plan.dropped, 1, state_bytes, update_bytes, stream=stream)
    return full if full.total_bytes <= budget else plan


def _add_while_fits(prog: Program, plan: StepPlan, keys: list[int], stream_of, budget: int, state_bytes: int,
                    update_bytes: int, faster: bool = False) -> StepPlan:
    """Greedy over ``keys`` (best first): add each whose stream (``stream_of(chosen)``) keeps the
    live bytes within ``budget`` (and, ``faster``, lowers the estimated time). The placement is
    checked once at the end; only when it does not fit, again key by key (each placed)."""
    n = len(prog.cal.nodes)
    for exact in (False, True):
        chosen: set[int] = set()
        best, best_t = plan, estimated_seconds(prog, plan) if faster else 0.0
        for k in keys:
            trial = stream_of(chosen | {k})
            candidate = plan_program(prog, plan.batch, plan.dropped, 1, state_bytes, update_bytes, arena=False,
                                     stream=trial)
            if int(live_profile(candidate.buffers, 2 * n + 1).max()) + candidate.pinned_bytes > budget:
                continue
            t = estimated_seconds(prog, candidate) if faster else 0.0
            if faster and t >= best_t:
                continue
            if exact:
                candidate = plan_program(prog, plan.batch, plan.dropped, 1, state_bytes, update_bytes, stream=trial)
                if candidate.total_bytes > budget:  # the placement, not only the live bytes, must fit
                    continue
                best = candidate
            chosen.add(k)
            best_t = t
        if not chosen:
            return plan
        if exact:
            return best
        full = plan_program(prog, plan.batch, plan.dropped, 1, state_bytes, update_bytes, stream=stream_of(chosen))
        if full.total_bytes <= budget:
            return full
    return plan


def park_segments(prog: Program, plan: StepPlan, budget: int, state_bytes: int, update_bytes: int) -> StepPlan:
    """Speed a fitting streamed plan up by parking segments (their BatchNorms' inputs kept for the
    whole batch during the segment's own passes, forward and backward, so that the passes do not
    recompute the convolutions before them), the segments with the most BatchNorm passes over the
    most calibrated time first, each while the plan still fits. Those tensors are not kept in
    between, where a step's peak usually is."""
    stream = plan.stream
    if stream is None:
        return plan
    nodes = prog.cal.nodes

    def saved(seg: tuple[int, int]) -> float:
        a, b = seg
        return len(prog.segment(a, b).bns) * sum(_seconds(prog, i, plan.batch) for i in range(a, b))

    keys = [a for a, b in sorted(stream.segments, key=saved, reverse=True) if parked_inputs(nodes, prog.segment(a, b))]
    return _add_while_fits(prog, plan, keys, lambda chosen: Stream.at(
        stream.end, stream.chunk, stream.borders, tuple(chosen), stream.carried), budget, state_bytes, update_bytes)


def carry_segments(prog: Program, plan: StepPlan, budget: int, state_bytes: int, update_bytes: int) -> StepPlan:
    """Speed a fitting streamed plan up by carrying segments' BatchNorm output gradients (whole
    batch, during the segment's backward only): no backward pass runs again through what a later
    pass did. The segments that save the most calibrated time first, each while the plan still fits
    and gets faster."""
    stream = plan.stream
    if stream is None:
        return plan
    base = estimated_seconds(prog, plan)
    options = []
    for a, b in stream.segments:
        if a in stream.carried or not carried_grads(prog.cal.nodes, prog.segment(a, b), prog.consumers, prog.output):
            continue
        trial = Stream.at(stream.end, stream.chunk, stream.borders, stream.parked, (*stream.carried, a))
        saved = base - estimated_seconds(
            prog, plan_program(prog, plan.batch, plan.dropped, 1, state_bytes, update_bytes, arena=False, stream=trial))
        if saved > 0:
            options.append((saved, a))
    keys = [a for _, a in sorted(options, reverse=True)]
    return _add_while_fits(prog, plan, keys, lambda chosen: Stream.at(
        stream.end, stream.chunk, stream.borders, stream.parked, (*stream.carried, *chosen)), budget, state_bytes,
        update_bytes, faster=True)


def _with(stream: Stream, **changes) -> Stream:
    fields = {"parked": stream.parked, "carried": stream.carried, "parked_bns": stream.parked_bns,
              "carried_bns": stream.carried_bns, **changes}
    return Stream.at(stream.end, stream.chunk, stream.borders, **fields)


def _add_faster(prog: Program, plan: StepPlan, options: list[int], field: str, budget: int, state_bytes: int,
                update_bytes: int) -> StepPlan:
    """Greedy over single BatchNorms ``options`` added to the stream's ``field``: the one saving the
    most calibrated time first, each while the plan still fits and gets faster."""
    stream = plan.stream
    assert stream is not None
    base = estimated_seconds(prog, plan)
    scored = []
    for j in options:
        trial = _with(stream, **{field: (*getattr(stream, field), j)})
        saved = base - estimated_seconds(
            prog, plan_program(prog, plan.batch, plan.dropped, 1, state_bytes, update_bytes, arena=False, stream=trial))
        if saved > 0:
            scored.append((saved, j))
    keys = [j for _, j in sorted(scored, reverse=True)]
    return _add_while_fits(prog, plan, keys,
                           lambda chosen: _with(stream, **{field: (*getattr(stream, field), *chosen)}),
                           budget, state_bytes, update_bytes, faster=True)


SUBSET_OPTIONS = 6  # a segment's parking and carrying choices are searched in full up to this many options


def _segment_choices(prog: Program, plan: StepPlan, budget: int, state_bytes: int, update_bytes: int) -> Stream:
    """Segment by segment (those not parked and carried whole), every subset of its BatchNorms'
    inputs parked and of its BatchNorms' output gradients carried (up to ``SUBSET_OPTIONS``
    options): the fastest by the calibration whose live bytes fit, the others as chosen so far."""
    stream = plan.stream
    assert stream is not None
    nodes, n = prog.cal.nodes, len(prog.cal.nodes)
    best_t = estimated_seconds(prog, plan)
    for a, b in stream.segments:
        seg = prog.segment(a, b)
        if a in stream.parked and a in stream.carried and carried_grads(nodes, seg, prog.consumers, prog.output):
            continue
        made = {nodes[i].outputs[0] for i in range(a, b)}
        parkable = [j for j in seg.bns if nodes[j].inputs[0] in made]
        carry_ok = carriable(nodes, seg, prog.consumers, prog.output)
        if not parkable and not carry_ok or len(parkable) + len(carry_ok) > SUBSET_OPTIONS:
            continue
        parked = tuple(x for x in stream.parked if x != a)
        carried = tuple(x for x in stream.carried if x != a)
        pbns = tuple(j for j in stream.parked_bns if not a <= j < b)
        cbns = tuple(j for j in stream.carried_bns if not a <= j < b)
        chosen = None
        for pick in itertools.product(*[(False, True)] * (len(parkable) + len(carry_ok))):
            ps = [j for j, on in zip(parkable, pick[:len(parkable)], strict=True) if on]
            cs = [j for j, on in zip(carry_ok, pick[len(parkable):], strict=True) if on]
            trial = Stream.at(stream.end, stream.chunk, stream.borders, parked, carried, (*pbns, *ps), (*cbns, *cs))
            candidate = plan_program(prog, plan.batch, plan.dropped, 1, state_bytes, update_bytes, arena=False,
                                     stream=trial)
            if int(live_profile(candidate.buffers, 2 * n + 1).max()) + candidate.pinned_bytes > budget:
                continue
            t = estimated_seconds(prog, candidate)
            if t < best_t * (1 - 1e-9):
                best_t, chosen = t, trial
        if chosen is not None:
            stream = chosen
    return stream


def single_batchnorms(prog: Program, plan: StepPlan, budget: int, state_bytes: int, update_bytes: int) -> StepPlan:
    """Speed a fitting streamed plan up where whole segments could not be parked or carried (a
    segment's largest BatchNorm tensor does not fit): single BatchNorms' inputs parked (kept for
    the whole batch during their segment's passes) and single BatchNorms' output gradients carried
    (during its backward, so that the passes below start there), chosen per segment among all
    subsets (:func:`_segment_choices`) when the placed plan fits; else greedily, parked then
    carried, each while the plan still fits and gets faster by the calibration."""
    stream = plan.stream
    if stream is None:
        return plan
    searched = _segment_choices(prog, plan, budget, state_bytes, update_bytes)
    if searched != stream:
        full = plan_program(prog, plan.batch, plan.dropped, 1, state_bytes, update_bytes, stream=searched)
        if full.total_bytes <= budget:
            return full
    nodes = prog.cal.nodes
    options = []
    for a, b in stream.segments:
        seg = prog.segment(a, b)
        made = {nodes[i].outputs[0] for i in range(a, b)}
        if a not in stream.parked:
            options += [j for j in seg.bns if nodes[j].inputs[0] in made]
    plan = _add_faster(prog, plan, options, "parked_bns", budget, state_bytes, update_bytes)
    stream, options = plan.stream, []
    for a, b in stream.segments:
        seg = prog.segment(a, b)
        if not (a in stream.carried and carried_grads(nodes, seg, prog.consumers, prog.output)):
            options += [j for j in carriable(nodes, seg, prog.consumers, prog.output) if j not in stream.carried_bns]
    return _add_faster(prog, plan, options, "carried_bns", budget, state_bytes, update_bytes)


def fit_recompute(prog: Program, batch: int, budget: int, micro_batches: int, state_bytes: int,
                  update_bytes: int, stream: Stream | None = None) -> StepPlan:
    """The plan at ``batch`` with the fewest recomputations and segment merges (chosen greedily)
    that fits ``budget``, starting from ``stream`` (none: nothing streamed)."""
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

    def planned() -> tuple[StepPlan, np.ndarray, int]:
        plan = plan_program(prog, batch, frozenset(dropped), micro_batches, state_bytes, update_bytes, arena=False,
                            stream=stream)
        live = live_profile(plan.buffers, 2 * n + 1)
        return plan, live, int(live.max()) + plan.pinned_bytes

    best: tuple[int, frozenset[int], Stream | None] | None = None
    refused: set = set()  # single moves that did not lower the peak
    last_peak: int | None = None
    undo: tuple | None = None
    single = False  # after a batch of moves raised the peak, one move at a time
    for _ in range(4 * n + 4):
        plan, live, peak = planned()
        if last_peak is not None and peak > last_peak and undo is not None:
            moves, dropped, stream = undo
            if len(moves) == 1:
                refused.add(moves[0])
            single = True
            plan, live, peak = planned()
        elif undo is not None:
            single = False
        last_peak = peak
        if best is None or peak < best[0]:
            best = (peak, frozenset(dropped), stream)
        if peak <= budget:
            full = plan_program(prog, batch, frozenset(dropped), micro_batches, state_bytes, update_bytes,
                                stream=stream)
            if full.total_bytes <= budget:
                return full
        at = int(live.argmax())
        first = stream.end if stream else 0
        scored: list[tuple[float, int, tuple]] = []
        for i, c in enumerate(costs):
            if i < first or i in dropped or ("drop", i) in refused or not i <= at < 2 * n - i:
                continue  # its state must be freed across the peak
            freed = NodeCost.at(c.context_bytes, m) + (NodeCost.at(c.out_bytes, m) if c.keeps_output else 0)
            for t in c.keeps_inputs:  # an input only it keeps for its backward is freed after the forward
                if all(j == i or j in dropped or t not in costs[j].keeps_inputs for j in consumers.get(t, ())):
                    freed += size_of(t)
            if freed > 0:
                scored.append((freed * (2 * n - 2 * i) / _seconds(prog, i, m), freed, ("drop", i)))
        if stream is not None:
            scored += [(sc, freed, ("merge", q)) for sc, freed, q in _merge_scores(prog, batch, stream, at)
                       if ("merge", q) not in refused]
        if not scored:
            break
        scored.sort(key=lambda s: -s[0])
        excess = max(peak - budget, 1)
        moves, covered = [], 0
        for _, freed, move in scored:  # far over the budget: several moves per re-plan
            moves.append(move)
            covered += freed
            if single or covered >= excess or len(moves) >= MOVES_PER_PLAN:
                break
        undo = (moves, set(dropped), stream)
        dropped = dropped | {i for kind, i in moves if kind == "drop"}
        merged = {q for kind, q in moves if kind == "merge"}
        if merged and stream is not None:
            stream = Stream.at(stream.end, stream.chunk, [q for q in stream.borders if q not in merged])
    assert best is not None
    smallest = plan_program(prog, batch, best[1], micro_batches, state_bytes, update_bytes,
                            stream=best[2]).total_bytes
    raise BudgetError(f"batch {batch} ({micro_batches} micro-batch(es)) does not fit {budget} bytes: the smallest "
                      f"plan found needs {smallest} bytes ({len(best[1])} node(s) recomputed)", smallest)


def node_floor(prog: Program, i: int, m: int) -> int:
    """Bytes node ``i`` needs at batch ``m`` whatever is recomputed: its inputs, output, context and
    scratch forward, or its output's and inputs' gradients, context and scratch backward."""
    c, nodes = prog.cal.costs[i], prog.cal.nodes
    producer = {nd.outputs[0]: j for j, nd in enumerate(nodes)}
    ins = sum(NodeCost.at(prog.cal.costs[producer[t]].out_bytes, m) for t in set(nodes[i].inputs) if t in producer)
    out, ctx = NodeCost.at(c.out_bytes, m), NodeCost.at(c.context_bytes, m)
    return max(ins + out + ctx + NodeCost.at(c.forward_scratch, m),
               2 * out + ins + ctx + NodeCost.at(c.backward_scratch, m))


def stream_chunks(prog: Program, batch: int, budget: int) -> list[int]:
    """Chunk sizes to stream with: the largest whose busiest node takes at most an eighth of the
    budget, and twice and four times that (fewer chunks, fewer calls, while the plan fits)."""
    n = len(prog.cal.nodes)
    chunk = max(1, batch // 2)
    while chunk > 1 and max(node_floor(prog, i, chunk) for i in range(n)) > budget // 8:
        chunk //= 2
    return list(dict.fromkeys(c for c in (4 * chunk, 2 * chunk, chunk) if c < batch))


def estimated_seconds(prog: Program, plan: StepPlan) -> float:
    """A step's time by the calibration: each full-batch node forward and backward (plus its
    recomputation when dropped); each streamed segment's passes, chunk by chunk."""
    nodes, costs = prog.cal.nodes, prog.cal.costs
    n, st = len(nodes), plan.stream
    first = st.end if st else 0

    def fwd(i: int, m: int, calls: int) -> float:
        f = costs[i].forward_s
        return calls * (f[0] + f[1] * m)

    total = 0.0
    for i in range(first, n):
        t = fwd(i, plan.micro_batch, plan.micro_batches)
        total += 2 * t if i in plan.dropped else t
        total += _backward_seconds(prog, i, plan.micro_batch, plan.micro_batches)
    if st is None:
        return total
    calls = -(-plan.batch // st.chunk)
    for a, b in st.segments:
        seg = prog.segment(a, b)
        f = {i: fwd(i, st.chunk, calls) for i in range(a, b)}
        whole = sum(f.values())
        kept = kept_of(nodes, seg, st)
        if kept:  # forward: a BatchNorm's statistics read its kept input, or run the nodes to it twice
            have: set[str] = set()
            for j in seg.bns:
                x = nodes[j].inputs[0]
                cost = sum(f[i] for i in needed(nodes, a, j, [x], {*seg.inputs, *have}))
                total += cost if x in kept else 2 * cost
                have |= {x} & set(kept)
            total += sum(f[i] for i in needed(nodes, a, b, seg.outputs, {*seg.inputs, *have}))
            total += sum(f[i] for i in needed(nodes, a, b, kept, set(seg.inputs)))  # the backward's refill
        else:
            fold = fold_of(prog, seg, plan.batch)
            total += sum((1 if fold and j == fold[0] else 2) * sum(f[i] for i in seg.needs[j]) for j in seg.bns)
            total += sum(f[i] for i in range(fold[0], b)) if fold else whole  # the pass writing the outputs
        # backward: each pass recomputes its nodes (a Conv whose output is kept, or read by no later node of
        # the segment, only sets up its backward) and back-propagates through its stretch
        read = {t for i in range(a, b) for t in nodes[i].inputs}
        lite = {i for i in range(a, b) if nodes[i].op == "Conv" and (nodes[i].outputs[0] in kept
                                                                     or nodes[i].outputs[0] not in read)}
        carried = carried_of(nodes, seg, prog.consumers, prog.output, st)
        bw = {i: _backward_seconds(prog, i, st.chunk, calls) for i in range(a, b)}
        for order, top, _, stop, _ in backward_passes(nodes, seg, carried, {*seg.inputs, *kept}):
            total += sum(f[i] for i in order if i not in lite) + sum(bw[i] for i in range(stop, top + 1))
    return total


def _fit_stream_at(prog: Program, batch: int, budget: int, state_bytes: int, update_bytes: int, end: int,
                   chunk: int, floors: tuple[list[int], list[int]]) -> tuple[StepPlan | None, int | None]:
    """The plan streaming ``[0, end)`` (or None), and the smallest total tried."""
    full, chunked = floors
    floor = max(max(full[end:], default=0), max(chunked[:end])) + prog.crossing_bytes(end, batch)
    if floor + state_bytes > budget:  # some node alone cannot fit: no need to search
        return None, None
    borders = [q for q in prog.cut_positions if q < end]  # start fast (short segments), merge while too big
    try:
        return fit_recompute(prog, batch, budget, 1, state_bytes, update_bytes,
                             stream=Stream.at(end, chunk, borders)), None
    except BudgetError as e:
        return None, e.smallest


SPLIT_TRIES = 3  # per chunk size, the fastest this many streamed plans (by the calibration) get their segments split


def fit_streamed(prog: Program, batch: int, budget: int, state_bytes: int, update_bytes: int,
                 tries: int = 8) -> StepPlan:
    """The fastest streamed plan found (by :func:`estimated_seconds`): for each chunk size, the
    shortest prefix that fits (binary search over the positions one tensor crosses) and a few
    longer ones (each starting from short segments, merged while too big), each with its segments
    parked where it fits (:func:`park_segments`); the fastest of them, also sped up by
    :func:`split_segments`, then the fastest over the chunk sizes."""
    n = len(prog.cal.nodes)
    cuts = prog.cut_positions
    full = [node_floor(prog, i, batch) for i in range(n)]
    smallest: list[int] = []
    best: tuple[float, StepPlan] | None = None
    for chunk in stream_chunks(prog, batch, budget):
        floors = (full, [node_floor(prog, i, chunk) for i in range(n)])

        def attempt(end: int, chunk: int = chunk, floors: tuple = floors) -> StepPlan | None:
            plan, least = _fit_stream_at(prog, batch, budget, state_bytes, update_bytes, end, chunk, floors)
            smallest.extend([least] if least else [])
            return plan

        lo, hi = 0, len(cuts) - 1
        found = {hi: attempt(cuts[hi])}
        if found[hi] is None:
            continue
        while lo < hi:
            mid = (lo + hi) // 2
            found[mid] = attempt(cuts[mid])
            lo, hi = (lo, mid) if found[mid] is not None else (mid + 1, hi)
        last = len(cuts) - 1
        for k in dict.fromkeys(hi + (last - hi) * j // tries for j in range(1, tries)):
            if k not in found:
                found[k] = attempt(cuts[k])
        parked = [carry_segments(prog, park_segments(prog, p, budget, state_bytes, update_bytes), budget, state_bytes,
                                 update_bytes) for p in found.values() if p is not None]
        if not parked:
            continue
        ranked = sorted(parked, key=lambda p: estimated_seconds(prog, p))
        for plan in ranked[:SPLIT_TRIES]:  # each chunk's best few, sped up (a split can reorder them)
            split = carry_segments(prog, park_segments(prog, split_segments(prog, plan, budget, state_bytes,
                                                                            update_bytes),
                                                       budget, state_bytes, update_bytes), budget, state_bytes,
                                   update_bytes)
            for p in (plan, split):
                t = estimated_seconds(prog, p)
                if best is None or t < best[0]:
                    best = (t, p)
    if best is None:
        raise BudgetError(f"batch {batch} does not fit {budget} bytes streamed", min(smallest, default=0))
    return single_batchnorms(prog, best[1], budget, state_bytes, update_bytes)


def fit(prog: Program, batch: int, budget: int | None, state_bytes: int, update_bytes: int,
        micro_batches: int | None = None) -> StepPlan:
    """Micro-batches first (without BatchNorm: k = 1, 2, 4, ...), recomputation within each; with
    BatchNorm, recomputation, then a streamed prefix with the whole batch's statistics."""
    if micro_batches is not None and micro_batches > 1 and prog.has_batchnorm:
        raise ValueError("micro-batching is refused for a model with BatchNorm: its batch statistics (and the "
                         "running mean/variance) would be computed per micro-batch and change the result; "
                         "under a memory budget its first layers are streamed with the whole batch's statistics")
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
    smallest = error.smallest
    if prog.has_batchnorm and (micro_batches or 1) == 1:
        try:
            return fit_streamed(prog, batch, budget, state_bytes, update_bytes)
        except BudgetError as e:
            smallest = min(smallest, e.smallest or smallest)
    smallest = -(-smallest * 10 // 9)  # what the plan needs, plus the headroom
    raise BudgetError(f"batch {batch} does not fit a {int(budget / (1 - HEADROOM))}-byte budget; the smallest "
                      f"feasible budget found is {smallest} bytes", smallest)
