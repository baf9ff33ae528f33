"""Trigger management: every task's trigger condition in one trie, as in Walle.

A *trigger condition* is a sequence of trigger ids. Matching semantics:

- An event offers one or two trigger ids: its ``event_id`` and, for a ``page_exit`` event, also its
  ``page_id`` (so a page id as trigger id means "that page was just left", i.e. its page-level
  sequence is complete).
- Elements match **contiguous** events of the user's time-level sequence: ``["a", "b"]`` fires on
  an event offering ``b`` whose immediately preceding event offered ``a``.
- The wildcard ``"*"`` matches a gap of zero or more events of any kind: ``["page_enter", "*",
  "buy"]`` fires on every ``buy`` that follows a ``page_enter`` at any distance. Repeated ``*`` are
  one ``*``; a leading ``*`` changes nothing (a condition may start anywhere) and is dropped; a
  trailing ``*`` is refused: a condition fires on the event that completes it, so it must end on a
  concrete id.
- A condition fires at most once per event (however many alignments end there) and fires again on
  every later event that completes it.
- A condition registered while events flow fires on the events after its registration. The trie
  tracks prefixes, not conditions: a user's partial match of a prefix the new condition shares with
  conditions registered before it (a proper prefix of one of them, so that it was pending) counts
  towards it, as in Walle's dynamic pending list; any other prefix starts matching with the next
  event. Unregistering a condition leaves the partial
  matches of all others intact.

The trie: the root's children are the *static pending list*, tried on every event; the nodes a
user's recent events have partially matched are that user's *dynamic pending list*. Stepping an event
is ``dynamic pending list ∪ static pending list → next dynamic pending list``, plus the tasks whose
condition just completed. The step is cached per (dynamic pending list, event ids) like a lazily built
DFA, so a steady stream costs one dictionary lookup per event; the cache is bounded and is rebuilt
after tasks are registered or unregistered.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import count
from typing import Any

from streamflow.events import PAGE_EXIT, Event

WILDCARD = "*"
_MAX_CACHED_STATES = 20_000
_MAX_STEPS_PER_STATE = 1_024


def normalize_condition(condition: Sequence[str]) -> tuple[str, ...]:
    """The canonical form of a trigger condition (see the module docstring), or ``ValueError``.

    Example:
        >>> normalize_condition(["*", "page_enter", "*", "*", "buy"])
        ('page_enter', '*', 'buy')
    """
    if isinstance(condition, str):
        raise ValueError(f"a trigger condition is a sequence of ids, not the string {condition!r}")
    out: list[str] = []
    for element in condition:
        if not isinstance(element, str) or not element:
            raise ValueError(f"trigger ids must be non-empty strings, got {element!r} in {list(condition)!r}")
        if element == WILDCARD and (not out or out[-1] == WILDCARD):
            continue
        out.append(element)
    if not out:
        raise ValueError(f"trigger condition {list(condition)!r} has no trigger id")
    if out[-1] == WILDCARD:
        raise ValueError(f"trigger condition {list(condition)!r} ends with '*': it must end on a trigger id")
    return tuple(out)


def trigger_ids(event: Event) -> tuple[str, ...]:
    """The trigger ids an event offers: its event id, plus its page id if it exits that page."""
    if event.event_id == PAGE_EXIT and event.page_id != PAGE_EXIT:
        return (PAGE_EXIT, event.page_id)
    return (event.event_id,)


class _Node:
    __slots__ = ("id", "symbol", "parent", "children", "star", "tasks", "removed")

    def __init__(self, node_id: int, symbol: str, parent: _Node | None):
        self.id = node_id
        self.symbol = symbol
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.star: _Node | None = None  # the wildcard child: a gap after this node's prefix
        self.tasks: list[str] = []
        self.removed = False

    @property
    def is_star(self) -> bool:
        return self.symbol == WILDCARD


_Step = tuple["MatchState", tuple[str, ...]]  # (next state, tasks that fire)


class MatchState:
    """A user's position in the trie: the dynamic pending list, interned and with its cached steps.

    Instances are shared between users and owned by one :class:`TriggerTrie`; treat them as opaque
    values (``pending_nodes`` is there for inspection and for persisting the state elsewhere).
    """

    __slots__ = ("pending_nodes", "steps", "exit_steps", "generation")

    def __init__(self, pending_nodes: frozenset[int], generation: int):
        self.pending_nodes = pending_nodes
        self.steps: dict[str, _Step] = {}  # by event id
        self.exit_steps: dict[str, _Step] = {}  # page exits, by page id
        self.generation = generation

    def __reduce__(self) -> tuple:
        # Persisted (keyed state, checkpoints) as the pending list alone, never with the cached steps;
        # no trie has generation -1, so the trie that steps it next re-interns it.
        return MatchState, (self.pending_nodes, -1)


class TriggerTrie:
    """All tasks' trigger conditions in one trie; steps users' events and says which tasks fire.

    Example:
        >>> trie = TriggerTrie()
        >>> trie.register("ipv", ["item"])            # the item page was exited
        >>> trie.register("buy_after_fav", ["fav", "*", "buy"])
        >>> state = trie.initial_state()
        >>> fired = []
        >>> for e in [Event("u", "fav", "item", 1.0), Event("u", "buy", "item", 2.0),
        ...           Event("u", "page_exit", "item", 3.0)]:
        ...     state, tasks = trie.step(state, e)
        ...     fired.append(tasks)
        >>> fired
        [(), ('buy_after_fav',), ('ipv',)]
    """

    def __init__(self) -> None:
        self._ids = count()
        self.root = _Node(next(self._ids), "", None)
        self._nodes: dict[int, _Node] = {self.root.id: self.root}
        self._conditions: dict[str, tuple[str, ...]] = {}
        self._alphabet: dict[str, int] = {}  # trigger id -> number of conditions using it
        self._generation = 0
        self._order: dict[str, int] = {}
        self._states: dict[frozenset[int], MatchState] = {}
        self._initial = self._intern(frozenset())
        self.single_step = True

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Interned states pickle as their pending list alone (generation -1, see MatchState.__reduce__);
        # intern them afresh, or every step of an unpickled trie (a Flink worker's) would restore its state.
        self.__dict__.update(state)
        self._states = {}
        self._initial = self._intern(frozenset())

    # -- registration -------------------------------------------------------------------------
    @property
    def conditions(self) -> dict[str, tuple[str, ...]]:
        """Registered task name → its normalized condition."""
        return dict(self._conditions)

    def register(self, task: str, condition: Sequence[str]) -> None:
        """Add ``task``'s trigger condition; a name can hold one condition at a time."""
        if task in self._conditions:
            raise ValueError(f"task {task!r} is already registered")
        self._attach(task, normalize_condition(condition))
        self._invalidate()

    def unregister(self, task: str) -> None:
        """Remove ``task``'s condition and prune the nodes no other condition uses."""
        self._prune(self._detach(task))
        self._invalidate()

    def replace(self, remove: Iterable[str], add: Mapping[str, Sequence[str]]) -> None:
        """Unregister ``remove`` and register ``add`` (name → condition) as one change.

        Unlike an unregister followed by a register, a prefix the old and the new conditions share
        is never pruned in between, so users' partial matches of it carry over to the new condition
        (a new version of a task with the same trigger goes on matching where the old one was).
        Everything is checked before anything changes.

        Example:
            >>> trie = TriggerTrie()
            >>> trie.register("t", ["fav", "buy"])
            >>> state, _ = trie.step(trie.initial_state(), Event("u", "fav", "item", 1.0))
            >>> trie.replace(["t"], {"t": ["fav", "buy"]})
            >>> trie.step(state, Event("u", "buy", "item", 2.0))[1]
            ('t',)
        """
        remove = list(dict.fromkeys(remove))
        unknown = [name for name in remove if name not in self._conditions]
        if unknown:
            raise ValueError(f"tasks {unknown} are not registered")
        conditions = {name: normalize_condition(cond) for name, cond in add.items()}
        clash = [name for name in conditions if name in self._conditions and name not in remove]
        if clash:
            raise ValueError(f"tasks {clash} are already registered")
        ends = [self._detach(name) for name in remove]
        for name, cond in conditions.items():
            self._attach(name, cond)
        for node in ends:
            self._prune(node)
        self._invalidate()

    def _attach(self, task: str, cond: tuple[str, ...]) -> None:
        node = self.root
        for symbol in cond:
            if symbol == WILDCARD:
                if node.star is None:
                    node.star = self._new_node(WILDCARD, node)
                node = node.star
            else:
                child = node.children.get(symbol)
                if child is None:
                    child = node.children[symbol] = self._new_node(symbol, node)
                node = child
                self._alphabet[symbol] = self._alphabet.get(symbol, 0) + 1
        node.tasks.append(task)
        self._conditions[task] = cond

    def _detach(self, task: str) -> _Node:
        """Take ``task``'s condition out (nodes stay until :meth:`_prune`); the node it ended at."""
        cond = self._conditions.pop(task)
        node = self.root
        for symbol in cond:
            step = node.star if symbol == WILDCARD else node.children[symbol]
            assert step is not None  # the condition's path is in the trie
            node = step
            if symbol != WILDCARD:
                self._alphabet[symbol] -= 1
                if not self._alphabet[symbol]:
                    del self._alphabet[symbol]
        node.tasks.remove(task)
        return node

    def _prune(self, node: _Node) -> None:
        """Remove ``node`` and its ancestors as long as no condition uses them."""
        while (node is not self.root and not node.removed and not node.tasks and not node.children
               and node.star is None):
            parent = node.parent
            assert parent is not None
            if node.is_star:
                parent.star = None
            else:
                del parent.children[node.symbol]
            node.removed = True
            del self._nodes[node.id]
            node = parent

    def _new_node(self, symbol: str, parent: _Node) -> _Node:
        node = _Node(next(self._ids), symbol, parent)
        self._nodes[node.id] = node
        return node

    def _invalidate(self) -> None:
        self._generation += 1
        #: Every condition is one trigger id: no user ever has a partial match to keep.
        self.single_step = all(len(cond) == 1 for cond in self._conditions.values())
        self._order = {name: i for i, name in enumerate(self._conditions)}  # registration order
        self._states = {}
        self._initial = self._intern(frozenset())

    # -- matching ---------------------------------------------------------------------------
    def initial_state(self) -> MatchState:
        """The state of a user with no partial match (only the static pending list is active)."""
        return self._initial

    def step(self, state: MatchState, event: Event) -> tuple[MatchState, tuple[str, ...]]:
        """Advance one user's state by one event; return the new state and the tasks that fire."""
        if state.generation != self._generation:
            state = self.restore(state.pending_nodes)
        eid = event.event_id
        if eid == PAGE_EXIT:
            steps, key = state.exit_steps, event.page_id
        else:
            steps, key = state.steps, eid
        hit = steps.get(key)
        if hit is None:
            symbol = tuple(k for k in trigger_ids(event) if k in self._alphabet)
            hit = self._compute_step(state.pending_nodes, symbol)
            if len(steps) < _MAX_STEPS_PER_STATE:  # ids no condition uses could be unbounded
                steps[key] = hit
        return hit

    def restore(self, pending_nodes: Iterable[int]) -> MatchState:
        """The state for a persisted dynamic pending list (nodes pruned since are dropped)."""
        return self._intern(frozenset(n for n in pending_nodes if n in self._nodes))

    def static_pending(self) -> list[str]:
        """The trigger ids of the static pending list (the root's children)."""
        return sorted(self.root.children)

    def dynamic_pending(self, state: MatchState) -> list[tuple[str, ...]]:
        """The partial matches of a state, each as the condition prefix it has matched."""
        return sorted(self._prefix(self._nodes[n]) for n in state.pending_nodes if n in self._nodes)

    def _prefix(self, node: _Node) -> tuple[str, ...]:
        symbols = []
        while node is not self.root:
            symbols.append(node.symbol)
            parent = node.parent
            assert parent is not None  # only the root has none
            node = parent
        return tuple(reversed(symbols))

    def _compute_step(self, pending: frozenset[int], symbol: tuple[str, ...]) -> _Step:
        nodes = [self.root] + [self._nodes[n] for n in pending]
        reached: dict[int, _Node] = {}
        for node in nodes:
            if node.is_star:
                reached[node.id] = node  # the gap swallows this event
            for key in symbol:
                child = node.children.get(key)
                if child is not None:
                    reached[child.id] = child
        fired: list[str] = []
        next_pending: set[int] = set()
        for node in reached.values():
            if not node.is_star:
                fired.extend(node.tasks)
                if node.star is not None:
                    next_pending.add(node.star.id)
            if node.children or node.star is not None:
                next_pending.add(node.id)
        fired_tasks = tuple(sorted(set(fired), key=self._order.__getitem__))
        return self._intern(frozenset(next_pending)), fired_tasks

    def _intern(self, pending: frozenset[int]) -> MatchState:
        state = self._states.get(pending)
        if state is None:
            if len(self._states) >= _MAX_CACHED_STATES:
                self._states = {}  # bounded memory: forget cached steps, keep matching correctly
            state = self._states[pending] = MatchState(pending, self._generation)
        return state

    # -- inspection -------------------------------------------------------------------------
    def render(self) -> str:
        """The trie as an indented tree, tasks shown where their condition ends."""
        lines = ["(root)  static pending list: " + (", ".join(self.static_pending()) or "empty")]

        def walk(node: _Node, depth: int) -> None:
            kids = [node.children[k] for k in sorted(node.children)]
            if node.star is not None:
                kids.append(node.star)
            for kid in kids:
                label = "* (gap)" if kid.is_star else kid.symbol
                tasks = f"  -> fires {', '.join(kid.tasks)}" if kid.tasks else ""
                lines.append("  " * (depth + 1) + label + tasks)
                walk(kid, depth + 1)

        walk(self.root, 0)
        return "\n".join(lines)
