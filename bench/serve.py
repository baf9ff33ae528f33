"""Real-time serving (MDInference) over a real broker: SLA attainment and accuracy of three policies, side by side.

What runs: a fresh noida-db broker on 127.0.0.1; the serving worker (``streamflow serve``, faust-streaming, every
model of the zoo) in its own process; a network shim process (:class:`~streamflow.serve.netshim.ShimProcess`)
between the device and the broker adding a seeded gamma delay to every Kafka frame, each way; one device
(:class:`~streamflow.serve.client.ServeClient`: its own model and Kafka helper processes) sending labelled pages of
the zoo's evaluation set (a held-out seed, not the pages the zoo's accuracy was measured on).

Settings: SLA 100 / 150 / 250 ms × delay CV 0 / 50 / 100 % (mean one-way delay ``--delay-ms``, 15 ms), then one run
(SLA 150, CV 50 %) with a broker outage of ``--outage-s`` (10 s; the shim drops every connection of the device and
refuses new ones). In every setting the three policies take turns request by request, so they see the same
network, load and worker: ``mdinference`` (the cloud picks the model by ``--rule``: ``expected``, the worker's
default, or ``paper``), ``largest`` (the cloud always runs the largest model, the most work per image, whatever
the budget; the device still races its local model: the static cloud baseline), ``local`` (the device's
fastest model only). Requests leave every ``--interval-ms`` on a fixed schedule; the first few of each setting (2 %,
at least 6) are a warm-up after the network changed and are not counted.

Accuracy is the fraction of answers equal to the page's label: real predictions of whichever model answered
(cloud or device), never the zoo's stored figure. SLA attainment: answered within the SLA, measured on the device
from submission to answer. ``on_device_reliance``: the share of MDInference's requests the device answered.

Metrics (issue 30): the worker runs with ``--metrics-port``, its ``/metrics`` scraped every ``SCRAPE_EVERY_S`` (1 s)
by a process of its own, so every figure is with metrics on. ``metrics_overhead_fraction``: afterwards, fresh workers
serving only the fastest model (the least work per request: the metrics' largest share) take turns with and without
metrics (6 turns, 3 each; quick 2), each answering 400 requests (quick 60) sent 5 ms apart straight to the broker;
the worker's CPU per request (``/proc``) with metrics over without, less 1 (medians); ``_wall``: from requests/s.

Final JSON keys: ``sla_attainment_min`` (MDInference, over the 9 settings and the outage run),
``sla_attainment_min_all_policies``, ``accuracy_mdinference`` / ``accuracy_static_cloud`` / ``accuracy_local_only``
(means over the 9 settings), ``on_device_reliance`` (mean over the 9), ``p99_ms`` (MDInference, all 9 pooled),
``outage_sla_attainment`` (MDInference; ``outage_sla_attainment_all_policies`` the minimum over the three),
``outage_answered_once``, ``outage_cloud_replied_share`` (of the requests sent during the outage, the share the
cloud replied to afterwards), ``per_setting`` (each setting × policy), the load average before and after.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bench.common import REPO, GcPauses, finish, log, parse_args, percentile
from connectors.tunnel.keys import KeyRegistry
from streamflow.serve.client import Answer, ServeClient
from streamflow.serve.evalset import eval_set
from streamflow.serve.netshim import LinkProfile, ShimProcess
from streamflow.serve.policy import RULES
from streamflow.serve.zoo import Zoo, ZooError, build_zoo

SLAS_MS = (100.0, 150.0, 250.0)
CVS = (0.0, 0.5, 1.0)
POLICIES = ("mdinference", "largest", "local")
OUTAGE_SLA_MS, OUTAGE_CV = 150.0, 0.5
DEVICE = "bench-phone"
SCRAPE_EVERY_S = 1.0  # the worker's /metrics is scraped this often (Prometheus: 5-60 s; docker/'s: 5 s)
BURST_INTERVAL_S = 0.005  # between requests of the metrics-overhead phase


def options(parser: Any) -> None:
    parser.add_argument("--requests", type=int, default=None, help="per policy per setting (default 1000, quick 15)")
    parser.add_argument("--interval-ms", type=float, default=None, help="between requests (default 60, quick 40)")
    parser.add_argument("--delay-ms", type=float, default=15.0, help="mean one-way delay of the shim per frame")
    parser.add_argument("--outage-s", type=float, default=None, help="broker outage (default 10, quick 3)")
    parser.add_argument("--eval-size", type=int, default=None, help="distinct labelled pages (default 400, quick 60)")
    parser.add_argument("--rule", choices=RULES, default="expected", help="MDInference's model-choice rule")
    parser.add_argument("--settings", default=None,
                        help="comma-separated settings to run, e.g. sla100_cv100,outage (default: all)")


def load_zoo() -> Zoo:
    try:
        return Zoo.load()
    except ZooError as exc:
        log(f"{exc}; building the zoo (once per machine)")
        return build_zoo()


def start_worker(bootstrap: str, zoo: Zoo, registry: Path, log_path: Path, rule: str,
                 metrics_port: int | None = None, models: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "STREAMFLOW_KAFKA_BOOTSTRAP": bootstrap, "STREAMFLOW_KEY_REGISTRY": str(registry),
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    extra = (["--metrics-port", str(metrics_port)] if metrics_port is not None else []) + (
        ["--models", models] if models else [])
    with open(log_path, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "streamflow.cli", "serve", "--app-id",
                                 f"bench-serve-{uuid.uuid4().hex[:8]}", "--zoo", str(zoo.path), "--rule", rule,
                                 *extra], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def stop_worker(worker: subprocess.Popen) -> None:
    if worker.poll() is not None:
        return
    worker.terminate()
    try:
        worker.wait(timeout=5)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_loop(url: str, every_s: float, stop: Any, out: Any) -> None:
    """A Prometheus stand-in (its own process, so the device's process pays nothing): GET ``url`` every
    ``every_s``; puts the number of scrapes and the last exposition on ``out`` when ``stop`` is set."""
    import urllib.request

    scrapes, last = 0, ""
    while not stop.wait(every_s):
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                last = response.read().decode()
            scrapes += 1
        except OSError:  # not up yet, or stopping
            continue
    out.put((scrapes, last))


class Scraping:
    """:func:`scrape_loop` in a spawned process, from start to :meth:`stop` (the scrapes and the last text)."""

    def __init__(self, url: str, every_s: float = SCRAPE_EVERY_S):
        ctx = mp.get_context("spawn")
        self.stop_event, self.out = ctx.Event(), ctx.Queue()
        self.process = ctx.Process(target=scrape_loop, args=(url, every_s, self.stop_event, self.out), daemon=True)
        self.process.start()

    def stop(self) -> tuple[int, str]:
        self.stop_event.set()
        try:
            result = self.out.get(timeout=30)
        except Exception:  # noqa: BLE001 - queue.Empty: the scraper died; say so in the figures
            result = (0, "")
        self.process.join(10)
        return result


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for_cloud(client: ServeClient, image: np.ndarray, worker: subprocess.Popen, log_path: Path,
                   timeout_s: float = 300.0) -> float:
    started = time.monotonic()
    while client.infer(image, sla_ms=2000.0).answered_by != "cloud":
        if worker.poll() is not None:
            raise RuntimeError(f"the serving worker exited:\n{log_path.read_text(errors='replace')[-3000:]}")
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"no cloud answer within {timeout_s}s")
    return time.monotonic() - started


def run_setting(client: ServeClient, images: np.ndarray, labels: np.ndarray, start_index: int, sla_ms: float,
                per_policy: int, interval_s: float, shim: ShimProcess | None = None,
                outage: tuple[float, float] | None = None) -> tuple[list[tuple[int, str, float, Answer]], int, dict]:
    """Requests on a fixed schedule, policies in turn; ``(label, policy, sent at s, answer)`` of each counted one,
    the number of warm-up requests, and the client's count deltas."""
    warmup = max(6, round(0.02 * per_policy * len(POLICIES)))
    total = warmup + per_policy * len(POLICIES)
    before = Counter(client.counts)
    sent: list[tuple[int, str, float, Any]] = []
    in_outage = False
    start = time.monotonic()
    for i in range(total):
        due = start + i * interval_s
        pause = due - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        at = time.monotonic() - start
        if outage is not None and shim is not None and not in_outage and at >= outage[0]:
            shim.outage(outage[1], mode="drop")
            in_outage = True
        index = (start_index + i // len(POLICIES)) % len(images)  # the three policies get the same pages
        policy = POLICIES[i % len(POLICIES)]
        sent.append((int(labels[index]), policy, at, client.submit(images[index], sla_ms, policy)))
    answered = [(label, policy, at, future.result(timeout=60)) for label, policy, at, future in sent]
    counts = Counter(client.counts)
    counts.subtract(before)
    return answered[warmup:], warmup, dict(counts)


def metrics_overhead(bootstrap: str, zoo: Zoo, registry: Path, key: bytes, images: np.ndarray, tmp: Path,
                     rule: str, n: int, orders: tuple[bool, ...]) -> dict[str, Any]:
    """The worker's CPU per request with its metrics served and scraped vs without: a fresh worker per turn (two
    cannot share ``serve.requests``), each serving only the zoo's fastest model (the least work per request, so the
    metrics' share is the largest), ``n`` requests with a 10 s SLA sent every :data:`BURST_INTERVAL_S` straight to
    the broker (no shim), after a warm-up. The worker's CPU (``/proc``) over the burst, per request."""
    fastest = zoo.fastest().name
    cpu: dict[bool, list[float]] = {True: [], False: []}
    rate: dict[bool, list[float]] = {True: [], False: []}
    for turn, with_metrics in enumerate(orders):
        port = free_port() if with_metrics else None
        log_path = tmp / f"overhead_{turn}.log"
        worker = start_worker(bootstrap, zoo, registry, log_path, rule, metrics_port=port, models=fastest)
        scraping = Scraping(f"http://127.0.0.1:{port}/metrics") if port is not None else None
        try:
            with ServeClient(DEVICE, key, bootstrap=bootstrap, zoo=zoo) as client:
                wait_for_cloud(client, images[0], worker, log_path)
                for i in range(30):  # warm-up: the device's upload estimate, the worker's first fetches
                    client.infer(images[i % len(images)], 2000.0, "largest")
                before, started = process_cpu_s(worker.pid), time.monotonic()
                futures = []
                for i in range(n):
                    futures.append(client.submit(images[i % len(images)], 10_000.0, "largest"))
                    time.sleep(BURST_INTERVAL_S)
                answers = [future.result(timeout=120) for future in futures]
                wall = time.monotonic() - started
                used = process_cpu_s(worker.pid) - before
            by_cloud = sum(a.answered_by == "cloud" for a in answers)
            if by_cloud < n:
                log(f"metrics overhead: {n - by_cloud} of {n} requests answered by the device")
            cpu[with_metrics].append(used / n)
            rate[with_metrics].append(n / wall)
            log(f"metrics overhead: worker {'with' if with_metrics else 'without'} metrics: "
                f"{used / n * 1000:.2f} ms CPU per request, {n / wall:.0f} requests/s")
        finally:
            if scraping is not None:
                scraping.stop()
            worker.terminate()
            try:
                worker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
    on, off = statistics.median(cpu[True]), statistics.median(cpu[False])
    return {"metrics_overhead_fraction": round(on / off - 1, 4),
            "target_metrics_overhead_3pct_met": on / off - 1 <= 0.03,
            "metrics_overhead_fraction_wall": round(1 - statistics.median(rate[True]) / statistics.median(rate[False]),
                                                    4),
            "metrics_overhead_worker_cpu_ms_per_request": {"metrics": round(on * 1000, 3),
                                                           "no_metrics": round(off * 1000, 3)},
            "metrics_overhead_requests": n, "metrics_overhead_model": fastest,
            "metrics_overhead_turns": ["metrics" if t else "no_metrics" for t in orders]}


def misses(rows: list[tuple[int, str, float, Answer]], limit: int = 5) -> list[str]:
    """The first answers that came after their SLA, for the log."""
    late = [(p, round(at, 2), a) for _, p, at, a in rows if not a.met_sla]
    return [f"{p}@{at}s {a.latency_ms:.0f}ms by {a.answered_by} (cloud {a.cloud})" for p, at, a in late[:limit]]


def summarize(rows: list[tuple[int, str, float, Answer]]) -> dict[str, dict[str, Any]]:
    out = {}
    for policy in POLICIES:
        answers = [(label, a) for label, p, _, a in rows if p == policy]
        latencies = sorted(a.latency_ms for _, a in answers)
        cloud_models = Counter(a.model for _, a in answers if a.answered_by == "cloud")
        out[policy] = {
            "n": len(answers),
            "sla_attainment": sum(a.met_sla for _, a in answers) / len(answers),
            "accuracy": sum(a.label == label for label, a in answers) / len(answers),
            "device_share": sum(a.answered_by == "device" for _, a in answers) / len(answers),
            "p50_ms": round(percentile(latencies, 50), 2),
            "p99_ms": round(percentile(latencies, 99), 2),
            "max_ms": round(latencies[-1], 2),
            "cloud_models": dict(cloud_models.most_common()),
            # why the device answered: the cloud's status then (expired: the worker ran no model; pending: late)
            "device_answers_cloud_status": dict(Counter(a.cloud for _, a in answers
                                                        if a.answered_by == "device").most_common()),
        }
        cloud = [a for _, a in answers if a.answered_by == "cloud"]
        if cloud:
            # the cloud's network estimate against what the round trip took besides the model
            out[policy]["median_budget_ms"] = round(statistics.median(a.budget_ms for a in cloud), 2)
            out[policy]["median_network_estimate_ms"] = round(statistics.median(a.network_ms for a in cloud), 2)
            out[policy]["median_non_model_ms"] = round(statistics.median(a.latency_ms - a.inference_ms
                                                                         for a in cloud), 2)
            out[policy]["cloud_answers_without_budget"] = sum(a.budget_ms <= 0 for a in cloud)
    return out


def run_outage(client: ServeClient, shim: ShimProcess, images: np.ndarray, labels: np.ndarray, next_image: int,
               per_policy: int, interval_s: float, outage_s: float, args: Any,
               per_setting: dict[str, Any]) -> dict[str, Any]:
    """The outage run (added to ``per_setting``); its final JSON keys."""
    # the outage: a quarter of the run before it, the outage, the rest after (at least 1.5 outages long)
    shim.set_profile(LinkProfile(args.delay_ms, OUTAGE_CV, args.seed))
    outage_per_policy = max(per_policy, int((2.5 * outage_s) / interval_s / len(POLICIES)) + 1)
    outage_at = outage_per_policy * len(POLICIES) * interval_s / 4
    rows, warmup, counts = run_setting(client, images, labels, next_image, OUTAGE_SLA_MS, outage_per_policy,
                                       interval_s, shim=shim, outage=(outage_at, outage_s))
    during = [a.request_id for _, p, at, a in rows if p != "local" and outage_at <= at < outage_at + outage_s]
    drain_until = time.monotonic() + (8 if args.quick else 40)
    while set(during) - client.replied and time.monotonic() < drain_until:
        time.sleep(0.2)
    outage = summarize(rows)
    ids = [a.request_id for _, _, _, a in rows]
    per_setting["outage"] = {**outage, "outage_s": outage_s, "outage_from_s": round(outage_at, 2),
                             "sla_ms": OUTAGE_SLA_MS, "cv": OUTAGE_CV, "client_counts": counts,
                             "requests_during_outage_to_cloud": len(during)}
    log("outage: " + "; ".join(f"{p} sla {s['sla_attainment']:.4f} acc {s['accuracy']:.3f} "
                               f"device {s['device_share']:.3f}" for p, s in outage.items()))
    if missed := misses(rows):
        log(f"outage: after the SLA: {missed}")
    log(f"outage: client counts {counts}; cloud replied to {len(set(during) & client.replied)} of the "
        f"{len(during)} requests sent to it during the outage")
    return {
        "outage_sla_attainment": outage["mdinference"]["sla_attainment"],
        "outage_sla_attainment_all_policies": min(outage[p]["sla_attainment"] for p in POLICIES),
        "outage_answered_once": len(set(ids)) == len(ids) == len(rows),
        "outage_cloud_replied_share": round(len(set(during) & client.replied) / max(len(during), 1), 4),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv, extra=options)
    per_policy = args.requests or (15 if args.quick else 1000)
    interval_s = (args.interval_ms or (40.0 if args.quick else 60.0)) / 1000.0
    outage_s = args.outage_s if args.outage_s is not None else (3.0 if args.quick else 10.0)
    eval_size = args.eval_size or (60 if args.quick else 400)
    load_before = os.getloadavg()
    began = time.monotonic()
    from tests.kafka_broker import LocalBroker

    zoo = load_zoo()
    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    broker = LocalBroker(tmp / "broker").up()
    registry = KeyRegistry(tmp / "keys.json")
    key = registry.add(DEVICE)
    worker_log = tmp / "worker.log"
    metrics_port = free_port()  # the settings run with the worker's metrics served and scraped
    worker = start_worker(broker.bootstrap, zoo, registry.path, worker_log, args.rule, metrics_port=metrics_port)
    scraping: Scraping | None = Scraping(f"http://127.0.0.1:{metrics_port}/metrics")
    wanted = set(args.settings.split(",")) if args.settings else None
    shim = client = None
    try:
        log(f"broker noida-db on {broker.bootstrap}; worker starting; zoo {zoo.path}")
        images, labels = eval_set(eval_size, seed=args.seed)  # held out: the zoo's accuracy used seed 0
        shim = ShimProcess(broker.bootstrap, LinkProfile(args.delay_ms, 0.0, args.seed)).start()
        client = ServeClient(DEVICE, key, bootstrap=shim.bootstrap, zoo=zoo).start()
        gc_pauses = GcPauses()  # from here on: the collections while requests are timed
        ready_s = wait_for_cloud(client, images[0], worker, worker_log)
        # settle: the first replies of a cold worker are slow; the device's upload estimate learns from them
        settling = []
        for i in range(30):
            settling.append(client.submit(images[i % len(images)], 250.0))
            time.sleep(interval_s)
        for future in settling:
            future.result(timeout=60)
        log(f"worker answering after {ready_s:.1f}s more; {per_policy} requests per policy per setting, one every "
            f"{interval_s * 1000:.0f} ms, mean delay {args.delay_ms} ms each way")
        per_setting: dict[str, Any] = {}
        pooled_mdi: list[float] = []
        next_image = 0
        for sla in SLAS_MS:
            for cv in CVS:
                name = f"sla{sla:g}_cv{cv * 100:g}"
                if wanted is not None and name not in wanted:
                    continue
                shim.set_profile(LinkProfile(args.delay_ms, cv, args.seed))
                rows, warmup, counts = run_setting(client, images, labels, next_image, sla, per_policy, interval_s)
                next_image += (len(rows) + warmup) // len(POLICIES) + 1
                summary = summarize(rows)
                per_setting[name] = {**summary, "late_replies": counts.get("late_replies", 0)}
                pooled_mdi += [a.latency_ms for _, p, _, a in rows if p == "mdinference"]
                if missed := misses(rows):
                    log(f"{name}: after the SLA: {missed}")
                log(f"{name}: " + "; ".join(f"{p} sla {s['sla_attainment']:.4f} acc {s['accuracy']:.3f} "
                                             f"device {s['device_share']:.3f} p99 {s['p99_ms']:.0f}ms"
                                             for p, s in summary.items()))
                mdi = summary["mdinference"]
                log(f"{name}: mdinference budget {mdi.get('median_budget_ms')} ms, network estimate "
                    f"{mdi.get('median_network_estimate_ms')} ms, non-model time of cloud answers "
                    f"{mdi.get('median_non_model_ms')} ms, models {mdi['cloud_models']}")
        outage_metrics: dict[str, Any] = {}
        if wanted is None or "outage" in wanted:
            outage_metrics = run_outage(client, shim, images, labels, next_image, per_policy, interval_s, outage_s,
                                        args, per_setting)
        scrapes, exposition = scraping.stop()
        scraping = None
        scraped = {s.name: s.value for f in text_string_to_metric_families(exposition) for s in f.samples
                   if not s.labels}
        counts, local_model = dict(client.counts), client.local_model
        client.close()
        shim.stop()
        client = shim = None
        stop_worker(worker)
        turns = (True, False) if args.quick else (True, False, False, True, True, False)  # each first in turn
        overhead = metrics_overhead(broker.bootstrap, zoo, registry.path, key, images, tmp, args.rule,
                                    60 if args.quick else 400, turns)
        network = [v for k, v in per_setting.items() if k != "outage"]
        attainments = [s["mdinference"]["sla_attainment"] for s in per_setting.values()]
        metrics = {
            "sla_attainment_min": min(attainments),
            "sla_attainment_min_all_policies": min(s[p]["sla_attainment"] for s in per_setting.values()
                                                   for p in POLICIES),
            "accuracy_mdinference": round(statistics.fmean(s["mdinference"]["accuracy"] for s in network), 4),
            "accuracy_static_cloud": round(statistics.fmean(s["largest"]["accuracy"] for s in network), 4),
            "accuracy_local_only": round(statistics.fmean(s["local"]["accuracy"] for s in network), 4),
            "on_device_reliance": round(statistics.fmean(s["mdinference"]["device_share"] for s in network), 4),
            "p99_ms": round(percentile(sorted(pooled_mdi), 99), 2),
            **outage_metrics,
            **overhead,
            "metrics_scrapes": scrapes,
            "metrics_scrape_every_s": SCRAPE_EVERY_S,
            "metrics_requests_total_last_scrape": scraped.get("streamflow_serve_requests_total"),
            "duplicate_replies": counts.get("duplicate_replies", 0),
            "requests_per_policy_per_setting": per_policy,
            "interval_ms": interval_s * 1000,
            "mean_delay_ms": args.delay_ms,
            "rule": args.rule,
            "settings_run": list(per_setting),
            "local_model": local_model,
            "static_model": zoo.largest().name,
            "zoo_accuracy": {m.name: m.accuracy for m in zoo.models},
            "zoo_eval_size": zoo.meta.get("eval_size"),
            "cloud_less_accurate_replies": counts.get("cloud_less_accurate", 0),
            "device_process_gc": gc_pauses.summary(),
            "per_setting": per_setting,
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "quick": args.quick,
            "wall_s": round(time.monotonic() - began, 1),
        }
    finally:
        if scraping is not None:
            scraping.stop()
        if client is not None:
            client.close()
        if shim is not None:
            shim.stop()
        stop_worker(worker)
        broker.down()
        shutil.rmtree(tmp, ignore_errors=True)
    finish("serve", metrics, quick=args.quick)


if __name__ == "__main__":
    main()
