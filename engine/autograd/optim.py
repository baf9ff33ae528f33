"""Optimizers with PyTorch's update rules (so results can be compared step for step)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from engine.autograd.tensor import Tensor


class Optimizer:
    def __init__(self, params: Iterable[Tensor]) -> None:
        self.params = [p for p in params if p.requires_grad]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        raise NotImplementedError


class SGD(Optimizer):
    """SGD with momentum and weight decay: ``v = m*v + g (+wd*p); p -= lr*v``.

    >>> p = Tensor(np.ones(2, np.float32), requires_grad=True); p.grad = np.ones(2, np.float32)
    >>> SGD([p], lr=0.1).step(); p.data
    array([0.9, 0.9], dtype=float32)
    """

    def __init__(self, params, lr: float = 0.01, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        super().__init__(params)
        self.lr, self.momentum, self.wd = lr, momentum, weight_decay
        self.velocity: dict[int, np.ndarray] = {}

    def step(self) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            g = p.grad + self.wd * p.data if self.wd else p.grad
            if self.momentum:
                v = self.velocity.get(id(p))
                v = g.copy() if v is None else v * self.momentum + g
                self.velocity[id(p)] = v
                g = v
            p.data -= (self.lr * g).astype(p.data.dtype)


class Adam(Optimizer):
    """Adam (Kingma & Ba) with bias correction, as ``torch.optim.Adam``."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params)
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.m: dict[int, np.ndarray] = {}
        self.v: dict[int, np.ndarray] = {}
        self.t = 0

    def step(self) -> None:
        self.t += 1
        b1, b2 = self.betas
        for p in self.params:
            if p.grad is None:
                continue
            g = p.grad + self.wd * p.data if self.wd else p.grad
            m = self.m.get(id(p), np.zeros_like(p.data)) * b1 + (1 - b1) * g
            v = self.v.get(id(p), np.zeros_like(p.data)) * b2 + (1 - b2) * g * g
            self.m[id(p)], self.v[id(p)] = m, v
            m_hat = m / (1 - b1**self.t)
            v_hat = v / (1 - b2**self.t)
            p.data -= (self.lr * m_hat / (np.sqrt(v_hat) + self.eps)).astype(p.data.dtype)
