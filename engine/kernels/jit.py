"""numba loops (an optional accelerator): fused depthwise conv and a one-pass conv epilogue.

Importing this module raises ImportError when numba is missing; callers fall back to numpy.
Activation codes: 0 none, 1 relu, 2 clip(p0, p1), 3 hardswish, 4 hardsigmoid(alpha=p0, beta=p1),
5 sigmoid.
"""

from __future__ import annotations

import numba
import numpy as np

from engine.kernels.activation import act_row
from engine.kernels.nchwc_loops import nchwc_conv, nchwc_depthwise, nchwc_maxpool  # noqa: F401 - generated, ours too


@numba.njit(cache=True, nogil=True, error_model="numpy")
def bias_act(y, b, r, has_b, has_r, code, p0, p1):  # pragma: no cover - compiled
    """In place on y (C, M): y = act(y + b[:, None] + r)."""
    c_n, m_n = y.shape
    for c in range(c_n):
        row = y[c]
        if has_b:
            bc = b[c]
            for m in range(m_n):
                row[m] += bc
        if has_r:
            res = r[c]
            for m in range(m_n):
                row[m] += res[m]
        act_row(row, code, p0, p1)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def depthwise_taps(wd: int, ow_n: int, kw: int, sw: int, pl: int, dw: int) -> np.ndarray:
    """Per kernel column j: (first output col, end output col, first source col, source phase),
    computed once at bind time so the hot loop does no integer division."""
    taps = np.zeros((kw, 4), np.int64)
    for j in range(kw):
        off = j * dw - pl
        lo = 0 if off >= 0 else (-off + sw - 1) // sw
        hi = 0 if wd - 1 - off < 0 else min(ow_n, (wd - 1 - off) // sw + 1)
        phase = off % sw  # input column (lo + k) * sw + off lives in phase off % sw
        taps[j] = (lo, max(hi, lo), lo + (off - phase) // sw if sw > 1 else lo + off, phase)
    return taps


@numba.njit(cache=True, nogil=True, error_model="numpy")
def depthwise(x, w, b, r, has_r, out, phases, taps, sh, sw, pt, dh, code, p0, p1):  # pragma: no cover
    """out (C, OH, OW) = act(depthwise_conv(x (C, H, W), w (C, KH, KW)) + b + r), padding implicit.

    ``phases`` (sw, H, ceil(W / sw)) is scratch: for strided convs each channel is split once into
    its sw column phases so every tap reads a contiguous slice. Inner loops run over slices indexed from 0 so
    numba drops negative-index wraparound checks and vectorises them (a 6x difference)."""
    c_n, h, wd = x.shape
    _, oh_n, ow_n = out.shape
    kh, kw = w.shape[1], w.shape[2]
    for c in range(c_n):
        if sw > 1:
            for yy in range(h):
                xrow = x[c, yy]
                for ph in range(sw):
                    dst_ph = phases[ph, yy]
                    for t in range((wd - ph + sw - 1) // sw):
                        dst_ph[t] = xrow[t * sw + ph]
        for oh in range(oh_n):
            row = out[c, oh]
            bc = b[c]
            for k in range(ow_n):
                row[k] = bc
            for i in range(kh):
                ih = oh * sh - pt + i * dh
                if ih < 0 or ih >= h:
                    continue
                xrow = x[c, ih]
                for j in range(kw):
                    lo, hi = taps[j, 0], taps[j, 1]
                    if hi <= lo:
                        continue
                    wv = w[c, i, j]
                    dst = row[lo:hi]
                    if sw == 1:
                        src = xrow[taps[j, 2] : taps[j, 2] + hi - lo]
                    else:
                        src = phases[taps[j, 3], ih, taps[j, 2] : taps[j, 2] + hi - lo]
                    for k in range(hi - lo):
                        dst[k] += wv * src[k]
            if has_r:
                res = r[c, oh]
                for k in range(ow_n):
                    row[k] += res[k]
            act_row(row, code, p0, p1)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def winograd23_in(x, v, th, tw, pt, pl):  # pragma: no cover - compiled
    """V (16, C, th*tw) = B^T d B for every 4x4 input tile d (stride 2, implicit zero padding)."""
    c_n, h, wd = x.shape
    d = np.zeros((4, 4), np.float32)
    t = np.empty((4, 4), np.float32)
    for c in range(c_n):
        for ty in range(th):
            y0 = 2 * ty - pt
            for tx in range(tw):
                x0 = 2 * tx - pl
                for i in range(4):
                    for j in range(4):
                        yy, xx = y0 + i, x0 + j
                        d[i, j] = x[c, yy, xx] if (0 <= yy < h and 0 <= xx < wd) else 0.0
                for j in range(4):
                    t[0, j] = d[0, j] - d[2, j]
                    t[1, j] = d[1, j] + d[2, j]
                    t[2, j] = d[2, j] - d[1, j]
                    t[3, j] = d[1, j] - d[3, j]
                p = ty * tw + tx
                for i in range(4):
                    v[4 * i + 0, c, p] = t[i, 0] - t[i, 2]
                    v[4 * i + 1, c, p] = t[i, 1] + t[i, 2]
                    v[4 * i + 2, c, p] = t[i, 2] - t[i, 1]
                    v[4 * i + 3, c, p] = t[i, 1] - t[i, 3]


@numba.njit(cache=True, nogil=True, error_model="numpy")
def winograd23_out(m, out, b, r, has_r, th, tw, code, p0, p1):  # pragma: no cover - compiled
    """out = act(A^T M A + b + r) for every tile, cropping the partial last row/column of tiles."""
    co_n, oh_n, ow_n = out.shape
    s = np.empty((2, 4), np.float32)
    y = np.empty(4, np.float32)
    for co in range(co_n):
        bc = b[co]
        for ty in range(th):
            for tx in range(tw):
                p = ty * tw + tx
                for j in range(4):
                    m0, m1, m2, m3 = m[j, co, p], m[4 + j, co, p], m[8 + j, co, p], m[12 + j, co, p]
                    s[0, j] = m0 + m1 + m2
                    s[1, j] = m1 - m2 - m3
                for a in range(2):
                    y[2 * a] = s[a, 0] + s[a, 1] + s[a, 2] + bc
                    y[2 * a + 1] = s[a, 1] - s[a, 2] - s[a, 3] + bc
                for a in range(2):
                    oy = 2 * ty + a
                    if oy >= oh_n:
                        continue
                    for e in range(2):
                        ox = 2 * tx + e
                        if ox >= ow_n:
                            continue
                        val = y[2 * a + e]
                        if has_r:
                            val += r[co, oy, ox]
                        out[co, oy, ox] = _act_scalar(val, code, p0, p1)


@numba.njit(inline="always")
def _act_scalar(v, code, p0, p1):
    if code == 1:
        return max(v, np.float32(0.0))
    if code == 2:
        return min(max(v, np.float32(p0)), np.float32(p1))
    if code == 3:
        return v * min(max(v + np.float32(3.0), np.float32(0.0)), np.float32(6.0)) / np.float32(6.0)
    if code == 4:
        return min(max(v * np.float32(p0) + np.float32(p1), np.float32(0.0)), np.float32(1.0))
    if code == 5:
        return np.float32(1.0) / (np.float32(1.0) + np.exp(-v))
    return v


@numba.njit(cache=True, nogil=True, error_model="numpy")
def depthwise_backward(x, g, w, dx, dw_, taps, sh, sw, pt, pl, dh, dil_w, want_dw=True):  # pragma: no cover
    """Gradients of a depthwise conv for one image: dx (C, H, W) += conv^T(g), dw_ (C, KH, KW) +=
    correlation(x, g) (unless not ``want_dw``). ``taps`` as for :func:`depthwise` (column ranges per
    kernel column)."""
    c_n, h, wd = x.shape
    _, oh_n, ow_n = g.shape
    kh, kw = w.shape[1], w.shape[2]
    for c in range(c_n):
        for oh in range(oh_n):
            grow = g[c, oh]
            for i in range(kh):
                ih = oh * sh - pt + i * dh
                if ih < 0 or ih >= h:
                    continue
                xrow = x[c, ih]
                dxrow = dx[c, ih]
                for j in range(kw):
                    lo, hi = taps[j, 0], taps[j, 1]
                    if hi <= lo:
                        continue
                    wv = w[c, i, j]
                    acc = np.float32(0.0)
                    gs = grow[lo:hi]
                    if sw == 1 and not want_dw:
                        start = lo + j * dil_w - pl
                        dxs = dxrow[start : start + hi - lo]
                        for k in range(hi - lo):
                            dxs[k] += wv * gs[k]
                    elif sw == 1:
                        start = lo + j * dil_w - pl
                        xs = xrow[start : start + hi - lo]
                        dxs = dxrow[start : start + hi - lo]
                        for k in range(hi - lo):
                            acc += gs[k] * xs[k]
                            dxs[k] += wv * gs[k]
                    else:
                        for k in range(hi - lo):
                            col = (lo + k) * sw + j * dil_w - pl
                            acc += gs[k] * xrow[col]
                            dxrow[col] += wv * gs[k]
                    dw_[c, i, j] += acc


@numba.njit(cache=True, nogil=True, error_model="numpy")
def batchnorm_given(x, mean, inv, gamma, beta, xhat, y):  # pragma: no cover - compiled
    """xhat = (x - mean) * inv and y = xhat * gamma + beta per channel, in one pass over x (N, C, M)
    (the same float32 operations, in the same order, as the numpy expression)."""
    n_n, c_n, m_n = x.shape
    for n in range(n_n):
        for c in range(c_n):
            mu, s, g, b = mean[c], inv[c], gamma[c], beta[c]
            xr, hr, yr = x[n, c], xhat[n, c], y[n, c]
            for k in range(m_n):
                v = (xr[k] - mu) * s
                hr[k] = v
                yr[k] = v * g + b


@numba.njit(cache=True, nogil=True, error_model="numpy")
def clip_mask(x, lo, hi, y, mask):  # pragma: no cover - compiled
    """y = clip(x, lo, hi) and mask = lo < x < hi over flat arrays, in one pass."""
    lo32, hi32 = np.float32(lo), np.float32(hi)
    for k in range(x.shape[0]):
        v = x[k]
        mask[k] = (v > lo32) and (v < hi32)
        y[k] = min(max(v, lo32), hi32)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def batchnorm_given_dx(g, xhat, sum_g, sum_gx, m, scale, dx):  # pragma: no cover - compiled
    """dx = (xhat * -sum_gx + m * g - sum_g) * scale per channel over (N, C, M): the float32
    operations of :meth:`BatchNormGiven.backward`, in one pass."""
    n_n, c_n, m_n = g.shape
    mf = np.float32(m)
    for n in range(n_n):
        for c in range(c_n):
            gr, hr, dr = g[n, c], xhat[n, c], dx[n, c]
            a, b, s = -sum_gx[c], sum_g[c], scale[c]
            for k in range(m_n):
                v = hr[k] * a
                v += mf * gr[k]
                v -= b
                dr[k] = v * s


@numba.njit(cache=True, nogil=True, error_model="numpy")
def depthwise_batch(x, w, b, out, phases, taps, sh, sw, pt, dh):  # pragma: no cover - compiled
    """:func:`depthwise` (no residual, no activation) over every image of x (N, C, H, W): one call
    for a batch instead of one per image."""
    for k in range(x.shape[0]):
        depthwise(x[k], w, b, out[k], False, out[k], phases, taps, sh, sw, pt, dh, 0, 0.0, 0.0)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def depthwise_backward_batch(x, g, w, dx, dw_, taps, sh, sw, pt, pl, dh, dil_w, want_dw):  # pragma: no cover
    """:func:`depthwise_backward` over every image of a batch."""
    for k in range(x.shape[0]):
        depthwise_backward(x[k], g[k], w, dx[k], dw_, taps, sh, sw, pt, pl, dh, dil_w, want_dw)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def depthwise3x3_s1(x, w, b, out):  # pragma: no cover - compiled
    """A 3x3 depthwise conv, stride 1, padding 1, of x (N, C, H, W >= 2) into out (N, C, H, W): each
    output row in one pass per input row with its three taps (9 short passes for the general loop)."""
    n_n, c_n, h, wd = x.shape
    for n in range(n_n):
        for c in range(c_n):
            bc = b[c]
            xc, oc = x[n, c], out[n, c]
            for oh in range(h):
                row = oc[oh]
                for k in range(wd):
                    row[k] = bc
                for i in range(3):
                    ih = oh - 1 + i
                    if ih < 0 or ih >= h:
                        continue
                    xr = xc[ih]
                    wa, wb, wc = w[c, i, 0], w[c, i, 1], w[c, i, 2]
                    row[0] += wb * xr[0] + wc * xr[1]
                    for k in range(1, wd - 1):
                        row[k] += wa * xr[k - 1] + wb * xr[k] + wc * xr[k + 1]
                    row[wd - 1] += wa * xr[wd - 2] + wb * xr[wd - 1]


@numba.njit(cache=True, nogil=True, error_model="numpy")
def depthwise3x3_s2(x, w, b, out):  # pragma: no cover - compiled
    """As :func:`depthwise3x3_s1` with stride 2 (out (N, C, ceil(H / 2), ceil(W / 2)))."""
    n_n, c_n, h, wd = x.shape
    oh_n, ow_n = out.shape[2], out.shape[3]
    inner = (wd - 2) // 2 + 1  # columns k >= 1 with 2k + 1 <= wd - 1
    for n in range(n_n):
        for c in range(c_n):
            bc = b[c]
            xc, oc = x[n, c], out[n, c]
            for oh in range(oh_n):
                row = oc[oh]
                for k in range(ow_n):
                    row[k] = bc
                for i in range(3):
                    ih = 2 * oh - 1 + i
                    if ih < 0 or ih >= h:
                        continue
                    xr = xc[ih]
                    wa, wb, wc = w[c, i, 0], w[c, i, 1], w[c, i, 2]
                    row[0] += wb * xr[0] + wc * xr[1]
                    for k in range(1, inner):
                        row[k] += wa * xr[2 * k - 1] + wb * xr[2 * k] + wc * xr[2 * k + 1]
                    for k in range(max(inner, 1), ow_n):  # a last column whose right tap is padding
                        row[k] += wa * xr[2 * k - 1] + wb * xr[2 * k]
