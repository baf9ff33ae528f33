"""What one budgeted inference did, and when: per load its read window, per unit its wait and compute.

:class:`Timeline` is filled by :class:`~engine.memory.budgeted.BudgetedSession` on every run (a few
``perf_counter`` calls per unit) and kept as ``session.last_timeline``. ``summary()`` says where the
time went: compute, compute waiting on loads, the loader's busy time and its effective read
bandwidth; ``table()`` lists the units that waited.

>>> sess.run(x); print(sess.last_timeline.summary())   # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Timeline:
    """Seconds since the run started. ``unit_wait[u]`` is how long unit ``u`` waited for its loads."""

    loads: int
    units: int
    load_bytes: list[int]
    load_start: list[float] = field(default_factory=list)
    load_end: list[float] = field(default_factory=list)
    unit_wait: list[float] = field(default_factory=list)
    unit_start: list[float] = field(default_factory=list)
    unit_end: list[float] = field(default_factory=list)
    compute_cpu_s: float = 0.0  # the compute thread's CPU time (its wall time minus this: waiting for a CPU)
    loader_cpu_s: float = 0.0  # the loader thread's CPU time in its reads (page-cache copies, checksums)

    def __post_init__(self) -> None:
        self.load_start = [0.0] * self.loads
        self.load_end = [0.0] * self.loads
        self.unit_wait = [0.0] * self.units
        self.unit_start = [0.0] * self.units
        self.unit_end = [0.0] * self.units

    @property
    def total_s(self) -> float:
        return self.unit_end[-1] if self.units else 0.0

    @property
    def wait_s(self) -> float:
        return sum(self.unit_wait)

    @property
    def compute_s(self) -> float:
        return sum(e - s for s, e in zip(self.unit_start, self.unit_end, strict=True))

    @property
    def read_s(self) -> float:
        return sum(e - s for s, e in zip(self.load_start, self.load_end, strict=True))

    @property
    def read_bps(self) -> float:
        """Bytes per second while the loader was reading (its effective bandwidth)."""
        return sum(self.load_bytes) / self.read_s if self.read_s > 0 else 0.0

    def report(self) -> dict[str, float]:
        return {"total_ms": round(self.total_s * 1e3, 2), "compute_ms": round(self.compute_s * 1e3, 2),
                "wait_ms": round(self.wait_s * 1e3, 2), "read_ms": round(self.read_s * 1e3, 2),
                "read_mb": round(sum(self.load_bytes) / 1e6, 2), "read_gbps": round(self.read_bps / 1e9, 3),
                "waiting_units": sum(w > 1e-4 for w in self.unit_wait),
                "compute_cpu_ms": round(self.compute_cpu_s * 1e3, 2),
                "loader_cpu_ms": round(self.loader_cpu_s * 1e3, 2)}

    def summary(self) -> str:
        r = self.report()
        return (f"{r['total_ms']:.1f} ms: compute {r['compute_ms']:.1f} ms, waiting on loads {r['wait_ms']:.1f} ms "
                f"({r['waiting_units']} of {self.units} units); loader read {r['read_mb']:.1f} MB in "
                f"{r['read_ms']:.1f} ms ({r['read_gbps']:.2f} GB/s while reading); CPU: compute thread "
                f"{r['compute_cpu_ms']:.1f} ms, loader {r['loader_cpu_ms']:.1f} ms")

    def table(self, names: list[str] | None = None, limit: int = 40) -> str:
        """The units that waited longest: when, how long, and the compute they did."""
        order = sorted(range(self.units), key=lambda u: -self.unit_wait[u])[:limit]
        rows = [f"{'unit':>5} {'name':<28} {'start ms':>9} {'wait ms':>8} {'compute ms':>10}"]
        for u in sorted(order):
            if self.unit_wait[u] <= 1e-4:
                continue
            name = names[u] if names else ""
            rows.append(f"{u:>5} {name[:28]:<28} {self.unit_start[u] * 1e3:>9.2f} {self.unit_wait[u] * 1e3:>8.2f} "
                        f"{(self.unit_end[u] - self.unit_start[u]) * 1e3:>10.2f}")
        return "\n".join(rows)
