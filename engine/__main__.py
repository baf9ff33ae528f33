"""``python -m engine plan MODEL [--batch N] [--tune] [--budget BYTES] [--json]``: per-node kernel,
memory, expected time, and why each kernel was chosen. With ``--train``: the training step's plan
(SGD with momentum, cross-entropy) under ``--budget``: what is recomputed, micro-batched and where
each tensor lives."""

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
    plan.add_argument("--budget", type=int, help="cap the arena at this many bytes")
    plan.add_argument("--train", action="store_true", help="plan a training step instead (engine.training)")
    args = parser.parse_args(argv)
    if args.train:
        return _train_plan(args, parser)

    sess = InferenceSession(args.model, tune=args.tune, memory_budget=args.budget)
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


def _train_plan(args, parser) -> int:
    from engine.autograd import SGD, GraphModel
    from engine.session import load_graph
    from engine.training import BudgetedTrainer, BudgetError

    graph = load_graph(args.model)
    shape = graph.inputs[0].shape[1:]
    if any(d is None for d in shape):
        parser.error(f"input {graph.inputs[0].name} has unknown dims {graph.inputs[0].shape}")
    model = GraphModel(graph)
    trainer = BudgetedTrainer(model, SGD(model.parameters(), lr=0.01, momentum=0.9), memory_budget=args.budget)
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
