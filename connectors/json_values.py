"""Any value as JSON text, never raising: dead letters, late events and task errors keep what they were given.

Example:
    >>> print(to_json({"n": 2**70, "tags": {"a"}}))
    {"n": 1180591620717411303424, "tags": "{'a'}"}
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Callable, Mapping
from typing import Any

_SAFE_REPR = reprlib.Repr()  # bounded depth and size: safe on cycles and deep nesting
_SAFE_REPR.maxlevel, _SAFE_REPR.maxstring, _SAFE_REPR.maxother = 20, 2000, 2000
_SAFE_REPR.maxlist = _SAFE_REPR.maxdict = _SAFE_REPR.maxtuple = _SAFE_REPR.maxset = 1000


def to_json(value: Any, sort_keys: bool = False) -> str:
    """``value`` as JSON text for a text column (dead letters, late events, task errors); never raises.

    A value JSON has no type for is written as its ``str``; dict keys JSON cannot take (a tuple; mixed
    types when sorting) become their ``str``; what still cannot be encoded (a cycle, nesting deeper
    than the recursion limit) is kept as a JSON string of its (bounded) ``repr``.

    Example:
        >>> print(to_json({"n": 2**70, "tags": {"a"}, "pair": {(1, 2): "x"}}))
        {"n": 1180591620717411303424, "tags": "{'a'}", "pair": {"(1, 2)": "x"}}
    """
    encode = _SORTED_JSON if sort_keys else _JSON
    for prepare in (_same, _string_keys):
        try:
            return encode(prepare(value))
        except JSON_ERRORS:
            pass
    return json.dumps(_SAFE_REPR.repr(value))


def encode_json(value: Any, sort_keys: bool = False) -> str:
    """``json.dumps(value, default=str, sort_keys=sort_keys)``, or one of :data:`JSON_ERRORS` (where
    :func:`to_json` tries further); the encoder is built once.

    Example:
        >>> encode_json({"b": 1, "a": {2}}, sort_keys=True)
        '{"a": "{2}", "b": 1}'
    """
    return (_SORTED_JSON if sort_keys else _JSON)(value)


JSON_ERRORS = (TypeError, ValueError, RecursionError)


def _encoder(sort_keys: bool) -> Callable[[Any], str]:
    """``json.JSONEncoder(default=str, sort_keys=sort_keys).encode``, built once: ``JSONEncoder.encode``
    builds its C encoder again at every call (~2.5 us of a late event's ~7). Without the C accelerator,
    the encoder's own ``encode``. No circular-reference markers: a cycle ends in ``RecursionError``, which
    :func:`to_json` handles."""
    encoder = json.JSONEncoder(default=str, sort_keys=sort_keys)
    make = getattr(json.encoder, "c_make_encoder", None)  # None (or absent) without the C accelerator
    if make is None:
        return encoder.encode
    chunks = make(None, str, json.encoder.encode_basestring_ascii, None, encoder.key_separator,
                  encoder.item_separator, sort_keys, False, True)
    return lambda value: "".join(chunks(value, 0))


_JSON = _encoder(sort_keys=False)
_SORTED_JSON = _encoder(sort_keys=True)


def _same(value: Any) -> Any:
    return value


def _string_keys(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _string_keys(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_string_keys(v) for v in value]
    return value
