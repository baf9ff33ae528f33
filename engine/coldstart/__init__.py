"""Cold-start inference (NNV12): the first output of a freshly started process, fast.

- :mod:`engine.coldstart.fingerprint`: CPU model/features and engine version, the key parts that
  make a persisted result valid only where it was measured or built.
- :mod:`engine.coldstart.store`: a size-limited (LRU) on-disk store of checksummed entries,
  written atomically; corrupt or stale entries are detected and rebuilt, never used.
- :mod:`engine.coldstart.pipeline`: the preparation thread (read + transform layer i+1..) and the
  execution thread (run layer i), with the schedule and waits recorded.
- :class:`engine.coldstart.session.ColdSession`: the cold path (cached optimised graph, cold-aware
  kernels, cached transformed weights, pipelined first run) and the background warm switch.
"""
