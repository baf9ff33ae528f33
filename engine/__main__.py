"""``python -m engine plan MODEL [--batch N] [--tune] [--arena-budget BYTES] [--json] [--cold]``:
per-node kernel, memory, expected time, and why each kernel was chosen; ``--cold`` plans for the
first run (:class:`engine.coldstart.session.ColdSession`) and adds its preparation/execution schedule.

``python -m engine plan MODEL --budget 8MB``: the budgeted (FlexNN) plan, weights included: per unit
what is loaded, computed and freed, and the expected time (a non-streamable MODEL, e.g. ``.onnx``,
is first written as a streamable copy in a temporary file).

``python -m engine plan MODEL --train --batch N --budget 64MB``: the training step's plan (SGD with
momentum, cross-entropy) under the budget: what is recomputed, micro-batched and where each tensor lives."""

from __future__ import annotations

import argparse
import json
import sys

from engine.ir import GraphError
from engine.session import InferenceSession


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="show the execution plan of a model (.onnx or engine file)")
    plan.add_argument("model")
    plan.add_argument("--batch", type=int, default=1)
    plan.add_argument("--json", action="store_true", help="print the memory report as JSON as well")
    plan.add_argument("--tune", action="store_true", help="time every candidate kernel instead of estimating")
    plan.add_argument("--arena-budget", type=int, help="cap the activation arena at this many bytes")
    plan.add_argument("--budget", help="run (or, with --train, train) within this many bytes (e.g. 8MB); "
                                       "inference streams the weights")
    plan.add_argument("--cold", action="store_true",
                      help="the cold path's plan (first-run costs) and its first run's prepare/execute schedule")
    plan.add_argument("--train", action="store_true", help="plan a training step instead (engine.training)")
    args = parser.parse_args(argv)
    if args.train:
        return _train_plan(args, parser)
    if args.budget is not None:
        return _budgeted(args, parser)
    if args.cold:
        return cold_plan(args.model, args.batch)

    sess = InferenceSession(args.model, tune=args.tune, memory_budget=args.arena_budget)
    shapes = {}
    for t in sess.graph.inputs:
        if any(d is None for d in t.shape[1:]):
            parser.error(f"input {t.name} has unknown dims {t.shape}")
        shapes[t.name] = (args.batch, *t.shape[1:])
    try:
        p = sess.plan_for(shapes)
    except GraphError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(p.table())
    if args.json:
        print(json.dumps(p.memory_report()))
    return 0


def _budgeted(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import tempfile

    from engine.memory.budgeted import BudgetedSession, parse_bytes
    from engine.memory.streamable import save_streamable

    try:
        budget = parse_bytes(args.budget)
    except ValueError as e:
        parser.error(str(e))
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        try:
            sess = BudgetedSession(path, budget)
        except (GraphError, ValueError):  # not laid out for streaming: write a streamable copy
            path = f"{tmp}/model.sfe"
            save_streamable(args.model, path)
            sess = BudgetedSession(path, budget)
        shapes = {t.name: (args.batch, *t.shape[1:]) for t in sess.graph.inputs}
        try:
            bp = sess.plan_for(shapes)
        except GraphError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        finally:
            sess.close()
    print(bp.table())
    if args.json:
        print(json.dumps(bp.report()))
    return 0


def cold_plan(model: str, batch: int) -> int:
    """Run a :class:`ColdSession` once on zeros; print its plan and the pipelined schedule."""
    import numpy as np

    from engine.coldstart.session import ColdSession

    sess = ColdSession(model, warm_switch=False)
    feeds = {t.name: np.zeros((batch, *t.shape[1:]), np.float32) for t in sess.graph.inputs}
    sess.run(feeds)
    print(sess.plan_for({k: v.shape for k, v in feeds.items()}).table())
    print(sess.schedule())


def _train_plan(args, parser) -> int:
    from engine.autograd import SGD, GraphModel
    from engine.session import load_graph
    from engine.training import BudgetedTrainer, BudgetError

    graph = load_graph(args.model)
    shape = graph.inputs[0].shape[1:]
    if any(d is None for d in shape):
        parser.error(f"input {graph.inputs[0].name} has unknown dims {graph.inputs[0].shape}")
    model = GraphModel(graph)
    from engine.memory.budgeted import parse_bytes

    try:
        budget = parse_bytes(args.budget) if args.budget is not None else None
    except ValueError as e:
        parser.error(str(e))
    trainer = BudgetedTrainer(model, SGD(model.parameters(), lr=0.01, momentum=0.9), memory_budget=budget)
    try:
        plan = trainer.plan_for(args.batch, tuple(shape))
    except BudgetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(plan.table())
    if args.json:
        print(json.dumps(plan.report()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
