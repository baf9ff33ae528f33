"""One region-copy primitive ("raster") behind every layout op: Transpose, Concat, Slice, Pad.

A :class:`Region` copies an N-d block from an input to the output, both described by an element
offset and per-dimension element strides (MNN's idea). Each layout op only *compiles* to regions;
one kernel executes them, so a new layout op is a new compiler, not a new kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided

from engine.kernels.base import Cost, Kernel, NodeCtx, Step
from engine.ops import pad_params, slice_params


@dataclass(frozen=True)
class Region:
    """``out.flat[dst_offset + i.dst_strides] = in[src].flat[src_offset + i.src_strides]`` for
    every index ``i`` in ``shape``."""

    src: int
    shape: tuple[int, ...]
    src_offset: int
    src_strides: tuple[int, ...]
    dst_offset: int
    dst_strides: tuple[int, ...]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


def compile_regions(ctx: NodeCtx) -> tuple[list[Region], float | None]:
    """The regions (and an optional fill value for the whole output) implementing ``ctx.node``."""
    op, x = ctx.node.op, ctx.ins[0].shape
    out = ctx.outs[0].shape
    dst = contiguous_strides(out)
    src = contiguous_strides(x)
    if op == "Transpose":
        perm = ctx.attrs.get("perm") or list(range(len(x)))[::-1]
        return [Region(0, out, 0, tuple(src[p] for p in perm), 0, dst)], None
    if op == "Concat":
        axis, regions, offset = ctx.attrs["axis"] % len(out), [], 0
        for i, t in enumerate(ctx.ins):
            regions.append(Region(i, t.shape, 0, contiguous_strides(t.shape), offset * dst[axis], dst))
            offset += t.shape[axis]
        return regions, None
    if op == "Slice":
        params = slice_params(ctx.node, lambda n: ctx.consts.get(n), x)
        start = sum(p[0] * s for p, s in zip(params, src, strict=True))
        return [Region(0, out, start, tuple(p[2] * s for p, s in zip(params, src, strict=True)), 0, dst)], None
    if op == "Pad":
        pads, value = pad_params(ctx.node, lambda n: ctx.consts.get(n), len(x))
        return [Region(0, x, 0, src, sum(p * s for p, s in zip(pads, dst, strict=False)), dst)], value
    raise ValueError(f"no raster compiler for {op}")


def region_views(region: Region, ins: Sequence[np.ndarray], out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(destination view, source view) of one region over contiguous arrays."""
    s = ins[region.src].reshape(-1)
    d = out.reshape(-1)
    si, di = s.itemsize, d.itemsize
    src = as_strided(s[region.src_offset :], region.shape, tuple(x * si for x in region.src_strides))
    dst = as_strided(d[region.dst_offset :], region.shape, tuple(x * di for x in region.dst_strides))
    return dst, src


class Raster(Kernel):
    name, ops = "raster", ("Transpose", "Concat", "Slice", "Pad")

    def cost(self, ctx):
        regions, fill = compile_regions(ctx)
        item = ctx.outs[0].dtype.itemsize
        moved = sum(r.size for r in regions) * 2 * item
        filled = float(np.prod(ctx.outs[0].shape)) * item if fill is not None else 0
        return Cost(vector_flops=sum(r.size for r in regions), bytes=moved + filled, calls=len(regions))

    def bind(self, ctx, params, ins, outs, scratch) -> Step:
        regions, fill = compile_regions(ctx)
        pairs = [region_views(r, ins, outs[0]) for r in regions]
        out = outs[0]

        def run():
            if fill is not None:
                out.fill(fill)
            for dst, src in pairs:
                np.copyto(dst, src)

        return run


KERNELS = [Raster()]
