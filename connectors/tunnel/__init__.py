"""The Kafka tunnel: feature rows from a device to the cloud, compressed, signed, ordered, never lost.

- :mod:`.envelope`: the wire format (a compact binary header, HMAC-signed; format 1 still read);
- :mod:`.columns`: the compact column codec of the payload;
- :mod:`.registry`: schemas and zstd dictionaries, registered once and named by id;
- :mod:`.codebook`: what a device encodes with and has announced;
- :mod:`.keys`: the per-device key registry and signing.
"""

from typing import Any

__all__ = ["FORMAT_VERSION", "Batch", "EnvelopeError", "KeyRegistry", "decode", "encode"]


def __getattr__(name: str) -> Any:
    # Loaded on first use: the envelope needs pyarrow, which the CLI should not import to start.
    if name in ("FORMAT_VERSION", "Batch", "EnvelopeError", "decode", "encode"):
        from connectors.tunnel import envelope

        return getattr(envelope, name)
    if name == "KeyRegistry":
        from connectors.tunnel.keys import KeyRegistry

        return KeyRegistry
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
