"""A network shim between a device's Kafka client and the broker: seeded delay and jitter, and outages.

:class:`KafkaShim` is a loopback TCP proxy that understands Kafka's framing (a 4-byte size before every
request and response). Each frame is held for a delay drawn from a seeded gamma distribution with the
profile's mean and coefficient of variation (:class:`LinkProfile`: CV 0 = a constant delay, CV 1 = an
exponential one) before it is passed on, in order (a later frame never overtakes an earlier one, as on
a real link). An outage drops every connection and refuses new ones for N seconds (``mode="drop"``, the
broker looks down), or holds every frame for N seconds (``mode="stall"``, the link hangs).

Why a Kafka-aware proxy and not a plain one: a Kafka client connects to the bootstrap address only to
ask for metadata, then connects to the address each broker *advertises* (noida-db advertises the address
it binds; it has no setting to advertise another). A plain proxy would see the metadata request and
nothing else. So the shim rewrites the broker addresses in Metadata and FindCoordinator responses
(decoded and re-encoded with kafka-python's own protocol classes, for the version the client asked
for) to addresses of its own listeners, one per broker, and the device's traffic — produce, acks,
fetches — all goes through it. Only the device uses the shim; the cloud worker talks to the broker
directly (it sits next to the broker).

Reproducibility: the delays of connection ``i``'s direction ``d`` are the sequence drawn from
``Random(f"{seed}:{i}:{d}")``; the same client traffic sees the same delays. (Which frame gets which draw
depends on the order the client sends frames in, which for a real client depends on timing.)

Example:
    >>> profile = LinkProfile(mean_ms=20.0, cv=0.5, seed=7)
    >>> a, b = profile.sampler("0:up"), profile.sampler("0:up")
    >>> [round(a(), 3) for _ in range(3)] == [round(b(), 3) for _ in range(3)]
    True
    >>> LinkProfile(mean_ms=20.0, cv=0.0).sampler("0:up")()
    20.0
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

log = logging.getLogger("streamflow.serve.netshim")

METADATA_API_KEY = 3
FIND_COORDINATOR_API_KEY = 10
_REWRITTEN = (METADATA_API_KEY, FIND_COORDINATOR_API_KEY)
T = TypeVar("T")
OutageMode = Literal["drop", "stall"]
_OUTAGE_MODES: tuple[OutageMode, ...] = ("drop", "stall")


def _outage_mode(text: str) -> OutageMode:
    """``text`` as an outage mode; ``ValueError`` if it is none."""
    for mode in _OUTAGE_MODES:
        if mode == text:
            return mode
    raise ValueError(f"an outage mode is 'drop' or 'stall', got {text!r}")


@dataclass(frozen=True)
class LinkProfile:
    """One-way delay of every frame: gamma-distributed with ``mean_ms`` and coefficient of variation ``cv``."""

    mean_ms: float = 0.0
    cv: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mean_ms < 0 or self.cv < 0:
            raise ValueError(f"a link profile needs mean_ms >= 0 and cv >= 0, got {self.mean_ms}, {self.cv}")

    def sampler(self, stream: str) -> Callable[[], float]:
        """A function drawing this profile's delays (ms) from the seeded stream named ``stream``."""
        rng = random.Random(f"{self.seed}:{stream}")
        if self.mean_ms == 0 or self.cv == 0:
            return lambda: self.mean_ms
        shape, scale = 1.0 / self.cv**2, self.mean_ms * self.cv**2
        return lambda: rng.gammavariate(shape, scale)


@dataclass
class ShimStats:
    connections: int = 0
    refused: int = 0
    dropped: int = 0
    frames_up: int = 0
    frames_down: int = 0
    rewritten: int = 0
    outages: list[tuple[float, float, str]] = field(default_factory=list)


class KafkaShim:
    """The proxy; :meth:`start` it, point the device's client at :attr:`bootstrap`, :meth:`stop` it.

    ``broker`` is the real broker's ``host:port`` (the first one of a bootstrap list).
    """

    def __init__(self, broker: str, profile: LinkProfile | None = None, host: str = "127.0.0.1"):
        target_host, _, target_port = broker.split(",")[0].strip().rpartition(":")
        self.target = (target_host, int(target_port))
        self.profile = profile or LinkProfile()
        self.host = host
        self.stats = ShimStats()
        self.bootstrap = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._listeners: dict[tuple[str, int], tuple[asyncio.Server, int]] = {}
        self._connections: set[_Connection] = set()
        self._ids = itertools.count()
        self._drop_until = 0.0
        self._stall_until = 0.0

    # -- life cycle ---------------------------------------------------------------------------------
    def start(self) -> KafkaShim:
        ready = threading.Event()
        self._loop = loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(loop)
            ready.set()
            loop.run_forever()

        self._thread = threading.Thread(target=run, name="kafka-shim", daemon=True)
        self._thread.start()
        ready.wait()
        port = self._call(self._listener_for(*self.target))
        self.bootstrap = f"{self.host}:{port}"
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        with contextlib.suppress(RuntimeError, TimeoutError):
            self._call(self._close_all(listeners=True))
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._loop.close()
        self._loop = None

    def __enter__(self) -> KafkaShim:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        assert self._loop is not None, "the shim is not started"
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # -- knobs --------------------------------------------------------------------------------------
    def set_profile(self, profile: LinkProfile) -> None:
        """Use ``profile`` from the next frame on, on open connections too (each connection's delays are then
        drawn from the new profile's seeded streams)."""
        self.profile = profile

    def outage(self, seconds: float, mode: OutageMode = "drop") -> None:
        """Start an outage of ``seconds`` now (returns at once): ``drop`` closes every connection and refuses
        new ones, ``stall`` holds every frame until the outage ends."""
        if mode not in ("drop", "stall"):
            raise ValueError(f"an outage mode is 'drop' or 'stall', got {mode!r}")
        start = time.monotonic()
        self.stats.outages.append((start, start + seconds, mode))
        if mode == "stall":
            self._stall_until = start + seconds
            return
        self._drop_until = start + seconds
        self._call(self._close_all(listeners=False))

    def in_outage(self) -> bool:
        now = time.monotonic()
        return now < self._drop_until or now < self._stall_until

    # -- inside the loop ----------------------------------------------------------------------------
    async def _listener_for(self, host: str, port: int) -> int:
        """The port of our listener standing in for broker ``host:port`` (opened on first use)."""
        known = self._listeners.get((host, port))
        if known is not None:
            return known[1]
        server = await asyncio.start_server(lambda r, w: self._accept(r, w, (host, port)), self.host, 0)
        local_port = server.sockets[0].getsockname()[1]
        self._listeners[(host, port)] = (server, local_port)
        return local_port

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      target: tuple[str, int]) -> None:
        if time.monotonic() < self._drop_until:
            self.stats.refused += 1
            writer.close()
            return
        try:
            broker_reader, broker_writer = await asyncio.open_connection(*target)
        except OSError:
            self.stats.refused += 1
            writer.close()
            return
        self.stats.connections += 1
        conn = _Connection(self, next(self._ids), reader, writer, broker_reader, broker_writer)
        self._connections.add(conn)
        try:
            await conn.run()
        finally:
            self._connections.discard(conn)

    async def _close_all(self, listeners: bool) -> None:
        for conn in list(self._connections):
            if not listeners:  # an outage, not the shim's own stop
                self.stats.dropped += 1
            conn.close()
        if listeners:
            for server, _ in self._listeners.values():
                server.close()
            self._listeners.clear()

    async def _stalled(self) -> None:
        while time.monotonic() < self._stall_until:
            await asyncio.sleep(min(0.05, self._stall_until - time.monotonic()))

    async def rewrite(self, api_key: int, version: int, frame: bytes) -> bytes:
        """A Metadata/FindCoordinator response frame with every broker address replaced by ours."""
        if api_key == METADATA_API_KEY:
            from kafka.protocol.metadata import MetadataResponse

            response = MetadataResponse.decode(frame, version=version, header=True)
            for broker in response.brokers:
                broker.host, broker.port = self.host, await self._listener_for(broker.host, broker.port)
        else:
            from kafka.protocol.metadata import FindCoordinatorResponse

            response = FindCoordinatorResponse.decode(frame, version=version, header=True)
            coordinators = getattr(response, "coordinators", None) or []
            for c in coordinators or [response]:
                if c.host and c.port >= 0:
                    c.host, c.port = self.host, await self._listener_for(c.host, c.port)
        self.stats.rewritten += 1
        if version != response.API_VERSION:  # decode sets it; encode(version=...) trips on a response header
            raise ValueError(f"decoded api version {response.API_VERSION}, asked {version}")
        return response.encode(header=True)


class _Connection:
    """One client connection and its broker connection: two delayed, ordered frame pipes."""

    def __init__(self, shim: KafkaShim, ident: int, client_reader: asyncio.StreamReader,
                 client_writer: asyncio.StreamWriter, broker_reader: asyncio.StreamReader,
                 broker_writer: asyncio.StreamWriter):
        self.shim = shim
        self.writers = (client_writer, broker_writer)
        self.asked: dict[int, tuple[int, int]] = {}  # correlation id → (api key, version) of what we rewrite
        self.up = _DelayedPipe(shim, client_reader, broker_writer, f"{ident}:up", self._request)
        self.down = _DelayedPipe(shim, broker_reader, client_writer, f"{ident}:down", self._response)
        self.tasks: list[asyncio.Task] = []

    async def run(self) -> None:
        senders = [asyncio.ensure_future(pipe.sender()) for pipe in (self.up, self.down)]
        self.tasks = [*senders, *(asyncio.ensure_future(pipe.run()) for pipe in (self.up, self.down))]
        # a side that closes ends its reader, whose sender then flushes what it holds and ends
        await asyncio.wait(senders, return_when=asyncio.FIRST_COMPLETED)
        self.close()

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for w in self.writers:
            w.close()

    async def _request(self, frame: bytes) -> bytes:
        self.shim.stats.frames_up += 1
        if len(frame) >= 8:
            api_key = int.from_bytes(frame[0:2], "big", signed=True)
            if api_key in _REWRITTEN:
                version = int.from_bytes(frame[2:4], "big", signed=True)
                self.asked[int.from_bytes(frame[4:8], "big", signed=True)] = (api_key, version)
        return frame

    async def _response(self, frame: bytes) -> bytes:
        self.shim.stats.frames_down += 1
        if self.asked and len(frame) >= 4:
            asked = self.asked.pop(int.from_bytes(frame[0:4], "big", signed=True), None)
            if asked is not None:
                try:
                    return await self.shim.rewrite(*asked, frame)
                except Exception:  # the client would bypass the shim: say so loudly, and pass the frame on
                    log.exception("could not rewrite broker addresses (api key %d v%d); the client may "
                                  "connect to the broker directly", *asked)
        return frame


class _DelayedPipe:
    """Reads frames from one side, holds each for its delay (never overtaking), writes them to the other."""

    def __init__(self, shim: KafkaShim, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stream: str,
                 transform: Callable[[bytes], Awaitable[bytes]]):
        self.shim = shim
        self.reader = reader
        self.writer = writer
        self.stream = stream
        self.profile: LinkProfile | None = None
        self.draw: Callable[[], float] = lambda: 0.0
        self.transform = transform
        self.queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        self.last_release = 0.0

    async def run(self) -> None:
        try:
            while True:
                size = await self.reader.readexactly(4)
                frame = await self.reader.readexactly(int.from_bytes(size, "big", signed=True))
                if self.profile is not self.shim.profile:  # a new profile: its own seeded stream from here on
                    self.profile = self.shim.profile
                    self.draw = self.profile.sampler(self.stream)
                release = max(time.monotonic() + self.draw() / 1000.0, self.last_release)
                self.last_release = release
                self.queue.put_nowait((release, await self.transform(frame)))
        except (asyncio.IncompleteReadError, ConnectionError):
            self.queue.put_nowait(None)

    async def sender(self) -> None:
        while True:
            item = await self.queue.get()
            if item is None:
                return
            release, frame = item
            wait = release - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            await self.shim._stalled()
            self.writer.write(len(frame).to_bytes(4, "big") + frame)
            await self.writer.drain()


class ShimProcess:
    """A :class:`KafkaShim` in a process of its own (``python -m streamflow.serve.netshim``), driven over its
    stdin: the proxy's Python work then takes no GIL time from the device process it sits in front of.

    The same knobs: :meth:`start`, :attr:`bootstrap`, :meth:`outage`, :meth:`set_profile`, :meth:`stop`;
    :meth:`stats` returns the counters of :class:`ShimStats` as a dict.
    """

    def __init__(self, broker: str, profile: LinkProfile | None = None, host: str = "127.0.0.1"):
        self.broker = broker
        self.profile = profile or LinkProfile()
        self.host = host
        self.bootstrap = ""
        self._process: Any = None

    def start(self, timeout_s: float = 60.0) -> ShimProcess:
        import os
        import subprocess
        import sys
        from pathlib import Path

        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "streamflow.serve.netshim", self.broker, "--mean-ms", str(self.profile.mean_ms),
             "--cv", str(self.profile.cv), "--seed", str(self.profile.seed), "--host", self.host],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = self._process.stdout.readline().split()
        if len(line) != 2 or line[0] != "listening":
            self.stop()
            raise RuntimeError(f"the shim process did not start: {line}")
        self.bootstrap = line[1]
        return self

    def _ask(self, command: str) -> str:
        self._process.stdin.write(command + "\n")
        self._process.stdin.flush()
        return self._process.stdout.readline().strip()

    def outage(self, seconds: float, mode: OutageMode = "drop") -> None:
        if mode not in ("drop", "stall"):
            raise ValueError(f"an outage mode is 'drop' or 'stall', got {mode!r}")
        answer = self._ask(f"outage {seconds} {mode}")
        if answer != "ok":
            raise RuntimeError(f"the shim process refused the outage: {answer}")

    def set_profile(self, profile: LinkProfile) -> None:
        answer = self._ask(f"profile {profile.mean_ms} {profile.cv} {profile.seed}")
        if answer != "ok":
            raise RuntimeError(f"the shim process refused the profile: {answer}")
        self.profile = profile

    def stats(self) -> dict[str, Any]:
        import json

        return json.loads(self._ask("stats"))

    def stop(self) -> None:
        if self._process is None:
            return
        try:
            self._process.stdin.close()
            self._process.wait(timeout=10)
        except Exception:
            self._process.kill()
            self._process.wait()
        self._process = None

    def __enter__(self) -> ShimProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m streamflow.serve.netshim BROKER [--mean-ms M] [--cv C] [--seed S]``: print ``listening
    HOST:PORT``, then obey ``outage SECONDS drop|stall``, ``profile MEAN_MS CV SEED`` and ``stats`` lines on
    stdin until it closes."""
    import argparse
    import dataclasses
    import json
    import sys

    parser = argparse.ArgumentParser(prog="python -m streamflow.serve.netshim")
    parser.add_argument("broker")
    parser.add_argument("--mean-ms", type=float, default=0.0)
    parser.add_argument("--cv", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    with KafkaShim(args.broker, LinkProfile(args.mean_ms, args.cv, args.seed), args.host) as shim:
        print("listening", shim.bootstrap, flush=True)
        for line in sys.stdin:
            words = line.split()
            try:
                if words[:1] == ["outage"] and len(words) == 3:
                    shim.outage(float(words[1]), _outage_mode(words[2]))
                    print("ok", flush=True)
                elif words[:1] == ["profile"] and len(words) == 4:
                    shim.set_profile(LinkProfile(float(words[1]), float(words[2]), int(words[3])))
                    print("ok", flush=True)
                elif words == ["stats"]:
                    print(json.dumps(dataclasses.asdict(shim.stats)), flush=True)
                else:
                    print(f"error: unknown command {line.strip()!r}", flush=True)
            except ValueError as exc:
                print(f"error: {exc}", flush=True)
    return 0


__all__ = ["KafkaShim", "LinkProfile", "OutageMode", "ShimProcess", "ShimStats"]


if __name__ == "__main__":
    raise SystemExit(main())
