"""Reference figures computed from a trace file's raw events by the definitions in
docs/trace.md, with nothing from offload.trace: what the report's tests hold the page
to."""

import math


def prefetch_outcomes(gathers: list[dict], fetches: list[tuple], a: float = -math.inf,
                      b: float = math.inf) -> dict[str, int]:
    """In time / late / on demand / resident for each use (a `wait:gather` span) that
    starts in [a, b]; `fetches`: (key, begin, end, steps) of each completed fetch."""
    counts = dict.fromkeys(("in time", "late", "on demand", "resident"), 0)
    previous: dict = {}
    for u in sorted(gathers, key=lambda e: e["ts"]):
        key, start, end = u["args"]["key"], u["ts"], u["ts"] + u["dur"]
        after, previous[key] = previous.get(key, -math.inf), end
        if not a <= start <= b:
            continue
        ahead = [f for f in fetches if f[0] == key and after <= f[1] < start and f[3]]
        if ahead:
            counts["in time" if max(ahead, key=lambda f: f[1])[2] <= start else "late"] += 1
        elif any(f[0] == key and start <= f[1] <= end and f[3] for f in fetches):
            counts["on demand"] += 1
        else:
            counts["resident"] += 1
    return counts
