/* offload trace report: draws the model embedded in #report-data (offload/trace/report.py).
 *
 * Panels: summary per rank and step, the timeline (one lane per activity, one lane
 * group per rank, canvas), tier occupancy against budgets (canvas, same time axis),
 * prefetch outcomes, plan against measurement. Times in the model are microseconds
 * from the earliest event. Nothing here loads anything: no fetch, no fonts, no images.
 * When everything is drawn, <html data-rendered="true"> is set,
 * window.offloadReport.renderMs holds the time from the script's start and
 * window.offloadReport.buildMs the time each panel took to build (ms, by panel).
 */
(function () {
  "use strict";
  var started = performance.now();
  var data = JSON.parse(document.getElementById("report-data").textContent);
  var S = data.strings;
  var app = document.getElementById("app");
  var OUTCOME_CLASS = ["in-time", "late", "on-demand", "resident"];
  var OUTCOME_COLOR = ["#2e8b57", "#c9821a", "#c23b30", "#9aa5b1"];
  var ROW_H = 12, LANE_PAD = 4, GROUP_H = 22, AXIS_H = 22, OCC_H = 96;
  var MAX_GRID_LINES = 200;  // niceStep puts one per ~110 px: never near this
  var MAX_CANVAS_PX = 8192;  // the tallest timeline canvas, device px: below any browser's limit
  var SECTION_COLOR = {
    compute: "#3b7dd8", waits: "#d0453a", fetches: "#7a8ca3", copies: "#a0673a",
    nvme: "#2e9b6a", optimizer: "#c7a42a", comm: "#b04fa0", plan: "#6b6b6b", other: "#8a8f98"
  };
  var LANE_COLOR = {
    "forward": "#3b7dd8", "backward": "#e07b39", "recompute": "#8a5cc9", "step": "#9fb3cc",
    "phases": "#6f8fb8", "weights (gather)": "#d0453a", "store (fetch, move)": "#e0605a",
    "room in a tier": "#a02a8a", "collective": "#c0409a", "optimizer I/O": "#e69a3a",
    "evictions": "#6d4c2f"
  };
  var GROUP_SERIES_COLOR = ["#3b7dd8", "#e07b39", "#2e9b6a", "#b04fa0", "#c7a42a", "#5c6bc0",
    "#8d6e63", "#00897b"];

  // -- small helpers -------------------------------------------------------------------------
  function el(tag, attrs, children) {
    var e = document.createElement(tag);
    if (attrs) {
      for (var k in attrs) {
        if (!Object.prototype.hasOwnProperty.call(attrs, k) || attrs[k] === undefined) continue;
        if (k === "text") e.textContent = attrs[k];
        else if (k === "cls") e.className = attrs[k];
        else if (k === "style") e.style.cssText = attrs[k];
        else e.setAttribute(k, attrs[k]);
      }
    }
    (children || []).forEach(function (c) {
      if (c !== null && c !== undefined) e.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    });
    return e;
  }
  function fmtTime(us) {
    if (us === null || us === undefined || !isFinite(us)) return "–";
    var a = Math.abs(us);
    if (a >= 1e6) return (us / 1e6).toFixed(a >= 1e7 ? 1 : 2) + " s";
    if (a >= 1e3) return (us / 1e3).toFixed(a >= 1e5 ? 0 : a >= 1e4 ? 1 : 2) + " ms";
    return us.toFixed(a >= 100 ? 0 : 1) + " µs";
  }
  function fmtBytes(b) {
    if (b === null || b === undefined || !isFinite(b)) return "–";
    var units = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0, v = b;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (i === 0 ? v.toFixed(0) : v.toFixed(v >= 100 ? 0 : 1)) + " " + units[i];
  }
  function fmtRate(gbps) {
    return gbps === null || gbps === undefined || !isFinite(gbps) ? "–" : gbps.toFixed(gbps >= 10 ? 1 : 2) + " GB/s";
  }
  function pct(x) { return isFinite(x) ? (100 * x).toFixed(x < 0.1 ? 1 : 0) + "%" : "–"; }
  function maxOf(xs) {  // the largest of xs, null for none; a loop, not apply: any length
    var m = null;
    for (var i = 0; i < xs.length; i++) if (m === null || xs[i] > m) m = xs[i];
    return m;
  }
  function lowerBound(arr, x) {
    var lo = 0, hi = arr.length;
    while (lo < hi) { var mid = (lo + hi) >> 1; if (arr[mid] < x) lo = mid + 1; else hi = mid; }
    return lo;
  }
  function figure(label, value, sub, field, raw, group) {
    return el("div", { cls: "fig", "data-field": field, "data-value": raw === null || raw === undefined ? "" : String(raw),
      "data-group": group }, [
      el("div", { cls: "k", text: label }), el("div", { cls: "v", text: value }),
      sub ? el("div", { cls: "s", text: sub }) : null]);
  }

  // -- header --------------------------------------------------------------------------------
  function buildHeader() {
    var measured = data.groups.filter(function (g) { return !g.predicted; });
    var predicted = data.groups.length - measured.length;
    app.appendChild(el("header", {}, [
      el("h1", { text: data.title }),
      el("div", { cls: "meta", text: [
        measured.length + (measured.length === 1 ? " rank" : " ranks") +
          (predicted ? " measured, " + predicted + " predicted" : ""),
        data.events.toLocaleString("en-US") + " events",
        fmtTime(data.duration_us) + " traced",
        "files: " + data.sources.join(", "),
        "written " + data.generated].join(" · ") })]));
  }

  // -- summary -------------------------------------------------------------------------------
  function buildSummary() {
    var sec = el("section", { id: "summary" }, [el("h2", {}, ["Summary",
      el("span", { cls: "hint", text: "per rank and step; exposed = the compute stood still" })])]);
    var cards = el("div", { cls: "cards" });
    data.summary.forEach(function (g) {
      g.steps.forEach(function (st, si) {
        var gid = g.group, figs = el("div", { cls: "figs" });
        var step = st.step_us;
        figs.appendChild(figure("step time", fmtTime(step), "fwd " + fmtTime(st.phases_us.forward) + " · bwd " +
          fmtTime(st.phases_us.backward) + " · opt " + fmtTime(st.phases_us["optimizer step"]), "step_us", step, gid));
        figs.appendChild(figure("exposed I/O", fmtTime(st.exposed_io_us), pct(st.exposed_io_us / step) + " of the step",
          "exposed_io_us", st.exposed_io_us, gid));
        figs.appendChild(figure("exposed communication", fmtTime(st.exposed_comm_us),
          pct(st.exposed_comm_us / step) + " of the step", "exposed_comm_us", st.exposed_comm_us, gid));
        ["read", "write"].forEach(function (op) {
          var n = st["nvme_" + op], busy = st[op + "_GBps_busy"], disk = g.disk[op + "_Bps"];
          var sub = "over the step " + fmtRate(st[op + "_GBps_step"]);
          figs.appendChild(figure("NVMe " + op, fmtBytes(n), sub, "nvme_" + op, n, gid));
          var vs = disk ? pct(busy / (disk / 1e9)) + " of the disk's " + fmtRate(disk / 1e9) : "disk rate not measured";
          // no rate: no bytes were read, or they were but in no measurable time
          var why = n ? op + "s took no measurable time" : "no " + op + "s";
          figs.appendChild(figure(op + " rate while busy", fmtRate(busy), busy === null ? why : vs,
            op + "_GBps_busy", busy, gid));
        });
        var ref = g.reference_step_s;
        figs.appendChild(figure("no-offload step", ref ? fmtTime(ref * 1e6) : "not known",
          ref ? "this step takes " + (step / (ref * 1e6)).toFixed(2) + "× as long" : "no reference in the trace",
          "reference_step_us", ref ? ref * 1e6 : null, gid));
        if (ref) figs.appendChild(figure("step / no-offload", (step / (ref * 1e6)).toFixed(2) + "×", "",
          "reference_ratio", step / (ref * 1e6), gid));
        var moves = el("table", { cls: "moves" }, [el("tr", {}, [el("th", { text: "bytes per tier move" }),
          el("th", { text: "bytes" })])]);
        Object.keys(st.moves).forEach(function (k) {
          moves.appendChild(el("tr", { "data-move": k, "data-group": gid, "data-value": String(st.moves[k]) },
            [el("td", { text: k }), el("td", { text: fmtBytes(st.moves[k]) })]));
        });
        if (!Object.keys(st.moves).length) moves.appendChild(el("tr", {}, [el("td", { text: "no moves between tiers" }), el("td")]));
        cards.appendChild(el("div", { cls: "card", "data-group": gid, "data-step": st.label }, [
          el("h3", { text: g.label + " · " + st.label }), figs, moves]));
      });
    });
    sec.appendChild(cards);
    app.appendChild(sec);
  }

  // -- the shared time view -------------------------------------------------------------------
  var view = { t0: 0, t1: Math.max(1, data.duration_us) };
  var plots = [];   // {canvas, width, draw()}
  function fitAll() { view.t0 = 0; view.t1 = Math.max(1, data.duration_us); }
  // The narrowest view around time t (µs): 1 µs, or about 2^10 steps of the float64
  // numbers near t (up to 2^-52·|t| apart) where that is more. Far from the origin (a
  // trace spanning an epoch's microseconds) a narrower view would draw one float over
  // many pixels, and its gridlines would be closer than floats there can be.
  function minSpan(t) { return Math.max(1, Math.abs(t) * Math.pow(2, -42)); }
  function zoomTo(a, b) {
    var pad = Math.max(1, (b - a) * 0.05), mid = a / 2 + b / 2;
    var half = Math.max((b - a) / 2 + pad, minSpan(mid) / 2);
    view.t0 = mid - half; view.t1 = mid + half; redraw();
  }
  function zoomAt(frac, factor) {
    var span = view.t1 - view.t0, t = view.t0 + frac * span;
    var ns = Math.max(Math.min(span * factor, data.duration_us * 4 + 10), minSpan(t));
    view.t0 = t - frac * ns; view.t1 = view.t0 + ns; redraw();
  }
  var pending = false;
  function redraw() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(function () { pending = false; drawAll(); });
  }
  function drawAll() {
    plots.forEach(function (p) { p.draw(); });
    var r = document.getElementById("view-range");
    if (r) r.textContent = fmtTime(view.t0) + " – " + fmtTime(view.t1) + "  (" + fmtTime(view.t1 - view.t0) + " shown)";
  }
  // A canvas of width x height CSS px whose drawing is offset `top` px up: it shows
  // rows top .. top + height of its plot (0 for a canvas showing all of it).
  function setupCanvas(canvas, width, height, top) {
    var dpr = window.devicePixelRatio || 1;
    canvas.width = Math.max(1, Math.round(width * dpr));
    canvas.height = Math.max(1, Math.round(height * dpr));
    canvas.style.width = width + "px";
    canvas.style.height = height + "px";
    var ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, -(top || 0) * dpr);
    return ctx;
  }
  function attachNavigation(canvas, plot) {
    var drag = null;
    canvas.addEventListener("wheel", function (ev) {
      // a mostly sideways wheel (a trackpad's swipe, shift+wheel) pans; only an upright
      // one zooms, and a wheel that moved neither way does nothing
      if (Math.abs(ev.deltaX) > Math.abs(ev.deltaY)) {
        ev.preventDefault();
        var px = ev.deltaX * (ev.deltaMode === 1 ? 16 : ev.deltaMode === 2 ? plot.width : 1);
        var dt = px / plot.width * (view.t1 - view.t0);
        view.t0 += dt; view.t1 += dt; redraw();
      } else if (ev.deltaY !== 0) {
        ev.preventDefault();
        var rect = canvas.getBoundingClientRect();
        zoomAt((ev.clientX - rect.left) / rect.width, ev.deltaY > 0 ? 1.25 : 0.8);
      }
    }, { passive: false });
    canvas.addEventListener("mousedown", function (ev) {
      drag = { x: ev.clientX, t0: view.t0, t1: view.t1 };
      canvas.classList.add("dragging");
    });
    window.addEventListener("mousemove", function (ev) {
      if (!drag) return;
      var dt = (ev.clientX - drag.x) / plot.width * (drag.t1 - drag.t0);
      view.t0 = drag.t0 - dt; view.t1 = drag.t1 - dt; redraw();
    });
    window.addEventListener("mouseup", function () { drag = null; canvas.classList.remove("dragging"); });
    canvas.addEventListener("dblclick", function () { fitAll(); redraw(); });
  }
  function plotWidth(container) {
    var gutter = parseFloat(getComputedStyle(document.documentElement).getPropertyValue("--gutter")) || 230;
    return Math.max(200, container.clientWidth - gutter - 2);
  }
  function niceStep(span, px) {
    var raw = span / Math.max(1, px / 110), p = Math.pow(10, Math.floor(Math.log10(raw))), m = raw / p;
    return (m < 1.5 ? 1 : m < 3.5 ? 2 : m < 7.5 ? 5 : 10) * p;
  }
  function drawGrid(ctx, width, top, height, labels) {
    var span = view.t1 - view.t0, step = niceStep(span, width);
    ctx.strokeStyle = "#eef1f4"; ctx.fillStyle = "#5f6b7a"; ctx.font = "10px system-ui, sans-serif";
    ctx.lineWidth = 1;
    // lines counted, not stepped to: where `step` is below the float spacing at the
    // view's times, t + step == t and a loop stepping t would never end
    var first = Math.ceil(view.t0 / step) * step, n = Math.floor((view.t1 - first) / step);
    for (var k = 0; k <= Math.min(n, MAX_GRID_LINES); k++) {
      var t = first + k * step, x = Math.round((t - view.t0) / span * width) + 0.5;
      ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, top + height); ctx.stroke();
      if (labels) ctx.fillText(fmtTime(t), x + 3, 14);
    }
    ctx.strokeStyle = "rgba(47,111,208,0.55)";
    data.steps.forEach(function (st) {
      [st.start, st.end].forEach(function (t) {
        var x = Math.round((t - view.t0) / span * width) + 0.5;
        if (x < 0 || x > width) return;
        ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, top + height); ctx.stroke();
      });
    });
  }

  // -- timeline ------------------------------------------------------------------------------
  var rows = [];  // {y, h, lane, group} for hit-testing
  function buildTimeline() {
    var sec = el("section", { id: "timeline" }, [el("h2", {}, ["Timeline",
      el("span", { cls: "hint", text: "wheel: zoom · drag: pan · double-click: whole trace · hover: details" })])]);
    sec.appendChild(buildToolbar());
    var plot = el("div", { cls: "plot", id: "timeline-plot" });
    var gutter = el("div", { cls: "gutter" });
    plot.appendChild(gutter);
    var y = AXIS_H;
    data.groups.forEach(function (g) {
      var head = el("div", { cls: "group-head" + (g.predicted ? " predicted" : ""), "data-group": g.id,
        style: "top:" + y + "px;height:" + GROUP_H + "px;line-height:" + GROUP_H + "px",
        title: g.source, text: g.label + (g.host ? " · " + g.host : "") + (g.lanes.length ? "" : " · no events") });
      plot.appendChild(head);
      y += GROUP_H;
      var lastSection = null;
      g.lanes.forEach(function (lane) {
        var h = lane.rows * ROW_H + LANE_PAD;
        var label = el("div", { cls: "lane", "data-lane": lane.id, "data-section": lane.section,
          "data-label": lane.label, "data-count": String(lane.count), "data-group": g.id,
          title: lane.sectionLabel + " › " + lane.label + " (" + lane.count + " events)",
          style: "top:" + y + "px;height:" + h + "px;line-height:" + Math.min(h, 16) + "px" }, [
          lane.section !== lastSection ? el("span", { cls: "sec", text: lane.sectionLabel }) : null,
          lane.label, el("span", { cls: "cnt", text: String(lane.count) })]);
        lastSection = lane.section;
        plot.appendChild(label);
        rows.push({ y: y, h: h, lane: lane, group: g });
        y += h;
      });
    });
    var height = y + 4;
    plot.style.height = height + "px";
    var canvas = el("canvas", { id: "timeline-canvas" });
    plot.appendChild(canvas);
    sec.appendChild(plot);
    app.appendChild(sec);
    // top, bandH: the rows of the plot the canvas shows, top .. top + bandH (plot px)
    var p = { canvas: canvas, width: 0, height: height, container: plot, draw: null,
              top: 0, bandH: height };
    p.draw = function () {
      p.width = plotWidth(plot);
      var b = timelineBand(plot, height);
      p.top = b.top; p.bandH = b.h;
      canvas.style.top = b.top + "px";
      var ctx = setupCanvas(canvas, p.width, b.h, b.top);
      ctx.clearRect(0, b.top, p.width, b.h);
      drawGrid(ctx, p.width, b.top, b.h, true);
      rows.forEach(function (r) {
        if (r.y < b.top + b.h && r.y + r.h > b.top) drawLane(ctx, r, p.width);
      });
      ctx.strokeStyle = "#dde2e8";
      ctx.beginPath(); ctx.moveTo(0, AXIS_H - 0.5); ctx.lineTo(p.width, AXIS_H - 0.5); ctx.stroke();
    };
    plots.push(p);
    attachNavigation(canvas, p);
    attachTooltip(canvas, p);
    // a canvas holding a band of the plot is drawn again once scrolling brings rows
    // outside the band into view
    window.addEventListener("scroll", function () {
      if (p.bandH >= height) return;
      var vis = visibleRows(plot, height);
      if (vis.top < p.top || vis.bottom > p.top + p.bandH) p.draw();
    });
  }
  // The rows (plot px, clipped to 0 .. height) of a plot in the window now.
  function visibleRows(plot, height) {
    var top = -(plot.getBoundingClientRect().top + plot.clientTop);
    return { top: Math.min(height, Math.max(0, top)),
             bottom: Math.max(0, Math.min(height, top + window.innerHeight)) };
  }
  // Which rows of the timeline its canvas holds. All of them where that canvas fits in
  // MAX_CANVAS_PX device pixels; else a band of twice the window's height around the
  // rows in view (a canvas taller than a browser's limit, about 32k or 64k px, draws
  // nothing at all, with no error).
  function timelineBand(plot, height) {
    var dpr = window.devicePixelRatio || 1, cap = Math.floor(MAX_CANVAS_PX / dpr);
    if (height <= cap) return { top: 0, h: height };
    var h = Math.min(cap, Math.max(600, 2 * window.innerHeight)), vis = visibleRows(plot, height);
    var top = Math.round((vis.top + vis.bottom) / 2 - h / 2);
    return { top: Math.max(0, Math.min(height - h, top)), h: h };
  }
  function buildToolbar() {
    var bar = el("div", { cls: "toolbar" });
    bar.appendChild(el("button", { text: "whole trace", "data-action": "fit" }));
    bar.appendChild(el("button", { text: "zoom in" }));
    bar.appendChild(el("button", { text: "zoom out" }));
    var seen = new Set();  // one button per label (ranks share them), in first-seen order
    var stepButtons = data.steps.filter(function (s) {
      if (seen.has(s.label)) return false;
      seen.add(s.label);
      return true;
    });
    stepButtons.forEach(function (st) {
      bar.appendChild(el("button", { text: st.label, "data-step": st.label }));
    });
    bar.appendChild(el("span", { cls: "view-range", id: "view-range" }));
    bar.addEventListener("click", function (ev) {
      var b = ev.target.closest("button");
      if (!b) return;
      if (b.dataset.action === "fit") { fitAll(); redraw(); }
      else if (b.textContent === "zoom in") zoomAt(0.5, 0.5);
      else if (b.textContent === "zoom out") zoomAt(0.5, 2);
      else if (b.dataset.step) {
        var mine = data.steps.filter(function (s) { return s.label === b.dataset.step; });
        zoomTo(Math.min.apply(null, mine.map(function (s) { return s.start; })),
               Math.max.apply(null, mine.map(function (s) { return s.end; })));
      }
    });
    return bar;
  }
  function laneColor(lane) {
    return LANE_COLOR[lane.label] || (lane.section === "nvme" ? (lane.label.indexOf("write") === 0 ? "#1f7f8c" : "#2e9b6a")
      : SECTION_COLOR[lane.section] || "#8a8f98");
  }
  function drawLane(ctx, r, width) {
    var lane = r.lane, s = lane.s, d = lane.d, z = lane.z, n = s.length;
    if (!n) return;
    var span = view.t1 - view.t0, k = width / span, t0 = view.t0;
    var i = lowerBound(s, t0 - lane.maxDur), last = new Float64Array(lane.rows).fill(-1e9);
    var predicted = r.group.predicted;
    ctx.fillStyle = laneColor(lane);
    ctx.globalAlpha = predicted ? 0.55 : 1;
    var labels = [];
    for (; i < n; i++) {
      var a = s[i];
      if (a > view.t1) break;
      var x0 = (a - t0) * k, x1 = (a + d[i] - t0) * k;
      if (x1 < 0) continue;
      var row = z[i], w = x1 - x0;
      var yy = r.y + 2 + row * ROW_H;
      if (w < 1) {
        var px = Math.floor(x0);
        if (px <= last[row]) continue;   // one mark per pixel column and row
        last[row] = px;
        ctx.fillRect(px, yy, 1, ROW_H - 2);
      } else {
        ctx.fillRect(x0, yy, w, ROW_H - 2);
        last[row] = Math.floor(x1);
        if (w > 36) labels.push([Math.max(x0, 0), yy, Math.min(x1, width) - Math.max(x0, 0), i]);
      }
    }
    ctx.globalAlpha = 1;
    if (labels.length) {
      ctx.fillStyle = "#ffffff"; ctx.font = "9px system-ui, sans-serif";
      labels.forEach(function (L) {
        var text = S[lane.n[L[3]]] + (lane.r[L[3]] >= 0 && lane.section !== "compute" ? " " + S[lane.r[L[3]]] : "");
        var maxChars = Math.floor((L[2] - 4) / 5);
        if (maxChars < 3) return;
        ctx.fillText(text.length > maxChars ? text.slice(0, maxChars - 1) + "…" : text, L[0] + 2, L[1] + 8);
      });
    }
  }

  // -- tooltip -------------------------------------------------------------------------------
  var tip;
  function showTip(ev, html) {
    tip.innerHTML = html;
    tip.style.display = "block";
    var x = ev.clientX + 14, y = ev.clientY + 14;
    var w = tip.offsetWidth, h = tip.offsetHeight;
    if (x + w > window.innerWidth - 4) x = ev.clientX - w - 14;
    if (y + h > window.innerHeight - 4) y = ev.clientY - h - 14;
    tip.style.left = x + "px"; tip.style.top = y + "px";
  }
  function hideTip() { tip.style.display = "none"; }
  // every text from the trace that showTip puts into innerHTML goes through esc
  function esc(t) {
    return String(t).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
  }
  function tierOf(lane) {
    if (lane.section === "copies" && lane.label.indexOf("->") > 0) return lane.label;
    if (lane.section === "nvme") return "NVME";
    return null;
  }
  function hitEvent(r, t, row, tol) {
    var lane = r.lane, s = lane.s, d = lane.d, z = lane.z;
    var i = Math.min(s.length - 1, lowerBound(s, t + tol + 1e-9) - 1), best = -1;
    for (; i >= 0 && s[i] >= t - lane.maxDur - tol; i--) {
      if (z[i] !== row) continue;
      if (s[i] - tol <= t && t <= s[i] + d[i] + tol) { best = i; break; }
    }
    return best;
  }
  function attachTooltip(canvas, p) {
    canvas.addEventListener("mousemove", function (ev) {
      var rect = canvas.getBoundingClientRect(), x = ev.clientX - rect.left;
      var y = ev.clientY - rect.top + p.top;  // in the plot: the canvas shows rows from p.top
      var r = null;
      for (var j = 0; j < rows.length; j++) if (y >= rows[j].y && y < rows[j].y + rows[j].h) { r = rows[j]; break; }
      if (!r) { hideTip(); return; }
      var span = view.t1 - view.t0, t = view.t0 + x / p.width * span, tol = 3 / p.width * span;
      var row = Math.min(r.lane.rows - 1, Math.max(0, Math.floor((y - r.y - 2) / ROW_H)));
      var i = hitEvent(r, t, row, tol);
      if (i < 0) { hideTip(); return; }
      var lane = r.lane, parts = ["<b>" + esc(S[lane.n[i]]) + "</b> <span class=t>" + esc(r.group.label) +
        " · " + esc(lane.sectionLabel) + " › " + esc(lane.label) + "</span>"];
      if (lane.r[i] >= 0) parts.push("record " + esc(S[lane.r[i]]));
      if (lane.b[i]) parts.push("bytes " + fmtBytes(lane.b[i]) + " (" + lane.b[i].toLocaleString("en-US") + ")");
      var tier = tierOf(lane);
      if (tier) parts.push("tier " + esc(tier));
      parts.push("duration " + fmtTime(lane.d[i]) + " · at " + fmtTime(lane.s[i]));
      if (lane.b[i] && lane.d[i] > 0 && lane.section !== "compute") parts.push("rate " + fmtRate(lane.b[i] / lane.d[i] / 1e3));
      if (lane.x[i] >= 0 && S[lane.x[i]]) parts.push("<span class=t>" + esc(S[lane.x[i]]) + "</span>");
      showTip(ev, parts.join("<br>"));
    });
    canvas.addEventListener("mouseleave", hideTip);
  }

  // -- occupancy -----------------------------------------------------------------------------
  function buildOccupancy() {
    var sec = el("section", { id: "occupancy" }, [el("h2", {}, ["Tier occupancy",
      el("span", { cls: "hint", text: "bytes held per tier over the step; dashed red: the tier's budget; same time axis as the timeline" })])]);
    if (!data.occupancy.length) {
      sec.appendChild(el("p", { cls: "note", text: "No tier occupancy in these traces (the store records tier:<TIER> counters while tracing)." }));
    }
    data.occupancy.forEach(function (tier) {
      // the heading reads what was measured: a prediction's peak and budget are its own
      // (beside its name below), not the rank's; only a tier no rank measured reads them
      var measured = tier.series.filter(function (s) { return !s.predicted; });
      var heading = measured.length ? measured : tier.series;
      var budget = maxOf(heading.map(function (s) { return s.budget; })
        .filter(function (b) { return b; }));
      var peak = maxOf(heading.map(function (s) { return s.peak; }).concat([0]));
      // the scale holds every curve and budget line, predicted ones too
      var top = maxOf(tier.series.map(function (s) { return Math.max(s.peak, s.budget || 0); })
        .concat([0]));
      var plot = el("div", { cls: "plot", "data-tier": tier.tier, style: "height:" + OCC_H + "px" });
      plot.appendChild(el("div", { cls: "gutter" }));
      plot.appendChild(tierHead(tier, peak, budget));
      var canvas = el("canvas");
      plot.appendChild(canvas);
      sec.appendChild(plot);
      var p = { canvas: canvas, width: 0, draw: null };
      p.draw = function () { p.width = plotWidth(plot); drawTier(tier, canvas, p.width, top); };
      plots.push(p);
      attachNavigation(canvas, p);
      canvas.addEventListener("mousemove", function (ev) { tierTip(ev, tier, canvas, p.width); });
      canvas.addEventListener("mouseleave", hideTip);
    });
    app.appendChild(sec);
  }
  function tierHead(tier, peak, budget) {
    var head = el("div", { cls: "tier-head", "data-tier": tier.tier, "data-peak": String(peak),
      "data-budget": budget === null ? "" : String(budget), style: "height:" + OCC_H + "px" }, [
      el("b", { text: tier.tier }),
      el("span", { text: "peak " + fmtBytes(peak) }),
      el("span", { text: budget ? "budget " + fmtBytes(budget) + " (" + pct(peak / budget) + ")" : "no budget" })]);
    tier.series.forEach(function (s, i) {
      var gl = data.groups.filter(function (g) { return g.id === s.group; })[0];
      var own = tier.series.length > 1 ? " " + fmtBytes(s.peak) +
        (s.budget && s.budget !== budget ? " of " + fmtBytes(s.budget) : "") : "";
      head.appendChild(el("span", { "data-series": s.group, "data-peak": String(s.peak),
        "data-budget": s.budget ? String(s.budget) : "",
        style: "color:" + GROUP_SERIES_COLOR[i % GROUP_SERIES_COLOR.length],
        text: (gl ? gl.label : s.group) + own }));
    });
    return head;
  }
  function drawTier(tier, canvas, width, top) {
    var ctx = setupCanvas(canvas, width, OCC_H);
    ctx.clearRect(0, 0, width, OCC_H);
    drawGrid(ctx, width, 0, OCC_H, false);
    var yOf = function (v) { return OCC_H - 6 - (top > 0 ? v / top : 0) * (OCC_H - 16); };
    var span = view.t1 - view.t0, xOf = function (t) { return (t - view.t0) / span * width; };
    var xEnd = Math.min(width, xOf(data.duration_us));
    tier.series.forEach(function (s, si) {
      if (!s.t.length) return;
      // a step curve: flat until the next sample, then a vertical jump
      ctx.beginPath();
      var i0 = Math.max(0, lowerBound(s.t, view.t0) - 1), y = yOf(s.v[i0]), i;
      ctx.moveTo(Math.max(-1, xOf(s.t[i0])), y);
      for (i = i0 + 1; i < s.t.length; i++) {
        var x = xOf(s.t[i]);
        if (x > width + 1) { ctx.lineTo(width + 1, y); break; }
        ctx.lineTo(x, y);
        y = yOf(s.v[i]);
        ctx.lineTo(x, y);
      }
      if (i === s.t.length) ctx.lineTo(xEnd, y);
      ctx.strokeStyle = GROUP_SERIES_COLOR[si % GROUP_SERIES_COLOR.length]; ctx.lineWidth = 1.5;
      ctx.setLineDash(s.predicted ? [5, 3] : []);
      ctx.stroke();
      if (!s.predicted && tier.series.length === 1) {
        ctx.lineTo(xEnd, OCC_H);
        ctx.lineTo(Math.max(-1, xOf(s.t[i0])), OCC_H);
        ctx.closePath();
        ctx.fillStyle = "rgba(59,125,216,0.14)";
        ctx.fill();
      }
    });
    ctx.setLineDash([]);
    tier.series.forEach(function (s) {
      if (!s.budget) return;
      var yb = Math.round(yOf(s.budget)) + 0.5;
      ctx.strokeStyle = "#c23b30"; ctx.lineWidth = 1; ctx.setLineDash([6, 4]);
      ctx.beginPath(); ctx.moveTo(0, yb); ctx.lineTo(width, yb); ctx.stroke();
      ctx.setLineDash([]);
      ctx.fillStyle = "#c23b30"; ctx.font = "10px system-ui, sans-serif";
      ctx.fillText("budget " + fmtBytes(s.budget), 4, Math.max(10, yb - 3));
    });
  }
  function tierTip(ev, tier, canvas, width) {
    var rect = canvas.getBoundingClientRect(), t = view.t0 + (ev.clientX - rect.left) / width * (view.t1 - view.t0);
    var parts = ["<b>" + esc(tier.tier) + "</b> at " + fmtTime(t)];
    tier.series.forEach(function (s) {
      var i = lowerBound(s.t, t + 1e-9) - 1;
      if (i < 0) return;
      var kinds = Object.keys(s.kinds).map(function (k) { return k + " " + fmtBytes(s.kinds[k][i]); }).join(", ");
      parts.push(esc(s.group) + ": " + fmtBytes(s.v[i]) + (s.budget ? " of " + fmtBytes(s.budget) : "") +
        (kinds ? "<br><span class=t>" + esc(kinds) + "</span>" : ""));
    });
    showTip(ev, parts.join("<br>"));
  }

  // -- prefetch outcomes ---------------------------------------------------------------------
  function buildPrefetch() {
    var sec = el("section", { id: "prefetch" }, [el("h2", {}, ["Prefetch outcomes",
      el("span", { cls: "hint", text: "per use of a record: in time (slack before use), late (compute waited), on demand, resident; click a row to see it" })])]);
    data.prefetch.forEach(function (g) {
      var box = el("div", { cls: "card", "data-group": g.group, style: "margin-bottom:8px" }, [el("h3", { text: g.label })]);
      if (!g.hasFetches) {
        box.appendChild(el("p", { cls: "note", text: "This trace has no fetch events: it was recorded without the store's fetch records, so outcomes cannot be told." }));
      }
      var table = el("table", { cls: "totals" }, [el("tr", {}, [el("th", { text: "step" }), el("th", { text: "outcome" }),
        el("th", { text: "uses" }), el("th", { text: "slack (sum)" }), el("th", { text: "waited (sum)" })])]);
      g.totals.forEach(function (t) {
        var all = data.outcomes.reduce(function (a, o) { return a + t[o].count; }, 0);
        data.outcomes.forEach(function (o, oi) {
          table.appendChild(el("tr", { "data-step": t.label, "data-outcome": o, "data-count": String(t[o].count),
            "data-group": g.group, "data-slack": String(t[o].slack_us), "data-waited": String(t[o].waited_us) }, [
            el("td", { text: t.label }), el("td", { cls: "outcome-" + OUTCOME_CLASS[oi], text: o }),
            el("td", { text: String(t[o].count) }), el("td", { text: oi === 0 ? fmtTime(t[o].slack_us) : "" }),
            el("td", { text: oi === 1 || oi === 2 ? fmtTime(t[o].waited_us) : "" })]));
        });
        var bar = el("div", { cls: "bar", title: t.label });
        data.outcomes.forEach(function (o, oi) {
          if (t[o].count) bar.appendChild(el("div", { style: "width:" + (100 * t[o].count / all) + "%;background:" + OUTCOME_COLOR[oi], title: o + ": " + t[o].count }));
        });
        box.appendChild(bar);
      });
      box.appendChild(table);
      if (g.uses.length) {
        var uses = el("table", {}, [el("thead", {}, [el("tr", {}, [el("th", { text: "record" }), el("th", { text: "used at" }),
          el("th", { text: "outcome" }), el("th", { text: "slack" }), el("th", { text: "waited" }), el("th", { text: "issued" }),
          el("th", { text: "arrived" })])])]);
        var body = el("tbody");
        g.uses.forEach(function (u, i) {
          body.appendChild(el("tr", { "data-use": String(i), "data-outcome": data.outcomes[u[3]] }, [
            el("td", { text: S[u[0]] }), el("td", { text: fmtTime(u[1]) }),
            el("td", { cls: "outcome-" + OUTCOME_CLASS[u[3]], text: data.outcomes[u[3]] }),
            el("td", { text: u[3] === 0 ? fmtTime(u[4]) : "" }), el("td", { text: fmtTime(u[5]) }),
            el("td", { text: u[6] === null ? "" : fmtTime(u[6]) }), el("td", { text: u[7] === null ? "" : fmtTime(u[7]) })]));
        });
        body.addEventListener("click", function (ev) {
          var tr = ev.target.closest("tr");
          if (!tr) return;
          var u = g.uses[+tr.dataset.use];
          zoomTo(u[6] === null ? u[1] : Math.min(u[6], u[1]), Math.max(u[2], u[7] === null ? u[2] : u[7]));
          document.getElementById("timeline").scrollIntoView({ behavior: "smooth" });
        });
        uses.appendChild(body);
        box.appendChild(el("div", { cls: "uses" }, [uses]));
      }
      sec.appendChild(box);
    });
    app.appendChild(sec);
  }

  // -- plan against measurement --------------------------------------------------------------
  function buildPlan() {
    var sec = el("section", { id: "plan" }, [el("h2", { text: "Plan against measurement" })]);
    if (!data.plan.present) {
      sec.appendChild(el("p", { cls: "note", text: "No prediction in these traces. A simulator's predicted trace " +
        "(metadata kind \"predicted\") passed beside the measured ones is drawn as its own lane group and as dashed " +
        "occupancy curves; see docs/trace.md." }));
    } else if (data.plan.compare.length) {
      var t = el("table", {}, [el("tr", {}, ["rank", "measured step (median)", "predicted step", "measured / predicted",
        "measured exposed I/O", "predicted exposed I/O"].map(function (h) { return el("th", { text: h }); }))]);
      data.plan.compare.forEach(function (c) {
        t.appendChild(el("tr", { "data-rank": String(c.rank), "data-measured": String(c.measured_us), "data-predicted": String(c.predicted_us) }, [
          el("td", { text: String(c.rank) }), el("td", { text: fmtTime(c.measured_us) + " (" + c.measured_step + ")" }),
          el("td", { text: fmtTime(c.predicted_us) }),
          el("td", { text: c.predicted_us > 0 ? (c.measured_us / c.predicted_us).toFixed(2) + "×" : "–" }),
          el("td", { text: fmtTime(c.measured_exposed_io_us) }), el("td", { text: fmtTime(c.predicted_exposed_io_us) })]));
      });
      sec.appendChild(t);
    } else {
      sec.appendChild(el("p", { cls: "note", text: "The planner's schedule is drawn in the plan lanes; no predicted step to compare." }));
    }
    app.appendChild(sec);
  }

  var buildMs = {};  // ms each panel took to build, before anything is drawn
  [["header", buildHeader], ["summary", buildSummary], ["timeline", buildTimeline],
    ["occupancy", buildOccupancy], ["prefetch", buildPrefetch], ["plan", buildPlan]
  ].forEach(function (b) {
    var t = performance.now();
    b[1]();
    buildMs[b[0]] = performance.now() - t;
  });
  tip = el("div", { id: "tooltip" });
  document.body.appendChild(tip);
  if (data.steps.length) {
    // every rank's steps: one whose step began before rank 0's is not cut off
    var firstStart = Math.min.apply(null, data.steps.map(function (s) { return s.start; }));
    var lastEnd = Math.max.apply(null, data.steps.map(function (s) { return s.end; }));
    var pad = (lastEnd - firstStart) * 0.02;
    view.t0 = Math.max(0, firstStart - pad); view.t1 = Math.min(data.duration_us, lastEnd + pad);
    if (view.t1 <= view.t0) fitAll();
  }
  drawAll();
  var resizeTimer = null;
  window.addEventListener("resize", function () {
    clearTimeout(resizeTimer); resizeTimer = setTimeout(drawAll, 100);
  });
  // For tests and scripts: where event i of a lane is drawn now (client coordinates).
  function locate(laneId, i) {
    var r = rows.filter(function (x) { return x.lane.id === laneId; })[0];
    if (!r || i >= r.lane.s.length) return null;
    var p = plots[0], rect = p.canvas.getBoundingClientRect(), span = view.t1 - view.t0;
    var mid = r.lane.s[i] + r.lane.d[i] / 2;
    return { x: rect.left + (mid - view.t0) / span * p.width,
             y: rect.top - p.top + r.y + 2 + r.lane.z[i] * ROW_H + ROW_H / 2 };
  }
  window.offloadReport = { renderMs: performance.now() - started, renderedAt: performance.now(),
    buildMs: buildMs, events: data.events, view: view, locate: locate,
    zoomTo: function (a, b) { zoomTo(a, b); drawAll(); } };
  document.documentElement.setAttribute("data-rendered", "true");
})();
