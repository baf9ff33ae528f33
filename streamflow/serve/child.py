"""Helper processes of the device client, and why.

The client must answer each request at its deadline, from a thread that wakes up on time. In one Python
process that thread waits for the GIL, and the other work of a device holds it for long stretches: our
engine and Pillow's JPEG encoder ~20 ms at a time, kafka-python's pure-Python protocol code tens to
hundreds of ms after a reconnect (measured on this machine: a 2 ms sleeper thread's p99 lateness went from
3 ms to 16-20 ms with either in the same process). So the device's model and its Kafka clients each run in
a process of their own (:mod:`streamflow.serve.device`, :mod:`streamflow.serve.network`) and the client's
own process only keeps time and moves small messages.

A child is a fresh interpreter (``python -m MODULE FD``), not a ``multiprocessing`` child (those re-import
the parent's main module, which a user's script may not guard), talking pickled tuples over a socket pair:
the parent sends a first message (its settings, secrets included: never on the command line), the child
answers ``("ready", 0, None)`` or ``("failed", 0, reason)``, then both sides send ``(kind, request_id,
value)`` tuples; ``None`` asks the child to stop.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


class ChildFailed(RuntimeError):
    """A helper process could not start; the message is the child's reason."""


class Child:
    """One helper process and a thread handing each of its messages to ``on_message(kind, request_id, value)``
    (``("closed", 0, None)`` once it is gone)."""

    def __init__(self, module: str, on_message: Callable[[str, int, Any], None], start_timeout_s: float = 300.0):
        self.module = module
        self.on_message = on_message
        self.start_timeout_s = start_timeout_s
        self._send_lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._conn: Any = None
        self._reader: threading.Thread | None = None

    def start(self, hello: Any) -> Child:
        from multiprocessing.connection import Connection

        ours, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[2])  # the directory holding the streamflow package
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self._process = subprocess.Popen([sys.executable, "-m", self.module, str(theirs.fileno())],
                                         pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send(hello)
        if not self._conn.poll(self.start_timeout_s):
            self.close()
            raise ChildFailed(f"{self.module} did not start within {self.start_timeout_s}s")
        try:
            kind, _, detail = self._conn.recv()
        except EOFError:
            kind, detail = "failed", f"the process exited with code {self._process.wait()}"
        if kind != "ready":
            self.close()
            raise ChildFailed(str(detail))
        self._reader = threading.Thread(target=self._read, name=f"{self.module}-reader", daemon=True)
        self._reader.start()
        return self

    def send(self, message: Any) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self.on_message("closed", 0, None)
                return
            self.on_message(*message)

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError, ValueError):
                self.send(None)
        if self._process is not None:
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        if self._conn is not None:
            self._conn.close()


class ChildSide:
    """The child's end: :attr:`hello` (the parent's first message), a thread-safe :meth:`send`, :meth:`recv`."""

    def __init__(self, fd: int):
        from multiprocessing.connection import Connection

        self._conn = Connection(fd)
        self._lock = threading.Lock()
        self.hello = self._conn.recv()

    def send(self, kind: str, request_id: int, value: Any) -> None:
        with self._lock:
            self._conn.send((kind, request_id, value))

    def recv(self) -> Any:
        """The next message, or None when the parent asks to stop or is gone."""
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            return None


__all__ = ["Child", "ChildFailed", "ChildSide"]
