"""Progress for long work: a bar on a terminal, periodic log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger("streamflow.progress")


def track(items: Iterable[T], desc: str, unit: str = "events", every_s: float = 10.0,
          size: Callable[[T], int] | None = None) -> Iterator[T]:
    """Yield ``items``, showing progress on stderr; with ``size``, each item counts ``size(item)`` (a block
    of records counts its records).

    Example:
        >>> sum(track(range(3), "counting", every_s=60))
        3
        >>> len(list(track([[1, 2], [3]], "counting", every_s=60, size=len)))
        2
    """
    if sys.stderr.isatty():
        from tqdm import tqdm  # only for a terminal: it costs start-up time

        if size is None:
            yield from tqdm(items, desc=desc, unit=f" {unit}", unit_scale=True, file=sys.stderr)
            return
        with tqdm(desc=desc, unit=f" {unit}", unit_scale=True, file=sys.stderr) as bar:
            for item in items:
                yield item
                bar.update(size(item))
        return
    started = last = time.monotonic()
    n, check = 0, 1024
    for item in items:
        yield item
        n += 1 if size is None else size(item)
        if n >= check:  # the clock every 1,024 items: this wraps a runner's per-event loop
            check = n + 1024
            now = time.monotonic()
            if now - last >= every_s:
                last = now
                log.info("%s: %s %s so far (%.0f/s)", desc, f"{n:,}", unit, n / (now - started))
    log.info("%s: done, %s %s in %.1fs", desc, f"{n:,}", unit, time.monotonic() - started)


class Track:
    """:func:`track` as a runner's ``progress``: it wraps records one at a time (``track(records)``) or blocks
    of them (``track.blocks(blocks)``, each block counting its records), whichever the runner hands over
    (:meth:`streamflow.runners.device.DeviceRunner.run`).

    Example:
        >>> progress = Track("counting", every_s=60)
        >>> sum(progress(range(3))), sum(map(len, progress.blocks([[1, 2], [3]])))
        (3, 3)
    """

    def __init__(self, desc: str, unit: str = "events", every_s: float = 10.0):
        self.desc, self.unit, self.every_s = desc, unit, every_s

    def __call__(self, records: Iterable[T]) -> Iterator[T]:
        return track(records, self.desc, self.unit, self.every_s)

    def blocks(self, blocks: Iterable[list[T]]) -> Iterator[list[T]]:
        return track(blocks, self.desc, self.unit, self.every_s, size=len)
