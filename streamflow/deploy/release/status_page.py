"""The release server's read-only status page: plain server-rendered HTML with inline SVG, no external assets.

Sections: tasks (stable version, release in progress, devices per version), releases (stage, gray
fraction, samples, failure rate, outcome), per-release cohorts, a chart per recent release (coverage
as a filled blue area, the gray fraction as a grey step line, the failure rate as a red line, over
time), blocked digests and the latest events. Every value from the state is HTML-escaped.

Example:
    >>> page = render({"now": 0, "tasks": {}, "releases": [], "blocked": []}, {}, [])
    >>> page.startswith("<!doctype html>") and "<h1>streamflow releases</h1>" in page
    True
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

#: Chart colours (the browser test looks for them in a screenshot).
COVERAGE_COLOUR = "#2563eb"
FAILURE_COLOUR = "#dc2626"
FRACTION_COLOUR = "#6b7280"

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #111827; background: #ffffff; }
table { border-collapse: collapse; margin: 8px 0 20px; }
th, td { border: 1px solid #d1d5db; padding: 4px 10px; text-align: left; }
th { background: #f3f4f6; }
.rolled_back, .refused { color: #b91c1c; font-weight: 600; }
.complete { color: #047857; font-weight: 600; }
.active { color: #1d4ed8; font-weight: 600; }
.chart { margin: 4px 0 24px; }
code { font-size: 12px; }
"""


def _time(at: float | None) -> str:
    if at is None:
        return ""
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _pct(value: float) -> str:
    return f"{value * 100:.1f}%"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], css: str = "") -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table class="{css}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def chart(samples: Sequence[Sequence[float]], width: int = 640, height: int = 180) -> str:
    """An inline SVG of one release's coverage samples ``(at, fraction, devices, on_version, samples, failed)``.

    Example:
        >>> svg = chart([(0, 0.01, 100, 1, 1, 0), (60, 0.05, 100, 5, 5, 1), (120, 1.0, 100, 90, 90, 1)])
        >>> svg.startswith("<svg") and 'fill="#2563eb"' in svg and 'stroke="#dc2626"' in svg
        True
    """
    if not samples:
        return '<p class="chart">no coverage samples yet</p>'
    left, bottom, top, right = 44, 24, 10, 10
    t0, t1 = samples[0][0], samples[-1][0]
    span = (t1 - t0) or 1.0
    plot_w, plot_h = width - left - right, height - top - bottom

    def x(at: float) -> float:
        return left + (at - t0) / span * plot_w

    def y(value: float) -> float:
        return top + (1 - max(0.0, min(1.0, value))) * plot_h

    coverage = [(x(s[0]), y(s[3] / s[2] if s[2] else 0.0)) for s in samples]
    failure = [(x(s[0]), y(s[5] / s[4] if s[4] else 0.0)) for s in samples]
    fraction: list[tuple[float, float]] = []
    for s in samples:
        if fraction:
            fraction.append((x(s[0]), fraction[-1][1]))
        fraction.append((x(s[0]), y(s[1])))
    area = [(coverage[0][0], y(0)), *coverage, (coverage[-1][0], y(0))]

    def points(pts: Sequence[tuple[float, float]]) -> str:
        return " ".join(f"{px:.1f},{py:.1f}" for px, py in pts)

    if len(samples) == 1:  # a single sample: a visible bar rather than a zero-width area
        cx, cy = coverage[0]
        area = [(cx - 4, y(0)), (cx - 4, cy), (cx + 4, cy), (cx + 4, y(0))]
    grid = "".join(f'<line x1="{left}" x2="{width - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#e5e7eb"/>'
                   f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end" font-size="10">{int(v * 100)}%</text>'
                   for v in (0, 0.25, 0.5, 0.75, 1.0))
    minutes = span / 60
    return (f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="coverage over time">{grid}'
            f'<polygon points="{points(area)}" fill="{COVERAGE_COLOUR}" fill-opacity="1" stroke="none"/>'
            f'<polyline points="{points(fraction)}" fill="none" stroke="{FRACTION_COLOUR}" stroke-width="2" '
            f'stroke-dasharray="5,3"/>'
            f'<polyline points="{points(failure)}" fill="none" stroke="{FAILURE_COLOUR}" stroke-width="3"/>'
            f'<text x="{left}" y="{height - 6}" font-size="10">{escape(_time(t0))}</text>'
            f'<text x="{width - right}" y="{height - 6}" font-size="10" text-anchor="end">+{minutes:.1f} min</text>'
            "</svg>")


def render(status: Mapping[str, Any], coverage: Mapping[str, Sequence[Sequence[float]]],
           events: Sequence[Sequence[Any]]) -> str:
    """The whole page from :meth:`ReleaseManager.status`, coverage samples per release and recent events."""
    parts = ["<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
             '<meta http-equiv="refresh" content="10"><title>streamflow releases</title>',
             f"<style>{_STYLE}</style></head><body>", "<h1>streamflow releases</h1>",
             f"<p>as of {escape(_time(status.get('now')))} UTC</p>", "<h2>Tasks</h2>"]
    task_rows = []
    for task, info in status["tasks"].items():
        versions = ", ".join(f"{escape(v)}: {n}" for v, n in info["versions"].items() if n) or "none seen"
        task_rows.append([escape(task), escape(str(info["stable"] or "")), escape(info["active"] or "none"),
                          info["devices"], versions, escape(", ".join(info["published"]))])
    parts.append(_table(["task", "stable", "release in progress", "devices", "devices per version", "published"],
                        task_rows, "tasks"))
    parts.append("<h2>Releases</h2>")
    rows = []
    for r in status["releases"]:
        rows.append([escape(r["release_id"]), escape(f"{r['task']}@{r['version']}"),
                     f'<span class="{escape(r["status"])}">{escape(r["status"])}</span>', escape(r["stage"]),
                     _pct(r["fraction"]), r["samples"], r["failed"], _pct(r["failure_rate"]),
                     escape(_time(r["started_at"])), escape(r["reason"] or "")])
    parts.append(_table(["release", "version", "status", "stage", "gray", "devices reporting", "failed",
                         "failure rate", "started", "outcome"], rows, "releases"))
    for r in status["releases"]:
        if r["release_id"] not in coverage:
            continue
        parts.append(f"<h3>{escape(r['release_id'])}: coverage of {escape(r['task'])}@{escape(r['version'])}</h3>")
        parts.append(chart(coverage[r["release_id"]]))
        cohort_rows = [[escape(name), c["samples"], c["failed"], _pct(c["failure_rate"])]
                       for name, c in r["cohorts"].items()]
        if cohort_rows:
            parts.append(_table(["cohort", "devices reporting", "failed", "failure rate"], cohort_rows, "cohorts"))
        if r.get("simulation"):
            parts.append(f"<p>simulation: {escape(str(r['simulation'].get('summary', '')))}</p>")
    parts.append("<h2>Blocked digests</h2>")
    parts.append(_table(["digest", "version", "reason", "since"],
                        [[f"<code>{escape(b['digest'])}</code>", escape(f"{b['task']}@{b['version']}"),
                          escape(b["reason"]), escape(_time(b["at"]))] for b in status["blocked"]], "blocked"))
    parts.append("<h2>Latest events</h2>")
    parts.append(_table(["time", "release", "event", "detail"],
                        [[escape(_time(at)), escape(rid), escape(event), escape(detail)]
                         for rid, at, event, detail in events], "events"))
    parts.append("</body></html>")
    return "\n".join(parts)
