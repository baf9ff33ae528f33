"""Connectors: where events come from and where feature rows go (no runner logic here)."""

from connectors.storage import DEAD_LETTER_TABLE, CollectiveStorage, flush_on_signals

__all__ = ["DEAD_LETTER_TABLE", "CollectiveStorage", "flush_on_signals"]
