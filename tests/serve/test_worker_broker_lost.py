"""Issue 31: a serving worker whose broker goes away says so at each probe and gives up after a bounded time
(exit 1), instead of faust's endless ERROR lines and a stop that waits for the broker."""

from __future__ import annotations

import time

from tests.serve.serve_worker import start_worker


def test_the_worker_says_the_broker_is_away_and_gives_up(private_broker, serve_zoo, serve_keys, pages, tmp_path,
                                                         monkeypatch):
    monkeypatch.setenv("STREAMFLOW_CONSUMER_RETRY_S", "8")
    worker = start_worker(private_broker.bootstrap, serve_zoo, serve_keys, tmp_path / "worker.log", pages[0][0],
                          loglevel="warning")
    try:
        private_broker.down()
        gone = time.monotonic()
        worker.process.wait(timeout=60)
        took = time.monotonic() - gone
    finally:
        worker.stop()
    log = worker.log.read_text(errors="replace")
    assert worker.process.returncode == 1 and 8 <= took < 30, (took, log[-3000:])
    assert f"the broker at {private_broker.bootstrap} does not answer" in log and "gives up in" in log
    assert f"streamflow: error: the broker at {private_broker.bootstrap} did not answer for" in log
    assert log.count("\n") < 100, log[-3000:]  # faust's client no longer logs every failed connection
