"""Trigger matching: the trie (one lookup per event) vs a naive matcher that scans every condition.

``python -m bench.triggers [--quick]``

Input: the Taobao sample through :class:`~streamflow.sources.TaobaoBehaviorSource`, with a richer
alphabet than the raw adapter gives: the page id is ``p<category_id mod 50>`` (so a ``page_exit``
offers one of 50 page ids), clicks are ``click_fav``/``click_cart``/``click_buy`` (a reload would be
``reload``). About 55 trigger ids in all.

Conditions: 1,000 distinct ones of 1–5 trigger ids, ~10% with a ``*`` gap; most are real
subsequences of users' streams (so they fire), the rest random strings over the alphabet (which
mostly do not), as a job with many tasks would have.

Both matchers keep per-user state and see the same events in the same order:

- trie: ``state, fired = trie.step(state, event)`` with one :class:`TriggerTrie` holding every
  condition; the stream is replayed until >= 1M events a round (full mode);
- naive: per user and per condition, the set of matched prefix lengths, all advanced on every
  event (an exact simulation of the documented semantics, written independently of the trie).

The trie caches its steps (a lazily built DFA): its first round, cache filling up, is reported
apart (``trie_first_round_events_per_s``); the timed rounds reuse the trie with fresh per-user
states. Each round times the trie, then the naive matcher (it scans a prefix of the stream, it is
too slow for more); figures are medians of the rounds, wall clock, plus CPU-time figures
(``*_per_cpu_s``) that a busy shared machine disturbs less.

Before the timed rounds, both run over a prefix of the stream recording every (event, task) that
fires; any difference aborts the benchmark (a semantic bug, not a speed question).
"""

from __future__ import annotations

import random
import sys
import time
from collections import Counter
from itertools import chain

from bench.common import TAOBAO_SAMPLE, cpu_count, finish, log, median, parse_args, progress
from streamflow.events import PAGE_ENTER, PAGE_EXIT, Event
from streamflow.sources import TaobaoBehaviorSource
from streamflow.trie import WILDCARD, TriggerTrie

N_CONDITIONS = 1_000
N_PAGES = 50
LENGTH_WEIGHTS = {1: 0.08, 2: 0.22, 3: 0.30, 4: 0.22, 5: 0.18}  # trigger ids per condition, "*" not counted
REAL_SHARE = 0.7  # conditions taken from the stream; the rest are random strings over the alphabet
WILDCARD_SHARE = 0.1
SPECIFIC_SHARE = 0.8  # a page exit in a real subsequence becomes its page id (not the generic "page_exit")
TRIE_MIN_EVENTS = {False: 1_000_000, True: 200_000}  # per round, by --quick
NAIVE_EVENTS = {False: 4_000, True: 1_200}
VERIFY_EVENTS = {False: 12_000, True: 3_000}


# -- input ------------------------------------------------------------------------------------------
def build_stream() -> list[Event]:
    """The Taobao sample as app events with ~50 page ids and behaviour-derived click ids."""
    events = []
    for record in TaobaoBehaviorSource(TAOBAO_SAMPLE):
        if not isinstance(record, Event):
            continue  # rejected records never reach a matcher
        page = f"p{int(record.contents['category_id']) % N_PAGES}"
        kind = record.event_id
        if kind == "pv":
            kind = "reload"
        elif kind not in (PAGE_ENTER, PAGE_EXIT):
            kind = f"click_{kind}"
        events.append(Event(record.user_id, kind, page, record.ts))
    return events


def offered(event: Event) -> tuple[str, ...]:
    """Trigger ids an event offers (the trie's docstring): its event id, and its page id on exit."""
    if event.event_id == PAGE_EXIT:
        return (event.event_id, event.page_id)
    return (event.event_id,)


def make_conditions(events: list[Event], rng: random.Random) -> list[tuple[str, ...]]:
    """``N_CONDITIONS`` distinct conditions: mostly real subsequences of users' streams, some random."""
    per_user: dict[str, list[tuple[str, ...]]] = {}
    for event in events:
        per_user.setdefault(event.user_id, []).append(offered(event))
    streams = list(per_user.values())
    alphabet = sorted({tid for ids in chain.from_iterable(streams) for tid in ids})
    lengths, weights = list(LENGTH_WEIGHTS), list(LENGTH_WEIGHTS.values())
    conditions: dict[tuple[str, ...], None] = {}
    attempts = 0
    while len(conditions) < N_CONDITIONS:
        attempts += 1
        if attempts > 1_000 * N_CONDITIONS:
            raise RuntimeError(f"could not draw {N_CONDITIONS} distinct conditions from {len(alphabet)} ids")
        length = rng.choices(lengths, weights)[0]
        gap = length >= 2 and rng.random() < WILDCARD_SHARE / (1 - LENGTH_WEIGHTS[1])
        split = rng.randrange(1, length) if gap else length
        if rng.random() < REAL_SHARE:
            skipped = rng.randint(0, 3) if gap else 0  # events the "*" really swallows in the source
            stream = rng.choice(streams)
            span = length + skipped
            if len(stream) < span:
                continue
            start = rng.randrange(len(stream) - span + 1)
            window = stream[start:start + span]
            window = window[:split] + window[split + skipped:]
            if window[-1][-1] == PAGE_ENTER:
                continue  # a trigger fires on something specific: a click or leaving a given page
            ids = [tids[-1] if rng.random() < SPECIFIC_SHARE else rng.choice(tids) for tids in window[:-1]]
            ids.append(window[-1][-1])
        else:
            ids = [rng.choice(alphabet) for _ in range(length)]
        condition = tuple(ids[:split]) + ((WILDCARD,) if gap else ()) + tuple(ids[split:])
        conditions.setdefault(condition, None)
    return list(conditions)


# -- the naive matcher -----------------------------------------------------------------------------
class NaiveMatcher:
    """Every condition checked on every event: per user, per condition, the matched prefix lengths.

    Position ``p`` of condition ``c`` means ``c[:p]`` has been matched by the latest events (a ``"*"``
    element counts as matched once its gap is open). On an event offering ids ``S``, from position 0
    (a condition may start anywhere) and from every position held:

    - at a ``"*"`` (``c[p] == "*"``): the gap swallows the event (stay at ``p``), and the element
      after the gap may match it (reach ``p + 2``);
    - else if ``c[p]`` is in ``S``: reach ``p + 1``.

    Reaching ``len(c)`` fires the condition (once per event); any other position reached is held
    for the next event. That is contiguous matching with ``"*"`` as a gap of zero or more events.
    """

    def __init__(self, named: list[tuple[str, tuple[str, ...]]]):
        self.names = [name for name, _ in named]
        self.conditions = [cond for _, cond in named]

    def initial_state(self) -> list[tuple[int, ...]]:
        return [()] * len(self.conditions)

    def step(self, state: list[tuple[int, ...]], ids: tuple[str, ...]) -> list[int]:
        """Advance ``state`` in place; return the indexes of the conditions that fire."""
        fired = []
        for index, cond in enumerate(self.conditions):
            held = state[index]
            size = len(cond)
            nxt: set[int] = set()
            hit = False
            for pos in (0, *held):
                element = cond[pos]
                if element == WILDCARD:
                    nxt.add(pos)
                    if cond[pos + 1] in ids:
                        reached = pos + 2
                    else:
                        continue
                elif element in ids:
                    reached = pos + 1
                else:
                    continue
                if reached == size:
                    hit = True
                else:
                    nxt.add(reached)
            if nxt or held:
                state[index] = tuple(nxt)
            if hit:
                fired.append(index)
        return fired


# -- timed loops -----------------------------------------------------------------------------------
def run_trie(trie: TriggerTrie, events: list[Event], replays: int) -> tuple[float, float, int, int]:
    """(wall s, CPU s, events, tasks fired) of per-user trie stepping over ``replays`` passes of ``events``."""
    step = trie.step
    initial = trie.initial_state()
    states: dict[str, object] = {}
    get = states.get
    n_fired = 0
    cpu = time.process_time()
    started = time.perf_counter()
    for _ in range(replays):
        for event in events:
            user = event.user_id
            state, fired = step(get(user, initial), event)  # type: ignore[arg-type]
            states[user] = state
            if fired:
                n_fired += len(fired)
    return time.perf_counter() - started, time.process_time() - cpu, replays * len(events), n_fired


def run_naive(naive: NaiveMatcher, events: list[Event], limit: int) -> tuple[float, float, int, int]:
    """(wall s, CPU s, events, tasks fired) of the naive matcher over the first ``limit`` events."""
    states: dict[str, list[tuple[int, ...]]] = {}
    n_fired = 0
    chunk = events[:limit]
    cpu = time.process_time()
    started = time.perf_counter()
    for event in chunk:
        state = states.get(event.user_id)
        if state is None:
            state = states[event.user_id] = naive.initial_state()
        n_fired += len(naive.step(state, offered(event)))
    return time.perf_counter() - started, time.process_time() - cpu, len(chunk), n_fired


def verify(trie: TriggerTrie, naive: NaiveMatcher, events: list[Event]) -> dict[str, float]:
    """Both matchers over ``events``, every (event index, task) compared; exits non-zero on a difference.

    Also returns what the trie sees on the way: firing rate, dynamic pending list size, distinct states.
    """
    trie_states: dict[str, object] = {}
    naive_states: dict[str, list[tuple[int, ...]]] = {}
    initial = trie.initial_state()
    distinct: set[frozenset[int]] = set()
    pending_total = fired_total = events_firing = 0
    for index, event in enumerate(events):
        state, fired = trie.step(trie_states.get(event.user_id, initial), event)  # type: ignore[arg-type]
        trie_states[event.user_id] = state
        distinct.add(state.pending_nodes)
        pending_total += len(state.pending_nodes)
        nstate = naive_states.get(event.user_id)
        if nstate is None:
            nstate = naive_states[event.user_id] = naive.initial_state()
        expected = {naive.names[i] for i in naive.step(nstate, offered(event))}
        got = set(fired)
        if got != expected or len(fired) != len(got):
            history = [e for e in events[:index + 1] if e.user_id == event.user_id][-12:]
            lines = [f"MISMATCH at event #{index} {event} (user {event.user_id}):",
                     f"  trie fired  {sorted(fired)}", f"  naive fired {sorted(expected)}",
                     "  conditions: " + "; ".join(f"{n}={trie.conditions.get(n)}" for n in sorted(got ^ expected)),
                     "  the user's last events: " + ", ".join("+".join(offered(e)) for e in history)]
            print("\n".join(lines), file=sys.stderr)
            raise SystemExit(1)
        fired_total += len(fired)
        events_firing += bool(fired)
    n = len(events)
    return {"fired_per_event": fired_total / n, "events_firing_fraction": events_firing / n,
            "mean_dynamic_pending": pending_total / n, "distinct_states": len(distinct), "fired_pairs": fired_total}


def main(argv: list[str] | None = None) -> None:
    args = parse_args("Trigger trie vs naive per-condition matcher (events/s).", argv)
    rng = random.Random(args.seed)
    quick = args.quick
    log(f"building the event stream from {TAOBAO_SAMPLE.name}")
    events = build_stream()
    conditions = make_conditions(events, rng)
    named = [(f"t{i:04d}", cond) for i, cond in enumerate(conditions)]
    trie = TriggerTrie()
    for name, cond in named:
        trie.register(name, cond)
    if trie.conditions != dict(named):
        raise SystemExit("the trie normalized a generated condition differently; they must be canonical")
    naive = NaiveMatcher(named)
    lengths = Counter(sum(1 for x in c if x != WILDCARD) for c in conditions)
    n_wild = sum(WILDCARD in c for c in conditions)
    alphabet = {tid for e in events for tid in offered(e)}
    log(f"{len(events):,} events of {len({e.user_id for e in events})} users, {len(alphabet)} trigger ids; "
        f"{len(conditions)} conditions, lengths {dict(sorted(lengths.items()))}, {n_wild} with '*', "
        f"{len(trie.static_pending())} ids in the static pending list")

    replays = -(-TRIE_MIN_EVENTS[quick] // len(events))
    cold_s, _, cold_n, _ = run_trie(trie, events, replays)
    log(f"trie, first round (its step cache filling up): {cold_n / cold_s:,.0f} events/s over {cold_n:,} events")

    verify_n = min(VERIFY_EVENTS[quick], len(events))
    log(f"verifying trie == naive on the first {verify_n:,} events (every fired (event, task) pair)")
    stats = verify(trie, naive, events[:verify_n])
    log(f"  identical: {stats['fired_pairs']:,} fired pairs, {stats['fired_per_event']:.2f} tasks/event, "
        f"{stats['events_firing_fraction']:.1%} of events fire, {stats['distinct_states']:,} distinct trie states")

    naive_n = min(NAIVE_EVENTS[quick], len(events))
    trie_rates, naive_rates, trie_cpu_rates, naive_cpu_rates, trie_fired = [], [], [], [], 0
    for _ in progress(range(args.rounds), "rounds (trie, naive)", total=args.rounds):
        seconds, cpu_s, n, trie_fired = run_trie(trie, events, replays)
        trie_rates.append(n / seconds)
        trie_cpu_rates.append(n / cpu_s)
        seconds, cpu_s, n, _ = run_naive(naive, events, naive_n)
        naive_rates.append(n / seconds)
        naive_cpu_rates.append(n / cpu_s)
        log(f"  trie {trie_rates[-1]:,.0f} events/s over {replays * len(events):,} events; "
            f"naive {naive_rates[-1]:,.0f} events/s over {naive_n:,} events")

    trie_eps, naive_eps = median(trie_rates), median(naive_rates)
    metrics = {
        "trie_events_per_s": round(trie_eps),
        "naive_events_per_s": round(naive_eps, 1),
        "speedup": round(trie_eps / naive_eps, 1),
        "trie_events_per_cpu_s": round(median(trie_cpu_rates)),
        "naive_events_per_cpu_s": round(median(naive_cpu_rates), 1),
        "trie_first_round_events_per_s": round(cold_n / cold_s),
        "trie_events_per_round": replays * len(events),
        "naive_events_per_round": naive_n,
        "rounds": args.rounds,
        "conditions": len(conditions),
        "conditions_with_wildcard": n_wild,
        "trigger_ids": len(alphabet),
        "stream_events": len(events),
        "users": len({e.user_id for e in events}),
        "tasks_fired_per_event": round(trie_fired / (replays * len(events)), 3),
        "verify_events_firing_fraction": round(stats["events_firing_fraction"], 3),
        "verified_events": verify_n,
        "verified_fired_pairs": stats["fired_pairs"],
        "trie_distinct_states_in_verify": stats["distinct_states"],
        "mean_dynamic_pending": round(stats["mean_dynamic_pending"], 1),
        "target_trie_1M_events_per_s_met": trie_eps >= 1_000_000,
        "target_speedup_50x_met": trie_eps / naive_eps >= 50,
        "cpu_count": cpu_count(),
        "quick": quick,
    }
    finish("triggers", metrics, quick=args.quick)


if __name__ == "__main__":
    main()
