"""The serving app's consumers pause after an empty fetch; no other aiokafka consumer in the process does."""

from __future__ import annotations

import asyncio
import uuid

import pytest

aiokafka = pytest.importorskip("aiokafka")

from aiokafka.consumer.fetcher import Fetcher  # noqa: E402

from connectors.tunnel.kafka import ensure_topic  # noqa: E402
from streamflow.serve.fetch_pause import pausing_transport  # noqa: E402

PAUSE_MS = 100.0
WATCH_S = 1.0


def _counting(consumer: aiokafka.AIOKafkaConsumer) -> list[int]:
    """Count the fetch requests ``consumer`` makes from now on (a subclass of its fetcher's own class)."""
    calls = [0]
    base = type(consumer._fetcher)

    class Counting(base):  # type: ignore[misc, valid-type]
        async def _proc_fetch_request(self, *args, **kwargs):
            calls[0] += 1
            return await super()._proc_fetch_request(*args, **kwargs)

    consumer._fetcher.__class__ = Counting
    return calls


async def _fetches_while_idle(bootstrap: str, topic: str) -> tuple[int, int, type, type]:
    transport = pausing_transport(PAUSE_MS)
    paused = transport.kafka_consumer(topic, bootstrap_servers=bootstrap, group_id=None,
                                      auto_offset_reset="earliest")
    plain = aiokafka.AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest")
    await paused.start()
    await plain.start()
    try:
        kinds = type(paused._fetcher), type(plain._fetcher)
        paused_calls, plain_calls = _counting(paused), _counting(plain)
        await asyncio.sleep(WATCH_S)
        return paused_calls[0], plain_calls[0], *kinds
    finally:
        await paused.stop()
        await plain.stop()


def test_only_the_apps_consumers_wait_after_an_empty_fetch(kafka_bootstrap):
    original = Fetcher._proc_fetch_request
    topic = f"empty.{uuid.uuid4().hex[:8]}"
    ensure_topic(kafka_bootstrap, topic, partitions=1)
    paused, plain, paused_kind, plain_kind = asyncio.run(_fetches_while_idle(kafka_bootstrap, topic))
    assert Fetcher._proc_fetch_request is original  # nothing patched for the process
    assert paused_kind is not Fetcher and issubclass(paused_kind, Fetcher) and plain_kind is Fetcher
    bound = WATCH_S * 1000 / PAUSE_MS + 5  # one fetch per pause, and a few while it starts
    assert paused <= bound, paused
    # noida-db answers an empty fetch at once, so the unpaused consumer fetches far more often (a broker that holds
    # fetches for fetch_max_wait_ms keeps both below the bound)
    assert plain > 3 * paused or plain <= bound, (plain, paused)
