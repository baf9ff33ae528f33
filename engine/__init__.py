"""streamflow's embedded tensor engine: graph IR, ONNX import, multi-kernel ops chosen by a cost
model, a static memory arena, an inference session, and autograd for on-device training.

It imports numpy (plus, optionally, onnx for import, numba for faster kernels and threadpoolctl
for BLAS thread control) and knows nothing about streams.

>>> from engine import GraphBuilder, InferenceSession
>>> b = GraphBuilder(); x = b.input("x", (None, 4)); b.output(b.relu(x))
>>> InferenceSession(b.build()).run(np.array([[-1, 2, -3, 4]], "float32"))  # doctest: +SKIP
"""

from engine.builder import GraphBuilder
from engine.format import ModelFile, load_model, save_model
from engine.ir import Graph, GraphError, Node, TensorInfo
from engine.session import InferenceSession

__all__ = ["Graph", "GraphBuilder", "GraphError", "InferenceSession", "ModelFile", "Node", "TensorInfo",
           "load_model", "save_model"]
