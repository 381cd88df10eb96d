// The runs page: lists the training runs under the server's runs directory (GET /v1/runs), plots
// the metrics.jsonl of the ticked ones (several overlay), polls for new lines while they train
// (GET /v1/runs/metrics from the byte offset read so far), and mounts a run's adapter through
// POST /v1/adapters (when a model is served here).
import { api, apiJSON, el, fmt, health, keyButton } from "./common.js";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#0b5cad", "#c2410c", "#15803d", "#7e22ce", "#b91c1c", "#0e7490"];
const POLL_MS = 2000;
const LIST_MS = 5000;
const MAX_SELECTED = COLORS.length;

// Charts: a title and the metrics drawn in it (dashed: a second series of the same chart).
const CHARTS = [
  { id: "loss", title: "Loss", series: ["loss", "val_loss"], smooth: ["loss"], log: true },
  { id: "lr", title: "Learning rate", series: ["lr"] },
  { id: "tok_per_s", title: "Throughput (tok/s)", series: ["tok_per_s"] },
  { id: "peak_mem_gb", title: "Peak memory (GB)", series: ["peak_mem_gb"] },
  { id: "grad_norm", title: "Gradient norm", series: ["grad_norm"], smooth: ["grad_norm"] },
  { id: "mfu", title: "MFU", series: ["mfu"] },
  { id: "rewards", title: "DPO rewards", series: ["reward_chosen", "reward_rejected", "reward_margin"], smooth: ["reward_chosen", "reward_rejected", "reward_margin"] },
  { id: "pref_accuracy", title: "Preference accuracy", series: ["pref_accuracy"], smooth: ["pref_accuracy"] },
  { id: "logps", title: "Log-probs (chosen, rejected)", series: ["logp_chosen", "logp_rejected"], smooth: ["logp_chosen", "logp_rejected"] },
  { id: "orpo", title: "ORPO terms", series: ["nll_chosen", "log_odds_ratio", "or_term"], smooth: ["nll_chosen", "log_odds_ratio", "or_term"] },
];
const HIDDEN = new Set(["step", "elapsed_s", "tokens", "trained_tokens", "tflop", "gflops"]);
const DASHES = ["", "5 3", "2 3"];

let runs = []; // cards from GET /v1/runs
let canMount = false;
let defaultModel = null; // the default model's id: a link to chat names another model only
const selected = []; // run ids, in the order ticked (colors follow)
const data = new Map(); // run id -> {records, offset, file}
let drawn = ""; // what the charts show, to redraw only on change

// --- fetching ---------------------------------------------------------------------------------

async function refreshList() {
  let body;
  try {
    body = await apiJSON("/v1/runs");
  } catch (e) {
    $("notice").textContent = "Could not list the runs: " + e.message;
    return;
  }
  runs = body.data;
  canMount = body.can_mount;
  defaultModel = body.model;
  $("root").textContent = body.root;
  if (!body.model) $("chat-link").hidden = true;
  for (const id of [...selected]) if (!runs.some((r) => r.id === id)) unselect(id);
  if (!selected.length && runs.length && !refreshList.done) select(runs[0].id);
  refreshList.done = true;
  renderTable();
}

async function poll(id) {
  const have = data.get(id) || { records: [], offset: 0, file: null };
  for (;;) {
    const q = new URLSearchParams({ run: id, offset: String(have.offset) });
    if (have.file) q.set("file", have.file);
    const got = await apiJSON("/v1/runs/metrics?" + q);
    if (got.reset) have.records = [];
    have.records.push(...got.records);
    have.offset = got.offset;
    have.file = got.file;
    if (!got.more) break;
  }
  data.set(id, have);
}

// One poll at a time (two from the same offset would add the same lines twice); a call made
// while one runs asks for another round after it.
let polling = null;
let again = false;

async function pollSelected() {
  if (polling) {
    again = true;
    return polling;
  }
  polling = (async () => {
    do {
      again = false;
      try {
        await Promise.all([...selected].map(poll));
        $("live").textContent = "live: updated " + new Date().toLocaleTimeString();
      } catch (e) {
        $("live").textContent = "update failed: " + e.message;
      }
      draw();
    } while (again);
  })();
  try {
    await polling;
  } finally {
    polling = null;
  }
}

async function showInfo() {
  const box = $("info");
  const id = selected[0];
  if (!id) return box.replaceChildren();
  let info;
  try {
    info = await apiJSON("/v1/runs/info?" + new URLSearchParams({ run: id }));
  } catch (e) {
    return box.replaceChildren(el("p", { class: "error" }, e.message));
  }
  const c = info.config || {};
  const s = info.summary || {};
  const lora = c.lora || {};
  const optim = c.optim || {};
  const facts = [
    ["run", id],
    ["model", c.model],
    ["objective", c.objective || "sft"],
    ["LoRA", lora.rank ? `rank ${lora.rank}, scale ${lora.scale}, ${[].concat(lora.targets || []).join(",")}, layers ${lora.layers}` : null],
    ["optimizer", optim.name ? `${optim.name}, lr ${optim.lr}, warmup ${optim.warmup}` : null],
    ["batch", c.batch_size ? `${c.batch_size} x ${(c.data || {}).max_seq_length} tokens` : null],
    ["iters", c.iters],
    ["backward", c.backward ? `${c.backward.mode}${c.backward.mode === "segmented" ? " " + c.backward.segment_size : ""}` : null],
    ["val loss", s.val_loss !== undefined ? `${fmt(s.initial_val_loss)} -> ${fmt(s.val_loss)}` : null],
    ["wall time", s.wall_s !== undefined ? `${s.wall_s} s` : null],
    // training time and peak memory: the whole run's, over its attempts (null: unknown)
    ["training time", s.seconds !== undefined ? (s.seconds === null ? "n/a" : `${Math.round(s.seconds)} s`) : null],
    ["peak memory", s.peak_mem_gb !== undefined ? (s.peak_mem_gb === null ? "n/a" : `${fmt(s.peak_mem_gb, 3)} GB`) : null],
    ["resumed", s.resumed_from_step ? `at step ${s.resumed_from_step}` + (typeof s.resumed_seconds === "number" ? ` (this attempt ${Math.round(s.resumed_seconds)} s)` : "") : null],
  ].filter(([, v]) => v !== null && v !== undefined);
  box.replaceChildren(
    el("h3", {}, "Run details"),
    el("dl", {}, facts.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, String(v))])),
  );
}

// --- selection and the table ------------------------------------------------------------------

function colorOf(id) {
  return COLORS[selected.indexOf(id) % COLORS.length];
}

function select(id) {
  if (selected.includes(id)) return;
  if (selected.length >= MAX_SELECTED) {
    $("notice").textContent = `At most ${MAX_SELECTED} runs overlay; untick one first.`;
    return;
  }
  selected.push(id);
  pollSelected();
  showInfo();
}

function unselect(id) {
  const i = selected.indexOf(id);
  if (i >= 0) selected.splice(i, 1);
  data.delete(id);
  draw();
  showInfo();
}

function mountId(run) {
  return run.id.replace(/[^A-Za-z0-9_.:-]+/g, "-").replace(/^-+|-+$/g, "").slice(-64) || "run";
}

async function mount(run, button) {
  button.disabled = true;
  $("notice").textContent = `Mounting ${run.id}…`;
  try {
    const res = await api("/v1/adapters", {
      method: "POST",
      // on the model the run trained from when it is served here, else the default's
      body: { id: mountId(run), path: run.mount_path, model: run.mount_model || undefined },
    });
    const body = await res.json().catch(() => ({}));
    if (!res.ok) throw new Error((body.error && body.error.message) || `${res.status}`);
    $("notice").textContent = `Mounted as ${body.id} on ${body.model}.`;
  } catch (e) {
    $("notice").textContent = "Mount failed: " + e.message;
  }
  button.disabled = false;
  refreshList();
}

function adapterCell(run) {
  if (!run.adapter) return el("span", { class: "muted" }, run.status === "finished" ? "none" : "not yet");
  if (run.mounted_as.length) {
    const id = run.mounted_as[0];
    const q = new URLSearchParams({ adapter: id });
    if (run.mount_model && run.mount_model !== defaultModel) q.set("model", run.mount_model);
    return el("span", {}, "mounted as ", el("a", { href: "/?" + q, class: "chat-with" }, id));
  }
  if (!canMount) return el("span", { class: "muted" }, "final adapter");
  if (!run.mount_path) return el("span", { class: "muted", title: "outside the server's adapter root" }, "outside root");
  const b = el("button", { type: "button", class: "mount", "aria-label": `Mount the adapter of ${run.id}` }, "Mount");
  b.addEventListener("click", () => mount(run, b));
  return b;
}

// Rows are made once per run and updated in place (a refresh every few seconds must not take the
// focus away from a checkbox or a button).
function newRow(run) {
  const box = el("input", { type: "checkbox", "aria-label": `Plot ${run.id}` });
  box.addEventListener("change", () => {
    if (box.checked) select(run.id);
    else unselect(run.id);
    renderTable();
  });
  const name = el("button", { type: "button", class: "run-name", title: "Plot this run alone" }, run.id);
  name.addEventListener("click", () => {
    for (const id of [...selected]) if (id !== run.id) unselect(id);
    select(run.id);
    renderTable();
  });
  const swatch = el("span", { class: "swatch", "aria-hidden": "true", hidden: true });
  return el(
    "tr",
    { "data-run": run.id },
    el("td", {}, box),
    el("td", {}, el("div", { class: "run-title" }, swatch, name), el("div", { class: "muted small" })),
    el("td", { class: "num" }),
    el("td"),
    el("td", { class: "num" }),
    el("td", { class: "num" }),
    el("td"),
  );
}

function renderTable() {
  const body = $("runs-body");
  $("runs-empty").hidden = runs.length > 0;
  const rows = new Map([...body.children].map((tr) => [tr.dataset.run, tr]));
  runs.forEach((run, i) => {
    const tr = rows.get(run.id) || newRow(run);
    const cells = tr.children;
    const on = selected.includes(run.id);
    tr.classList.toggle("selected", on);
    cells[0].firstChild.checked = on;
    const swatch = cells[1].querySelector(".swatch");
    swatch.hidden = !on;
    if (on) swatch.style.background = colorOf(run.id); // CSSOM: allowed by the page's CSP
    cells[1].lastChild.textContent = [run.model, run.objective !== "sft" ? run.objective : null]
      .filter(Boolean)
      .join(" · ");
    cells[2].textContent = `${run.step ?? 0}${run.iters ? " / " + run.iters : ""}`;
    cells[3].textContent = run.status;
    cells[3].className = "status-" + run.status;
    cells[4].textContent = fmt(run.loss);
    cells[5].textContent = fmt(run.val_loss);
    const state = JSON.stringify([run.adapter, run.mount_path, run.mount_model, run.mounted_as, run.status, canMount]);
    if (cells[6].dataset.state !== state) {
      cells[6].dataset.state = state;
      cells[6].replaceChildren(adapterCell(run));
    }
    if (body.children[i] !== tr) body.insertBefore(tr, body.children[i] || null);
    rows.delete(run.id);
  });
  for (const tr of rows.values()) tr.remove();
}

// --- charts -----------------------------------------------------------------------------------

// An exponential moving average, as TensorBoard's smoothing slider draws it.
function smooth(points, alpha) {
  if (!alpha) return points;
  let s = null;
  return points.map(([x, y]) => {
    s = s === null ? y : alpha * s + (1 - alpha) * y;
    return [x, s];
  });
}

function ticks(lo, hi, count = 5) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
  return out;
}

function thin(points, max = 1500) {
  if (points.length <= max) return points;
  const stride = Math.ceil(points.length / max);
  const out = points.filter((_, i) => i % stride === 0);
  if (out[out.length - 1] !== points[points.length - 1]) out.push(points[points.length - 1]);
  return out;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}

function chartsToDraw() {
  const keys = new Set();
  for (const id of selected) for (const r of (data.get(id) || { records: [] }).records) for (const k in r) if (typeof r[k] === "number") keys.add(k);
  const out = CHARTS.filter((c) => c.series.some((s) => keys.has(s)));
  const known = new Set(CHARTS.flatMap((c) => c.series));
  for (const k of keys) if (!known.has(k) && !HIDDEN.has(k)) out.push({ id: k, title: k, series: [k] });
  return out;
}

function drawChart(chart) {
  const W = 360, H = 200, L = 58, R = 10, T = 8, B = 30;
  const alpha = Number($("smoothing").value);
  const logy = chart.log && $("logy").checked;
  const lines = [];
  for (const id of selected) {
    const recs = (data.get(id) || { records: [] }).records;
    chart.series.forEach((metric, k) => {
      let pts = recs.filter((r) => typeof r[metric] === "number").map((r) => [r.step, r[metric]]);
      if (logy) pts = pts.filter(([, y]) => y > 0);
      if (!pts.length) return;
      if ((chart.smooth || []).includes(metric)) pts = smooth(pts, alpha);
      lines.push({ id, metric, pts: thin(pts), dash: DASHES[k % DASHES.length], raw: pts });
    });
  }
  if (!lines.length) return null;
  const xs = lines.flatMap((l) => l.pts.map((p) => p[0]));
  const ys = lines.flatMap((l) => l.pts.map((p) => (logy ? Math.log10(p[1]) : p[1])));
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) [y0, y1] = [y0 - (Math.abs(y0) || 1) * 0.05, y1 + (Math.abs(y1) || 1) * 0.05];
  const pad = (y1 - y0) * 0.05;
  y0 -= pad;
  y1 += pad;
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => T + (1 - ((logy ? Math.log10(y) : y) - y0) / (y1 - y0)) * (H - T - B);
  const describe = lines
    .map((l) => `${l.metric} of ${l.id}: ${l.raw.length} points, last ${fmt(l.raw[l.raw.length - 1][1])} at step ${l.raw[l.raw.length - 1][0]}`)
    .join("; ");
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `${chart.title}: ${describe}` });
  for (const t of ticks(y0, y1, 4)) {
    const y = T + (1 - (t - y0) / (y1 - y0)) * (H - T - B);
    root.append(svg("line", { class: "grid", x1: L, x2: W - R, y1: y, y2: y }));
    const label = svg("text", { x: L - 6, y: y + 4, "text-anchor": "end" });
    label.textContent = fmt(logy ? 10 ** t : t, 3);
    root.append(label);
  }
  for (const t of ticks(x0, x1, 5)) {
    if (!Number.isInteger(t)) continue;
    const x = sx(t);
    root.append(svg("line", { class: "axis", x1: x, x2: x, y1: H - B, y2: H - B + 4 }));
    const label = svg("text", { x, y: H - B + 16, "text-anchor": "middle" });
    label.textContent = String(t);
    root.append(label);
  }
  root.append(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  root.append(svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
  const xlabel = svg("text", { x: (L + W - R) / 2, y: H - 2, "text-anchor": "middle" });
  xlabel.textContent = "step";
  root.append(xlabel);
  for (const l of lines) {
    const d = l.pts.map(([x, y], i) => `${i ? "L" : "M"}${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join("");
    const path = svg("path", {
      class: "series" + (l.dash ? " dashed" : ""),
      d,
      stroke: colorOf(l.id),
      "data-run": l.id,
      "data-metric": l.metric,
      "data-points": l.raw.length,
    });
    if (l.dash) path.setAttribute("stroke-dasharray", l.dash);
    root.append(path);
    if (l.pts.length <= 60 && (l.metric === "val_loss" || l.pts.length === 1)) {
      for (const [x, y] of l.pts) root.append(svg("circle", { cx: sx(x), cy: sy(y), r: 2.5, fill: colorOf(l.id) }));
    }
  }
  const caption = el("figcaption", {}, chart.title);
  const shown = chart.series.filter((m) => lines.some((l) => l.metric === m));
  if (shown.length > 1) {
    shown.forEach((metric) => {
      const k = chart.series.indexOf(metric);
      const sample = svg("svg", { viewBox: "0 0 22 6", "aria-hidden": "true" });
      const line = svg("line", { x1: 0, x2: 22, y1: 3, y2: 3, stroke: "currentColor", "stroke-width": 2 });
      if (DASHES[k % DASHES.length]) line.setAttribute("stroke-dasharray", DASHES[k % DASHES.length]);
      sample.append(line);
      caption.append(el("span", { class: "key" }, sample, metric));
    });
  }
  const fig = el("figure", { class: "chart", "data-chart": chart.id }, caption);
  fig.append(root);
  hover(fig, root, lines, sx, x0, x1, { W, L, R, T, B, H });
  return fig;
}

// A cursor line and the values at the nearest step under the pointer.
function hover(fig, root, lines, sx, x0, x1, box) {
  const tip = el("div", { class: "tooltip", hidden: true });
  const cursor = svg("line", { class: "cursor", y1: box.T, y2: box.H - box.B, visibility: "hidden" });
  root.append(cursor);
  fig.append(tip);
  root.addEventListener("mousemove", (e) => {
    const rect = root.getBoundingClientRect();
    const vx = ((e.clientX - rect.left) / rect.width) * box.W;
    const step = x0 + ((vx - box.L) / (box.W - box.L - box.R)) * (x1 - x0);
    const rows = [];
    for (const l of lines) {
      let best = null;
      for (const p of l.raw) if (best === null || Math.abs(p[0] - step) < Math.abs(best[0] - step)) best = p;
      if (best) rows.push([l, best]);
    }
    if (!rows.length) return;
    const at = rows[0][1][0];
    cursor.setAttribute("x1", sx(at));
    cursor.setAttribute("x2", sx(at));
    cursor.setAttribute("visibility", "visible");
    tip.replaceChildren(
      el("div", {}, `step ${at}`),
      ...rows.map(([l, p]) => {
        const who = selected.length > 1 ? ` (${l.id})` : "";
        const where = p[0] !== at ? ` at step ${p[0]}` : "";
        return el("div", {}, `${l.metric}${who} ${fmt(p[1])}${where}`);
      }),
    );
    tip.hidden = false;
    const x = e.clientX - fig.getBoundingClientRect().left;
    const left = x + 12 + tip.offsetWidth > fig.clientWidth ? x - 12 - tip.offsetWidth : x + 12;
    tip.style.left = `${Math.max(0, left)}px`;
    tip.style.top = "28px";
  });
  root.addEventListener("mouseleave", () => {
    tip.hidden = true;
    cursor.setAttribute("visibility", "hidden");
  });
}

function draw() {
  const sig = JSON.stringify([
    selected,
    selected.map((id) => [(data.get(id) || {}).file, (data.get(id) || { records: [] }).records.length]),
    $("smoothing").value,
    $("logy").checked,
  ]);
  if (sig === drawn) return;
  drawn = sig;
  const charts = $("charts");
  charts.replaceChildren();
  for (const chart of chartsToDraw()) {
    const fig = drawChart(chart);
    if (fig) charts.append(fig);
  }
  const legend = $("legend");
  legend.replaceChildren(
    ...selected.map((id) => {
      const sw = el("span", { class: "line-swatch", "aria-hidden": "true" });
      sw.style.background = colorOf(id);
      return el("span", {}, sw, id);
    }),
  );
  if (!selected.length) charts.append(el("p", { class: "muted" }, "Tick a run to plot it; tick several to overlay them."));
  else if (!charts.children.length) charts.append(el("p", { class: "muted" }, "No metrics logged yet."));
}

function start() {
  keyButton($("key-button"));
  health($("status"));
  $("smoothing").addEventListener("change", draw);
  $("logy").addEventListener("change", draw);
  document.addEventListener("mlxlab:key", () => {
    refreshList();
    pollSelected();
  });
  refreshList();
  setInterval(() => {
    if (!document.hidden && selected.length) pollSelected();
  }, POLL_MS);
  setInterval(() => {
    if (!document.hidden) refreshList();
  }, LIST_MS);
}

start();
