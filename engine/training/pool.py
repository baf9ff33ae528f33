"""Melon's lifetime-aware memory pool: buffers sorted by lifetime (longest first) then size, each
placed at the best-fitting gap among the buffers whose lifetimes overlap its own.

The placement loop is the engine's arena planner (:func:`engine.planner.plan_arena`); only the order
differs from the inference planner's greedy-by-size. :func:`plan_pool` plans both orders and keeps the
smaller arena, and :func:`compare` reports both against the live peak (the lower bound).
"""

from __future__ import annotations

from engine.planner import ArenaPlan, Buffer, greedy_by_size, plan_arena


def by_lifetime_then_size(b: Buffer) -> tuple:
    return -(b.end - b.start), -b.size, b.start, b.name


def plan_pool(buffers: list[Buffer]) -> ArenaPlan:
    """Place ``buffers`` with the lifetime-aware order, or greedy-by-size when that is smaller.

    >>> p = plan_pool([Buffer("w", 100, 0, 9), Buffer("a", 200, 0, 1), Buffer("b", 200, 2, 3)])
    >>> p.size, p.offsets["a"] == p.offsets["b"]
    (384, True)
    """
    melon = plan_arena(buffers, by_lifetime_then_size)
    greedy = plan_arena(buffers, greedy_by_size)
    return melon if melon.size <= greedy.size else greedy


def compare(buffers: list[Buffer]) -> dict[str, int]:
    """Arena bytes of the lifetime-aware pool and of greedy-by-size, and the live peak."""
    melon = plan_arena(buffers, by_lifetime_then_size)
    greedy = plan_arena(buffers, greedy_by_size)
    return {"pool_arena_bytes": melon.size, "greedy_arena_bytes": greedy.size, "live_peak_bytes": melon.live_peak}
