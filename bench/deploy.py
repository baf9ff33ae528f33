"""Staged release over a simulated fleet, in virtual time, against the release server's real decision code.

``python -m bench.deploy [--quick] [--devices N]``

**The fleet** (seeded): ``--devices`` devices (default 100,000; ``--quick`` 20,000), each sending app
requests as a Poisson process (mean one every ``--request-every`` s, default 60). Every request goes
through :meth:`ReleaseManager.decide_header` — the same call the HTTP server makes: header parsing,
noting the device's versions (coverage, success samples), the policy snapshot's decision — with a real
:class:`ReleaseStore` (SQLite, in a temporary directory) under it and :meth:`ReleaseManager.tick` every
virtual second (scheduled advances, coverage samples, flushing reports). Virtual time jumps from
request to request; nothing sleeps.

A device told to update downloads and installs in a random time (lognormal, median 3 s), then either
loads the new version and reports success, or fails at load (probability ``fail_at_load``), reports the
failure and stays on its version; reports reach the server 1 s later. Told to roll back, it reinstalls
its kept N−1 (0.5 s). The plan is the default one with a beta: an allow-list of 0.1 % of the fleet (at least
20 devices), then gray
1 % → 5 % → 20 % → 50 % → 100 %, each stage held ``--step-interval`` s (default 60) and at least
``min_samples`` = 50 reporting devices of its newest cohort within the guardrail of 5 %.

- **Good release** (0.1 % of loads fail): coverage (devices running the new version / fleet) over
  virtual time; ``coverage_t50_min`` / ``_t90_min`` / ``_t99_min`` in virtual minutes from the start.
- **Bad release** (30 % of loads fail): ``rollback_detect_s`` = virtual seconds from the start to the
  automatic rollback; ``bad_version_exposure_fraction`` = devices that were ever told to install it /
  fleet (``bad_version_ran_fraction``: those that loaded it); ``bad_version_gone_s``: seconds until no
  device runs it. ``nobeta_*``: the same bad release with no beta stage, so that the first gray step (1 %)
  has to catch it.
- ``decision_us_p50`` / ``_p99``: wall time of each ``decide_header`` call in the simulation (all of
  them, both releases). ``sim_wall_s``: wall seconds of both simulations.

**Over loopback HTTP**: the real server (:class:`DeployServer`, aiohttp) in a process of its own with a
release in progress; 200 concurrent device clients (asyncio, one kept-alive connection each, a
minimal HTTP/1.1 client so that the client side costs little of the 2 cores) send app requests with
the piggyback headers, signed with each device's key (random devices of the fleet, each request an
authentication and a decision) for a few seconds;
``http_requests_per_s`` (median of rounds), ``http_p50_ms`` / ``http_p99_ms`` per request.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import json
import multiprocessing
import random
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import finish, log, median, parse_args, percentile
from streamflow.deploy.device_auth import AUTH_HEADER, sign_request
from streamflow.deploy.release.stages import PublishedBundle, ReleaseManager, ReleasePlan
from streamflow.deploy.release.state import ReleaseStore

TASK = "ipv"
WINDOW_S = 60.0  # requests are drawn one virtual minute at a time (Poisson: memoryless, so exact)


@dataclass
class Fleet:
    """Per-device state of the simulation, as arrays and lists indexed by device number."""

    n: int
    version: list[str]
    ever_told: set[int] = field(default_factory=set)
    ever_ran: set[int] = field(default_factory=set)
    installing: set[int] = field(default_factory=set)


def _plan(args: Any, n: int, with_beta: bool = True) -> ReleasePlan:
    size = max(20, n // 1000)  # a beta of 0.1 % of the fleet
    beta = tuple(f"d{i:06d}" for i in range(0, n, max(1, n // size)))[:size] if with_beta else ()
    return ReleasePlan(beta=beta, step_interval_s=args.step_interval, min_samples=50, max_failure_rate=0.05,
                       simulate=False)


def simulate(args: Any, n: int, fail_at_load: float, seed: int, horizon_s: float, stop_at_rollback: bool,
             with_beta: bool = True) -> dict[str, Any]:
    """One release over the fleet; returns its figures."""
    rng = np.random.default_rng(seed)
    rand = random.Random(seed)
    now = [0.0]
    tmp = tempfile.mkdtemp(prefix="bench-deploy-")
    manager = ReleaseManager(ReleaseStore(tmp), clock=lambda: now[0], coverage_every_s=10.0, flush_every_s=1.0)
    for version, previous in (("1", None), ("2", "1")):
        manager.add_bundle(PublishedBundle(TASK, version, f"{seed:04d}digest{version}".ljust(64, "0"), "key",
                                           previous), b"{}", b"sig", [])
    manager.set_stable(TASK, "1")
    names = [f"d{i:06d}" for i in range(n)]
    headers = {v: f"{TASK}={v}" for v in ("1", "2")}
    fleet = Fleet(n, ["1"] * n)
    # per-device attributes, as a device sends them (the plan targets every device; parsing them is part of the cost)
    attrs = [f"os={'android' if i % 3 else 'ios'},app_version=7.{i % 10}" for i in range(n)]
    release = manager.start(TASK, "2", _plan(args, n, with_beta))
    parsed: dict[str, tuple[str, str]] = {}
    pending: list[tuple[float, int, int, str]] = []  # (time, seq, device, what) installs and reports in flight
    seq = 0
    timings = np.empty(0, dtype=np.int64)
    chunks = []
    on_new = 0
    marks: dict[float, float] = {}
    thresholds = [(q, int(np.ceil(q * n))) for q in (0.5, 0.9, 0.99)]
    rollback_at = gone_at = None
    next_tick = 1.0
    window = 0
    started = time.perf_counter()
    perf = time.perf_counter_ns
    while window * WINDOW_S < horizon_s:
        t0 = window * WINDOW_S
        counts = rng.poisson(WINDOW_S / args.request_every, n)
        devices = np.repeat(np.arange(n, dtype=np.int64), counts)
        times = t0 + rng.random(devices.size) * WINDOW_S
        order = np.argsort(times, kind="stable")
        times, devices = times[order].tolist(), devices[order].tolist()
        spent = np.empty(len(times), dtype=np.int64)
        for k in range(len(times)):
            t = times[k]
            while pending and pending[0][0] <= t:  # installs and reports that finished before this request
                at, _, d, what = heapq.heappop(pending)
                now[0] = at
                on_new += _complete(manager, fleet, names, d, what, fail_at_load, rand, pending, seq, at)
                seq += 1
                while thresholds and on_new >= thresholds[0][1]:
                    marks[thresholds.pop(0)[0]] = at / 60.0
            while next_tick <= t:
                now[0] = next_tick
                manager.tick()
                next_tick += 1.0
            now[0] = t
            d = devices[k]
            begin = perf()
            told = manager.decide_header(names[d], headers[fleet.version[d]], attrs[d])
            spent[k] = perf() - begin
            if told is None or d in fleet.installing:  # busy installing: the updater acts on the next request
                continue
            action, version = parsed.get(told) or parsed.setdefault(told, _directive(told))
            fleet.installing.add(d)
            if action == "update":
                fleet.ever_told.add(d)
                delay = rand.lognormvariate(np.log(3.0), 0.5)
                heapq.heappush(pending, (t + delay, seq, d, "install:" + version))
            else:
                heapq.heappush(pending, (t + 0.5, seq, d, "rollback:" + version))
            seq += 1
        chunks.append(spent)
        if release.status == "rolled_back" and rollback_at is None:
            rollback_at = release.ended_at
        if rollback_at is not None and gone_at is None and not any(v == "2" for v in fleet.version) \
                and not pending:
            gone_at = now[0]
        window += 1
        if 0.99 in marks or (stop_at_rollback and gone_at is not None):
            break
    wall = time.perf_counter() - started
    timings = np.concatenate(chunks) if chunks else timings
    manager.flush()
    manager.store.close()
    return {"wall_s": wall, "requests": int(timings.size), "timings_ns": timings, "marks": marks,
            "rollback_at": rollback_at, "gone_at": gone_at, "release": release, "fleet": fleet,
            "virtual_s": now[0], "coverage": on_new / n}


def _directive(told: str) -> tuple[str, str]:
    import json

    (first,) = json.loads(told)
    return first["action"], first["version"]


def _complete(manager: ReleaseManager, fleet: Fleet, names: list[str], d: int, what: str, fail_at_load: float,
              rand: random.Random, pending: list, seq: int, at: float) -> int:
    """Apply one finished install, rollback or report; returns the change in devices running version 2."""
    kind, _, version = what.partition(":")
    if kind == "install":
        fleet.installing.discard(d)
        ok = rand.random() >= fail_at_load
        heapq.heappush(pending, (at + 1.0, seq, d, ("ok:" if ok else "fail:") + version))
        if ok:
            fleet.version[d] = version
            fleet.ever_ran.add(d)
            return 1 if version == "2" else 0
        return 0
    if kind == "rollback":
        fleet.installing.discard(d)
        was = fleet.version[d]
        fleet.version[d] = version
        return -1 if was == "2" and version != "2" else 0
    manager.report(names[d], TASK, version, ok=kind == "ok", reason="" if kind == "ok" else
                   "load_failed: ipv@2: RuntimeError: simulated failure at load")
    return 0


# -- HTTP ---------------------------------------------------------------------------------------------
def _device_key(d: int) -> bytes:
    """Device ``d``'s key (the server's registry and the clients derive the same one)."""
    return hashlib.sha256(f"bench-device-{d}".encode()).digest()


def _serve(directory: str, port: int, n: int, ready: Any) -> None:
    from connectors.tunnel.keys import KeyRegistry
    from streamflow.deploy.release.server import DeployServer, run

    keys = Path(directory) / "keys.json"  # the fleet's keys: every request is signed and checked, as in production
    keys.write_text(json.dumps({"devices": {f"d{d:06d}": _device_key(d).hex() for d in range(n)}}))
    server = DeployServer(directory, None, devices=KeyRegistry(keys), tick_s=0.5)
    manager = server.manager
    for version, previous in (("1", None), ("2", "1")):
        manager.add_bundle(PublishedBundle(TASK, version, f"httpdigest{version}".ljust(64, "0"), "key", previous),
                           b"{}", b"sig", [])
    manager.set_stable(TASK, "1")
    manager.start(TASK, "2", ReleasePlan(steps=(0.2, 1.0), step_interval_s=None, simulate=False))
    ready.set()
    run(server, "127.0.0.1", port)


async def _client(port: int, n: int, stop_at: float, latencies: list[float], seed: int) -> int:
    rand = random.Random(seed)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    done = 0
    try:
        while time.perf_counter() < stop_at:
            d = rand.randrange(n)
            headers = {"X-Streamflow-Device": f"d{d:06d}", "X-Streamflow-Tasks": f"{TASK}=1",
                       "X-Streamflow-Attrs": "os=android,app_version=7.3"}
            begin = time.perf_counter()
            headers[AUTH_HEADER] = sign_request(_device_key(d), "GET", "/app/feed", headers, b"", time.time())
            request = "GET /app/feed HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "".join(
                f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
            writer.write(request.encode())
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            if not head.startswith(b"HTTP/1.1 200") or b"x-streamflow-deploy-error" in head.lower():
                raise RuntimeError(f"server answered {head[:300]!r}")
            await reader.readexactly(length)
            latencies.append(time.perf_counter() - begin)
            done += 1
    finally:
        writer.close()
    return done


async def _load(port: int, n: int, clients: int, seconds: float, seed: int) -> tuple[float, list[float]]:
    latencies: list[float] = []
    begin = time.perf_counter()
    counts = await asyncio.gather(*(_client(port, n, begin + seconds, latencies, seed + i) for i in range(clients)))
    elapsed = time.perf_counter() - begin
    return sum(counts) / elapsed, latencies


def http_round_trips(n: int, clients: int, seconds: float, rounds: int, seed: int) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    server = ctx.Process(target=_serve, args=(tempfile.mkdtemp(prefix="bench-deploy-http-"), port, n, ready),
                         daemon=True)
    server.start()
    try:
        deadline = time.monotonic() + 60
        while not ready.wait(0.2):
            if not server.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the release server process did not start (exit code {server.exitcode})")
        for _ in range(100):  # until it accepts connections
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        asyncio.run(_load(port, n, clients, 0.5, seed))  # warm-up
        rates, all_latencies = [], []
        for r in range(rounds):
            rate, latencies = asyncio.run(_load(port, n, clients, seconds, seed + 1000 * (r + 1)))
            log(f"http round {r + 1}/{rounds}: {rate:.0f} requests/s from {clients} clients")
            rates.append(rate)
            all_latencies += latencies
    finally:
        server.terminate()
        server.join(10)
    all_latencies.sort()
    return {"http_requests_per_s": round(median(rates), 1), "http_requests_per_s_rounds": [round(x) for x in rates],
            "http_p50_ms": round(percentile(all_latencies, 50) * 1000, 2),
            "http_p99_ms": round(percentile(all_latencies, 99) * 1000, 2), "http_clients": clients}


def main(argv: list[str] | None = None) -> None:
    def extra(parser: Any) -> None:
        parser.add_argument("--devices", type=int, default=None, help="fleet size (default 100,000; quick 20,000)")
        parser.add_argument("--request-every", type=float, default=60.0, help="mean seconds between a device's "
                                                                              "requests")
        parser.add_argument("--step-interval", type=float, default=60.0, help="seconds each stage is held")
        parser.add_argument("--clients", type=int, default=200, help="concurrent HTTP device clients")

    args = parse_args(__doc__.splitlines()[0], argv, extra)
    n = args.devices or (20_000 if args.quick else 100_000)
    log(f"good release over {n} devices (virtual time)")
    good = simulate(args, n, fail_at_load=0.001, seed=args.seed, horizon_s=4 * 3600, stop_at_rollback=False)
    log(f"good release: {good['requests']} requests in {good['wall_s']:.1f} s wall, {good['virtual_s'] / 60:.1f} "
        f"virtual min, coverage {good['coverage']:.3f}, marks {good['marks']}, status {good['release'].status}")
    log(f"bad release over {n} devices (30% fail at load)")
    bad = simulate(args, n, fail_at_load=0.30, seed=args.seed + 1, horizon_s=2 * 3600, stop_at_rollback=True)
    bad_release = bad["release"]
    log(f"bad release: {bad['requests']} requests in {bad['wall_s']:.1f} s wall, {bad_release.status}: "
        f"{bad_release.reason}")
    log(f"bad release without a beta stage over {n} devices: the 1 % gray cohort has to catch it")
    nobeta = simulate(args, n, fail_at_load=0.30, seed=args.seed + 2, horizon_s=2 * 3600, stop_at_rollback=True,
                      with_beta=False)
    log(f"bad release without beta: {nobeta['requests']} requests in {nobeta['wall_s']:.1f} s wall, "
        f"{nobeta['release'].status}: {nobeta['release'].reason}")
    timings = np.sort(np.concatenate([good["timings_ns"], bad["timings_ns"]])) / 1000.0
    http = http_round_trips(n, args.clients, 2.0 if args.quick else 5.0, 1 if args.quick else args.rounds,
                            args.seed)
    marks = good["marks"]
    metrics = {
        "devices": n,
        "request_every_s": args.request_every,
        "step_interval_s": args.step_interval,
        "coverage_t50_min": round(marks.get(0.5, float("nan")), 2),
        "coverage_t90_min": round(marks.get(0.9, float("nan")), 2),
        "coverage_t99_min": round(marks.get(0.99, float("nan")), 2),
        "good_release_status": good["release"].status,
        "rollback_detect_s": round(bad["rollback_at"], 1) if bad["rollback_at"] is not None else None,
        "bad_version_exposure_fraction": round(len(bad_release.exposed) / n, 5),
        "bad_version_ran_fraction": round(len(bad["fleet"].ever_ran) / n, 5),
        "bad_version_gone_s": round(bad["gone_at"], 1) if bad["gone_at"] is not None else None,
        "bad_release_reason": bad_release.reason,
        "nobeta_rollback_detect_s": round(nobeta["rollback_at"], 1) if nobeta["rollback_at"] is not None else None,
        "nobeta_bad_version_exposure_fraction": round(len(nobeta["release"].exposed) / n, 5),
        "nobeta_bad_version_ran_fraction": round(len(nobeta["fleet"].ever_ran) / n, 5),
        "nobeta_bad_release_reason": nobeta["release"].reason,
        "decision_us_p50": round(float(timings[int(0.50 * (timings.size - 1))]), 2),
        "decision_us_p99": round(float(timings[int(0.99 * (timings.size - 1))]), 2),
        "decisions": int(timings.size),
        "sim_wall_s": round(good["wall_s"] + bad["wall_s"], 1),
        **http,
        "quick": args.quick,
    }
    finish("deploy", metrics, quick=args.quick)


if __name__ == "__main__":
    main()
