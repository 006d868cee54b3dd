"""The HTML report of one or more trace files: one self-contained page, no network.

``write_report(paths, out)`` reads Chrome-trace files (:mod:`offload.trace.chrome`),
builds the report's model (lanes of events, tier occupancy, prefetch outcomes,
a summary per step; :mod:`offload.trace.analysis` computes the figures) and
writes one HTML file with the model as JSON and the drawing code
(``assets/report.js``, ``assets/report.css``) inline, so it opens from
``file://`` with nothing else. How to read each panel: docs/trace.md.

Traces of several ranks line up on one clock: ranks recorded on the same host
share CLOCK_MONOTONIC; a rank of another host is moved by the difference of
the hosts' clock anchors (wall clock minus monotonic clock, read together when
each recorder was made). A file whose metadata has ``"kind": "predicted"`` is
a simulator's prediction: it is drawn beside the measured rank of the same
number, its first step moved to start with the measured one.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from offload.files import regular_file_head, replace_atomically
from offload.trace.analysis import (COLLECTIVES, FETCH, OPTIM_UPDATE, PHASES, USE_WAIT,
                                    RankTrace, Span, Step, StepIndex, TraceFormatError,
                                    byte_count, bytes_moved_per_step, exposed_times, finite,
                                    is_collective_wait, parse_trace, prefetch_outcomes,
                                    steps_of, tier_occupancy)
from offload.trace.chrome import load_chrome_trace

__all__ = ["ReportInputError", "build_model", "default_report_path", "is_report",
           "load_traces", "render_html", "write_report"]

MODEL_VERSION = 1
MAX_ROWS = 4            # rows per lane: overlapping events beyond this share the last row
OUTCOMES = ("in time", "late", "on demand", "resident")
TIER_ORDER = ("DEVICE", "HOST", "NVME")
_SECTIONS = ("compute", "waits", "fetches", "copies", "nvme", "optimizer", "comm", "plan", "other")
_SECTION_LABELS = {"compute": "compute", "waits": "waits", "fetches": "fetches",
                   "copies": "copies", "nvme": "NVMe",
                   "optimizer": "CPU Adam", "comm": "collectives", "plan": "plan",
                   "other": "other"}
GENERATOR = '<meta name="generator" content="offload view">'  # marks a page as a report
_HEAD_BYTES = 64 << 10  # is_report reads this much: the head, with the style, of a report
_MOVE_ORDER = ("NVME->HOST", "NVME->DEVICE", "HOST->DEVICE", "DEVICE->HOST", "HOST->NVME")


class ReportInputError(Exception):
    """A trace file cannot be read, or the report's path would replace a file it must not;
    ``str()`` is one line naming the file, why, and what to do."""


# -- reading -------------------------------------------------------------------------------------
def load_traces(paths: Sequence[str | os.PathLike[str]]) -> list[RankTrace]:
    """Every rank of every file in ``paths``, aligned on one clock (see the module notes).

    Raises :class:`ReportInputError` for a missing, unreadable or malformed file, or
    when two measured files hold the same rank.
    """
    if not paths:
        raise ReportInputError("no trace files given")
    ranks: list[RankTrace] = []
    seen: dict[tuple[int, bool], str] = {}
    for path in paths:
        p = Path(path)
        try:
            parsed = parse_trace(_read_json(p), str(p), checked=True)
        except TraceFormatError as e:
            raise ReportInputError(str(e)) from None
        for rt in parsed:
            where = seen.get((rt.rank, rt.predicted))
            if where is not None:
                kind = "predicted" if rt.predicted else "measured"
                raise ReportInputError(f"{p}: rank {rt.rank} ({kind}) is also in {where}; pass "
                                       "one trace per rank")
            seen[(rt.rank, rt.predicted)] = str(p)
            ranks.append(rt)
    _align(ranks)
    return ranks


def _read_json(path: Path) -> Any:
    """The trace object of `path`, checked as `load_chrome_trace` checks it (a newer
    format, events that are not objects, bad metadata: refused, not drawn)."""
    try:
        return load_chrome_trace(path)
    except FileNotFoundError:
        raise ReportInputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ReportInputError(f"{path}: is a directory, not a trace file") from None
    except OSError as e:
        raise ReportInputError(f"{path}: cannot read it ({e.strerror or e})") from None
    except TraceFormatError as e:
        raise ReportInputError(str(e)) from None
    except MemoryError:  # the file, its text or its objects: a JSON event is ~10x its bytes
        raise ReportInputError(f"{path}: too large to read in the memory this process may use "
                               f"({_file_size(path)} on disk); record fewer steps, or view it "
                               "where there is more memory") from None


def _file_size(path: Path) -> str:
    try:
        n = path.stat().st_size
    except OSError:
        return "size unknown"
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n} bytes"


def _align(ranks: list[RankTrace]) -> None:
    """Puts every measured rank on the first one's clock, then each prediction on its rank."""
    measured = [r for r in ranks if not r.predicted]
    if measured:
        ref = measured[0]
        for rt in measured[1:]:
            same_host = rt.info.get("host") == ref.info.get("host")
            if not same_host and rt.anchor_ns and ref.anchor_ns:
                own = rt.anchor_ns[1] - rt.anchor_ns[0]
                base = ref.anchor_ns[1] - ref.anchor_ns[0]
                rt.shift((own - base) / 1000.0)
    starts = {r.rank: _median(steps_of(r), lambda s: s.dur).start for r in measured}
    for rt in ranks:
        if rt.predicted:
            target = starts.get(rt.rank, starts[min(starts)] if starts else 0.0)
            rt.shift(target - steps_of(rt)[0].start)


def _median(items: Sequence[Any], length: Callable[[Any], float]) -> Any:
    """The item of median `length` (of two in the middle, the shorter): the measured
    step a prediction is laid beside and compared with, as `offload bench plan`
    compares it with the median of its timed steps."""
    return sorted(items, key=length)[(len(items) - 1) // 2]


# -- the model -----------------------------------------------------------------------------------
class _Strings:
    """Interned strings: the model refers to names, records and details by index."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self._index: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        i = self._index.get(text)
        if i is None:
            i = self._index[text] = len(self.items)
            self.items.append(text)
        return i


def _lane_of(span: Span) -> tuple[str, str, int]:
    """(section, lane label, order within the section) of one span."""
    name, cat = span.name, span.cat
    if cat == "compute":
        if name == "step":
            return "compute", "step", 0
        if name in PHASES:
            return "compute", "phases", 1
        for i, phase in enumerate(("forward", "recompute", "backward")):
            if name.startswith(phase + ":"):
                return "compute", phase, 2 + i
        if name == OPTIM_UPDATE:
            return "optimizer", "update", 0
    if cat == "wait" or name.startswith("optim:wait"):
        if name == USE_WAIT:
            return "waits", "weights (gather)", 0
        if is_collective_wait(span):
            return "waits", "collective", 3
        if name == "wait:budget":
            return "waits", "room in a tier", 2
        if name.startswith("optim:wait"):
            return "waits", "optimizer I/O", 4
        return "waits", "store (fetch, move)", 1
    if cat == "io" and name in ("read", "write"):
        path = str(span.args.get("path") or "")
        where = os.path.basename(os.path.dirname(path)) if path else ""
        return "nvme", f"{name} {where}".strip(), 0 if name == "read" else 1
    if cat == "store" and "->" in name:
        order = _MOVE_ORDER.index(name) if name in _MOVE_ORDER else len(_MOVE_ORDER)
        return "copies", name, order
    if name == FETCH and cat == FETCH:
        return "fetches", "issue -> arrival", 0
    if cat == "comm" or name in COLLECTIVES:
        return "comm", name, 0
    if cat == "plan":
        return "plan", name, 0
    return "other", span.track, 0


_SKIP_ARGS = frozenset(("bytes", "key", "step"))


def _detail(args: dict[str, Any]) -> str:
    """The args a tooltip shows besides record and bytes, as one short line."""
    parts = []
    for k, v in args.items():
        if k in _SKIP_ARGS:
            continue
        if k == "path" and isinstance(v, str):
            v = os.path.basename(v)
        text = f"{k} {v}"
        parts.append(text if len(text) < 80 else text[:77] + "...")
    return " · ".join(parts)


def _display_name(span: Span, section: str) -> str:
    if section == "compute" and ":" in span.name and span.name.split(":", 1)[0] in (
            "forward", "recompute", "backward"):
        return span.name.split(":", 1)[1]
    return span.name


def _rows(starts: list[float], ends: list[float]) -> tuple[list[int], int]:
    """Greedy row per event (sorted by start) so that events on one row do not overlap."""
    row_end: list[float] = []
    out = []
    for s, e in zip(starts, ends):
        for i, end in enumerate(row_end):
            if end <= s:
                row_end[i] = e
                out.append(i)
                break
        else:
            if len(row_end) < MAX_ROWS:
                row_end.append(e)
                out.append(len(row_end) - 1)
            else:
                i = min(range(MAX_ROWS), key=row_end.__getitem__)
                row_end[i] = max(row_end[i], e)
                out.append(i)
    return out, max(1, len(row_end))


def _r(x: float) -> float:
    return round(x, 2)


def _group_lanes(rt: RankTrace, gid: str, origin: float, strings: _Strings) -> list[dict[str, Any]]:
    buckets: dict[tuple[str, str, int], list[tuple[float, float, int, int, int, int]]] = {}
    for s in rt.spans:
        lane = _lane_of(s)
        key = str(s.args["key"]) if "key" in s.args else ""
        buckets.setdefault(lane, []).append((
            s.start - origin, s.end - origin, strings(_display_name(s, lane[0])),
            strings(key) if key else -1, byte_count(s.args.get("bytes")),
            strings(_detail(s.args))))
    for i in rt.instants:
        if i.cat == "plan":
            lane = ("plan", i.name, 0)
        elif i.name.startswith("evict"):
            lane = ("copies", "evictions", len(_MOVE_ORDER) + 1)
        else:
            lane = ("other", i.track, 0)
        key = str(i.args["key"]) if "key" in i.args else ""
        buckets.setdefault(lane, []).append((
            i.ts - origin, i.ts - origin, strings(i.name), strings(key) if key else -1,
            byte_count(i.args.get("bytes")), strings(_detail(i.args))))
    lanes = []
    for (section, label, order) in sorted(buckets, key=lambda k: (_SECTIONS.index(k[0]), k[2],
                                                                   k[1])):
        evs = sorted(buckets[(section, label, order)], key=lambda e: (e[0], -e[1]))
        starts = [e[0] for e in evs]
        ends = [e[1] for e in evs]
        rows, nrows = _rows(starts, ends)
        lanes.append({
            "id": f"{gid}/{section}/{label}", "section": section,
            "sectionLabel": _SECTION_LABELS[section], "label": label, "rows": nrows,
            "count": len(evs), "maxDur": _r(max((b - a for a, b in zip(starts, ends)),
                                                 default=0.0)),
            "s": [_r(x) for x in starts], "d": [_r(b - a) for a, b in zip(starts, ends)],
            "n": [e[2] for e in evs], "r": [e[3] for e in evs], "b": [e[4] for e in evs],
            "x": [e[5] for e in evs], "z": rows,
        })
    return lanes


def _step_summaries(rt: RankTrace, steps: list[Step]) -> list[dict[str, Any]]:
    """Each step's figures; each pass over the rank's spans serves every step."""
    index = StepIndex(steps)
    phases = [dict.fromkeys(PHASES, 0.0) for _ in steps]
    for s in rt.spans:
        if s.name in PHASES and s.cat == "compute":
            for k in index.holding(s.start):
                phases[k][s.name] += s.dur
    out = []
    for step, exposed, moved, ph in zip(steps, exposed_times(rt, steps),
                                        bytes_moved_per_step(rt, steps), phases):
        row: dict[str, Any] = {
            "label": step.label, "start": step.start, "step_us": step.dur,
            "phases_us": ph, "exposed_io_us": exposed["io"],
            "exposed_comm_us": exposed["comm"], "moves": moved["moves"],
            "nvme_read": moved["nvme_read"], "nvme_write": moved["nvme_write"],
            "read_busy_us": moved["read_busy_us"], "write_busy_us": moved["write_busy_us"],
        }
        for op in ("read", "write"):
            n, busy = moved[f"nvme_{op}"], moved[f"{op}_busy_us"]
            row[f"{op}_GBps_busy"] = _rate(n, busy)
            row[f"{op}_GBps_step"] = _rate(n, step.dur)
        out.append(row)
    return out


def _rate(n: int, us: float) -> float | None:
    """``n`` bytes over ``us`` microseconds in GB/s; None (not known) where the time is
    not positive or the quotient is not finite (bytes over a time too short for a
    float to hold the rate): the page says so rather than the report failing."""
    if us <= 0:
        return None
    rate = n / us / 1e3
    return rate if math.isfinite(rate) else None


def _disk(info: dict[str, Any]) -> dict[str, float]:
    disk = info.get("disk")
    out = {}
    if isinstance(disk, dict):
        for k in ("read_Bps", "write_Bps"):
            v = finite(disk.get(k))
            if v is not None and v > 0:
                out[k] = v
    return out


def _host(info: dict[str, Any]) -> str | None:
    """The host the rank ran on, where the trace says it as text."""
    host = info.get("host")
    return host if isinstance(host, str) and host else None


def _reference_step(info: dict[str, Any]) -> float | None:
    v = finite(info.get("reference_step_s"))
    return v if v is not None and v > 0 else None


def _prefetch(rt: RankTrace, steps: list[Step], origin: float,
              strings: _Strings) -> dict[str, Any]:
    uses = prefetch_outcomes(rt)
    rows = [[strings(u.key), _r(u.use - origin), _r(u.end - origin), OUTCOMES.index(u.outcome),
             _r(u.slack_us), _r(u.waited_us),
             None if u.issued is None else _r(u.issued - origin),
             None if u.arrived is None else _r(u.arrived - origin)] for u in uses]
    totals: list[dict[str, Any]] = [
        {"label": st.label, **{o: {"count": 0, "slack_us": 0.0, "waited_us": 0.0}
                               for o in OUTCOMES}} for st in steps]
    index = StepIndex(steps)
    for u in uses:
        for k in index.holding(u.use):
            t = totals[k][u.outcome]
            t["count"] += 1
            t["slack_us"] += u.slack_us
            t["waited_us"] += u.waited_us
    has_fetches = any(s.name == FETCH and s.cat == FETCH for s in rt.spans)
    return {"uses": rows, "totals": totals, "hasFetches": has_fetches}


def _occupancy(ranks: list[tuple[str, RankTrace]], origin: float) -> list[dict[str, Any]]:
    tiers: dict[str, dict[str, Any]] = {}
    for gid, rt in ranks:
        budgets = rt.info.get("tier_budgets") if isinstance(rt.info.get("tier_budgets"),
                                                            dict) else {}
        for tier, series in tier_occupancy(rt).items():
            entry = tiers.setdefault(tier, {"tier": tier, "series": []})
            kinds = sorted({k for _, _, ks in series for k in ks})
            budget = byte_count(budgets.get(tier))
            entry["series"].append({
                "group": gid, "predicted": rt.predicted, "budget": budget or None,
                "t": [_r(t - origin) for t, _, _ in series], "v": [v for _, v, _ in series],
                "peak": max((v for _, v, _ in series), default=0.0),
                "kinds": {k: [ks.get(k, 0.0) for _, _, ks in series] for k in kinds}})
    order = {t: i for i, t in enumerate(TIER_ORDER)}
    return sorted(tiers.values(), key=lambda e: (order.get(e["tier"], len(order)), e["tier"]))


def build_model(ranks: list[RankTrace], *, title: str = "",
                sources: Iterable[str] = ()) -> dict[str, Any]:
    """The JSON-ready model the page draws (see assets/report.js for its use)."""
    strings = _Strings()
    extents = [rt.extent() for rt in ranks if rt.spans or rt.instants or rt.counters]
    origin = min((a for a, _ in extents), default=0.0)
    end = max((b for _, b in extents), default=0.0)
    ordered = sorted(ranks, key=lambda r: (r.rank, r.predicted))
    groups, summary, prefetch, steps_out, named = [], [], [], [], []
    for rt in ordered:
        gid = f"r{rt.rank}" + ("p" if rt.predicted else "")
        named.append((gid, rt))
        label = f"rank {rt.rank}" + (" (predicted)" if rt.predicted else "")
        steps = steps_of(rt)
        groups.append({"id": gid, "label": label, "rank": rt.rank, "predicted": rt.predicted,
                       "process": rt.name, "host": _host(rt.info), "source": rt.source,
                       "lanes": _group_lanes(rt, gid, origin, strings)})
        steps_out.extend({"group": gid, "label": s.label, "start": _r(s.start - origin),
                          "end": _r(s.end - origin)} for s in steps)
        summary.append({"group": gid, "label": label, "rank": rt.rank,
                        "predicted": rt.predicted, "disk": _disk(rt.info),
                        "reference_step_s": _reference_step(rt.info),
                        "steps": _step_summaries(rt, steps)})
        prefetch.append({"group": gid, "label": label, **_prefetch(rt, steps, origin, strings)})
    for s in summary:
        for st in s["steps"]:
            st["start"] = _r(st["start"] - origin)
    predicted = [s for s in summary if s["predicted"]]
    compare = []
    for p in predicted:
        m = next((s for s in summary if s["rank"] == p["rank"] and not s["predicted"]), None)
        if m is not None and m["steps"] and p["steps"]:
            ms = _median(m["steps"], lambda st: st["step_us"])
            compare.append({"rank": p["rank"], "measured_step": ms["label"],
                            "measured_us": ms["step_us"], "predicted_us": p["steps"][0]["step_us"],
                            "measured_exposed_io_us": ms["exposed_io_us"],
                            "predicted_exposed_io_us": p["steps"][0]["exposed_io_us"]})
    return {
        "version": MODEL_VERSION, "title": title or "offload trace report",
        "sources": list(sources),
        "generated": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "duration_us": _r(end - origin), "outcomes": list(OUTCOMES), "strings": strings.items,
        "groups": groups, "steps": steps_out, "occupancy": _occupancy(named, origin),
        "summary": summary, "prefetch": prefetch,
        "plan": {"present": bool(predicted) or any(
            lane["section"] == "plan" for g in groups for lane in g["lanes"]), "compare": compare},
        "events": sum(lane["count"] for g in groups for lane in g["lanes"]),
    }


# -- the page ------------------------------------------------------------------------------------
def _asset(name: str) -> str:
    return resources.files("offload.trace").joinpath("assets", name).read_text(encoding="utf-8")


_SURROGATE = re.compile("[\ud800-\udfff]")


def _escape_html(text: str) -> str:
    """``text`` for an element's content; a lone surrogate (a file name's byte that is not
    UTF-8, as Python decodes it) becomes U+FFFD, as UTF-8 cannot hold it."""
    text = _SURROGATE.sub("\ufffd", text)
    return (text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;"))


def render_html(model: dict[str, Any]) -> str:
    """The whole page: model as JSON, script and style inline; no external reference."""
    data = json.dumps(model, separators=(",", ":"), allow_nan=False)
    # "</script>" or "<!--" in a name would end or confuse the script element: no "<" at
    # all (it can only occur inside JSON strings, where \u003c is the same character)
    data = data.replace("<", "\\u003c")
    title = _escape_html(model.get("title", "offload trace report"))
    script = f"\n{_asset('report.js')}\n"
    # The page runs this one script and nothing else: not even an event handler in markup
    # that a name from the trace might smuggle into the DOM ('unsafe-inline' would allow it)
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode()
    return (
        f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n{GENERATOR}\n"
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
        f"script-src 'sha256-{digest}'; style-src 'unsafe-inline'\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        f"<title>{title}</title>\n<style>\n{_asset('report.css')}\n</style>\n</head>\n"
        "<body>\n<noscript>This report draws with JavaScript; enable it to see the "
        "panels.</noscript>\n<div id=\"app\"></div>\n"
        f"<script type=\"application/json\" id=\"report-data\">{data}</script>\n"
        f"<script>{script}</script>\n</body>\n</html>\n")


def is_report(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a regular file holding a report this module wrote (one that
    ``offload view`` may replace without losing anything of the user's)."""
    head = regular_file_head(path, _HEAD_BYTES)
    if head is None:
        return False
    # reports written before the generator tag have the model's script in their head
    return head.startswith(b"<!DOCTYPE html>") and (
        GENERATOR.encode() in head or b'<script type="application/json" id="report-data">'
        in head)


def default_report_path(trace: str | os.PathLike[str]) -> Path:
    """``run.trace.json`` -> ``run.report.html`` beside it (also ``.json.gz``, ``.json``)."""
    p = Path(trace)
    name = p.name
    for suffix in (".json.gz", ".json"):
        if name.endswith(suffix):
            name = name[:-len(suffix)]
            break
    if name.endswith(".trace"):
        name = name[:-len(".trace")]
    return p.with_name(f"{name}.report.html")


def write_report(paths: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str] | None = None,
                 *, title: str = "", replace_only_reports: bool = False) -> Path:
    """Reads ``paths``, writes the report to ``out`` (default beside the first trace)
    atomically, returns its path. Raises :class:`ReportInputError` for bad input, before
    anything is written: a trace that cannot be read, an ``out`` that is one of the
    traces or not a regular file, or (with ``replace_only_reports``) a file with
    something in it other than a report; ``OSError`` when ``out`` cannot be written."""
    target = Path(out) if out is not None else default_report_path(paths[0])
    _check_output(target, paths, replace_only_reports)
    ranks = load_traces(paths)
    model = build_model(ranks, title=title or _title(paths),
                        sources=[Path(p).name for p in paths])
    html = render_html(model).encode("utf-8")
    replace_atomically(target, lambda f: f.write(html), mode=0o644)
    return target


def _check_output(target: Path, paths: Sequence[str | os.PathLike[str]],
                  replace_only_reports: bool) -> None:
    """Raises :class:`ReportInputError` when writing ``target`` would replace a file the
    report must not: one of its traces, a device or pipe, or (``replace_only_reports``)
    a file with something in it other than a report."""
    for p in paths:
        try:
            same = target.exists() and os.path.samefile(target, p)
        except OSError:  # a trace that cannot be found is reported when it is read
            same = False
        if same or os.path.abspath(target) == os.path.abspath(p):
            raise ReportInputError(f"{target}: is one of the traces ({p}); the report would "
                                   "replace it. Name the report otherwise (-o), such as "
                                   f"{default_report_path(p)}")
    if target.exists() and not target.is_file() and not target.is_dir():
        raise ReportInputError(f"{target}: is not a regular file; name the report (-o) a "
                               "new .html file")
    if replace_only_reports and target.is_file() and target.stat().st_size \
            and not is_report(target):
        raise ReportInputError(f"{target}: exists and is not a report of offload view; "
                               "remove it, or name the report otherwise (-o)")


def _title(paths: Sequence[str | os.PathLike[str]]) -> str:
    names = [Path(p).name for p in paths]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"offload trace report: {shown}"
