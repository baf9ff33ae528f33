"""The Kafka tunnel: feature rows from a device to the cloud, compressed, signed, ordered, never lost.

- :mod:`.envelope`: the wire format (a compact binary header, HMAC-signed; format 1 still read);
- :mod:`.columns`: the compact column codec of the payload;
- :mod:`.registry`: schemas and zstd dictionaries, registered once and named by id;
- :mod:`.codebook`: what a device encodes with and has announced;
- :mod:`.keys`: the per-device key registry and signing.
"""

from connectors.tunnel.envelope import FORMAT_VERSION, Batch, EnvelopeError, decode, encode
from connectors.tunnel.keys import KeyRegistry

__all__ = ["FORMAT_VERSION", "Batch", "EnvelopeError", "KeyRegistry", "decode", "encode"]
