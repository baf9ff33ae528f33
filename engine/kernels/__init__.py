"""Kernel registry: every op maps to one or more implementations; the planner picks one."""

from __future__ import annotations

from engine.kernels import accel, conv, elementwise, gemm, nchwc, pool, raster
from engine.kernels.base import Cost, Kernel, NodeCtx

REGISTRY: dict[str, list[Kernel]] = {}


def register(kernel: Kernel) -> Kernel:
    for op in kernel.ops:
        REGISTRY.setdefault(op, []).append(kernel)
    return kernel


def candidates(ctx: NodeCtx) -> list[Kernel]:
    """Kernels implementing ``ctx.node.op`` that apply to its shapes and attributes."""
    return [k for k in REGISTRY.get(ctx.node.op, []) if k.applies(ctx)]


_BY_NAME: dict[str, Kernel] = {}


def by_name(name: str) -> Kernel:
    kernel = _BY_NAME.get(name)
    if kernel is None:
        kernel = next((k for ks in REGISTRY.values() for k in ks if k.name == name), None)
        if kernel is None:
            raise KeyError(f"no kernel named {name!r}")
        _BY_NAME[name] = kernel
    return kernel


for _module in (conv, gemm, elementwise, pool, raster, nchwc):
    for _k in _module.KERNELS:
        register(_k)

if accel.available():  # numba is an optional accelerator, loaded on first use; numpy covers every op
    from engine.kernels import numba_kernels

    for _k in numba_kernels.KERNELS + nchwc.JIT_KERNELS:
        register(_k)

__all__ = ["REGISTRY", "Cost", "Kernel", "NodeCtx", "by_name", "candidates", "register"]
