"""``python -m engine plan MODEL [--batch N] [--size H W]``: per-node kernel, memory, expected time."""

from __future__ import annotations

import argparse
import json
import sys

from engine.session import InferenceSession


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="show the execution plan of a model (.onnx or engine file)")
    plan.add_argument("model")
    plan.add_argument("--batch", type=int, default=1)
    plan.add_argument("--json", action="store_true", help="print the memory report as JSON as well")
    args = parser.parse_args(argv)

    sess = InferenceSession(args.model)
    shapes = {}
    for t in sess.graph.inputs:
        if any(d is None for d in t.shape[1:]):
            parser.error(f"input {t.name} has unknown dims {t.shape}")
        shapes[t.name] = (args.batch, *t.shape[1:])
    p = sess.plan_for(shapes)
    print(p.table())
    if args.json:
        print(json.dumps(p.memory_report()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
