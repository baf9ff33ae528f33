"""The network shim: seeded delays with the asked mean and CV, every byte of a real Kafka client through it
(the advertised broker address rewritten), drop and stall outages."""

from __future__ import annotations

import socket
import statistics
import time

import pytest
from kafka import KafkaProducer

from streamflow.serve.netshim import KafkaShim, LinkProfile


@pytest.mark.parametrize("cv", [0.0, 0.5, 1.0])
def test_delays_have_the_asked_mean_and_cv_and_repeat_with_the_seed(cv):
    draw = LinkProfile(mean_ms=20.0, cv=cv, seed=3).sampler("0:up")
    delays = [draw() for _ in range(40_000)]
    assert statistics.fmean(delays) == pytest.approx(20.0, rel=0.02)
    assert statistics.pstdev(delays) / statistics.fmean(delays) == pytest.approx(cv, abs=0.02)
    again = LinkProfile(mean_ms=20.0, cv=cv, seed=3).sampler("0:up")
    assert [again() for _ in range(100)] == delays[:100]
    if cv:
        other = LinkProfile(mean_ms=20.0, cv=cv, seed=4).sampler("0:up")
        assert [other() for _ in range(100)] != delays[:100]


def _acks(producer: KafkaProducer, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        producer.send("netshim.test", b"x" * 100).get(timeout=30)
        times.append((time.perf_counter() - start) * 1000)
    return times


def test_a_kafka_client_goes_through_the_shim_for_everything(kafka_bootstrap):
    broker_port = int(kafka_bootstrap.rsplit(":", 1)[1])
    direct = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    direct_ms = statistics.median(_acks(direct, 10))
    direct.close()
    with KafkaShim(kafka_bootstrap, LinkProfile(mean_ms=30.0, cv=0.0)) as shim:
        producer = KafkaProducer(bootstrap_servers=shim.bootstrap)
        shimmed_ms = _acks(producer, 10)
        brokers = producer._metadata.brokers()
        frames = shim.stats.frames_up
        producer.close()
    # the client was told the broker is the shim, so produce requests and acks cross it: ≥ 30 ms each way
    assert {(b.host, b.port) for b in brokers} == {("127.0.0.1", int(shim.bootstrap.rsplit(":", 1)[1]))}
    assert all(b.port != broker_port for b in brokers)
    assert min(shimmed_ms) >= 60.0 > direct_ms
    assert frames >= 10 and shim.stats.rewritten >= 1


def test_a_drop_outage_refuses_connections_then_the_link_comes_back(kafka_bootstrap):
    with KafkaShim(kafka_bootstrap) as shim:
        producer = KafkaProducer(bootstrap_servers=shim.bootstrap, request_timeout_ms=5000,
                                 reconnect_backoff_max_ms=200)
        _acks(producer, 1)
        shim.outage(1.5, mode="drop")
        assert shim.in_outage()
        with socket.create_connection(("127.0.0.1", int(shim.bootstrap.rsplit(":", 1)[1])), timeout=2) as probe:
            probe.settimeout(2)
            assert probe.recv(1) == b""  # accepted and closed at once: the broker looks down
        start = time.perf_counter()
        producer.send("netshim.test", b"during the outage").get(timeout=30)  # delivered once it is over
        waited = time.perf_counter() - start
        producer.close()
    assert waited >= 1.0
    assert shim.stats.dropped >= 1 and shim.stats.refused >= 1


def test_a_stall_holds_frames_until_it_ends(kafka_bootstrap):
    with KafkaShim(kafka_bootstrap) as shim:
        producer = KafkaProducer(bootstrap_servers=shim.bootstrap, request_timeout_ms=10_000)
        _acks(producer, 1)
        shim.outage(1.0, mode="stall")
        start = time.perf_counter()
        producer.send("netshim.test", b"held").get(timeout=30)
        held = time.perf_counter() - start
        producer.close()
    assert 0.8 <= held < 5.0
    assert shim.stats.dropped == 0


def test_bad_profiles_are_refused():
    with pytest.raises(ValueError):
        LinkProfile(mean_ms=-1)
    with pytest.raises(ValueError):
        KafkaShim("127.0.0.1:9").outage(1.0, mode="flaky")
