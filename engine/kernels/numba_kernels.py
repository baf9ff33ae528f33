"""Kernels that need numba (optional): registered when numba is installed; numba itself is loaded
by :func:`engine.kernels.accel.load` when one of them is first bound (``needs_jit``)."""

from __future__ import annotations

import numpy as np

from engine.kernels import accel
from engine.kernels.base import Cost, Step, carve, scratch_size
from engine.kernels.conv import ConvGeom, ConvWinograd23, DepthwiseNumpy


class DepthwiseNumba(DepthwiseNumpy):
    """Depthwise conv in one fused loop nest: implicit padding, bias, residual and activation in
    the same pass, no scratch."""

    name = "depthwise_numba"
    needs_jit = True

    def cost(self, ctx):
        g = ConvGeom.of(ctx)
        taps = g.n * g.c * g.oh * g.ow * g.kh * g.kw
        return Cost(vector_flops=taps / 4, bytes=4 * g.n * (g.c * g.h * g.w + 2 * g.c * g.oh * g.ow), calls=g.n)

    def scratch_bytes(self, ctx):
        g = ConvGeom.of(ctx)
        return scratch_size(self.phases_shape(g))

    @staticmethod
    def phases_shape(g: ConvGeom) -> tuple[tuple[int, int, int], type]:
        return (g.stride[1], g.h if g.stride[1] > 1 else 1, -(-g.w // g.stride[1])), np.float32

    def transform(self, ctx):
        p = super().transform(ctx)
        p["w3"] = p["w"].reshape(p["w"].shape[0], p["w"].shape[2], p["w"].shape[3])
        p["b1"] = p["b"].reshape(-1)
        return p

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        jit = accel.loops()
        g = ConvGeom.of(ctx)
        code, p0, p1 = accel.act_code(ctx.attrs.get("act"), ctx.attrs.get("act_params", ()))
        has_r = len(ins) > 3 and ctx.has_input(3)
        w3, b1 = params["w3"], np.ascontiguousarray(params["b1"])
        (phases,) = carve(scratch, self.phases_shape(g))
        taps = jit.depthwise_taps(g.w, g.ow, g.kw, g.stride[1], g.pads[1], g.dil[1])
        args = (phases, taps, g.stride[0], g.stride[1], g.pads[0], g.dil[0], code, p0, p1)

        def run():
            for n in range(g.n):
                r = ins[3][n] if has_r else outs[0][n]
                jit.depthwise(ins[0][n], w3, b1, r, has_r, outs[0][n], *args)

        return run


class ConvWinograd23Numba(ConvWinograd23):
    """Winograd F(2,3) with the tile transforms as numba loops (implicit padding; bias, residual
    and activation fused into the output transform); the 16 GEMMs stay on BLAS."""

    name = "conv_winograd_f23_numba"
    needs_jit = True

    def parts(self, g: ConvGeom):
        th, tw = self.tiles(g)
        return [((16, g.c, th * tw), np.float32), ((16, g.cout, th * tw), np.float32)]

    def cost(self, ctx):
        g = ConvGeom.of(ctx)
        th, tw = self.tiles(g)
        p = g.n * th * tw
        return Cost(gemm_flops=2 * 16 * g.cout * g.c * p, vector_flops=p * (g.c + g.cout) * 8,
                    bytes=4 * 16 * p * (g.c + g.cout) * 2, calls=g.n * 3)

    def scratch_bytes(self, ctx):
        return scratch_size(*self.parts(ConvGeom.of(ctx)))

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        g = ConvGeom.of(ctx)
        th, tw = self.tiles(g)
        v, m = carve(scratch, *self.parts(g))
        jit = accel.loops()
        code, p0, p1 = accel.act_code(ctx.attrs.get("act"), ctx.attrs.get("act_params", ()))
        has_r = len(ins) > 3 and ctx.has_input(3)
        b = np.ascontiguousarray(params["b"].reshape(-1))
        u = params["u"]

        def run():
            for n in range(g.n):
                jit.winograd23_in(ins[0][n], v, th, tw, g.pads[0], g.pads[1])
                np.matmul(u, v, out=m)
                r = ins[3][n] if has_r else outs[0][n]
                jit.winograd23_out(m, outs[0][n], b, r, has_r, th, tw, code, p0, p1)

        return run


KERNELS = [DepthwiseNumba(), ConvWinograd23Numba()]
