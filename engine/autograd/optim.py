"""Optimizers with PyTorch's update rules (so results can be compared step for step).

Updates run in place, block by block, so a step's scratch is a few blocks rather than copies of
the largest parameter; :meth:`Optimizer.update` applies one parameter's update on its own, so a
trainer may update a parameter as soon as its gradient is final (``begin_step`` first).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from engine.autograd.tensor import Tensor

BLOCK = 1 << 14  # elements per block of an in-place update (64 KiB of float32)


def blocks(*arrays: np.ndarray) -> Iterator[tuple[np.ndarray, ...]]:
    """Matching flat slices of same-sized arrays, ``BLOCK`` elements at a time (views, writable)."""
    flat = [a.reshape(-1) for a in arrays]
    for lo in range(0, flat[0].size, BLOCK):
        yield tuple(f[lo : lo + BLOCK] for f in flat)


class Optimizer:
    def __init__(self, params: Iterable[Tensor]) -> None:
        self.params = [p for p in params if p.requires_grad]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def begin_step(self) -> None:
        """Once per step, before the first :meth:`update` (step counters)."""

    def update(self, p: Tensor) -> None:
        """Apply ``p``'s update from ``p.grad`` (nothing when it has none)."""
        raise NotImplementedError

    def step(self) -> None:
        self.begin_step()
        for p in self.params:
            self.update(p)

    def state_bytes(self) -> int:
        """Bytes of state the optimizer keeps between steps (once every parameter has been updated)."""
        return 0

    def scratch_bytes(self) -> int:
        """Bytes of temporaries one :meth:`update` allocates at most (a few blocks)."""
        return 3 * self._block_bytes()

    def _block_bytes(self) -> int:
        return 4 * min(BLOCK, max((p.data.size for p in self.params), default=0))


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

    def update(self, p: Tensor) -> None:
        if p.grad is None:
            return
        v = self.velocity.get(id(p)) if self.momentum else None
        if self.momentum and v is None:
            v = self.velocity[id(p)] = np.empty_like(p.data)
            first = True
        else:
            first = False
        for (w, g, *vb) in blocks(p.data, p.grad, *([v] if v is not None else [])):
            if self.wd:
                g = g + self.wd * w
            if vb:
                if first:
                    vb[0][...] = g
                else:
                    vb[0] *= self.momentum
                    vb[0] += g
                g = vb[0]
            w -= (self.lr * g).astype(w.dtype)

    def state_bytes(self) -> int:
        return sum(p.data.nbytes for p in self.params) if self.momentum else 0


class Adam(Optimizer):
    """Adam (Kingma & Ba) with bias correction, as ``torch.optim.Adam``."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params)
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.m: dict[int, np.ndarray] = {}
        self.v: dict[int, np.ndarray] = {}
        self.t = 0

    def begin_step(self) -> None:
        self.t += 1

    def update(self, p: Tensor) -> None:
        if p.grad is None:
            return
        b1, b2 = self.betas
        if id(p) not in self.m:
            self.m[id(p)], self.v[id(p)] = np.zeros_like(p.data), np.zeros_like(p.data)
        for w, g, m, v in blocks(p.data, p.grad, self.m[id(p)], self.v[id(p)]):
            if self.wd:
                g = g + self.wd * w
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            m_hat = m / (1 - b1**self.t)
            v_hat = v / (1 - b2**self.t)
            w -= (self.lr * m_hat / (np.sqrt(v_hat) + self.eps)).astype(w.dtype)

    def state_bytes(self) -> int:
        return 2 * sum(p.data.nbytes for p in self.params)

    def scratch_bytes(self) -> int:
        return 6 * self._block_bytes()
