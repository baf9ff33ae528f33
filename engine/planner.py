"""Static memory planning: every activation and scratch buffer gets an offset in one arena.

Buffers are placed greedily, largest (then longest-lived) first, each at the lowest offset that
does not overlap a buffer whose lifetime intersects its own (TFLite/TVM "greedy by size").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

ALIGN = 64


@dataclass(frozen=True)
class Buffer:
    """A block of ``size`` bytes live from step ``start`` to step ``end`` (inclusive)."""

    name: str
    size: int
    start: int
    end: int

    def overlaps(self, other: Buffer) -> bool:
        return self.start <= other.end and other.start <= self.end


@dataclass
class ArenaPlan:
    """Offsets of every buffer in one arena, plus the numbers to judge the plan by.

    >>> p = plan_arena([Buffer("a", 100, 0, 1), Buffer("b", 100, 1, 2), Buffer("c", 100, 2, 3)])
    >>> p.offsets["a"] == p.offsets["c"], p.size
    (True, 256)
    """

    offsets: dict[str, int]
    buffers: dict[str, Buffer]
    size: int  # arena bytes
    sum_of_buffers: int  # every buffer allocated separately, no reuse
    live_peak: int  # max over steps of the bytes live at that step: what allocate-as-you-go needs

    def report(self) -> dict[str, int | float]:
        return {"arena_bytes": self.size, "sum_of_buffers_bytes": self.sum_of_buffers,
                "live_peak_bytes": self.live_peak, "buffers": len(self.buffers),
                "arena_vs_live_peak": round(self.size / max(self.live_peak, 1), 4),
                "arena_vs_sum": round(self.size / max(self.sum_of_buffers, 1), 4)}

    def check(self) -> None:
        """Assert no two buffers that are live at the same time share a byte."""
        items = list(self.buffers.values())
        for i, a in enumerate(items):
            oa = self.offsets[a.name]
            assert oa % ALIGN == 0 and oa + a.size <= self.size
            for b in items[i + 1 :]:
                ob = self.offsets[b.name]
                if a.overlaps(b) and oa < ob + b.size and ob < oa + a.size:
                    raise AssertionError(f"buffers {a.name} and {b.name} collide")


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def greedy_by_size(b: Buffer) -> tuple:
    return -b.size, -(b.end - b.start), b.start, b.name


def plan_arena(buffers: list[Buffer], order_key: Callable[[Buffer], tuple] = greedy_by_size) -> ArenaPlan:
    """Place ``buffers`` in one arena, in ``order_key`` order (default: greedy by size, then lifetime
    length), each at the best-fitting gap among the buffers whose lifetimes overlap its own."""
    order = sorted(buffers, key=order_key)
    offsets: dict[str, int] = {}
    size = 0
    starts = np.empty(len(order), np.int64)
    ends = np.empty(len(order), np.int64)
    offs = np.empty(len(order), np.int64)
    lengths = np.empty(len(order), np.int64)
    for k, buf in enumerate(order):
        need = _aligned(buf.size)
        hit = (starts[:k] <= buf.end) & (ends[:k] >= buf.start)  # placed buffers whose lifetimes overlap
        busy = sorted(zip(offs[:k][hit].tolist(), lengths[:k][hit].tolist(), strict=True))
        best, best_gap, cursor = None, None, 0
        for off, length in busy:  # best fit among the gaps between conflicting buffers
            gap = off - cursor
            if gap >= need and (best_gap is None or gap < best_gap):
                best, best_gap = cursor, gap
            cursor = max(cursor, off + length)
        offset = cursor if best is None else best
        offsets[buf.name] = offset
        starts[k], ends[k], offs[k], lengths[k] = buf.start, buf.end, offset, need
        size = max(size, offset + need)
    events = sorted([(b.start, b.size) for b in buffers] + [(b.end + 1, -b.size) for b in buffers],
                    key=lambda e: (e[0], e[1] > 0))
    live_peak = live = 0
    for _, delta in events:  # frees at a step come before allocations there
        live += delta
        live_peak = max(live_peak, live)
    return ArenaPlan(offsets, {b.name: b for b in buffers}, size, sum(b.size for b in buffers), live_peak)
