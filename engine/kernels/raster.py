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
    if "regions" in ctx.attrs:  # a merged raster carries its regions
        return list(ctx.attrs["regions"]), ctx.attrs.get("fill")
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


def compose(outer: Region, inner: Region, inner_shape: Sequence[int]) -> Region | None:
    """``outer`` reads the output of ``inner`` (one region covering a contiguous tensor of
    ``inner_shape``); return one region reading ``inner``'s source directly, or None when the
    read pattern does not follow ``inner_shape``'s dimensions (then the two cannot merge)."""
    dims = contiguous_strides(inner_shape)
    if inner.dst_offset != 0 or tuple(inner.dst_strides) != dims or tuple(inner.shape) != tuple(inner_shape):
        return None
    start = [int(i) for i in np.unravel_index(outer.src_offset, inner_shape)] if inner_shape else []
    shape, src_strides, dst_strides = _split_dims(outer, dims, inner_shape)
    lo, hi = [0] * len(inner_shape), [0] * len(inner_shape)  # reach below/above start per inner dim
    strides = []
    for size, stride in zip(shape, src_strides, strict=True):
        if size == 1:
            strides.append(0)
            continue
        # the stride must step along exactly one inner dimension
        d = next((k for k, c in enumerate(dims) if stride != 0 and stride % c == 0
                  and abs(stride // c) < inner_shape[k] and (k == 0 or abs(stride) < dims[k - 1])), None)
        if d is None:
            return None
        step = stride // dims[d]
        if step > 0:
            hi[d] += step * (size - 1)
        else:
            lo[d] += step * (size - 1)
        strides.append(step * inner.src_strides[d])
    for k, d in enumerate(inner_shape):
        if not (start[k] + lo[k] >= 0 and start[k] + hi[k] < d):
            return None
    offset = inner.src_offset + sum(i * s for i, s in zip(start, inner.src_strides, strict=True))
    return Region(outer.src, tuple(shape), offset, tuple(strides), outer.dst_offset, tuple(dst_strides))


def _split_dims(r: Region, dims: Sequence[int], inner_shape: Sequence[int]):
    """Split each unit-stride-per-dim walk of ``r`` that runs across inner dimensions (what a
    Reshape merging dims produces) into one walk per inner dimension."""
    shape, src, dst = [], [], []
    for size, st, dt in zip(r.shape, r.src_strides, r.dst_strides, strict=True):
        parts = []
        while size > 1:
            d = next((k for k, c in enumerate(dims) if st > 0 and st % c == 0 and st < c * inner_shape[k]), None)
            q = inner_shape[d] * dims[d] // st if d is not None and (inner_shape[d] * dims[d]) % st == 0 else 0
            if d is None or q <= 1 or size <= q or size % q:
                break
            parts.append((q, st, dt))  # the fastest-moving piece, inside inner dim d
            size, st, dt = size // q, st * q, dt * q
        parts.append((size, st, dt))
        for p in reversed(parts):
            shape.append(p[0])
            src.append(p[1])
            dst.append(p[2])
    return shape, src, dst


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
