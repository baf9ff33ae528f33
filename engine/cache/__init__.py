"""The engine's machine-keyed cache, its ground floor: what the kernels, the session, tuning and the cold start
persist on this machine, and under which key. It imports nothing else of the engine.

- :mod:`engine.cache.fingerprint`: CPU model/features and engine version, the key parts that
  make a persisted result valid only where it was measured or built.
- :mod:`engine.cache.store`: a size-limited (LRU) on-disk store of checksummed entries,
  written atomically; corrupt or stale entries are detected and rebuilt, never used.
"""
