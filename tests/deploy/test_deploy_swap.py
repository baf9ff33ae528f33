"""DeviceRunner.swap_tasks: the safe point between two events that deployment hot-swaps tasks through."""

from __future__ import annotations

import re
import threading

import pytest

from connectors.storage import CollectiveStorage
from operators import Aggregate, Count, KeyBy, Last, Map, TimeWindow
from streamflow.events import Event
from streamflow.job import Job, Task
from streamflow.runners.device import DeviceRunner
from streamflow.trie import TriggerTrie

T0 = 1_600_000_000.0


def ev(user: str, kind: str, t: float) -> Event:
    return Event(user, kind, "item", T0 + t, {"item_id": "i"})


def tagged(name: str, trigger: list[str], tag: str, **options) -> Task:
    return Task(name, trigger, [Aggregate(n=Count(), last=Last("event_id")), Map(lambda r: {**r, "tag": tag})],
                **options)


@pytest.fixture
def store(tmp_path):
    s = CollectiveStorage(tmp_path / "f.duckdb", flush_rows=5)
    yield s
    s.close()


def test_a_new_version_goes_on_matching_where_the_old_one_was():
    """fav → buy: the user had matched "fav" under the old version; the new one fires on the buy."""
    trie = TriggerTrie()
    trie.register("t", ["fav", "buy"])
    state, _ = trie.step(trie.initial_state(), ev("u", "fav", 0))
    trie.replace(["t"], {"t": ["fav", "buy"]})
    assert trie.step(state, ev("u", "buy", 1))[1] == ("t",)
    # unregister + register in two steps prunes the shared prefix in between: the partial match is lost
    other = TriggerTrie()
    other.register("t", ["fav", "buy"])
    state, _ = other.step(other.initial_state(), ev("u", "fav", 0))
    other.unregister("t")
    other.register("t", ["fav", "buy"])
    assert other.step(state, ev("u", "buy", 1))[1] == ()


def test_trie_replace_is_all_or_nothing():
    trie = TriggerTrie()
    trie.register("a", ["fav"])
    trie.register("b", ["buy"])
    with pytest.raises(ValueError, match=r"tasks \['b'\] are already registered"):
        trie.replace(["a"], {"a": ["cart"], "b": ["pv"]})
    with pytest.raises(ValueError, match="not registered"):
        trie.replace(["zz"], {})
    with pytest.raises(ValueError, match="ends with"):
        trie.replace(["a"], {"a": ["fav", "*"]})
    assert trie.conditions == {"a": ("fav",), "b": ("buy",)}


def test_swap_outside_a_run_applies_at_once_and_keeps_the_trigger_state(store):
    runner = DeviceRunner(Job("j", [tagged("pair", ["fav", "buy"], "old", input="recent")]), store)
    runner.process(ev("u", "fav", 0))
    swap = runner.swap_tasks(add=[tagged("pair", ["fav", "buy"], "new", input="recent")], remove=["pair"])
    assert swap.done() and swap.error is None
    runner.process(ev("u", "buy", 1))
    runner.close()
    assert store.query("SELECT n, tag FROM pair") == [(2, "new")]  # the recent events of before the swap too


def test_a_refused_swap_changes_nothing(store):
    runner = DeviceRunner(Job("j", [tagged("a", ["fav"], "a"), tagged("b", ["buy"], "b")]), store)
    for add, remove, match in [
        ([tagged("b", ["fav"], "x")], ["a"], r"tasks \['b'\] are already running"),
        ([tagged("c", ["fav"], "x"), tagged("c", ["buy"], "y")], [], r"tasks \['c'\] are already running"),
        ([], ["nope"], r"tasks \['nope'\] are not running"),
    ]:
        swap = runner.swap_tasks(add=add, remove=remove)
        assert swap.done() and isinstance(swap.error, ValueError) and re.match(match, str(swap.error))
    assert list(runner.tasks) == ["a", "b"] and runner.job.task_names() == ["a", "b"]
    runner.process(ev("u", "fav", 0))
    runner.process(ev("u", "buy", 1))
    runner.close()
    assert store.query("SELECT tag FROM a") == [("a",)] and store.query("SELECT tag FROM b") == [("b",)]


def test_a_swap_requested_during_a_run_lands_between_two_events(store):
    runner = DeviceRunner(Job("j", [tagged("favs", ["fav"], "v1", input="recent")]), store)
    gate, resume = threading.Event(), threading.Event()

    def source():
        for i in range(10):
            if i == 5:
                gate.set()
                assert resume.wait(10)
            yield ev("u", "fav", i)

    run = threading.Thread(target=runner.run, args=(source(),))
    run.start()
    assert gate.wait(10)
    swap = runner.swap_tasks(add=[tagged("favs", ["fav"], "v2", input="recent")], remove=["favs"])
    assert not swap.wait(0.2)  # the runner is inside a run: it waits for the safe point
    resume.set()
    assert swap.wait(10) and swap.error is None
    run.join(10)
    runner.close()
    assert store.query("SELECT n, tag FROM favs ORDER BY trigger_ts") == (
        [(n, "v1") for n in range(1, 6)] + [(n, "v2") for n in range(6, 11)])


def test_a_swap_requested_after_the_last_event_applies_when_the_run_ends(store):
    runner = DeviceRunner(Job("j", [tagged("favs", ["fav"], "v1")]), store)
    swaps = []

    def source():
        yield ev("u", "fav", 0)
        swaps.append(runner.swap_tasks(add=[tagged("more", ["buy"], "m")]))

    runner.run(source())
    assert swaps[0].done() and swaps[0].error is None and list(runner.tasks) == ["favs", "more"]
    runner.close()


def test_swapping_a_stream_task_fires_its_open_windows_and_keeps_the_others(store):
    def counter(name: str, tag: str) -> Task:
        return Task(name, None, [KeyBy("user_id"), TimeWindow(1000), Aggregate(n=Count()),
                                 Map(lambda r: {**r, "tag": tag})], input="stream")

    runner = DeviceRunner(Job("j", [counter("swapped", "old"), counter("kept", "k")]), store)
    for t in range(4):
        runner.process(ev("u", "fav", t))
    assert runner.swap_tasks(add=[counter("swapped", "new")], remove=["swapped"]).error is None
    for t in range(4, 10):
        runner.process(ev("u", "fav", t))
    runner.finish()
    runner.close()
    assert store.query("SELECT n, tag FROM swapped ORDER BY tag DESC") == [(4, "old"), (6, "new")]
    assert store.query("SELECT n FROM kept") == [(10,)]  # untouched: one window with every event
    assert runner.summary.task_stats["swapped"].rows == 2


def test_a_quarantined_task_can_be_swapped_for_a_fixed_version(store):
    broken = Task("t", ["fav"], [Map(lambda e: 1 / 0)], input="page")
    runner = DeviceRunner(Job("j", [broken]), store, quarantine_after=2)
    for t in range(3):
        runner.process(ev("u", "fav", t))
    assert runner.summary.task_stats["t"].quarantined
    assert runner.swap_tasks(add=[tagged("t", ["fav"], "fixed")], remove=["t"]).error is None
    stats = runner.summary.task_stats["t"]
    assert not stats.quarantined and stats.consecutive_errors == 0 and stats.errors == 2  # counters kept
    runner.process(ev("u", "fav", 3))
    runner.close()
    assert store.query("SELECT tag FROM t") == [("fixed",)]


def test_a_swap_refuses_operators_checkpoints_cannot_hold(store):
    class Stateful(Map):
        keeps_state = True

    runner = DeviceRunner(Job("j", [tagged("a", ["fav"], "a")]), store, checkpoint_interval_s=60)
    swap = runner.swap_tasks(add=[Task("s", ["fav"], [Stateful(lambda r: r)])])
    assert "checkpoints do not cover" in str(swap.error) and list(runner.tasks) == ["a"]
    runner.close()


def test_safe_point_hooks_see_each_event_and_their_swaps_land_before_the_next(store):
    """A hook that swaps a task out after its second firing: the third event already runs without it."""
    runner = DeviceRunner(Job("j", [tagged("favs", ["fav"], "v1")]), store)
    calls, applied = [], []

    def hook() -> bool:
        fired = runner.summary.task_stats["favs"].fired
        calls.append(fired)
        if fired == 2:
            runner.swap_tasks(add=[tagged("favs", ["fav"], "v2")], remove=["favs"],
                              on_applied=lambda: applied.append(runner.summary.task_stats["favs"].fired))
            return False  # done: never called again
        return True

    runner.add_safe_point_hook(hook)
    runner.run([ev("u", "fav", t) for t in range(5)])
    runner.close()
    assert calls == [0, 1, 2] and applied == [2]  # applied at the safe point where it was requested
    assert store.query("SELECT tag, count(*) FROM favs GROUP BY tag ORDER BY tag") == [("v1", 2), ("v2", 3)]
