"""ResNet-18/50 and MobileNetV2 built with the engine's GraphBuilder (random weights, BatchNorm
already folded into conv biases), for benchmarks that must not depend on PyTorch.

>>> g = resnet(18, size=64)                 # doctest: +SKIP
>>> sum(w.nbytes for w in g.weights.values()) // 2**20   # doctest: +SKIP
44
"""

from __future__ import annotations

import numpy as np

from engine.builder import GraphBuilder
from engine.ir import Graph


class _Init:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def conv(self, cout: int, cin: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        std = np.sqrt(2.0 / (cin * k * k))  # He init keeps activations in range through depth
        w = (self.rng.standard_normal((cout, cin, k, k)) * std).astype(np.float32)
        return w, (self.rng.standard_normal(cout) * 0.01).astype(np.float32)


def resnet(depth: int = 18, size: int = 224, classes: int = 1000, seed: int = 0) -> Graph:
    """torchvision's ResNet-18 (basic blocks) or ResNet-50 (bottlenecks), batch 1."""
    layers = {18: [2, 2, 2, 2], 34: [3, 4, 6, 3], 50: [3, 4, 6, 3]}[depth]
    bottleneck = depth >= 50
    init, b = _Init(seed), GraphBuilder(f"resnet{depth}")
    x = b.input("x", (1, 3, size, size))

    def conv(h, cin, cout, k, stride=1, relu=True):
        w, bias = init.conv(cout, cin, k)
        y = b.conv(h, w, bias, strides=stride, pads=k // 2)
        return b.relu(y) if relu else y

    h = b.max_pool(conv(x, 3, 64, 7, 2), 3, 2, 1)
    cin = 64
    for stage, blocks in enumerate(layers):
        width = 64 * 2**stage
        cout = width * 4 if bottleneck else width
        for i in range(blocks):
            stride = 2 if stage > 0 and i == 0 else 1
            if bottleneck:
                y = conv(conv(conv(h, cin, width, 1), width, width, 3, stride), width, cout, 1, relu=False)
            else:
                y = conv(conv(h, cin, width, 3, stride), width, cout, 3, relu=False)
            short = conv(h, cin, cout, 1, stride, relu=False) if stride != 1 or cin != cout else h
            h, cin = b.relu(b.add(y, short)), cout
    w = (init.rng.standard_normal((cin, classes)) / np.sqrt(cin)).astype(np.float32)
    b.output(b.linear(b.flatten(b.global_avg_pool(h)), w, np.zeros(classes, np.float32)))
    return b.build()


def mobilenetv2(size: int = 224, classes: int = 1000, seed: int = 0) -> Graph:
    """MobileNetV2 (width 1.0), batch 1."""
    init, b = _Init(seed), GraphBuilder("mobilenetv2")
    x = b.input("x", (1, 3, size, size))

    def conv(h, cin, cout, k, stride=1, group=1, act=True):
        w, bias = init.conv(cout, cin // group, k)
        y = b.conv(h, w, bias, strides=stride, pads=k // 2, group=group)
        return b.relu6(y) if act else y

    h, cin = conv(x, 3, 32, 3, 2), 32
    for t, c, n, s in [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                       (6, 160, 3, 2), (6, 320, 1, 1)]:
        for i in range(n):
            stride, hidden = (s if i == 0 else 1), cin * t
            y = conv(h, cin, hidden, 1) if t != 1 else h
            y = conv(conv(y, hidden, hidden, 3, stride, group=hidden), hidden, c, 1, act=False)
            h, cin = (b.add(y, h) if stride == 1 and cin == c else y), c
    h = conv(h, cin, 1280, 1)
    w = (init.rng.standard_normal((1280, classes)) / np.sqrt(1280)).astype(np.float32)
    b.output(b.linear(b.flatten(b.global_avg_pool(h)), w, np.zeros(classes, np.float32)))
    return b.build()
