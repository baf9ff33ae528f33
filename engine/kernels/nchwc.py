"""Channel-blocked (NCHWc) kernels: activations stored as (N, C/16, H, W, 16), weights packed once
(when :mod:`engine.layout` rewrites the graph) into the layout the loops read.

Why: in NCHW a 1x1 conv is a GEMM on short rows and a depthwise conv a per-channel stencil; with
16 channels contiguous, every conv tap is a 16-lane vector multiply-add, and the dense conv keeps a
register tile of 4 pixels x 64 output channels (:mod:`engine.kernels.nchwc_gen`). No im2col, no
padded copies, bias/residual/activation in the same pass.

The numba loops (``needs_jit``) are the warm kernels; each op also has a numpy kernel (correct,
slower) so a plan exists before numba or the ahead-of-time loops are loaded (the cold path).

>>> x = np.arange(2 * 20 * 3 * 3, dtype=np.float32).reshape(2, 20, 3, 3)
>>> blocked = to_blocked(x)
>>> blocked.shape
(2, 2, 3, 3, 16)
>>> bool((from_blocked(blocked, 20) == x).all())
True
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from engine.kernels import accel, epilogue
from engine.kernels.base import Cost, Kernel, NodeCtx, Step, carve, scratch_size
from engine.ops import NCHWC_BLOCK as B
from engine.ops import conv_attrs


def blocks(channels: int) -> int:
    """Channel blocks needed for ``channels`` (the last one zero-padded)."""
    return -(-channels // B)


# --- packing (done once, by the layout pass) -----------------------------------------------------
def to_blocked(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """(N, C, H, W) -> (N, C/16, H, W, 16), padded channels zero."""
    n, c, h, w = x.shape
    cb = blocks(c)
    if out is None:
        out = np.empty((n, cb, h, w, B), np.float32)
    full = c // B
    if full:
        np.copyto(out[:, :full], x[:, : full * B].reshape(n, full, B, h, w).transpose(0, 1, 3, 4, 2))
    if c % B:
        tail = out[:, full]
        tail[..., c % B :] = 0.0
        np.copyto(tail[..., : c % B], x[:, full * B :].transpose(0, 2, 3, 1))
    return out


def from_blocked(x: np.ndarray, channels: int, out: np.ndarray | None = None) -> np.ndarray:
    """(N, C/16, H, W, 16) -> (N, channels, H, W)."""
    n, cb, h, w, _ = x.shape
    if out is None:
        out = np.empty((n, channels, h, w), np.float32)
    np.copyto(out, x.transpose(0, 1, 4, 2, 3).reshape(n, cb * B, h, w)[:, :channels])
    return out


def pack_conv_weight(w: np.ndarray, input_block: int) -> np.ndarray:
    """(Cout, Cin, KH, KW) -> (Cout/16, Cin/bi, KH, KW, bi, 16), zero-padded."""
    co, ci, kh, kw = w.shape
    cbo, cbi = blocks(co), -(-ci // input_block)
    padded = np.zeros((cbo * B, cbi * input_block, kh, kw), np.float32)
    padded[:co, :ci] = w
    return np.ascontiguousarray(padded.reshape(cbo, B, cbi, input_block, kh, kw).transpose(0, 2, 4, 5, 3, 1))


def pack_depthwise_weight(w: np.ndarray) -> np.ndarray:
    """(C, 1, KH, KW) -> (C/16, KH, KW, 16), zero-padded."""
    c, _, kh, kw = w.shape
    padded = np.zeros((blocks(c) * B, kh, kw), np.float32)
    padded[:c] = w[:, 0]
    return np.ascontiguousarray(padded.reshape(-1, B, kh, kw).transpose(0, 2, 3, 1))


def pack_channels(v: np.ndarray, channels: int) -> np.ndarray:
    """A per-channel vector (C values) -> (C/16, 16), zero-padded."""
    out = np.zeros(blocks(channels) * B, np.float32)
    out[:channels] = np.asarray(v, np.float32).reshape(-1)
    return out.reshape(-1, B)


# --- geometry --------------------------------------------------------------------------------------
class BlockedGeom:
    """Per-image views and loop arguments of a blocked conv/pool node."""

    def __init__(self, ctx: NodeCtx) -> None:
        x, y = ctx.ins[0].shape, ctx.outs[0].shape
        a = conv_attrs(ctx.node, (0, 0, *ctx.attrs["kernel_shape"]))
        self.n, self.h, self.w = x[0], x[2], x[3]
        self.input_block = x[4] if len(x) == 5 else 1
        self.cbi = x[1]
        self.cbo, self.oh, self.ow = y[1], y[2], y[3]
        self.kh, self.kw = a["kernel"]
        self.sh, self.sw = a["strides"]
        self.pt, self.pl, self.pb, self.pr = a["pads"]
        self.dh, self.dw = a["dilations"]
        # a 1x1 stride-1 unpadded conv reads and writes whole images as one long row of pixels
        self.flat = (self.kh, self.kw, self.sh, self.sw, self.pt, self.pl, self.pb, self.pr) == (1, 1, 1, 1, 0, 0, 0, 0)

    @property
    def loop_args(self) -> tuple[int, ...]:
        return self.sh, self.sw, self.pt, self.pl, self.dh, self.dw

    def image_in(self, x: np.ndarray, n: int) -> np.ndarray:
        img = x[n] if self.input_block != 1 else x[n].reshape(self.cbi, self.h, self.w, 1)
        return img.reshape(img.shape[0], 1, self.h * self.w, img.shape[-1]) if self.flat else img

    def image_out(self, y: np.ndarray, n: int) -> np.ndarray:
        return y[n].reshape(self.cbo, 1, self.oh * self.ow, B) if self.flat else y[n]

    @property
    def pad_shape(self) -> tuple[int, int, int, int]:
        """The padded image the numpy kernels gather windows from (ceil-mode windows included)."""
        hp = max(self.h + self.pt + self.pb, (self.oh - 1) * self.sh + (self.kh - 1) * self.dh + 1)
        wp = max(self.w + self.pl + self.pr, (self.ow - 1) * self.sw + (self.kw - 1) * self.dw + 1)
        return self.cbi, hp, wp, self.input_block

    @property
    def padded(self) -> bool:
        return self.pad_shape[1:3] != (self.h, self.w)

    def windows(self, xp: np.ndarray) -> np.ndarray:
        """(OH, OW, CBi, KH, KW, Bi) strided view of a padded image (CBi, Hp, Wp, Bi)."""
        sc, sh, sw, sl = xp.strides
        return as_strided(xp, (self.oh, self.ow, xp.shape[0], self.kh, self.kw, xp.shape[3]),
                          (self.sh * sh, self.sw * sw, sc, self.dh * sh, self.dw * sw, sl))


def _geom(ctx: NodeCtx) -> BlockedGeom:
    g = ctx.memo.get("blocked_geom")
    if g is None:
        g = ctx.memo["blocked_geom"] = BlockedGeom(ctx)
    return g


def _act(ctx: NodeCtx) -> tuple[int, float, float]:
    return accel.act_code(ctx.attrs.get("act"), ctx.attrs.get("act_params", ()))


def _loop_array(a: np.ndarray) -> np.ndarray:
    """``a`` as the compiled loops take it: C-contiguous and writeable (a read-only memory-mapped
    weight would make numba compile another specialisation, and the ahead-of-time loops refuse it)."""
    return a if a.flags.c_contiguous and a.flags.writeable else np.array(a)


def _each(fn, calls: list[tuple]) -> Step:
    """A step calling ``fn`` once per image with arguments prepared at bind time."""
    if len(calls) == 1:
        (args,) = calls
        return lambda: fn(*args)

    def run():
        for args in calls:
            fn(*args)

    return run


def _residual(ctx: NodeCtx, ins: list[np.ndarray]) -> np.ndarray | None:
    return ins[3] if len(ins) > 3 and ctx.has_input(3) else None


def _pad_image(img: np.ndarray, buf: np.ndarray, g: BlockedGeom, value: float = 0.0) -> np.ndarray:
    """The image (CBi, H, W, Bi) inside ``buf`` with a ``value`` border (numpy kernels only)."""
    if not g.padded:
        return img
    buf[...] = value
    buf[:, g.pt : g.pt + g.h, g.pl : g.pl + g.w] = img
    return buf


# --- kernels ---------------------------------------------------------------------------------------
class NchwcConv(Kernel):
    """Dense conv on blocked activations (or on plain NCHW input for a stem with few channels),
    bias, residual and activation fused: the numba loop :func:`nchwc_loops.nchwc_conv`."""

    name, ops = "nchwc_conv", ("NchwcConv",)
    needs_jit = True

    def cost(self, ctx):
        g = _geom(ctx)
        w = ctx.ins[1].shape
        macs = g.n * g.cbo * B * g.oh * g.ow * w[1] * w[4] * g.kh * g.kw
        moved = 4 * g.n * (g.cbi * g.input_block * g.h * g.w + 2 * g.cbo * B * g.oh * g.ow)
        return Cost(gemm_flops=2 * macs, bytes=moved, calls=g.n)

    def transform(self, ctx):
        return {"w": ctx.const(1), "b": ctx.const(2)}

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        loops, g = accel.loops(), _geom(ctx)
        fn = loops.nchwc_conv
        code, p0, p1 = _act(ctx)
        r = _residual(ctx, ins)
        w, b = _loop_array(params["w"]), _loop_array(params["b"])
        calls = []  # the arena views are fixed: every call's arguments are built once, here
        for n in range(g.n):
            y = g.image_out(outs[0], n)
            res = g.image_out(r, n) if r is not None else y
            calls.append((g.image_in(ins[0], n), w, b, res, r is not None, y, *g.loop_args, code, p0, p1))
        return _each(fn, calls)


class NchwcConvNumpy(NchwcConv):
    """The same conv with numpy: the windows gathered into columns, one GEMM (like im2col)."""

    name = "nchwc_conv_numpy"
    needs_jit = False

    def parts(self, g: BlockedGeom, ctx: NodeCtx) -> list:
        k = ctx.ins[1].shape
        parts = [((g.oh * g.ow, k[1] * g.kh * g.kw * k[4]), np.float32), ((g.oh * g.ow, g.cbo * B), np.float32)]
        return parts + ([(g.pad_shape, np.float32)] if g.padded else [])

    def cost(self, ctx):
        g = _geom(ctx)
        cols = g.n * g.oh * g.ow * g.cbi * g.input_block * g.kh * g.kw
        out = g.n * g.cbo * B * g.oh * g.ow
        return super().cost(ctx) + Cost(vector_flops=2 * cols + 4 * out, bytes=4 * (2 * cols + 4 * out), calls=6)

    def scratch_bytes(self, ctx):
        return scratch_size(*self.parts(_geom(ctx), ctx)) + epilogue.CHUNK_BYTES

    def transform_bytes(self, ctx):
        return int(ctx.const(1).nbytes)

    def transform(self, ctx):
        w = ctx.const(1)  # (CBo, CBi, KH, KW, Bi, 16) -> (CBi*KH*KW*Bi, CBo*16)
        return {"wm": np.ascontiguousarray(w.transpose(1, 2, 3, 4, 0, 5).reshape(-1, w.shape[0] * B)),
                "b": ctx.const(2).reshape(-1)}

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        g = _geom(ctx)
        parts = self.parts(g, ctx)
        cols, acc, *pad = carve(scratch, *parts)
        tmp = scratch[scratch_size(*parts):].view(np.float32)
        cols6 = cols.reshape(g.oh, g.ow, g.cbi, g.kh, g.kw, g.input_block)
        r = _residual(ctx, ins)
        kind, act_params = ctx.attrs.get("act"), ctx.attrs.get("act_params", ())

        def run():
            for n in range(g.n):
                img = ins[0][n] if g.input_block != 1 else ins[0][n].reshape(g.cbi, g.h, g.w, 1)
                np.copyto(cols6, g.windows(_pad_image(img, pad[0] if pad else None, g)))
                np.matmul(cols, params["wm"], out=acc)
                np.add(acc, params["b"], out=acc)
                y = outs[0][n]
                np.copyto(y, acc.reshape(g.oh, g.ow, g.cbo, B).transpose(2, 0, 1, 3))
                if r is not None:
                    y += r[n]
                epilogue.apply(y, y, kind, act_params, tmp)

        return run


class NchwcDepthwise(Kernel):
    """Depthwise conv on blocked activations, bias/residual/activation fused (numba)."""

    name, ops = "nchwc_depthwise", ("NchwcDepthwiseConv",)
    needs_jit = True

    def cost(self, ctx):
        g = _geom(ctx)
        taps = g.n * g.cbo * B * g.oh * g.ow * g.kh * g.kw
        return Cost(vector_flops=taps / 8, bytes=4 * g.n * B * (g.cbi * g.h * g.w + 2 * g.cbo * g.oh * g.ow),
                    calls=g.n)

    def transform(self, ctx):
        return {"w": ctx.const(1), "b": ctx.const(2)}

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        loops, g = accel.loops(), _geom(ctx)
        code, p0, p1 = _act(ctx)
        r = _residual(ctx, ins)
        w, b = _loop_array(params["w"]), _loop_array(params["b"])
        calls = [(ins[0][n], w, b, r[n] if r is not None else outs[0][n], r is not None, outs[0][n], *g.loop_args,
                  code, p0, p1) for n in range(g.n)]
        return _each(loops.nchwc_depthwise, calls)


class NchwcDepthwiseNumpy(NchwcDepthwise):
    """The same depthwise conv with numpy: one broadcast multiply-add per tap."""

    name = "nchwc_depthwise_numpy"
    needs_jit = False

    def parts(self, g: BlockedGeom) -> list:
        return [((g.cbo, g.oh, g.ow, B), np.float32)] + ([(g.pad_shape, np.float32)] if g.padded else [])

    def cost(self, ctx):
        g = _geom(ctx)
        taps = g.n * g.cbo * B * g.oh * g.ow * g.kh * g.kw
        return Cost(vector_flops=2 * taps, bytes=4 * 3 * taps, calls=2 * g.n * g.kh * g.kw + 3)

    def scratch_bytes(self, ctx):
        return scratch_size(*self.parts(_geom(ctx))) + epilogue.CHUNK_BYTES

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        g = _geom(ctx)
        parts = self.parts(g)
        prod, *pad = carve(scratch, *parts)
        tmp = scratch[scratch_size(*parts):].view(np.float32)
        w = params["w"][:, :, :, None, None, :]  # (CB, KH, KW, 1, 1, 16)
        r = _residual(ctx, ins)
        kind, act_params = ctx.attrs.get("act"), ctx.attrs.get("act_params", ())

        def run():
            for n in range(g.n):
                win = g.windows(_pad_image(ins[0][n], pad[0] if pad else None, g))  # (OH, OW, CB, KH, KW, 16)
                y = outs[0][n]
                np.copyto(y, params["b"][:, None, None, :])
                for i in range(g.kh):
                    for j in range(g.kw):
                        np.multiply(win[:, :, :, i, j].transpose(2, 0, 1, 3), w[:, i, j], out=prod)
                        y += prod
                if r is not None:
                    y += r[n]
                epilogue.apply(y, y, kind, act_params, tmp)

        return run


class NchwcMaxPool(Kernel):
    name, ops = "nchwc_maxpool", ("NchwcMaxPool",)
    needs_jit = True

    def cost(self, ctx):
        g = _geom(ctx)
        taps = g.n * g.cbo * B * g.oh * g.ow * g.kh * g.kw
        return Cost(vector_flops=taps / 8, bytes=4 * g.n * B * (g.cbi * g.h * g.w + g.cbo * g.oh * g.ow), calls=g.n)

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        loops, g = accel.loops(), _geom(ctx)
        return _each(loops.nchwc_maxpool, [(ins[0][n], outs[0][n], g.kh, g.kw, *g.loop_args) for n in range(g.n)])


class NchwcMaxPoolNumpy(NchwcMaxPool):
    name = "nchwc_maxpool_numpy"
    needs_jit = False

    def cost(self, ctx):
        g = _geom(ctx)
        taps = g.n * g.cbo * B * g.oh * g.ow * g.kh * g.kw
        return Cost(vector_flops=taps, bytes=4 * 2 * taps, calls=g.n * g.kh * g.kw)

    def scratch_bytes(self, ctx):
        g = _geom(ctx)
        return scratch_size((g.pad_shape, np.float32)) if g.padded else 0

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        g = _geom(ctx)
        pad = carve(scratch, (g.pad_shape, np.float32))[0] if g.padded else None

        def run():
            for n in range(g.n):
                win = g.windows(_pad_image(ins[0][n], pad, g, -np.inf)).transpose(2, 0, 1, 3, 4, 5)
                y = outs[0][n]
                np.copyto(y, win[:, :, :, 0, 0])
                for t in range(1, g.kh * g.kw):
                    np.maximum(y, win[:, :, :, t // g.kw, t % g.kw], out=y)

        return run


class NchwcGlobalPool(Kernel):
    """Global average/max pooling of blocked activations: one reduction over H and W."""

    name, ops = "nchwc_global_pool", ("NchwcGlobalAveragePool", "NchwcGlobalMaxPool")

    def transform(self, ctx):
        _, _, h, w, _ = ctx.ins[0].shape
        return {"mean": np.full((1, h * w), 1.0 / (h * w), np.float32)}

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        n, cb, h, w, _ = ctx.ins[0].shape
        x, y = ins[0].reshape(n, cb, h * w, B), outs[0].reshape(n, cb, 1, B)
        if ctx.node.op == "NchwcGlobalMaxPool":
            return lambda: np.maximum.reduce(x, axis=2, keepdims=True, out=y)
        # a batched (1, HW) x (HW, 16) product: ~20x faster than numpy's reduction over a middle axis
        return lambda: np.matmul(params["mean"], x, out=y)


class Reorder(Kernel):
    """The layout changes at the edges of a blocked region: NCHW -> NCHWc (``ReorderInput``) and
    back (``ReorderOutput``)."""

    name, ops = "reorder", ("ReorderInput", "ReorderOutput")

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        x, y = ins[0], outs[0]
        if ctx.node.op == "ReorderInput":
            return lambda: to_blocked(x, y)
        channels = ctx.outs[0].shape[1]
        return lambda: from_blocked(x, channels, y)


KERNELS = [NchwcConvNumpy(), NchwcDepthwiseNumpy(), NchwcMaxPoolNumpy(), NchwcGlobalPool(), Reorder()]
JIT_KERNELS = [NchwcConv(), NchwcDepthwise(), NchwcMaxPool()]
