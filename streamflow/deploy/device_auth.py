"""Device identity on the release server's device-facing requests: each one signed with the device's own key.

The key is the device's entry in the tunnel's key registry (:class:`connectors.tunnel.keys.KeyRegistry`,
``streamflow tunnel keys add DEVICE``): one secret per device, the one its feature batches and deploy
reports over Kafka are signed with already. A request carries ``X-Streamflow-Auth: <unix seconds>
<hex HMAC-SHA256>`` over its method, path (with the query), that time, the piggyback headers
(device, tasks, attributes, user) and the sha256 of its body; the server recomputes it with the key it
holds for the named device and refuses a request more than :data:`WINDOW_S` seconds off its clock.
So a report, a ``X-Streamflow-Tasks`` observation or an exclusive file can only be had in the name
of a device whose key one holds. (Within the window a captured request can be replayed as it is: run
the server behind TLS.)

Standard library only: the device imports it through :mod:`streamflow.deploy.device.client`.

Example:
    >>> key = bytes(32)
    >>> headers = {"X-Streamflow-Device": "phone-1", "X-Streamflow-Tasks": "ipv=2"}
    >>> headers[AUTH_HEADER] = sign_request(key, "GET", "/app/feed", headers, b"", now=1_700_000_000)
    >>> verify_request(key, "GET", "/app/feed", headers, b"", now=1_700_000_030)
    >>> verify_request(key, "GET", "/app/feed", {**headers, "X-Streamflow-Tasks": "ipv=3"}, b"", now=1_700_000_030)
    Traceback (most recent call last):
    ...
    ValueError: the request's signature does not verify with the device's key
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

#: The header a signed request carries.
AUTH_HEADER = "X-Streamflow-Auth"
#: How far (seconds) a request's time may be from the server's.
WINDOW_S = 300
_SIGNED_HEADERS = ("X-Streamflow-Device", "X-Streamflow-Tasks", "X-Streamflow-Attrs", "X-Streamflow-User")


def _mac(key: bytes, method: str, path: str, timestamp: str, headers: Mapping[str, str], body: bytes) -> bytes:
    fields = [method.upper(), path, timestamp, *(headers.get(name) or "" for name in _SIGNED_HEADERS),
              hashlib.sha256(body).hexdigest()]
    return hmac.digest(key, "\n".join(fields).encode(), "sha256")


def sign_request(key: bytes, method: str, path: str, headers: Mapping[str, str], body: bytes | None,
                 now: float) -> str:
    """The ``X-Streamflow-Auth`` value of a request (``path`` as sent, with its query)."""
    timestamp = str(int(now))
    return f"{timestamp} {_mac(key, method, path, timestamp, headers, body or b'').hex()}"


def verify_request(key: bytes, method: str, path: str, headers: Mapping[str, str], body: bytes | None,
                   now: float, window_s: float = WINDOW_S) -> None:
    """Check a request's ``X-Streamflow-Auth`` against ``key``; ``ValueError`` saying why it does not hold."""
    value = headers.get(AUTH_HEADER)
    if not value:
        raise ValueError(f"the request carries no {AUTH_HEADER} (a device signs its requests with its key)")
    timestamp, _, mac = value.partition(" ")
    if not timestamp.isdigit() or len(timestamp) > 12 or len(mac) != 64:
        raise ValueError(f"{AUTH_HEADER} must be '<unix seconds> <64 hex digits>'")
    if abs(now - int(timestamp)) > window_s:
        raise ValueError(f"the request's time {timestamp} is more than {window_s:g} s from the server's")
    try:
        given = bytes.fromhex(mac)
    except ValueError:
        raise ValueError(f"{AUTH_HEADER} must be '<unix seconds> <64 hex digits>'") from None
    if not hmac.compare_digest(_mac(key, method, path, timestamp, headers, body or b""), given):
        raise ValueError("the request's signature does not verify with the device's key")
