"""The serving app's Kafka transport: faust's aiokafka driver, whose consumers wait a moment after an empty fetch.

A Kafka broker holds an empty fetch for ``fetch_max_wait_ms``; noida-db (the tests' and benchmarks' broker)
answers it at once, and aiokafka then fetches again in a tight loop: an idle worker took ~80% of a core on this
2-core machine (measured), which the models and the device then lack. With a broker that holds fetches the pause
changes nothing.

Only this app's consumers pause: :func:`pausing_transport` makes subclasses of faust's transport, consumer and
consumer thread, and of aiokafka's consumer and fetcher, and the app is given that transport (``app.transport``,
faust's setter). Nothing is patched for the process: any other aiokafka consumer in it fetches as before. The
pause wraps one private method of aiokafka's fetcher (``_proc_fetch_request``, there since aiokafka 0.5); if it
moved, the consumers run without the pause and say so.

Example:
    >>> transport = pausing_transport(2.0)
    >>> transport.Consumer.__name__, transport.kafka_consumer.__name__, transport.__mro__[1].__module__
    ('PausingConsumer', 'PausingKafkaConsumer', 'faust.transport.drivers.aiokafka')
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("streamflow.serve")


def pausing_transport(pause_ms: float) -> type[Any]:
    """faust's aiokafka transport whose consumers wait ``pause_ms`` after a fetch that brought nothing."""
    import aiokafka
    from aiokafka.consumer.fetcher import Fetcher
    from faust.transport.drivers import aiokafka as driver

    pause_s = pause_ms / 1000.0
    if not hasattr(Fetcher, "_proc_fetch_request"):
        log.warning("aiokafka's fetcher has no _proc_fetch_request; empty fetches are not paused")
        return driver.Transport

    class PausingFetcher(Fetcher):
        async def _proc_fetch_request(self, assignment: Any, node_id: Any, request: Any) -> Any:
            got = await super()._proc_fetch_request(assignment, node_id, request)
            if not got:
                try:
                    await asyncio.sleep(pause_s)
                except asyncio.CancelledError:  # closing: the fetcher awaits its cancelled tasks, as the original
                    return False  # returns on cancellation
            return got

    class PausingKafkaConsumer(aiokafka.AIOKafkaConsumer):
        async def start(self) -> None:
            await super().start()
            # the fetcher starts its loop in its constructor; the loop looks the method up at every fetch
            if type(self._fetcher) is Fetcher:
                self._fetcher.__class__ = PausingFetcher

    class PausingConsumerThread(driver.AIOKafkaConsumerThread):
        def _create_consumer(self, loop: asyncio.AbstractEventLoop) -> aiokafka.AIOKafkaConsumer:
            consumer = super()._create_consumer(loop)
            if type(consumer) is aiokafka.AIOKafkaConsumer:
                consumer.__class__ = PausingKafkaConsumer
            return consumer

    class PausingConsumer(driver.Consumer):
        def _new_consumer_thread(self) -> driver.AIOKafkaConsumerThread:
            return PausingConsumerThread(self, loop=self.loop, beacon=self.beacon)

    class PausingTransport(driver.Transport):
        Consumer = PausingConsumer
        kafka_consumer = PausingKafkaConsumer  # the aiokafka consumer class its consumers are made of

    return PausingTransport
