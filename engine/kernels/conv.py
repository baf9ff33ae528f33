"""Conv kernels: 1x1 GEMM, im2col+GEMM, direct (tap by tap), Winograd F(2,3) and F(4,3), depthwise.

All take NCHW float32 input, weights (Cout, Cin/group, kh, kw), optional bias, optional fused
residual (4th input, same shape as the output) and a fused activation (attrs ``act``,
``act_params``) applied in place on the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided

from engine.kernels import epilogue
from engine.kernels.base import Cost, Kernel, NodeCtx, Step, carve, scratch_size
from engine.ops import conv_attrs


@dataclass(frozen=True)
class ConvGeom:
    n: int
    c: int
    h: int
    w: int
    cout: int
    kh: int
    kw: int
    oh: int
    ow: int
    stride: tuple[int, int]
    pads: tuple[int, int, int, int]  # top, left, bottom, right
    dil: tuple[int, int]
    group: int

    @classmethod
    def of(cls, ctx: NodeCtx) -> ConvGeom:
        """Geometry of a Conv, or of a pool (seen as a depthwise conv with no weights); computed once per node."""
        g = ctx.memo.get("conv_geom")
        if g is None:
            g = ctx.memo["conv_geom"] = cls._of(ctx)
        return g

    @classmethod
    def _of(cls, ctx: NodeCtx) -> ConvGeom:
        x, y = ctx.ins[0].shape, ctx.outs[0].shape
        w = ctx.ins[1].shape if ctx.node.op == "Conv" else (x[1], 1, *ctx.attrs["kernel_shape"])
        a = conv_attrs(ctx.node, w)
        group = a["group"] if ctx.node.op == "Conv" else x[1]
        return cls(x[0], x[1], x[2], x[3], w[0], w[2], w[3], y[2], y[3], tuple(a["strides"]),
                   tuple(a["pads"]), tuple(a["dilations"]), group)

    @property
    def padded(self) -> bool:
        return any(self.pads)

    @property
    def pad_shape(self) -> tuple[int, int, int]:
        top, left, bottom, right = self.pads
        return (self.c, self.h + top + bottom, self.w + left + right)

    @property
    def macs(self) -> int:
        return self.n * self.cout * self.oh * self.ow * (self.c // self.group) * self.kh * self.kw


def pad_into(x: np.ndarray, buf: np.ndarray, top: int, left: int, value: float = 0.0) -> None:
    """Copy ``x`` (C,H,W) into ``buf`` at (top, left), filling only the border strips."""
    _, h, w = x.shape
    buf[:, :top] = value
    buf[:, top + h :] = value
    buf[:, top : top + h, :left] = value
    buf[:, top : top + h, left + w :] = value
    buf[:, top : top + h, left : left + w] = x


def windows(xp: np.ndarray, g: ConvGeom) -> np.ndarray:
    """(C, kh, kw, OH, OW) strided view of the padded input: every tap's input window."""
    sc, sh, sw = xp.strides
    return as_strided(xp, (xp.shape[0], g.kh, g.kw, g.oh, g.ow),
                      (sc, g.dil[0] * sh, g.dil[1] * sw, g.stride[0] * sh, g.stride[1] * sw))


class ConvBase(Kernel):
    ops = ("Conv",)

    def epilogue_bytes(self, ctx: NodeCtx) -> int:
        return epilogue.CHUNK_BYTES if epilogue.needs_scratch(ctx.attrs.get("act")) else 0

    def parts(self, g: ConvGeom) -> list[tuple[tuple[int, ...], type]]:
        """The kernel's scratch views (shape, dtype), carved in this order."""
        return []

    def scratch_bytes(self, ctx: NodeCtx) -> int:
        return scratch_size(*self.parts(ConvGeom.of(ctx))) + self.epilogue_bytes(ctx)

    def carve_scratch(self, ctx: NodeCtx, g: ConvGeom,
                      scratch: np.ndarray) -> tuple[list[np.ndarray], np.ndarray | None]:
        """The views of :meth:`parts`, in order, and the epilogue's chunk after them (None if not needed)."""
        parts = self.parts(g)
        tmp = scratch[scratch_size(*parts):].view(np.float32) if self.epilogue_bytes(ctx) else None
        return carve(scratch, *parts), tmp

    @staticmethod
    def image_windows(ins: list[np.ndarray], n: int, g: ConvGeom, xp: np.ndarray | None) -> np.ndarray:
        """Image ``n``'s sliding windows, read from ``xp`` after padding the image into it when padded."""
        src = ins[0][n]
        if xp is not None:
            pad_into(src, xp, g.pads[0], g.pads[1])
            src = xp
        return windows(src, g)

    def transform(self, ctx: NodeCtx) -> dict[str, np.ndarray]:
        w = ctx.const(1)
        b = ctx.const(2)
        cout = w.shape[0]
        return {"w": w, "b": (b if b is not None else np.zeros(cout, np.float32)).reshape(cout, 1)}

    def transform_streamed(self, ctx: NodeCtx, streamed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        p = ConvBase.transform(self, ctx)  # the bias; "w" is a view of the placeholder, unused
        return {**p, **streamed}

    def finish(self, ctx: NodeCtx, params, y: np.ndarray, r: np.ndarray | None, tmp) -> None:
        """Bias, residual and activation on one image's output viewed as (Cout, OH*OW)."""
        epilogue.bias_residual_act(y, params["b"] if ctx.has_input(2) else None, r, ctx.attrs.get("act"),
                                   ctx.attrs.get("act_params", ()), tmp)

    def residual(self, ctx: NodeCtx, ins: list[np.ndarray], n: int, g: ConvGeom) -> np.ndarray | None:
        return ins[3][n].reshape(g.cout, -1) if len(ins) > 3 and ctx.has_input(3) else None

    def epilogue_cost(self, g: ConvGeom) -> Cost:
        out = g.n * g.cout * g.oh * g.ow
        return Cost(vector_flops=3 * out, bytes=3 * 4 * out, calls=3)


class Conv1x1Gemm(ConvBase):
    """1x1, stride 1, no pad, group 1: the conv *is* a GEMM on the input, no scratch at all."""

    name = "conv1x1_gemm"

    def applies(self, ctx):
        g = ConvGeom.of(ctx)
        return (g.kh, g.kw, g.stride, g.group) == (1, 1, (1, 1), 1) and not g.padded

    def cost(self, ctx):
        g = ConvGeom.of(ctx)
        return Cost(gemm_flops=2 * g.macs, bytes=4 * g.n * (g.c + g.cout) * g.oh * g.ow,
                    calls=g.n) + self.epilogue_cost(g)

    def transform(self, ctx):
        p = super().transform(ctx)
        p["w"] = p["w"].reshape(p["w"].shape[0], -1)  # a view: no copy of the weights
        return p

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        g = ConvGeom.of(ctx)
        x, y = ins[0].reshape(g.n, g.c, -1), outs[0].reshape(g.n, g.cout, -1)
        tmp = scratch.view(np.float32) if self.epilogue_bytes(ctx) else None

        def run():
            for n in range(g.n):
                np.matmul(params["w"], x[n], out=y[n])
                self.finish(ctx, params, y[n], self.residual(ctx, ins, n, g), tmp)

        return run


class ConvIm2col(ConvBase):
    """General conv: pad, gather every tap's window into a (Cin*kh*kw, OH*OW) matrix, one GEMM."""

    name = "conv_im2col"

    def parts(self, g: ConvGeom):
        parts = [((g.c // g.group * g.kh * g.kw, g.oh * g.ow), np.float32)]
        return parts + ([(g.pad_shape, np.float32)] if g.padded else [])

    def cost(self, ctx):
        g = ConvGeom.of(ctx)
        cols = g.n * g.c * g.kh * g.kw * g.oh * g.ow
        # The strided gather runs far below bandwidth: count it as vector work as well as bytes.
        return Cost(gemm_flops=2 * g.macs, vector_flops=2 * cols, bytes=4 * (2 * cols + g.n * g.cout * g.oh * g.ow),
                    calls=g.n * (2 + g.group)) + self.epilogue_cost(g)

    def transform(self, ctx):
        p = super().transform(ctx)
        g = ConvGeom.of(ctx)
        p["w"] = p["w"].reshape(g.group, g.cout // g.group, -1)
        return p

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        g = ConvGeom.of(ctx)
        views, tmp = self.carve_scratch(ctx, g, scratch)
        cols = views[0]
        xp = views[1] if g.padded else None
        cg, og = g.c // g.group, g.cout // g.group
        cols5 = cols.reshape(cg, g.kh, g.kw, g.oh, g.ow)
        y = outs[0].reshape(g.n, g.cout, -1)

        def run():
            for n in range(g.n):
                win = self.image_windows(ins, n, g, xp)
                for k in range(g.group):
                    np.copyto(cols5, win[k * cg : (k + 1) * cg])
                    np.matmul(params["w"][k], cols, out=y[n, k * og : (k + 1) * og])
                self.finish(ctx, params, y[n], self.residual(ctx, ins, n, g), tmp)

        return run


class ConvDirect(ConvBase):
    """Tap-by-tap accumulation: kh*kw small GEMMs; scratch is one window, not kh*kw of them."""

    name = "conv_direct"
    streamed_params = {"taps": 1}  # (taps, Cout, Cin)

    def applies(self, ctx):
        return ConvGeom.of(ctx).group == 1

    def parts(self, g: ConvGeom):
        parts = [((g.c, g.oh * g.ow), np.float32), ((g.cout, g.oh * g.ow), np.float32)]
        return parts + ([(g.pad_shape, np.float32)] if g.padded else [])

    def cost(self, ctx):
        g = ConvGeom.of(ctx)
        taps = g.kh * g.kw
        win = g.n * taps * g.c * g.oh * g.ow
        acc = g.n * taps * g.cout * g.oh * g.ow
        return Cost(gemm_flops=2 * g.macs, vector_flops=2 * win + acc, bytes=4 * (2 * win + 3 * acc),
                    calls=g.n * taps * 3) + self.epilogue_cost(g)

    def transform_bytes(self, ctx):
        return int(ctx.const(1).nbytes)

    def transform(self, ctx):
        p = super().transform(ctx)
        w = p["w"]
        p["taps"] = np.ascontiguousarray(w.transpose(2, 3, 0, 1)).reshape(-1, w.shape[0], w.shape[1])
        return p

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        g = ConvGeom.of(ctx)
        views, tmp = self.carve_scratch(ctx, g, scratch)
        win_buf, acc = views[0], views[1]
        xp = views[2] if g.padded else None
        y = outs[0].reshape(g.n, g.cout, -1)
        win3 = win_buf.reshape(g.c, g.oh, g.ow)

        def run():
            for n in range(g.n):
                win = self.image_windows(ins, n, g, xp)
                for t in range(g.kh * g.kw):
                    np.copyto(win3, win[:, t // g.kw, t % g.kw])
                    if t == 0:
                        np.matmul(params["taps"][t], win_buf, out=y[n])
                    else:
                        np.matmul(params["taps"][t], win_buf, out=acc)
                        y[n] += acc
                self.finish(ctx, params, y[n], self.residual(ctx, ins, n, g), tmp)

        return run


# Winograd F(2x2, 3x3) matrices (Lavin & Gray).
_G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], dtype=np.float64)


class WinogradConv(ConvBase):
    """Winograd F(m,3) for 3x3 stride-1 convs: ``(m+2)^2`` batched GEMMs on transformed tiles; the
    weights are kept transformed (``U = G w G^T``, ``(m+2)^2/9`` of their size)."""

    m = 2  # output tile size
    g_matrix = _G
    streamed_params = {"u": 1}  # (tile positions, Cout, Cin)

    def applies(self, ctx):
        g = ConvGeom.of(ctx)
        return (g.kh, g.kw, g.stride, g.dil, g.group) == (3, 3, (1, 1), (1, 1), 1)

    def tiles(self, g: ConvGeom) -> tuple[int, int]:
        return -(-g.oh // self.m), -(-g.ow // self.m)

    def transform_bytes(self, ctx):
        taps = self.g_matrix.shape[0] ** 2
        return int(ctx.const(1).nbytes) * taps // 9 * 3  # float64 einsum, then the float32 copy

    def transform(self, ctx):
        p = super().transform(ctx)
        w = p.pop("w").astype(np.float64)
        u = np.einsum("ij,ocjk,lk->iloc", self.g_matrix, w, self.g_matrix)  # (m+2, m+2, Cout, Cin)
        p["u"] = np.ascontiguousarray(u.reshape(-1, w.shape[0], w.shape[1]), dtype=np.float32)
        return p


class ConvWinograd23(WinogradConv):
    """Winograd F(2,3): 16 batched GEMMs on transformed 4x4 tiles, 2.25x fewer multiplies than
    im2col."""

    name = "conv_winograd_f23"

    def parts(self, g: ConvGeom):
        th, tw = self.tiles(g)
        parts = [((g.c, 2 * th + 2, 2 * tw + 2), np.float32),  # padded input, whole tiles
                 ((4, g.c, th, tw, 4), np.float32),  # row-transformed tiles
                 ((16, g.c, th * tw), np.float32),  # V
                 ((16, g.cout, th * tw), np.float32),  # M
                 ((2, 4, g.cout, th, tw), np.float32)]  # row-transformed M
        if (g.oh % 2) or (g.ow % 2):
            parts.append(((g.cout, 2 * th, 2 * tw), np.float32))
        return parts

    def cost(self, ctx):
        g = ConvGeom.of(ctx)
        th, tw = self.tiles(g)
        p = g.n * th * tw
        transforms = p * (g.c * (16 + 32) + g.cout * (24 + 8))
        return Cost(gemm_flops=2 * 16 * g.cout * g.c * p, vector_flops=transforms, bytes=4 * 2 * transforms,
                    calls=g.n * 30) + self.epilogue_cost(g)

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        g = ConvGeom.of(ctx)
        th, tw = self.tiles(g)
        (xp, t, v, m, s, *full), tmp = self.carve_scratch(ctx, g, scratch)
        sc, sh, sw = xp.strides
        d = as_strided(xp, (g.c, th, tw, 4, 4), (sc, 2 * sh, 2 * sw, sh, sw))
        v5 = v.reshape(4, 4, g.c, th, tw)
        m5 = m.reshape(4, 4, g.cout, th, tw)
        y = outs[0].reshape(g.n, g.cout, -1)
        top, left = g.pads[0], g.pads[1]

        def run():
            for n in range(g.n):
                pad_into(ins[0][n], xp, top, left)  # zero fill also covers the partial last tiles
                # V = B^T d B, rows then columns
                np.subtract(d[..., 0, :], d[..., 2, :], out=t[0])
                np.add(d[..., 1, :], d[..., 2, :], out=t[1])
                np.subtract(d[..., 2, :], d[..., 1, :], out=t[2])
                np.subtract(d[..., 1, :], d[..., 3, :], out=t[3])
                for r in range(4):
                    np.subtract(t[r][..., 0], t[r][..., 2], out=v5[r, 0])
                    np.add(t[r][..., 1], t[r][..., 2], out=v5[r, 1])
                    np.subtract(t[r][..., 2], t[r][..., 1], out=v5[r, 2])
                    np.subtract(t[r][..., 1], t[r][..., 3], out=v5[r, 3])
                np.matmul(params["u"], v, out=m)
                # Y = A^T M A, rows then columns
                for c in range(4):
                    np.add(m5[0, c], m5[1, c], out=s[0, c])
                    s[0, c] += m5[2, c]
                    np.subtract(m5[1, c], m5[2, c], out=s[1, c])
                    s[1, c] -= m5[3, c]
                dst = full[0] if full else outs[0][n]
                yv = dst.reshape(g.cout, th, 2, tw, 2)
                for a in range(2):
                    np.add(s[a, 0], s[a, 1], out=yv[:, :, a, :, 0])
                    yv[:, :, a, :, 0] += s[a, 2]
                    np.subtract(s[a, 1], s[a, 2], out=yv[:, :, a, :, 1])
                    yv[:, :, a, :, 1] -= s[a, 3]
                if full:
                    np.copyto(outs[0][n], full[0][:, : g.oh, : g.ow])
                self.finish(ctx, params, y[n], self.residual(ctx, ins, n, g), tmp)

        return run


# Winograd F(4x4, 3x3) matrices (Lavin & Gray; interpolation points 0, +-1, +-2, infinity).
_BT4 = np.array([[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0],
                 [0, -2, -1, 2, 1, 0], [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]], dtype=np.float32)
_G4 = np.array([[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6],
                [1 / 24, 1 / 12, 1 / 6], [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]], dtype=np.float64)
_AT4 = np.array([[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]],
                dtype=np.float32)


class ConvWinograd43(WinogradConv):
    """Winograd F(4,3): 36 batched GEMMs on transformed 6x6 tiles, 4x fewer multiplies than im2col
    (F(2,3): 2.25x) at the price of bigger transforms and slightly larger rounding error. The tile
    transforms are small batched matrix products written into scratch (``B^T d B``, ``A^T M A``)."""

    name = "conv_winograd_f43"
    m = 4
    g_matrix = _G4

    def parts(self, g: ConvGeom):
        th, tw = self.tiles(g)
        return [((g.c, 4 * th + 2, 4 * tw + 2), np.float32),  # padded input, whole tiles
                ((g.c, th, tw, 6, 6), np.float32),  # B^T d
                ((g.c, th, tw, 6, 6), np.float32),  # B^T d B
                ((36, g.c, th * tw), np.float32),  # V, one GEMM operand per tile position
                ((36, g.cout, th * tw), np.float32),  # M = U V
                ((g.cout, th, tw, 6, 6), np.float32),  # M per tile
                ((g.cout, th, tw, 4, 6), np.float32),  # A^T M
                ((g.cout, th, tw, 4, 4), np.float32),  # A^T M A
                ((g.cout, 4 * th, 4 * tw), np.float32)]  # whole-tile output

    def cost(self, ctx):
        g = ConvGeom.of(ctx)
        th, tw = self.tiles(g)
        p = g.n * th * tw
        transforms = p * (g.c * 2 * 6 * 36 + g.cout * (2 * 6 * 24 + 2 * 4 * 16))
        copies = p * (g.c * 36 * 2 + g.cout * (36 + 16 * 2))
        return Cost(gemm_flops=2 * 36 * g.cout * g.c * p, vector_flops=transforms, bytes=4 * (transforms + copies),
                    calls=g.n * 10) + self.epilogue_cost(g)

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        g = ConvGeom.of(ctx)
        th, tw = self.tiles(g)
        (xp, bd, v_tiles, v, m, m_tiles, am, y_tiles, full), tmp = self.carve_scratch(ctx, g, scratch)
        sc, sh, sw = xp.strides
        d = as_strided(xp, (g.c, th, tw, 6, 6), (sc, 4 * sh, 4 * sw, sh, sw))
        bt, b = _BT4, np.ascontiguousarray(_BT4.T)
        at, a = _AT4, np.ascontiguousarray(_AT4.T)
        v_by_position = v.reshape(6, 6, g.c, th, tw)
        m_by_position = m.reshape(6, 6, g.cout, th, tw)
        full_tiles = full.reshape(g.cout, th, 4, tw, 4)
        y = outs[0].reshape(g.n, g.cout, -1)
        top, left = g.pads[0], g.pads[1]

        def run():
            for n in range(g.n):
                pad_into(ins[0][n], xp, top, left)  # zero fill also covers the partial last tiles
                np.matmul(bt, d, out=bd)
                np.matmul(bd, b, out=v_tiles)
                np.copyto(v_by_position, v_tiles.transpose(3, 4, 0, 1, 2))
                np.matmul(params["u"], v, out=m)
                np.copyto(m_tiles, m_by_position.transpose(2, 3, 4, 0, 1))
                np.matmul(at, m_tiles, out=am)
                np.matmul(am, a, out=y_tiles)
                np.copyto(full_tiles, y_tiles.transpose(0, 1, 3, 2, 4))
                np.copyto(outs[0][n], full[:, : g.oh, : g.ow])
                self.finish(ctx, params, y[n], self.residual(ctx, ins, n, g), tmp)

        return run


class DepthwiseNumpy(ConvBase):
    """Depthwise (group == Cin == Cout): per tap, a broadcast multiply-add over all channels."""

    name = "depthwise_numpy"

    def applies(self, ctx):
        g = ConvGeom.of(ctx)
        return g.group == g.c == g.cout

    def parts(self, g: ConvGeom):
        parts = [((g.c, g.oh, g.ow), np.float32)]
        return parts + ([(g.pad_shape, np.float32)] if g.padded else [])

    def cost(self, ctx):
        g = ConvGeom.of(ctx)
        taps = g.n * g.c * g.oh * g.ow * g.kh * g.kw
        return Cost(vector_flops=2 * taps, bytes=4 * 3 * taps, calls=2 * g.n * g.kh * g.kw) + self.epilogue_cost(g)

    def transform(self, ctx):
        p = super().transform(ctx)
        p["taps"] = p["w"].reshape(p["w"].shape[0], -1, 1, 1)  # (C, kh*kw, 1, 1) view
        return p

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        g = ConvGeom.of(ctx)
        views, tmp = self.carve_scratch(ctx, g, scratch)
        prod = views[0]
        xp = views[1] if g.padded else None
        taps = [params["taps"][:, t] for t in range(g.kh * g.kw)]
        y = outs[0].reshape(g.n, g.cout, -1)

        def run():
            for n in range(g.n):
                win = self.image_windows(ins, n, g, xp)
                out = outs[0][n]
                for t, w in enumerate(taps):
                    tap = win[:, t // g.kw, t % g.kw]
                    if t == 0:
                        np.multiply(tap, w, out=out)
                    else:
                        np.multiply(tap, w, out=prod)
                        out += prod
                self.finish(ctx, params, y[n], self.residual(ctx, ins, n, g), tmp)

        return run


KERNELS = [Conv1x1Gemm(), ConvIm2col(), ConvDirect(), ConvWinograd23(), ConvWinograd43(), DepthwiseNumpy()]

