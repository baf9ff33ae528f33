"""Max/average pooling over windows, global pooling and ReduceMean, as reductions with ``out=``."""

from __future__ import annotations

import numpy as np

from engine.kernels.base import Cost, Kernel, Step, carve, scratch_size
from engine.kernels.conv import ConvGeom, pad_into, windows


class WindowPool(Kernel):
    """MaxPool / AveragePool: pad once into scratch, then fold each window tap into the output."""

    name, ops = "window_pool", ("MaxPool", "AveragePool")

    def cost(self, ctx):
        g = ConvGeom.of(ctx)
        taps = g.n * g.c * g.oh * g.ow * g.kh * g.kw
        return Cost(vector_flops=taps, bytes=4 * 2 * taps, calls=g.n * g.kh * g.kw)

    def scratch_bytes(self, ctx):
        g = ConvGeom.of(ctx)
        return scratch_size((g.pad_shape, np.float32)) if g.padded else 0

    def transform(self, ctx):
        g = ConvGeom.of(ctx)
        if ctx.node.op != "AveragePool" or ctx.attrs.get("count_include_pad") or not g.padded:
            return {"inv": np.float32(1.0 / (g.kh * g.kw))}
        ones = np.pad(np.ones((1, g.h, g.w), np.float32), ((0, 0), (g.pads[0], g.pads[2]), (g.pads[1], g.pads[3])))
        counts = windows(ones, g).sum(axis=(1, 2))
        return {"inv": (1.0 / counts).astype(np.float32)}

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        g = ConvGeom.of(ctx)
        is_max = ctx.node.op == "MaxPool"
        xp = carve(scratch, (g.pad_shape, np.float32))[0] if g.padded else None
        fill = -np.inf if is_max else 0.0
        fold = np.maximum if is_max else np.add

        def run():
            for n in range(g.n):
                src = ins[0][n]
                if xp is not None:
                    pad_into(src, xp, g.pads[0], g.pads[1], fill)
                    src = xp
                win, out = windows(src, g), outs[0][n]
                np.copyto(out, win[:, 0, 0])
                for t in range(1, g.kh * g.kw):
                    fold(out, win[:, t // g.kw, t % g.kw], out=out)
                if not is_max:
                    out *= params["inv"]

        return run


class Reduce(Kernel):
    """GlobalAveragePool, GlobalMaxPool and ReduceMean: one numpy reduction into the output."""

    name, ops = "reduce", ("GlobalAveragePool", "GlobalMaxPool", "ReduceMean")

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        x, y, op = ins[0], outs[0], ctx.node.op
        rank = len(ctx.ins[0].shape)
        if op == "ReduceMean":
            axes = ctx.attrs.get("axes")
            if axes is None and ctx.has_input(1):
                axes = ctx.const(1)
            axes = tuple(sorted(int(a) % rank for a in (axes if axes is not None else range(rank))))
        else:
            axes = tuple(range(2, rank))
        keep = y.reshape([1 if i in axes else d for i, d in enumerate(ctx.ins[0].shape)])
        count = float(np.prod([ctx.ins[0].shape[a] for a in axes]))
        if op == "GlobalMaxPool":
            return lambda: np.maximum.reduce(x, axis=axes, keepdims=True, out=keep)

        def run():
            np.add.reduce(x, axis=axes, keepdims=True, out=keep)
            np.multiply(keep, 1.0 / count, out=keep)

        return run


KERNELS = [WindowPool(), Reduce()]
