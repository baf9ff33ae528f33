"""Per device, which sequence numbers the cloud has accounted for, and the gaps between them.

A device numbers its rows 0, 1, 2, ... across its tables. The cloud accounts for a batch once it stored it or
refused it after verifying it (a dead letter with known numbers). Numbers past the device's contiguous
*mark* (one past the last number with none missing before it) that are not accounted for form *gaps*: the
broker lost acknowledged records, a topic was deleted, retention passed before the consumer caught up. A gap is
noticed when a batch lands beyond it; later batches are stored meanwhile (de-duplication is by (device, seq),
so order of arrival does not matter). It is *filled* when its numbers arrive (the device resends what the
cloud lacks), or *lost* once it waited ``wait_s``: then it is reported and the mark moves past it. The numbers of a
lost gap are remembered as still missing (:meth:`Ledger.holes`) until they arrive after all: the receipts the
cloud publishes (:mod:`.receipts`) say what it has, not what it gave up on.

Example:
    >>> ledger = Ledger(wait_s=30)
    >>> ledger.account("phone-1", 0, 5, now=0.0)
    []
    >>> [(g.start, g.end) for g in ledger.account("phone-1", 8, 10, now=1.0)]  # 5..7 missing
    [(5, 8)]
    >>> ledger.mark("phone-1"), ledger.seen_end("phone-1")
    (5, 10)
    >>> _ = ledger.account("phone-1", 5, 8, now=2.0); [(g.start, g.outcome) for g in ledger.closed()]
    [(5, 'filled')]
    >>> ledger.mark("phone-1")
    10
    >>> _ = ledger.account("phone-1", 12, 13, now=3.0); [(g.start, g.missing_rows) for g in ledger.expire(now=40.0)]
    [(10, 2)]
    >>> ledger.mark("phone-1"), ledger.holes("phone-1"), ledger.stored_mark("phone-1")
    (13, [(10, 12)], 10)
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class Gap:
    """Missing numbers ``start..end-1`` of ``device``, noticed at ``noticed`` (monotonic seconds)."""

    device: str
    start: int
    end: int
    noticed: float
    missing: list[tuple[int, int]] = field(default_factory=list)  # pieces still missing
    outcome: str | None = None  # "filled" or "lost" once closed
    missing_rows: int = 0  # at closing

    def __post_init__(self) -> None:
        if not self.missing:
            self.missing = [(self.start, self.end)]


class _Device:
    def __init__(self) -> None:
        self.mark = 0
        self.above: list[tuple[int, int]] = []  # accounted spans past the mark, sorted, disjoint
        self.seen_end = 0
        self.gaps: list[Gap] = []
        self.lost: list[tuple[int, int]] = []  # numbers of lost gaps that never arrived, sorted, disjoint


class Ledger:
    """The accounted numbers and open gaps of every device seen (see the module docstring)."""

    def __init__(self, wait_s: float = 30.0):
        self.wait_s = wait_s
        self._devices: dict[str, _Device] = {}
        self._closed: list[Gap] = []

    def knows(self, device: str) -> bool:
        return device in self._devices

    def load(self, device: str, spans: Iterable[tuple[int, int]], now: float,
             lost: Iterable[tuple[int, int]] = ()) -> list[Gap]:
        """Start ``device`` from the spans ``[first, end)`` stored before and those given up as ``lost``; the
        holes between are gaps noticed ``now``."""
        d = self._devices[device] = _Device()
        spans, lost = sorted(spans), sorted(lost)
        for first, end in [*spans, *lost]:
            self._add(device, first, end)
        for first, end in lost:
            d.lost = _union(d.lost, [(first, end)])
        for first, end in spans:
            d.lost = _minus(d.lost, first, end)
        return self._notice_holes(device, now)

    def account(self, device: str, first: int, end: int, now: float) -> list[Gap]:
        """Numbers ``first..end-1`` are accounted for; returns the gaps this notices (fills go to :meth:`closed`)."""
        d = self._devices.setdefault(device, _Device())
        noticed = []
        if first > d.seen_end:
            noticed.append(Gap(device, d.seen_end, first, now))
            d.gaps.append(noticed[-1])
        self._add(device, first, end)
        if d.lost:
            d.lost = _minus(d.lost, first, end)
        for gap in list(d.gaps):
            gap.missing = [piece for a, b in gap.missing for piece in ((a, min(b, first)), (max(a, end), b))
                           if piece[0] < piece[1]]
            if not gap.missing:
                self._close(d, gap, "filled")
        return noticed

    def expire(self, now: float) -> list[Gap]:
        """Give up the gaps noticed ``wait_s`` or more before ``now``: they are lost, the mark moves past them."""
        lost = []
        for device, d in self._devices.items():
            for gap in list(d.gaps):
                if now - gap.noticed >= self.wait_s:
                    gap.missing_rows = sum(b - a for a, b in gap.missing)
                    for a, b in gap.missing:
                        self._add(device, a, b)
                    d.lost = _union(d.lost, gap.missing)
                    self._close(d, gap, "lost")
                    lost.append(gap)
        return lost

    def closed(self) -> list[Gap]:
        """The gaps closed (filled or lost) since the last call."""
        closed, self._closed = self._closed, []
        return closed

    def mark(self, device: str) -> int:
        """One past the device's last number with none missing before it (0 for a device never seen)."""
        d = self._devices.get(device)
        return 0 if d is None else d.mark

    def seen_end(self, device: str) -> int:
        d = self._devices.get(device)
        return 0 if d is None else d.seen_end

    def holes(self, device: str) -> list[tuple[int, int]]:
        """The spans below :meth:`seen_end` the cloud does not have: awaited (open gaps) or given up (lost)."""
        d = self._devices.get(device)
        if d is None:
            return []
        return _union(d.lost, [piece for g in d.gaps for piece in g.missing])

    def stored_mark(self, device: str) -> int:
        """One past the device's last number with none missing before it, lost numbers counting as missing."""
        holes = self.holes(device)
        return min(holes[0][0], self.mark(device)) if holes else self.mark(device)

    def open_gaps(self) -> list[Gap]:
        return [g for d in self._devices.values() for g in d.gaps]

    def _add(self, device: str, first: int, end: int) -> None:
        d = self._devices[device]
        d.seen_end = max(d.seen_end, end)
        first = max(first, d.mark)
        if first < end:
            i = bisect.bisect_left(d.above, (first, end))
            d.above.insert(i, (first, end))
            merged: list[tuple[int, int]] = []
            for a, b in d.above:
                if merged and a <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], b))
                else:
                    merged.append((a, b))
            d.above = merged
        while d.above and d.above[0][0] <= d.mark:
            d.mark = max(d.mark, d.above.pop(0)[1])

    def _notice_holes(self, device: str, now: float) -> list[Gap]:
        d = self._devices[device]
        holes, at = [], d.mark
        for a, b in d.above:
            if a > at:
                holes.append(Gap(device, at, a, now))
            at = b
        d.gaps += holes
        return holes

    def _close(self, d: _Device, gap: Gap, outcome: str) -> None:
        gap.outcome = outcome
        d.gaps.remove(gap)
        self._closed.append(gap)


def _union(spans: list[tuple[int, int]], more: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The sorted, disjoint union of ``spans`` and ``more``."""
    merged: list[tuple[int, int]] = []
    for a, b in sorted([*spans, *more]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        elif a < b:
            merged.append((a, b))
    return merged


def _minus(spans: list[tuple[int, int]], first: int, end: int) -> list[tuple[int, int]]:
    """``spans`` without ``first..end-1``."""
    return [piece for a, b in spans for piece in ((a, min(b, first)), (max(a, end), b)) if piece[0] < piece[1]]
