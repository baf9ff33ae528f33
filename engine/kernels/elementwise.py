"""Activations, binary arithmetic with broadcasting, standalone BatchNorm, Softmax."""

from __future__ import annotations

import numpy as np

from engine.kernels import epilogue
from engine.kernels.base import Cost, Kernel, NodeCtx, Step, nbytes, scratch_size
from engine.ops import ACTIVATIONS


class Activation(Kernel):
    name, ops = "activation", tuple(a for a in ACTIVATIONS if a != "Relu6")

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        kind, p = epilogue.activation_of(ctx.node, ctx.consts)
        x, y = ins[0], outs[0]
        return lambda: epilogue.apply(x, y, kind, p)


_BINARY = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide}


class Binary(Kernel):
    """Broadcasting binary op, with an optionally fused activation (e.g. ResNet's Add+Relu)."""

    name, ops = "binary", tuple(_BINARY)

    def scratch_bytes(self, ctx):
        return epilogue.CHUNK_BYTES if epilogue.needs_scratch(ctx.attrs.get("act")) else 0

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        fn = _BINARY[ctx.node.op]
        a, b, y = ins[0], ins[1], outs[0]
        act, act_params = ctx.attrs.get("act"), ctx.attrs.get("act_params", ())
        tmp = scratch.view(np.float32) if len(scratch) else None

        def run():
            fn(a, b, out=y)
            if act:
                epilogue.bias_residual_act(y.reshape(1, -1), None, None, act, act_params, tmp)

        return run


class BatchNorm(Kernel):
    """Inference BatchNorm not folded into a conv: a per-channel scale and shift."""

    name, ops = "batchnorm_affine", ("BatchNormalization",)

    def transform(self, ctx):
        scale, bias, mean, var = (ctx.const(i).astype(np.float64) for i in range(1, 5))
        s = scale / np.sqrt(var + ctx.attrs.get("epsilon", 1e-5))
        shape = (-1,) + (1,) * (len(ctx.ins[0].shape) - 2)
        return {"s": s.astype(np.float32).reshape(shape), "t": (bias - mean * s).astype(np.float32).reshape(shape)}

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        x, y = ins[0], outs[0]

        def run():
            np.multiply(x, params["s"], out=y)
            np.add(y, params["t"], out=y)

        return run


class Softmax(Kernel):
    name, ops = "softmax", ("Softmax",)

    def _reduced(self, ctx: NodeCtx) -> tuple[int, ...]:
        shape = list(ctx.ins[0].shape)
        shape[ctx.attrs.get("axis", -1) % len(shape)] = 1
        return tuple(shape)

    def cost(self, ctx):
        n = float(np.prod(ctx.ins[0].shape))
        return Cost(vector_flops=5 * n, bytes=4 * 4 * n, calls=5)

    def scratch_bytes(self, ctx):
        return scratch_size((self._reduced(ctx), np.float32))

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        axis = ctx.attrs.get("axis", -1) % len(ctx.ins[0].shape)
        red = self._reduced(ctx)
        m = scratch[: nbytes(red)].view(np.float32).reshape(red)
        x, y = ins[0], outs[0]

        def run():
            np.maximum.reduce(x, axis=axis, keepdims=True, out=m)
            np.subtract(x, m, out=y)
            np.exp(y, out=y)
            np.add.reduce(y, axis=axis, keepdims=True, out=m)
            np.divide(y, m, out=y)

        return run


KERNELS = [Activation(), Binary(), BatchNorm(), Softmax()]
