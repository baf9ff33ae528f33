"""KeyBy: split every group by a key."""

from __future__ import annotations

from typing import Any

from operators.base import FieldSpec, Group, Operator, field_name, field_reader


class KeyBy(Operator):
    """Split each group into one group per value of ``key``; the value is added to the group key.

    ``key`` is a field name or a function of the item; ``name`` is the key's column in the output
    (defaults to the field name, or ``"key"`` for a function). Groups keep first-seen order.

    Example:
        >>> from operators import Aggregate, Count, run_pipeline
        >>> run_pipeline([KeyBy("page"), Aggregate(views=Count())],
        ...              [{"page": "home"}, {"page": "item"}, {"page": "home"}])
        [{'page': 'home', 'views': 2}, {'page': 'item', 'views': 1}]
    """

    def __init__(self, key: FieldSpec, name: str | None = None):
        self.key = key
        self.name = name or field_name(key, "key")
        self._read = field_reader(key)

    def apply(self, groups: list[Group]) -> list[Group]:
        read, name = self._read, self.name
        out: list[Group] = []
        for key, items in groups:
            split: dict[Any, list[Any]] = {}
            for item in items:
                split.setdefault(read(item), []).append(item)
            out.extend(({**key, name: value}, members) for value, members in split.items())
        return out
