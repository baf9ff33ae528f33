"""The trigger trie against a brute-force matcher written straight from the documented semantics."""

from __future__ import annotations

from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamflow.events import PAGE_EXIT, Event
from streamflow.trie import WILDCARD, TriggerTrie, normalize_condition

EVENT_IDS = ["a", "b", "c", PAGE_EXIT]
PAGE_IDS = ["p", "q"]
TRIGGER_IDS = ["a", "b", "c", PAGE_EXIT, "p", "q"]


def offers(event: Event) -> set[str]:
    ids = {event.event_id}
    if event.event_id == PAGE_EXIT:
        ids.add(event.page_id)
    return ids


def brute_force_fires(condition: tuple[str, ...], events: list[Event], n: int) -> bool:
    """Does ``condition`` have an alignment over ``events`` that ends exactly at event ``n``?"""

    @cache
    def ends_at(ci: int, ei: int) -> bool:  # condition[ci] (an id) matches events[ei], prefix before it
        if ei < 0 or condition[ci] not in offers(events[ei]):
            return False
        if ci == 0:
            return True
        if condition[ci - 1] == WILDCARD:
            return any(ends_at(ci - 2, ej) for ej in range(ei))
        return ends_at(ci - 1, ei - 1)

    return ends_at(len(condition) - 1, n)


events_strategy = st.lists(
    st.builds(lambda e, p, i: Event("u", e, p, float(i)), st.sampled_from(EVENT_IDS), st.sampled_from(PAGE_IDS),
              st.integers(0, 10)),
    max_size=25,
)
conditions_strategy = st.lists(
    st.lists(st.sampled_from(TRIGGER_IDS + [WILDCARD, WILDCARD]), min_size=1, max_size=5)
    .filter(lambda c: any(x != WILDCARD for x in c) and c[-1] != WILDCARD),
    min_size=1, max_size=8,
)


def run_trie(trie: TriggerTrie, events: list[Event]) -> list[set[str]]:
    state = trie.initial_state()
    fired = []
    for event in events:
        state, tasks = trie.step(state, event)
        assert len(tasks) == len(set(tasks)), "a task fires at most once per event"
        fired.append(set(tasks))
    return fired


@settings(max_examples=300, deadline=None)
@given(conditions=conditions_strategy, events=events_strategy)
def test_trie_matches_brute_force(conditions, events):
    trie = TriggerTrie()
    normalized = {}
    for i, cond in enumerate(conditions):
        name = f"t{i}"
        trie.register(name, cond)
        normalized[name] = normalize_condition(cond)
    expected = [
        {name for name, cond in normalized.items() if brute_force_fires(cond, events, n)}
        for n in range(len(events))
    ]
    assert run_trie(trie, events) == expected


@settings(max_examples=200, deadline=None)
@given(conditions=conditions_strategy, events=events_strategy, data=st.data())
def test_register_and_unregister_while_events_flow(conditions, events, data):
    """Registering and unregistering at event ``split`` while users are mid-match.

    The removed condition stops firing, the others are untouched, and the late condition ``[x, x]``
    fires on the events after its registration, where a partial match of its prefix ``[x]`` that was
    already in progress counts if that was a proper prefix of an earlier condition (the trie tracks
    prefixes).
    """
    split = data.draw(st.integers(0, len(events)))
    late = data.draw(st.sampled_from(TRIGGER_IDS))  # registered at the split
    removed = data.draw(st.integers(0, len(conditions) - 1))  # unregistered at the split
    trie = TriggerTrie()
    for i, cond in enumerate(conditions):
        trie.register(f"t{i}", cond)
    state = trie.initial_state()
    fired = []
    for n, event in enumerate(events):
        if n == split:
            trie.register("late", [late, late])
            trie.unregister(f"t{removed}")
        state, tasks = trie.step(state, event)
        fired.append(set(tasks))
    if split == len(events):
        return
    for n in range(len(events)):
        expected = set()
        for i, cond in enumerate(conditions):
            if (i != removed or n < split) and brute_force_fires(normalize_condition(cond), events, n):
                expected.add(f"t{i}")
        # [late] is a partial match a user can be in only if it was a proper prefix of a condition
        prefix_known = any(len(nc) > 1 and nc[0] == late for nc in map(normalize_condition, conditions))
        if (n >= split and n >= 1 and brute_force_fires((late, late), events, n)
                and (n - 1 >= split or prefix_known)):
            expected.add("late")
        assert fired[n] == expected, f"event {n}"


def test_static_and_dynamic_pending_lists():
    trie = TriggerTrie()
    trie.register("ab", ["a", "b"])
    trie.register("a_gap_c", ["a", "*", "c"])
    trie.register("item_left", ["item"])
    assert trie.static_pending() == ["a", "item"]
    state, fired = trie.step(trie.initial_state(), Event("u", "a", "home", 1.0))
    assert fired == ()
    assert trie.dynamic_pending(state) == [("a",), ("a", "*")]
    state, fired = trie.step(state, Event("u", "x", "home", 2.0))
    assert trie.dynamic_pending(state) == [("a", "*")]  # contiguous "a b" broke, the gap survives
    state, fired = trie.step(state, Event("u", "c", "home", 3.0))
    assert fired == ("a_gap_c",)
    state, fired = trie.step(state, Event("u", PAGE_EXIT, "item", 4.0))
    assert fired == ("item_left",)


def test_condition_validation():
    assert normalize_condition(["*", "a", "*", "*", "b"]) == ("a", "*", "b")
    with pytest.raises(ValueError, match="ends with"):
        normalize_condition(["a", "*"])
    with pytest.raises(ValueError, match="no trigger id"):
        normalize_condition(["*"])
    with pytest.raises(ValueError, match="not the string"):
        normalize_condition("ab")
    with pytest.raises(ValueError, match="non-empty strings"):
        normalize_condition(["a", ""])
    trie = TriggerTrie()
    trie.register("t", ["a"])
    with pytest.raises(ValueError, match="already registered"):
        trie.register("t", ["b"])


def test_unregister_prunes_nodes_and_state_survives():
    trie = TriggerTrie()
    trie.register("abc", ["a", "b", "c"])
    trie.register("abd", ["a", "b", "d"])
    state = trie.initial_state()
    for eid in ("a", "b"):
        state, _ = trie.step(state, Event("u", eid, "p", 1.0))
    trie.unregister("abc")
    assert "fires abc" not in trie.render() and "      c" not in trie.render()
    state, fired = trie.step(state, Event("u", "d", "p", 2.0))
    assert fired == ("abd",)
    trie.unregister("abd")
    assert trie.static_pending() == []
    assert trie.step(state, Event("u", "d", "p", 3.0))[1] == ()
