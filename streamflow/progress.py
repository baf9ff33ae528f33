"""Progress for long work: a bar on a terminal, periodic log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger("streamflow.progress")


def track(items: Iterable[T], desc: str, unit: str = "events", every_s: float = 10.0) -> Iterator[T]:
    """Yield ``items``, showing progress on stderr.

    Example:
        >>> sum(track(range(3), "counting", every_s=60))
        3
    """
    if sys.stderr.isatty():
        from tqdm import tqdm  # only for a terminal: it costs start-up time

        yield from tqdm(items, desc=desc, unit=f" {unit}", unit_scale=True, file=sys.stderr)
        return
    started = last = time.monotonic()
    n = 0
    for n, item in enumerate(items, start=1):  # noqa: B007 - n is read after the loop
        yield item
        if not n & 1023:  # the clock every 1,024 items: this wraps a runner's per-event loop
            now = time.monotonic()
            if now - last >= every_s:
                last = now
                log.info("%s: %s %s so far (%.0f/s)", desc, f"{n:,}", unit, n / (now - started))
    log.info("%s: done, %s %s in %.1fs", desc, f"{n:,}", unit, time.monotonic() - started)
