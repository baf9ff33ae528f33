"""Cold-start inference (NNV12): the first output of a freshly started process, fast.

- :mod:`engine.coldstart.pipeline`: the preparation thread (read + transform layer i+1..) and the
  execution thread (run layer i), with the schedule and waits recorded.
- :class:`engine.coldstart.session.ColdSession`: the cold path (cached optimised graph, cold-aware
  kernels, cached transformed weights, pipelined first run) and the background warm switch.

What it persists, and under which key, is kept by the engine's cache (:mod:`engine.cache`).
"""
