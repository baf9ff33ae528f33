"""Differentiable ops: each forward next to its backward.

Arrays are NCHW float32. Convolutions use im2col windows (strided views) forward and scatter the
column gradient back tap by tap; depthwise convs use per-channel einsums instead of a GEMM.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from engine.autograd.tensor import Add, Function, MatMul, MatMulT, Mul, Tensor

try:  # numba (optional) runs depthwise convs as fused loops
    from engine.kernels import jit
except ImportError:  # pragma: no cover - depends on the environment
    jit = None

__all__ = ["Add", "Mul", "MatMul", "MatMulT", "Conv2d", "Relu", "Clip", "HardSwish", "HardSigmoid", "Sigmoid",
           "Softmax", "BatchNorm", "BatchStats", "BatchNormGiven", "warm_streamed_batchnorm", "MaxPool2d",
           "AvgPool2d", "GlobalAvgPool", "GlobalMaxPool", "ReduceMean", "Reshape", "Transpose", "Concat", "Slice",
           "Pad"]


def _windows(xp: np.ndarray, k: tuple[int, int], out_hw: tuple[int, int], stride, dil) -> np.ndarray:
    """(N, C, kh, kw, OH, OW) strided view of every tap's window."""
    n, c, _, _ = xp.shape
    sn, sc, sh, sw = xp.strides
    return as_strided(xp, (n, c, k[0], k[1], out_hw[0], out_hw[1]),
                      (sn, sc, dil[0] * sh, dil[1] * sw, stride[0] * sh, stride[1] * sw))


def _scatter_taps(dwin: np.ndarray, xp_shape, stride, dil) -> np.ndarray:
    """Adjoint of :func:`_windows`: add each tap's gradient back into a padded-input gradient."""
    dxp = np.zeros(xp_shape, np.float32)
    _, _, kh, kw, oh, ow = dwin.shape
    for i in range(kh):
        for j in range(kw):
            y0, x0 = i * dil[0], j * dil[1]
            dxp[:, :, y0 : y0 + stride[0] * (oh - 1) + 1 : stride[0], x0 : x0 + stride[1] * (ow - 1) + 1 : stride[1]] \
                += dwin[:, :, i, j]
    return dxp


def _pad(x: np.ndarray, pads, value: float = 0.0) -> np.ndarray:
    t, l_, b, r = pads
    if not any(pads):
        return x
    return np.pad(x, ((0, 0), (0, 0), (t, b), (l_, r)), constant_values=value)


def _crop(dxp: np.ndarray, pads) -> np.ndarray:
    t, l_, b, r = pads
    return dxp[:, :, t : dxp.shape[2] - b, l_ : dxp.shape[3] - r]


def _out_hw(h, w, k, stride, pads, dil):
    return ((h + pads[0] + pads[2] - dil[0] * (k[0] - 1) - 1) // stride[0] + 1,
            (w + pads[1] + pads[3] - dil[1] * (k[1] - 1) - 1) // stride[1] + 1)


class Conv2d(Function):
    """y = conv(x, w) + b; ``pads`` is (top, left, bottom, right). Given ``out`` (y computed before,
    e.g. kept by a streamed training step), only what the backward needs is set up and ``out`` is
    returned (for a pointwise or depthwise conv that is no work)."""

    def forward(self, x, w, b, stride=(1, 1), pads=(0, 0, 0, 0), dil=(1, 1), group=1, out=None):
        self.stride, self.pads, self.dil, self.group = tuple(stride), tuple(pads), tuple(dil), group
        n, c, h, wd = x.shape
        cout, _, kh, kw = w.shape
        self.k = (kh, kw)
        self.oh, self.ow = _out_hw(h, wd, self.k, self.stride, self.pads, self.dil)
        self.w = w
        self.depthwise = group == c == cout and w.shape[1] == 1
        if self.depthwise and jit is not None:  # fused loops, padding implicit (no padded copy)
            self.x = x
            self.taps = jit.depthwise_taps(wd, self.ow, kw, self.stride[1], self.pads[1], self.dil[1])
            if out is not None:
                return out
            phases = np.empty((self.stride[1], h if self.stride[1] > 1 else 1, -(-wd // self.stride[1])), np.float32)
            y = np.empty((n, c, self.oh, self.ow), np.float32)
            w3, b1 = np.ascontiguousarray(w[:, 0]), np.ascontiguousarray(b, dtype=np.float32)
            xc = np.ascontiguousarray(x)
            if (kh, kw, self.pads, self.dil) == (3, 3, (1, 1, 1, 1), (1, 1)) and self.stride in ((1, 1), (2, 2)) \
                    and wd >= 2:  # MobileNet's depthwise convs: fused rows
                (jit.depthwise3x3_s1 if self.stride == (1, 1) else jit.depthwise3x3_s2)(xc, w3, b1, y)
                return y
            jit.depthwise_batch(xc, w3, b1, y, phases, self.taps, self.stride[0], self.stride[1], self.pads[0],
                                self.dil[0])
            return y
        xp = _pad(x, self.pads)
        self.xp_shape = xp.shape
        win = _windows(xp, self.k, (self.oh, self.ow), self.stride, self.dil)
        if self.depthwise:  # per-tap broadcast multiply-adds: far faster than an einsum on 6-d views
            self.win = win
            y = np.zeros((n, c, self.oh, self.ow), np.float32)
            for i in range(kh):
                for j in range(kw):
                    y += win[:, :, i, j] * w[:, 0, i, j].reshape(1, -1, 1, 1)
        else:
            cg, og = c // group, cout // group
            # A pointwise conv needs no im2col: its columns are the input itself.
            self.pointwise = (kh, kw, self.stride, group) == (1, 1, (1, 1), 1) and not any(self.pads)
            if out is not None and not self.needs_grad(1):  # no weight gradient wanted: no columns
                return out
            self.cols = [x.reshape(n, c, -1)] if self.pointwise else \
                [np.ascontiguousarray(win[:, g * cg : (g + 1) * cg]).reshape(n, cg * kh * kw, -1)
                 for g in range(group)]
            if out is not None:
                return out
            if group == 1:  # one product, written once (no concatenation copy)
                y = (w.reshape(cout, -1) @ self.cols[0]).reshape(n, cout, self.oh, self.ow)
            else:
                y = np.concatenate([w[g * og : (g + 1) * og].reshape(og, -1) @ self.cols[g] for g in range(group)],
                                   axis=1).reshape(n, cout, self.oh, self.ow)
        y = y.astype(np.float32, copy=False)
        if b is not None and b.any():  # a fresh array: the bias goes in place (a conv before a BatchNorm has none)
            y += b.reshape(1, -1, 1, 1)
        return y

    def backward(self, g):
        w, (kh, kw) = self.w, self.k
        n, cout = g.shape[:2]
        db = g.sum(axis=(0, 2, 3)) if self.needs_grad(2) else None
        if self.depthwise and jit is not None:
            want_dw = self.needs_grad(1)
            dx = np.zeros(self.x.shape, np.float32)
            dw3 = np.zeros((w.shape[0], kh, kw), np.float32)
            w3, gc = np.ascontiguousarray(w[:, 0]), np.ascontiguousarray(g, dtype=np.float32)
            jit.depthwise_backward_batch(np.ascontiguousarray(self.x), gc, w3, dx, dw3, self.taps, self.stride[0],
                                         self.stride[1], self.pads[0], self.pads[1], self.dil[0], self.dil[1], want_dw)
            return dx, dw3[:, None] if want_dw else None, db
        if self.depthwise:
            dw = np.empty_like(w)
            dxp = np.zeros(self.xp_shape, np.float32)
            sy, sx = self.stride
            for i in range(kh):
                for j in range(kw):
                    dw[:, 0, i, j] = (self.win[:, :, i, j] * g).sum(axis=(0, 2, 3))
                    y0, x0 = i * self.dil[0], j * self.dil[1]
                    dxp[:, :, y0 : y0 + sy * (self.oh - 1) + 1 : sy, x0 : x0 + sx * (self.ow - 1) + 1 : sx] \
                        += g * w[:, 0, i, j].reshape(1, -1, 1, 1)
            return _crop(dxp, self.pads), dw, db
        og = cout // self.group
        g2 = g.reshape(n, cout, -1)
        want_dx, want_dw = self.needs_grad(0), self.needs_grad(1)  # e.g. no dx for the model's input
        dws, dcols = [], []
        for k in range(self.group):
            gk = g2[:, k * og : (k + 1) * og]
            wk = w[k * og : (k + 1) * og].reshape(og, -1)
            if want_dw:
                dws.append(np.tensordot(gk, self.cols[k], axes=([0, 2], [0, 2])).reshape(og, -1, kh, kw))
            if want_dx:
                dcols.append(wk.T @ gk)
        dw = np.concatenate(dws, axis=0).astype(np.float32, copy=False) if want_dw else None
        if not want_dx:
            return None, dw, db
        if self.pointwise:
            return dcols[0].reshape(n, -1, self.oh, self.ow), dw, db
        dwin = np.concatenate(dcols, axis=1).reshape(n, -1, kh, kw, self.oh, self.ow)
        dx = _crop(_scatter_taps(dwin, self.xp_shape, self.stride, self.dil), self.pads)
        return dx, dw, db


class Relu(Function):
    def forward(self, x):
        self.mask = x > 0
        return x * self.mask

    def backward(self, g):
        return (g * self.mask,)


class Clip(Function):
    def forward(self, x, lo=-np.inf, hi=np.inf):
        if jit is not None and x.dtype == np.float32:  # one pass for the mask and the clipped copy
            flat = np.ascontiguousarray(x).reshape(-1)
            y, self.mask = np.empty(x.shape, np.float32), np.empty(x.shape, np.bool_)
            jit.clip_mask(flat, float(lo), float(hi), y.reshape(-1), self.mask.reshape(-1))
            return y
        self.mask = (x > lo) & (x < hi)
        return np.clip(x, lo, hi).astype(np.float32, copy=False)

    def backward(self, g):
        return (g * self.mask,)


class HardSwish(Function):
    def forward(self, x):
        self.x = x
        return (x * np.clip(x + 3, 0, 6) / 6).astype(np.float32, copy=False)

    def backward(self, g):
        x = self.x
        d = np.where(x < -3, 0.0, np.where(x > 3, 1.0, (2 * x + 3) / 6))
        return ((g * d).astype(np.float32, copy=False),)


class HardSigmoid(Function):
    def forward(self, x, alpha=0.2, beta=0.5):
        z = alpha * x + beta
        self.d = ((z > 0) & (z < 1)) * np.float32(alpha)
        return np.clip(z, 0, 1).astype(np.float32, copy=False)

    def backward(self, g):
        return (g * self.d,)


class Sigmoid(Function):
    def forward(self, x):
        self.y = (1 / (1 + np.exp(-x))).astype(np.float32, copy=False)
        return self.y

    def backward(self, g):
        return (g * self.y * (1 - self.y),)


class Softmax(Function):
    def forward(self, x, axis=-1):
        e = np.exp(x - x.max(axis=axis, keepdims=True))
        self.y, self.axis = e / e.sum(axis=axis, keepdims=True), axis
        return self.y

    def backward(self, g):
        y = self.y
        return (y * (g - (g * y).sum(axis=self.axis, keepdims=True)),)


class BatchNorm(Function):
    """Training-mode BatchNorm over (N, H, W) with batch statistics; updates running stats in
    place (PyTorch's momentum convention: new = (1 - m) * old + m * batch, unbiased variance)."""

    def forward(self, x, gamma, beta, running_mean=None, running_var=None, momentum=0.1, eps=1e-5):
        axes = (0, 2, 3)
        m = x.size // x.shape[1]
        mean = x.mean(axis=axes, keepdims=True)
        xhat = x - mean  # centred once, normalised in place: fewer passes than x.var() then (x - mean)
        var = np.einsum("nchw,nchw->c", xhat, xhat).reshape(mean.shape) / m
        self.inv = (1 / np.sqrt(var + eps)).astype(np.float32)
        xhat *= self.inv
        self.xhat, self.gamma = xhat, gamma.reshape(1, -1, 1, 1)
        if running_mean is not None:
            running_mean *= 1 - momentum
            running_mean += momentum * mean.reshape(-1)
            running_var *= 1 - momentum
            running_var += momentum * var.reshape(-1) * m / max(m - 1, 1)
        y = xhat * self.gamma
        y += beta.reshape(1, -1, 1, 1)
        return y

    def backward(self, g):
        # dx = gamma * inv / m * (m * g - sum(g) - xhat * sum(g * xhat)), per channel
        m = g.size // g.shape[1]
        sum_g = g.sum(axis=(0, 2, 3))
        sum_gx = np.einsum("nchw,nchw->c", g, self.xhat)
        dx = self.xhat * (-sum_gx).reshape(1, -1, 1, 1)
        dx += m * g
        dx -= sum_g.reshape(1, -1, 1, 1)
        dx *= self.gamma * self.inv / m
        return dx.astype(np.float32, copy=False), sum_gx, sum_g


def _add_rows(acc: np.ndarray | None, rows: np.ndarray) -> np.ndarray:
    """``acc + rows[0] + rows[1] + ...`` in float32, row after row: the order in which numpy reduces
    a whole (N, C, H, W) batch over (0, 2, 3) (each row's per-channel sum, added in row order)."""
    acc = np.zeros(rows.shape[1], np.float32) if acc is None else acc
    for row in rows:
        acc += row
    return acc


class BatchStats:
    """One BatchNorm's whole-batch numbers gathered chunk by chunk, so that a batch run in chunks of
    rows normalises and back-propagates bitwise as :class:`BatchNorm` does on the whole batch: every
    sum is the same float32 sum, in the same order (numpy reduces a batch over (0, 2, 3) row after
    row, so each chunk's per-row sums are added to the running ones in row order).

    Forward, two passes over the chunks of the input: :meth:`add` each (the sum, for the mean), then
    :meth:`add_centred` each (the sum of squares around that mean, as ``BatchNorm`` computes its
    variance), then :meth:`finish`. Backward: while ``collecting``, :class:`BatchNormGiven` adds each
    chunk's ``sum(g)`` and ``sum(g * xhat)`` (the gradients of beta and gamma); after
    :meth:`end_collect` every chunk's input gradient uses the batch's sums.

    >>> x = np.arange(16, dtype=np.float32).reshape(4, 1, 2, 2); st = BatchStats()
    >>> st.add(x[:1]); st.add(x[1:]); st.add_centred(x[:3]); st.add_centred(x[3:])
    >>> mean, var = st.finish(0.0); float(mean[0]), float(var[0])
    (7.5, 21.25)
    """

    def __init__(self) -> None:
        self.count = 0
        self._sum: np.ndarray | None = None
        self._squares: np.ndarray | None = None
        self.mean = self.inv = None
        self.sum_g = self.sum_gx = None
        self.collecting = False

    def add(self, x: np.ndarray) -> None:
        self._sum = _add_rows(self._sum, x.sum(axis=(2, 3)))
        self.count += x.size // x.shape[1]

    def add_centred(self, x: np.ndarray) -> None:
        if self.mean is None:
            self.mean = (self._sum / self.count).reshape(1, -1, 1, 1)
        d = x - self.mean
        self._squares = _add_rows(self._squares, np.einsum("nchw,nchw->nc", d, d))

    def finish(self, eps: float) -> tuple[np.ndarray, np.ndarray]:
        """The batch's (mean, biased variance) as float32; sets what :class:`BatchNormGiven` uses."""
        var = self._squares / self.count
        self.inv = (1 / np.sqrt(var + eps)).astype(np.float32).reshape(1, -1, 1, 1)
        return self.mean.reshape(-1), var

    def collect(self, g: np.ndarray, xhat: np.ndarray) -> None:
        """Add one chunk's ``sum(g)`` and ``sum(g * xhat)`` (as ``BatchNorm.backward`` sums them)."""
        self.sum_g = _add_rows(self.sum_g, g.sum(axis=(2, 3)))
        self.sum_gx = _add_rows(self.sum_gx, np.einsum("nchw,nchw->nc", g, xhat))

    def begin_collect(self) -> None:
        self.collecting, self.sum_g, self.sum_gx = True, None, None

    def end_collect(self) -> None:
        self.collecting = False


class BatchNormGiven(Function):
    """Training-mode BatchNorm on one chunk of a batch, with the batch's statistics from ``stats``
    (:class:`BatchStats`); gamma's and beta's gradients are the batch sums, set by the caller. While
    ``stats.collecting`` the backward only adds this chunk's sums and propagates nothing."""

    def forward(self, x, gamma, beta, stats=None):
        self.stats = stats
        self.gamma = gamma.reshape(1, -1, 1, 1)
        if jit is not None and x.dtype == np.float32 and x.ndim == 4:  # one pass: fewer temporaries
            n, c = x.shape[:2]
            xhat, y = np.empty(x.shape, np.float32), np.empty(x.shape, np.float32)
            jit.batchnorm_given(np.ascontiguousarray(x).reshape(n, c, -1), stats.mean.reshape(-1),
                                stats.inv.reshape(-1), np.ascontiguousarray(gamma, np.float32).reshape(-1),
                                np.ascontiguousarray(beta, np.float32).reshape(-1), xhat.reshape(n, c, -1),
                                y.reshape(n, c, -1))
            self.xhat = xhat
            return y
        xhat = x - stats.mean
        xhat *= stats.inv
        self.xhat = xhat
        y = xhat * self.gamma
        y += beta.reshape(1, -1, 1, 1)
        return y

    def backward(self, g):
        st = self.stats
        fused = jit is not None and g.ndim == 4 and g.dtype == np.float32
        n, c = g.shape[:2]
        if st.collecting:
            st.collect(np.ascontiguousarray(g), self.xhat)
            return None, None, None
        m = st.count  # as BatchNorm.backward, with the whole batch's count and sums
        if fused:
            dx = np.empty(g.shape, np.float32)
            scale = (self.gamma * st.inv / m).astype(np.float32, copy=False).reshape(-1)
            jit.batchnorm_given_dx(np.ascontiguousarray(g).reshape(n, c, -1), self.xhat.reshape(n, c, -1),
                                   st.sum_g.reshape(-1), st.sum_gx.reshape(-1), m, scale, dx.reshape(n, c, -1))
            return dx, None, None
        dx = self.xhat * (-st.sum_gx).reshape(1, -1, 1, 1)
        dx += m * g
        dx -= st.sum_g.reshape(1, -1, 1, 1)
        dx *= self.gamma * st.inv / m
        return dx.astype(np.float32, copy=False), None, None


def warm_streamed_batchnorm() -> None:
    """Run :class:`BatchNormGiven` forward and both backwards once on a tiny array, so that their
    compiled loops are loaded (numba's first call) before a measured or budgeted step needs them."""
    x = np.arange(8, dtype=np.float32).reshape(2, 1, 2, 2)
    st = BatchStats()
    st.add(x)
    st.add_centred(x)
    st.finish(1e-5)
    for collect in (True, False):
        st.begin_collect()
        if not collect:
            st.sum_g, st.sum_gx = np.ones(1, np.float32), np.ones(1, np.float32)
            st.end_collect()
        out = BatchNormGiven.apply(Tensor(x, requires_grad=True), Tensor(np.ones(1, np.float32)),
                                   Tensor(np.zeros(1, np.float32)), stats=st)
        out.backward(np.ones_like(x))
        st.end_collect()


class MaxPool2d(Function):
    def forward(self, x, k=(2, 2), stride=(2, 2), pads=(0, 0, 0, 0)):
        self.k, self.stride, self.pads = tuple(k), tuple(stride), tuple(pads)
        oh, ow = _out_hw(x.shape[2], x.shape[3], self.k, self.stride, self.pads, (1, 1))
        xp = _pad(x, self.pads, -np.inf)
        self.xp_shape = xp.shape
        win = _windows(xp, self.k, (oh, ow), self.stride, (1, 1))
        flat = win.reshape(*win.shape[:2], -1, oh, ow) if win.flags.c_contiguous else \
            np.ascontiguousarray(win).reshape(*win.shape[:2], -1, oh, ow)
        self.arg = flat.argmax(axis=2)
        return flat.max(axis=2)

    def backward(self, g):
        kh, kw = self.k
        taps = np.arange(kh * kw).reshape(1, 1, -1, 1, 1)
        dwin = (self.arg[:, :, None] == taps) * g[:, :, None]
        dwin = dwin.reshape(g.shape[0], g.shape[1], kh, kw, *g.shape[2:]).astype(np.float32, copy=False)
        return (_crop(_scatter_taps(dwin, self.xp_shape, self.stride, (1, 1)), self.pads),)


class AvgPool2d(Function):
    def forward(self, x, k=(2, 2), stride=(2, 2), pads=(0, 0, 0, 0), count_include_pad=False):
        self.k, self.stride, self.pads = tuple(k), tuple(stride), tuple(pads)
        oh, ow = _out_hw(x.shape[2], x.shape[3], self.k, self.stride, self.pads, (1, 1))
        xp = _pad(x, self.pads)
        self.xp_shape = xp.shape
        ones = _pad(np.ones((1, 1, *x.shape[2:]), np.float32), self.pads, 0.0 if not count_include_pad else 1.0)
        if count_include_pad:
            ones = np.ones_like(ones)
        self.count = _windows(ones, self.k, (oh, ow), self.stride, (1, 1)).sum(axis=(2, 3))
        pooled = _windows(xp, self.k, (oh, ow), self.stride, (1, 1)).sum(axis=(2, 3)) / self.count
        return pooled.astype(np.float32, copy=False)

    def backward(self, g):
        kh, kw = self.k
        dwin = np.broadcast_to((g / self.count)[:, :, None, None], (*g.shape[:2], kh, kw, *g.shape[2:]))
        return (_crop(_scatter_taps(dwin, self.xp_shape, self.stride, (1, 1)), self.pads),)


class GlobalAvgPool(Function):
    def forward(self, x):
        self.shape = x.shape
        return x.mean(axis=(2, 3), keepdims=True)

    def backward(self, g):
        n = self.shape[2] * self.shape[3]
        return (np.broadcast_to(g / n, self.shape).astype(np.float32, copy=False),)


class GlobalMaxPool(Function):
    def forward(self, x):
        flat = x.reshape(x.shape[0], x.shape[1], -1)
        self.shape, self.arg = x.shape, flat.argmax(axis=2)
        return flat.max(axis=2).reshape(x.shape[0], x.shape[1], *([1] * (x.ndim - 2)))

    def backward(self, g):
        n, c = self.shape[:2]
        dx = np.zeros((n, c, int(np.prod(self.shape[2:]))), np.float32)
        np.put_along_axis(dx, self.arg[..., None], g.reshape(n, c, 1), axis=2)
        return (dx.reshape(self.shape),)


class ReduceMean(Function):
    def forward(self, x, axes=(), keepdims=True):
        self.shape, self.axes = x.shape, tuple(axes)
        y = x.mean(axis=self.axes, keepdims=True)
        return y if keepdims else y.reshape([d for i, d in enumerate(y.shape) if i not in self.axes])

    def backward(self, g):
        kept = [1 if i in self.axes else d for i, d in enumerate(self.shape)]
        n = int(np.prod([self.shape[a] for a in self.axes]))
        return (np.broadcast_to(g.reshape(kept) / n, self.shape).astype(np.float32),)


class Reshape(Function):
    def forward(self, x, shape=()):
        self.shape = x.shape
        return x.reshape(shape)

    def backward(self, g):
        return (g.reshape(self.shape),)


class Transpose(Function):
    def forward(self, x, perm=()):
        self.perm = perm
        return np.ascontiguousarray(x.transpose(perm))

    def backward(self, g):
        return (g.transpose(np.argsort(self.perm)),)


class Concat(Function):
    def forward(self, *xs, axis=0):
        self.axis, self.sizes = axis, [x.shape[axis] for x in xs]
        return np.concatenate(xs, axis=axis)

    def backward(self, g):
        return tuple(np.split(g, np.cumsum(self.sizes)[:-1], axis=self.axis))


class Slice(Function):
    def forward(self, x, index=()):
        self.shape, self.index = x.shape, index
        return np.ascontiguousarray(x[index])

    def backward(self, g):
        dx = np.zeros(self.shape, np.float32)
        dx[self.index] = g
        return (dx,)


class Pad(Function):
    def forward(self, x, pads=(), value=0.0):
        rank = x.ndim
        self.index = tuple(slice(pads[i], pads[i] + x.shape[i]) for i in range(rank))
        return np.pad(x, [(pads[i], pads[i + rank]) for i in range(rank)], constant_values=value)

    def backward(self, g):
        return (g[self.index],)


def linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """``x @ w + b`` (w is (in, out))."""
    y = MatMul.apply(x, w)
    return Add.apply(y, b) if b is not None else y


