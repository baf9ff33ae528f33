"""Gemm (alpha*A'B' + beta*C, with fused activation) and MatMul, both straight onto BLAS."""

from __future__ import annotations

import numpy as np

from engine.kernels import epilogue
from engine.kernels.base import Cost, Kernel, NodeCtx, Step


def _flops(ctx: NodeCtx) -> float:
    a, y = ctx.ins[0].shape, ctx.outs[0].shape
    k = a[0] if ctx.node.op == "Gemm" and ctx.attrs.get("transA") else a[-1]
    return 2.0 * float(np.prod(y)) * k


class GemmBlas(Kernel):
    name, ops = "gemm_blas", ("Gemm",)

    def cost(self, ctx):
        return Cost(gemm_flops=_flops(ctx), bytes=4 * sum(float(np.prod(t.shape)) for t in ctx.ins + ctx.outs),
                    calls=3)

    def scratch_bytes(self, ctx):
        return epilogue.CHUNK_BYTES if epilogue.needs_scratch(ctx.attrs.get("act")) else 0

    def transform(self, ctx):
        p = {}
        b = ctx.const(1)
        if b is not None:
            p["b"] = b.T if ctx.attrs.get("transB") else b  # a transposed view: BLAS handles it
        c = ctx.const(2)
        if c is not None:
            p["c"] = (c * ctx.attrs.get("beta", 1.0)).astype(np.float32)
        return p

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        alpha = ctx.attrs.get("alpha", 1.0)
        trans_a = bool(ctx.attrs.get("transA"))
        beta = ctx.attrs.get("beta", 1.0)
        act, act_params = ctx.attrs.get("act"), ctx.attrs.get("act_params", ())
        tmp = scratch.view(np.float32) if len(scratch) else None
        y = outs[0]

        def run():
            a = ins[0].T if trans_a else ins[0]
            b = params.get("b")
            if b is None:
                b = ins[1].T if ctx.attrs.get("transB") else ins[1]
            np.matmul(a, b, out=y)
            if alpha != 1.0:
                np.multiply(y, alpha, out=y)
            if "c" in params:
                np.add(y, params["c"], out=y)
            elif ctx.has_input(2):
                np.add(y, ins[2] if beta == 1.0 else beta * ins[2], out=y)
            epilogue.bias_residual_act(y.reshape(1, -1), None, None, act, act_params, tmp)

        return run


class MatMulBlas(Kernel):
    name, ops = "matmul_blas", ("MatMul",)

    def cost(self, ctx):
        return Cost(gemm_flops=_flops(ctx), bytes=4 * sum(float(np.prod(t.shape)) for t in ctx.ins + ctx.outs))

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        a, b, y = ins[0], ins[1], outs[0]
        return lambda: np.matmul(a, b, out=y)


KERNELS = [GemmBlas(), MatMulBlas()]
