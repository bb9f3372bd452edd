"""The coordinator's status page: one self-contained HTML file (no CDN); its script draws the charts as SVG."""

from __future__ import annotations

PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>gossamer</title>
<style>
  :root { --fg: #1d2330; --muted: #667085; --line: #e4e7ec; --bg: #f7f8fa; --card: #fff;
          --accent: #2f6fde; --ok: #12805c; --warn: #b54708; --bad: #c01048; }
  * { box-sizing: border-box; }
  body { margin: 0; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--fg);
         background: var(--bg); }
  header { display: flex; align-items: baseline; gap: 16px; padding: 14px 24px; background: #101828; color: #fff; }
  header h1 { margin: 0; font-size: 20px; letter-spacing: .5px; }
  header .sub { color: #98a2b3; font-size: 13px; }
  main { padding: 16px 24px; display: grid; grid-template-columns: minmax(0, 1fr); gap: 16px; }
  .scroll { overflow-x: auto; }
  section { background: var(--card); border: 1px solid var(--line); border-radius: 8px; padding: 12px 16px; }
  h2 { font-size: 15px; margin: 0 0 10px; }
  table { border-collapse: collapse; width: 100%; }
  th, td { text-align: left; padding: 5px 8px; border-bottom: 1px solid var(--line); white-space: nowrap; }
  th { color: var(--muted); font-weight: 600; font-size: 12px; text-transform: uppercase; letter-spacing: .3px; }
  td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
  tr.selectable { cursor: pointer; }
  tr.selected { background: #eef4ff; }
  tr.straggler td { background: #fff1f3; }
  .badge { display: inline-block; padding: 1px 7px; border-radius: 10px; font-size: 12px; font-weight: 600; }
  .state-running, .state-ready { background: #dcfae6; color: var(--ok); }
  .state-busy { background: #d1e9ff; color: #175cd3; }
  .state-queued, .state-starting { background: #fef0c7; color: var(--warn); }
  .state-completed { background: #eaecf0; color: #344054; }
  .state-failed, .state-lost, .state-cancelled, .state-left { background: #fee4e2; color: var(--bad); }
  .badge.straggler { background: var(--bad); color: #fff; margin-left: 6px; }
  .bar { width: 120px; height: 8px; background: var(--line); border-radius: 4px; display: inline-block;
         vertical-align: middle; margin-right: 6px; overflow: hidden; }
  .bar > span { display: block; height: 100%; background: var(--accent); }
  .summary { display: flex; flex-wrap: wrap; gap: 8px 28px; margin: 0 0 12px; }
  .summary div { min-width: 110px; }
  .summary b { display: block; font-size: 18px; font-variant-numeric: tabular-nums; }
  .summary span { color: var(--muted); font-size: 12px; }
  .charts { display: grid; grid-template-columns: repeat(3, minmax(0, 1fr)); gap: 12px; margin-bottom: 12px; }
  .chart { border: 1px solid var(--line); border-radius: 6px; padding: 8px; }
  .chart h3 { margin: 0 0 4px; font-size: 13px; }
  .chart svg { width: 100%; height: 170px; display: block; }
  .chart .axis { stroke: #98a2b3; stroke-width: 1; }
  .chart .grid { stroke: var(--line); stroke-width: 1; }
  .chart text { fill: var(--muted); font-size: 11px; }
  .chart .chart-line { fill: none; stroke-width: 2; }
  .chart .empty { fill: var(--muted); font-size: 13px; }
  .muted { color: var(--muted); }
  .message { color: var(--muted); margin: -6px 0 10px; }
  #error { color: var(--bad); }
</style>
</head>
<body>
<header><h1>gossamer</h1><span class="sub" id="updated">loading…</span><span id="error"></span></header>
<main>
  <section>
    <h2>Experiments</h2>
    <div class="scroll"><table id="experiments"><thead><tr><th>experiment</th><th>mode</th><th>state</th>
      <th>progress</th><th class="num">gen</th><th class="num">loss</th><th class="num">eval acc</th>
      <th class="num">samples/s</th><th class="num">bytes up</th><th class="num">bytes down</th>
      <th>stragglers</th></tr></thead><tbody></tbody></table></div>
  </section>
  <section id="detail">
    <h2 id="detail-title">No experiment yet</h2>
    <div class="message" id="detail-message"></div>
    <div class="summary" id="summary"></div>
    <div class="charts" id="charts"></div>
    <div class="scroll"><table id="roles"><thead><tr><th>node</th><th>role</th><th class="num">index</th>
      <th>state</th><th class="num">steps/s</th><th>endpoint</th></tr></thead><tbody></tbody></table></div>
  </section>
  <section>
    <h2>Nodes</h2>
    <div class="scroll"><table id="nodes"><thead><tr><th>node</th><th>address</th><th>state</th><th>roles</th>
      <th>experiment</th><th>spot</th><th class="num">lease age</th><th>labels</th></tr></thead><tbody></tbody>
    </table></div>
  </section>
</main>
<script>
"use strict";
const SVG = "http://www.w3.org/2000/svg";
let selected = decodeURIComponent(location.hash.slice(1));

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
  return e;
}
function svg(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}
function num(v, digits) {
  if (v == null || !isFinite(v)) return "–";
  if (Math.abs(v) >= 1000) return Math.round(v).toLocaleString("en-US");
  const t = Number(v).toPrecision(digits || 4);
  return t.includes(".") && !t.includes("e") ? t.replace(/0+$/, "").replace(/\.$/, "") : t;
}
function bytes(v) {
  if (v == null || !isFinite(v)) return "–";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
  return (i ? v.toFixed(1) : String(Math.round(v))) + " " + u[i];
}
function badge(state) { return el("span", {class: "badge state-" + state}, state); }
function stragglerBadge() { return el("span", {class: "badge straggler", title: "slower than half the median step rate"}, "straggler"); }
function fill(tbody, rows) { tbody.replaceChildren(...rows); }

function renderExperiments(exps) {
  const rows = exps.map(e => {
    const m = e.metrics || {};
    const pct = e.total_steps ? Math.min(100, 100 * e.steps / e.total_steps) : 0;
    const bar = el("span", {class: "bar"}, el("span", {style: "width:" + pct.toFixed(1) + "%"}));
    const slow = e.stragglers.length ? e.stragglers.join(", ") : "";
    const tr = el("tr", {class: "selectable" + (e.id === selected ? " selected" : ""), "data-experiment": e.id},
      el("td", {title: e.name}, e.id), el("td", {}, e.mode), el("td", {title: e.message || ""}, badge(e.state)),
      el("td", {}, bar, e.steps + " / " + e.total_steps), el("td", {class: "num"}, e.generation),
      el("td", {class: "num"}, num(m.loss)), el("td", {class: "num"}, num(m.eval_accuracy)),
      el("td", {class: "num"}, num(m.samples_per_s)), el("td", {class: "num"}, bytes(m.bytes_up)),
      el("td", {class: "num"}, bytes(m.bytes_down)), el("td", {}, slow));
    tr.addEventListener("click", () => { selected = e.id; location.hash = e.id; refresh(); });
    return tr;
  });
  fill(document.querySelector("#experiments tbody"), rows);
}

function renderDetail(e) {
  document.getElementById("detail-title").textContent = e ? e.name + " (" + e.id + ")" : "No experiment yet";
  document.getElementById("detail-message").textContent = e ? e.message : "";
  const summary = document.getElementById("summary");
  if (!e) { summary.replaceChildren(); fill(document.querySelector("#roles tbody"), []); return; }
  const m = e.metrics || {};
  const items = [["steps", e.steps + " / " + e.total_steps], ["generation", e.generation],
    ["loss", num(m.loss)], ["eval accuracy", num(m.eval_accuracy)], ["samples/s", num(m.samples_per_s)],
    ["median steps/s", num(e.median_step_rate, 3)], ["bytes up", bytes(m.bytes_up)],
    ["bytes down", bytes(m.bytes_down)], ["compression", m.compression_ratio ? num(m.compression_ratio, 3) + "×" : "–"],
    ["nodes lost", num(m.nodes_lost || 0)], ["promotions", num(m.promotions || 0)], ["restores", num(m.restores || 0)]];
  summary.replaceChildren(...items.map(([k, v]) => el("div", {}, el("b", {}, v), el("span", {}, k))));
  const rows = e.roles.map(r => {
    const role = r.role === "ps" ? "shard" + (r.replica ? " (backup)" : r.replicated ? " (replicated)" : " (unreplicated)") : "worker";
    const node = el("td", {}, r.node);
    if (r.straggler) node.append(stragglerBadge());
    return el("tr", {class: r.straggler ? "straggler" : ""}, node, el("td", {}, role),
      el("td", {class: "num"}, r.index), el("td", {}, r.state), el("td", {class: "num"}, num(r.step_rate, 3)),
      el("td", {class: "muted"}, r.endpoint));
  });
  fill(document.querySelector("#roles tbody"), rows);
}

function renderNodes(nodes) {
  const rows = nodes.map(n => {
    const name = el("td", {}, n.name);
    if (n.straggler) name.append(stragglerBadge());
    const labels = Object.entries(n.labels || {}).map(([k, v]) => k + "=" + v).join(" ");
    return el("tr", {class: n.straggler ? "straggler" : "", "data-node": n.name}, name, el("td", {}, n.address),
      el("td", {}, badge(n.state)), el("td", {}, n.roles.join(", ")), el("td", {}, n.experiment),
      el("td", {}, n.spot ? "spot" : ""), el("td", {class: "num"}, n.lease_age_s == null ? "–" : n.lease_age_s.toFixed(1) + " s"),
      el("td", {class: "muted"}, labels));
  });
  fill(document.querySelector("#nodes tbody"), rows);
}

// Round tick values (1, 2 or 5 times a power of ten) that cover [lo, hi].
function niceTicks(lo, hi) {
  if (hi === lo) { const d = Math.abs(lo) * 0.1 || 1; lo -= d; hi += d; }
  const raw = (hi - lo) / 4, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map(m => m * mag).find(s => s >= raw);
  const out = [];
  for (let v = Math.floor(lo / step) * step; v < hi + step * 0.999; v += step) out.push(Number(v.toPrecision(12)));
  return out;
}

function chart(name, title, points, color, fmt) {
  const W = 360, H = 170, L = 46, R = 8, T = 8, B = 22;
  const box = el("div", {class: "chart", "data-chart": name}, el("h3", {}, title));
  const s = svg("svg", {viewBox: "0 0 " + W + " " + H, class: "chart-svg", "data-series": name,
                        "data-points": String(points.length), role: "img", "aria-label": title});
  box.append(s);
  if (points.length < 2) {
    const t = svg("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty"});
    t.textContent = points.length ? fmt(points[0][1]) : "no data yet";
    s.append(t);
    return box;
  }
  const xs = points.map(p => p[0]), ys = points.map(p => p[1]);
  let x0 = Math.min(...xs), x1 = Math.max(...xs);
  if (x1 === x0) x1 = x0 + 1;
  const ticks = niceTicks(Math.min(...ys), Math.max(...ys));
  const y0 = ticks[0], y1 = ticks[ticks.length - 1];
  const X = x => L + (x - x0) / (x1 - x0) * (W - L - R), Y = y => T + (y1 - y) / (y1 - y0) * (H - T - B);
  for (const v of ticks) {
    const y = Y(v);
    s.append(svg("line", {x1: L, x2: W - R, y1: y, y2: y, class: "grid"}));
    const t = svg("text", {x: L - 4, y: y + 4, "text-anchor": "end"}); t.textContent = fmt(v); s.append(t);
  }
  s.append(svg("line", {x1: L, x2: L, y1: T, y2: H - B, class: "axis"}));
  s.append(svg("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis"}));
  for (const [x, anchor] of [[x0, "start"], [x1, "end"]]) {
    const t = svg("text", {x: X(x), y: H - 6, "text-anchor": anchor}); t.textContent = Math.round(x) + " s"; s.append(t);
  }
  const d = points.map((p, i) => (i ? "L" : "M") + X(p[0]).toFixed(1) + " " + Y(p[1]).toFixed(1)).join(" ");
  s.append(svg("path", {d: d, class: "chart-line", stroke: color}));
  return box;
}

function renderCharts(data) {
  const f = v => Math.abs(v) >= 1000 ? (v / 1000).toFixed(v % 1000 ? 1 : 0) + "k" : num(v, 3);
  document.getElementById("charts").replaceChildren(
    chart("loss", "training loss", data.loss || [], "#c01048", f),
    data.eval_accuracy && data.eval_accuracy.length
      ? chart("eval_accuracy", "eval accuracy", data.eval_accuracy, "#12805c", f)
      : chart("eval_loss", "eval loss", data.eval_loss || [], "#12805c", f),
    chart("samples_per_s", "throughput (samples/s)", data.samples_per_s || [], "#2f6fde", f));
}

let timer = null;
async function refresh() {
  clearTimeout(timer);
  try {
    const st = await (await fetch("/api/status", {cache: "no-store"})).json();
    const exps = st.experiments;
    if (!exps.some(e => e.id === selected)) {
      const active = exps.find(e => ["running", "starting", "queued"].includes(e.state));
      selected = active ? active.id : (exps.length ? exps[0].id : "");
    }
    renderExperiments(exps);
    const exp = exps.find(e => e.id === selected);
    renderDetail(exp);
    renderNodes(st.nodes);
    if (exp) {
      const r = await fetch("/api/series?experiment=" + encodeURIComponent(exp.id), {cache: "no-store"});
      renderCharts(r.ok ? await r.json() : {});
    } else {
      document.getElementById("charts").replaceChildren();
    }
    document.getElementById("updated").textContent = st.experiments.length + " experiment(s), " + st.nodes.length +
      " node(s) · updated " + new Date(st.time_unix * 1000).toLocaleTimeString();
    document.getElementById("error").textContent = "";
    document.body.dataset.rendered = "true";
  } catch (err) {
    document.getElementById("error").textContent = "coordinator unreachable: " + err;
  }
  timer = setTimeout(refresh, 2000);
}
refresh();
</script>
</body>
</html>
"""
