"""The Kafka tunnel: feature rows from a device to the cloud, compressed, signed, ordered, never lost.

- :mod:`.envelope`: the wire format (versioned, HMAC-signed Arrow IPC batches);
- :mod:`.keys`: the per-device key registry.
"""

from connectors.tunnel.envelope import FORMAT_VERSION, Batch, EnvelopeError, decode, encode
from connectors.tunnel.keys import KeyRegistry

__all__ = ["FORMAT_VERSION", "Batch", "EnvelopeError", "KeyRegistry", "decode", "encode"]
