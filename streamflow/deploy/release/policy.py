"""Which task versions a device should run: the release server's decision, per request, in memory.

A device sends its task versions on any app request (``X-Streamflow-Tasks: ipv=2,sessions=1``, with
``X-Streamflow-Device`` and optionally ``X-Streamflow-Attrs: os=android,app_version=7.3`` and
``X-Streamflow-User``); :meth:`Policy.decide` says what it should change, as the compact JSON list the
response carries in ``X-Streamflow-Deploy`` (None when nothing changes).

A task's policy is a stack of :class:`Layer` s over a stable version: the active release first, then
finished releases that targeted some devices only; a device takes the first layer that admits it, else
the stable version. A layer admits a device when its :class:`Target` matches the device (every
attribute rule, and the user if the layer is per user; no rules: uniform) and the device is on the
beta allow-list or its sticky cohort point is below the layer's gray fraction. The cohort point is
``sha256(release_id ":" device_id)`` mapped onto [0, 1): it does not change while a release grows from
1 % to 100 %, so a device that got the version keeps it, and it differs between releases, so the same
devices do not always go first.

The directive's action is ``rollback`` when the wanted version is older than the device's (a release
rolled back, a withdrawn version), else ``update``. A device whose failure on a release was reported
is not sent that release again (it stays on what it falls back to).

:class:`Policy` is an immutable snapshot, rebuilt by the release manager on every change and swapped
in whole; deciding takes no lock and queries no database.

Example:
    >>> policy = Policy.build([TaskPolicy("ipv", stable="2", layers=(
    ...     Layer("ipv-3-1", "ipv", "3", fraction=0.5),))])
    >>> picks = [policy.decide_header(f"dev-{i}", "ipv=2") for i in range(8)]
    >>> sorted({p for p in picks if p})
    ['[{"action":"update","manifest":"/deploy/bundles/ipv/3/manifest.json","signature":"/deploy/bundles/ipv/3/manifest.sig","task":"ipv","version":"3"}]']
    >>> 0 < sum(p is not None for p in picks) < 8
    True
    >>> policy.decide_header("dev-0", "ipv=1") is not None  # behind the stable version: always told
    True
"""

from __future__ import annotations

import hashlib
import json
import operator
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from streamflow.deploy.manifest import version_key
from streamflow.deploy.protocol import directive, parse_pairs

_RULE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_.-]{0,62})\s*(>=|<=|!=|=|>|<)\s*(.*?)\s*$")
_TWO64 = float(1 << 64)


def cohort_point(release_id: str, device_id: str) -> float:
    """The device's sticky place in [0, 1) for one release.

    Example:
        >>> p = cohort_point("ipv-3-1", "phone-7")
        >>> 0 <= p < 1, p == cohort_point("ipv-3-1", "phone-7"), p == cohort_point("ipv-4-2", "phone-7")
        (True, True, False)
    """
    digest = hashlib.sha256(f"{release_id}:{device_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / _TWO64


def version_order(version: str) -> tuple[int, ...] | None:
    """A version's sort key (``"3"`` < ``"3.1"`` < ``"10"``), None if it is not a version."""
    try:
        return version_key(version)
    except ValueError:
        return None


_ORDER: dict[str, Callable[[Any, Any], bool]] = {">=": operator.ge, "<=": operator.le, ">": operator.gt,
                                                  "<": operator.lt}


@dataclass(frozen=True)
class Rule:
    """One condition on a device attribute: ``os=android``, ``app_version>=7.2``, ``model=a|b`` (any of).

    Order comparisons compare dotted numbers as versions, anything else as text. A device without
    the attribute matches no rule on it (not even ``!=``).

    Example:
        >>> rule = Rule.parse("app_version>=7.2")
        >>> rule.matches({"app_version": "7.10"}), rule.matches({"app_version": "7.1"}), rule.matches({})
        (True, False, False)
        >>> Rule.parse("model=pixel|galaxy").matches({"model": "galaxy"})
        True
    """

    key: str
    op: str
    values: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Rule:
        match = _RULE.match(text)
        if match is None or not match.group(3):
            raise ValueError(f"device rule {text!r} must look like KEY=VALUE, KEY!=VALUE, KEY>=VALUE (also <=, >, <); "
                             "VALUE may list alternatives with '|' for = and !=")
        key, op, value = match.groups()
        values = tuple(v.strip() for v in value.split("|")) if op in ("=", "!=") else (value,)
        if any(not v or "," in v for v in values):
            raise ValueError(f"device rule {text!r}: empty alternative or a ',' in a value")
        return cls(key, op, values)

    def matches(self, attrs: Mapping[str, str]) -> bool:
        have = attrs.get(self.key)
        if have is None:
            return False
        if self.op == "=":
            return have in self.values
        if self.op == "!=":
            return have not in self.values
        compare = _ORDER[self.op]
        left, right = version_order(have), version_order(self.values[0])
        if left is not None and right is not None:
            return compare(left, right)
        return compare(have, self.values[0])  # not versions: as text

    def __str__(self) -> str:
        return f"{self.key}{self.op}{'|'.join(self.values)}"


@dataclass(frozen=True)
class Target:
    """Which devices a release is for: every rule must match; with ``users``, only those users' devices.

    No rules and no users: every device (a uniform release).

    Example:
        >>> target = Target.parse(["os=android"], users=["u1"])
        >>> target.matches({"os": "android"}, "u1"), target.matches({"os": "android"}, "u2"), str(target)
        (True, False, 'os=android users=u1')
    """

    rules: tuple[Rule, ...] = ()
    users: frozenset[str] | None = None

    @classmethod
    def parse(cls, rules: Iterable[str] = (), users: Iterable[str] | None = None) -> Target:
        return cls(tuple(Rule.parse(r) for r in rules), frozenset(users) if users is not None else None)

    @property
    def uniform(self) -> bool:
        return not self.rules and self.users is None

    def matches(self, attrs: Mapping[str, str], user: str | None) -> bool:
        if self.users is not None and user not in self.users:
            return False
        return all(rule.matches(attrs) for rule in self.rules)

    def to_json(self) -> dict[str, Any]:
        return {"rules": [str(r) for r in self.rules], "users": sorted(self.users) if self.users is not None else None}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Target:
        return cls.parse(data.get("rules") or (), data.get("users"))

    def __str__(self) -> str:
        parts = [str(r) for r in self.rules]
        if self.users is not None:
            parts.append("users=" + "|".join(sorted(self.users)))
        return " ".join(parts) or "every device"


@dataclass(frozen=True)
class Layer:
    """One release's reach: its version, target, beta allow-list and gray fraction (a finished one: 1.0).

    ``failed`` holds the devices whose failure on this release was reported; it is the release
    manager's live set (shared, not copied), so a device is held back from the moment it reports.
    """

    release_id: str
    task: str
    version: str
    fraction: float = 0.0
    beta: frozenset[str] = frozenset()
    target: Target = Target()
    failed: set[str] = field(default_factory=set, compare=False)

    def admits(self, device_id: str, attrs: Mapping[str, str], user: str | None) -> bool:
        if device_id in self.failed:
            return False
        if not self.target.uniform and not self.target.matches(attrs, user):
            return False
        if device_id in self.beta:
            return True
        return self.fraction > 0.0 and (self.fraction >= 1.0 or cohort_point(self.release_id, device_id)
                                        < self.fraction)


@dataclass(frozen=True)
class TaskPolicy:
    """A task's stable version and its layers, newest first (see the module docstring)."""

    task: str
    stable: str | None = None
    layers: tuple[Layer, ...] = ()
    _fragments: dict[tuple[str, str], str] = field(default_factory=dict, compare=False, repr=False)

    def want(self, device_id: str, attrs: Mapping[str, str], user: str | None) -> str | None:
        """The version this device should run (None: the server has no opinion)."""
        for layer in self.layers:
            if layer.admits(device_id, attrs, user):
                return layer.version
        return self.stable

    def fragment(self, version: str, action: str) -> str:
        """The directive's compact JSON, built once per (version, action)."""
        key = (version, action)
        text = self._fragments.get(key)
        if text is None:
            text = self._fragments[key] = json.dumps(directive(self.task, version, action), sort_keys=True,
                                                     separators=(",", ":"))
        return text


class Policy:
    """An immutable snapshot of every task's policy; :meth:`decide` is the per-request decision."""

    __slots__ = ("tasks",)

    def __init__(self, tasks: Mapping[str, TaskPolicy]):
        self.tasks = dict(tasks)

    @classmethod
    def build(cls, tasks: Iterable[TaskPolicy]) -> Policy:
        return cls({t.task: t for t in tasks})

    def decide(self, device_id: str, running: Mapping[str, str], attrs: Mapping[str, str] | None = None,
               user: str | None = None) -> list[str]:
        """The directives (compact JSON objects) for a device running ``running`` (task → version).

        Only tasks the device reports are decided: the server changes versions, it does not add tasks.
        """
        out = []
        attrs = attrs or {}
        for task, version in running.items():
            policy = self.tasks.get(task)
            if policy is None:
                continue
            want = policy.want(device_id, attrs, user)
            if want is None or want == version:
                continue
            have, wanted = version_order(version), version_order(want)
            action = "rollback" if have is not None and wanted is not None and have > wanted else "update"
            out.append(policy.fragment(want, action))
        return out

    def decide_header(self, device_id: str, tasks_header: str, attrs_header: str | None = None,
                      user: str | None = None) -> str | None:
        """:meth:`decide` from the raw request headers to the ``X-Streamflow-Deploy`` value (None: nothing)."""
        out = self.decide(device_id, parse_pairs(tasks_header), parse_pairs(attrs_header) if attrs_header else None,
                          user)
        return "[" + ",".join(out) + "]" if out else None
