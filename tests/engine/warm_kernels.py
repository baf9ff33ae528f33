"""Fill numba's on-disk cache with the engine's loops while the suite does other work.

``tests/conftest.py`` starts this in a niced child process at the start of a session when numba is installed. A
fresh checkout has no cache, and the first test that runs a numba kernel would otherwise spend ~1.5 min of CPU
compiling; this runs the same compiles on the core the suite leaves idle (it mostly waits on brokers and JVMs).
The workloads are real ones: inference over the reference models' layers and a training step, so the cache
gets the specialisations the tests call, whatever they are. Nothing is asserted here; a failure only means the
tests compile for themselves.

    python tests/engine/warm_kernels.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    sys.path[:0] = [str(ROOT), str(Path(__file__).parent)]
    import engine_zoo
    import numpy as np

    from engine.autograd import GraphModel, cross_entropy
    from engine.onnx_import import from_onnx
    from engine.session import InferenceSession

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 64, 64), dtype=np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        for name, kwargs in (("mobilenetv2", {}), ("resnet18", {}), ("mobilenetv2", {"width": 0.35, "classes": 10})):
            path = engine_zoo.export(engine_zoo.build(name, **kwargs), f"{tmp}/{name}.onnx", size=64)
            InferenceSession(path).run(x)
        unfolded = engine_zoo.export(engine_zoo.build("mobilenetv2", width=0.35, classes=10), f"{tmp}/train.onnx",
                                     size=64, fold=False)
        model = GraphModel(from_onnx(unfolded))
        cross_entropy(model(x)["y"], rng.integers(0, 10, 2)).backward()
    return 0


if __name__ == "__main__":
    sys.exit(main())
