// The chat page: streams answers from POST /v1/chat/completions (server-sent events), one per
// adapter spec, side by side when comparing. The conversation lives in this tab only
// (sessionStorage); the server keeps nothing.
import { api, apiJSON, el, fmt, health, keyButton } from "./common.js";

const $ = (id) => document.getElementById(id);
const STORE = "mlxlab.chat";
const SETTINGS = [
  "adapter-a", "adapter-b", "compare", "system", "temperature", "top_p", "max_tokens", "seed",
  "stop", "thinking", "tools", "tool-choice", "response-format", "schema",
];
const EXAMPLE_TOOLS = [
  {
    type: "function",
    function: {
      name: "get_weather",
      description: "The current weather in a city",
      parameters: {
        type: "object",
        properties: { city: { type: "string" }, unit: { type: "string", enum: ["C", "F"] } },
        required: ["city"],
      },
    },
  },
];

// turns: {role: "user", content} | {role: "assistant", sides: {A: answer, B?: answer}}
//      | {role: "tool", results: [{id, name, content}]}
// answer: {spec, content, reasoning, tool_calls: [{id, name, arguments}], finish, usage,
//          ttft_ms, tok_s, error, json}
let turns = [];
let model = null;
const running = new Map(); // "turn:side" -> AbortController

// --- settings ---------------------------------------------------------------------------------

function value(id) {
  const node = $(id);
  return node.type === "checkbox" ? node.checked : node.value;
}

function saveSettings() {
  const out = {};
  for (const id of SETTINGS) out[id] = value(id);
  sessionStorage.setItem(STORE + ".settings", JSON.stringify(out));
}

function loadSettings() {
  let saved = {};
  try {
    saved = JSON.parse(sessionStorage.getItem(STORE + ".settings") || "{}");
  } catch (_) {
    saved = {};
  }
  for (const id of SETTINGS) {
    if (!(id in saved)) continue;
    const node = $(id);
    if (node.type === "checkbox") node.checked = !!saved[id];
    else node.value = saved[id];
  }
  const wanted = new URLSearchParams(location.search).get("adapter");
  if (wanted) $("adapter-a").value = wanted;
  $("compare-b").hidden = !$("compare").checked;
}

function number(id, integer = false) {
  const raw = $(id).value.trim();
  if (raw === "") return undefined;
  const n = Number(raw);
  if (!Number.isFinite(n) || (integer && !Number.isInteger(n))) {
    throw new Error(`${id} must be ${integer ? "an integer" : "a number"}`);
  }
  return n;
}

// The request fields the settings give (the sampling ones only when set: a blank field leaves
// the server's default, as a client that sends none gets).
function requestFields() {
  const body = {};
  const sampling = {
    temperature: number("temperature"),
    top_p: number("top_p"),
    max_tokens: number("max_tokens", true),
    seed: number("seed", true),
  };
  for (const [k, v] of Object.entries(sampling)) if (v !== undefined) body[k] = v;
  const stops = $("stop").value.split("\n").filter((s) => s !== "");
  if (stops.length > 4) throw new Error("at most 4 stop sequences");
  if (stops.length) body.stop = stops;
  const tools = $("tools").value.trim();
  if (tools) {
    let parsed;
    try {
      parsed = JSON.parse(tools);
    } catch (e) {
      throw new Error("Tools: not JSON (" + e.message + ")");
    }
    if (!Array.isArray(parsed)) throw new Error("Tools: a JSON list of tool definitions");
    if (parsed.length) {
      body.tools = parsed;
      body.tool_choice = $("tool-choice").value;
    }
  }
  const format = $("response-format").value;
  if (format === "json_object") body.response_format = { type: "json_object" };
  if (format === "json_schema") {
    let schema;
    try {
      schema = JSON.parse($("schema").value || "{}");
    } catch (e) {
      throw new Error("JSON schema: not JSON (" + e.message + ")");
    }
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema } };
  }
  if ($("thinking").checked) body.chat_template_kwargs = { enable_thinking: true };
  return body;
}

function specOf(side) {
  const raw = value(side === "B" ? "adapter-b" : "adapter-a").trim();
  return raw || "none";
}

// --- the conversation -------------------------------------------------------------------------

function save() {
  const plain = turns.map((t) =>
    t.role === "assistant"
      ? { ...t, sides: Object.fromEntries(Object.entries(t.sides).map(([k, a]) => [k, { ...a, streaming: false }])) }
      : t,
  );
  try {
    sessionStorage.setItem(STORE, JSON.stringify(plain));
  } catch (_) {
    // over the tab's storage quota: the conversation stays on screen, a reload loses it
    $("notice").textContent = "This conversation is too long to keep across reloads (Download saves it).";
  }
}

function load() {
  try {
    turns = JSON.parse(sessionStorage.getItem(STORE) || "[]");
  } catch (_) {
    turns = [];
  }
}

// The messages side `side` has seen before turn `upto`: its own answers (the first side's where
// it has none), and the tool results given.
function messagesFor(side, upto) {
  const out = [];
  const system = $("system").value.trim();
  if (system) out.push({ role: "system", content: system });
  for (const t of turns.slice(0, upto)) {
    if (t.role === "user") out.push({ role: "user", content: t.content });
    else if (t.role === "tool") {
      for (const r of t.results) out.push({ role: "tool", tool_call_id: r.id, content: r.content });
    } else {
      const a = t.sides[side] || t.sides.A;
      if (!a || (a.error && !a.content && !a.tool_calls.length)) continue;
      const msg = { role: "assistant", content: a.content };
      if (a.tool_calls.length) {
        msg.tool_calls = a.tool_calls.map((c) => ({
          id: c.id,
          type: "function",
          function: { name: c.name, arguments: c.arguments },
        }));
        if (!a.content) msg.content = null;
      }
      out.push(msg);
    }
  }
  return out;
}

function newAnswer(spec) {
  return {
    spec, content: "", reasoning: "", tool_calls: [], finish: null, usage: null,
    ttft_ms: null, tok_s: null, error: null, streaming: true, json: false,
  };
}

// --- streaming --------------------------------------------------------------------------------

// Server-sent events from a fetch body: yields each `data:` payload.
async function* events(res, signal) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value: chunk, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(chunk, { stream: true });
      let cut;
      while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
        const data = block
          .split(/\r?\n/)
          .filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, ""))
          .join("\n");
        if (data) yield data;
      }
      if (signal.aborted) break;
    }
  } finally {
    reader.releaseLock();
  }
}

async function generate(index, side) {
  const turn = turns[index];
  const answer = newAnswer(specOf(side));
  turn.sides[side] = answer;
  const key = `${index}:${side}`;
  const controller = new AbortController();
  running.set(key, controller);
  updateBusy();
  renderAnswer(index, side);
  let body;
  try {
    body = {
      model: model || undefined,
      messages: messagesFor(side, index),
      stream: true,
      stream_options: { include_usage: true },
      adapter: answer.spec,
      ...requestFields(),
    };
  } catch (e) {
    answer.error = e.message;
    return finish(index, side, key);
  }
  answer.json = !!body.response_format;
  const t0 = performance.now();
  let first = null;
  let last = null;
  try {
    const res = await api("/v1/chat/completions", { method: "POST", body, signal: controller.signal });
    if (!res.ok) {
      let message = `${res.status} ${res.statusText}`;
      try {
        const err = await res.json();
        message = (err.error && err.error.message) || message;
      } catch (_) {
        // keep the status line
      }
      answer.error = message;
      return finish(index, side, key);
    }
    for await (const data of events(res, controller.signal)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) {
        answer.error = chunk.error.message || "error";
        continue;
      }
      if (chunk.usage) answer.usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      const text = (delta.content || "") + (delta.reasoning_content || "");
      if (text) {
        const now = performance.now();
        if (first === null) {
          first = now;
          answer.ttft_ms = Math.round(now - t0);
        }
        last = now;
      }
      if (delta.content) answer.content += delta.content;
      if (delta.reasoning_content) answer.reasoning += delta.reasoning_content;
      for (const call of delta.tool_calls || []) {
        const i = call.index ?? answer.tool_calls.length;
        const slot = (answer.tool_calls[i] ||= { id: "", name: "", arguments: "" });
        if (call.id) slot.id = call.id;
        if (call.function && call.function.name) slot.name += call.function.name;
        if (call.function && call.function.arguments) slot.arguments += call.function.arguments;
        if (first === null) {
          first = performance.now();
          answer.ttft_ms = Math.round(first - t0);
        }
        last = performance.now();
      }
      if (choice.finish_reason) answer.finish = choice.finish_reason;
      renderAnswer(index, side);
    }
  } catch (e) {
    if (e.name === "AbortError") answer.finish = answer.finish || "stopped";
    else answer.error = String(e.message || e);
  }
  const n = answer.usage ? answer.usage.completion_tokens : null;
  if (n && first !== null) {
    // decode speed: tokens after the first over the time they took (TTFT apart)
    const span = (last - first) / 1000;
    answer.tok_s = n > 1 && span > 0 ? (n - 1) / span : n / ((performance.now() - t0) / 1000);
  }
  return finish(index, side, key);
}

function finish(index, side, key) {
  const answer = turns[index] && turns[index].sides[side];
  if (answer) answer.streaming = false;
  running.delete(key);
  updateBusy();
  save();
  render();
}

function updateBusy() {
  const busy = running.size > 0;
  $("stop-button").disabled = !busy;
  $("send").disabled = busy;
  for (const b of document.querySelectorAll(".answer .regenerate")) b.disabled = busy;
  for (const b of document.querySelectorAll(".tool-results button")) b.disabled = busy;
}

function sides() {
  return $("compare").checked ? ["A", "B"] : ["A"];
}

async function send(event) {
  event && event.preventDefault();
  if (running.size) return;
  $("notice").textContent = "";
  const text = $("prompt").value;
  if (!text.trim()) return;
  try {
    requestFields(); // a bad setting is said before anything is sent
  } catch (e) {
    $("notice").textContent = e.message;
    return;
  }
  $("prompt").value = "";
  turns.push({ role: "user", content: text });
  turns.push({ role: "assistant", sides: {} });
  const index = turns.length - 1;
  save();
  render();
  await Promise.all(sides().map((s) => generate(index, s)));
}

async function regenerate(index, side) {
  if (running.size) return;
  await generate(index, side);
}

async function sendToolResults(index, form) {
  if (running.size) return;
  const answer = turns[index].sides.A;
  const results = answer.tool_calls.map((c, i) => ({
    id: c.id,
    name: c.name,
    content: form.querySelector(`[data-call="${i}"]`).value,
  }));
  turns.push({ role: "tool", results });
  turns.push({ role: "assistant", sides: {} });
  save();
  render();
  await generate(turns.length - 1, "A");
}

// --- rendering --------------------------------------------------------------------------------

function pretty(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch (_) {
    return text;
  }
}

async function copy(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch (_) {
    // not a secure context (a remote http host): the selection way
    const area = el("textarea", { "aria-hidden": "true", class: "visually-hidden" });
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  const was = button.textContent;
  button.textContent = "Copied";
  setTimeout(() => (button.textContent = was), 1200);
}

function statsOf(a) {
  const items = [];
  if (a.usage) {
    items.push(`${a.usage.completion_tokens} tokens`);
    if (a.tok_s !== null) items.push(`${a.tok_s.toFixed(1)} tok/s`);
    const cached = (a.usage.prompt_tokens_details || {}).cached_tokens || 0;
    items.push(`prompt ${a.usage.prompt_tokens} (cached ${cached})`);
  }
  if (a.ttft_ms !== null) items.push(`first token ${a.ttft_ms} ms`);
  if (a.finish) items.push(`finish: ${a.finish}`);
  return items.map((t) => el("span", {}, t));
}

function answerNode(index, side, a, last) {
  const compare = Object.keys(turns[index].sides).length > 1;
  const label = `Answer${compare ? " " + side : ""}, adapter ${a.spec}`;
  const node = el("article", {
    class: "answer" + (a.streaming ? " streaming" : ""),
    "data-side": side,
    "data-turn": index,
    "aria-label": label,
    "aria-busy": a.streaming ? "true" : "false",
  });
  node.append(el("h3", {}, compare ? `${side} · ` : "", el("span", { class: "spec" }, `adapter: ${a.spec}`)));
  if (a.reasoning) {
    node.append(
      el(
        "details",
        { class: "reasoning", open: a.streaming && !a.content ? true : undefined },
        el("summary", {}, "Reasoning"),
        el("div", { class: "text" }, a.reasoning),
      ),
    );
  }
  const content = el("div", { class: "content" + (a.json && !a.streaming ? " json" : "") });
  content.textContent = a.json && !a.streaming ? pretty(a.content) : a.content;
  node.append(content);
  if (a.tool_calls.length) {
    const calls = el("div", { class: "tool-calls" });
    for (const c of a.tool_calls) {
      calls.append(
        el(
          "div",
          { class: "tool-call", role: "group", "aria-label": `Tool call ${c.name}` },
          el("span", { class: "muted" }, "tool call "),
          el("span", { class: "tool-name" }, c.name || "…"),
          el("pre", { class: "tool-args" }, pretty(c.arguments || "")),
        ),
      );
    }
    node.append(calls);
  }
  if (a.error) node.append(el("p", { class: "error", role: "alert" }, a.error));
  if (!a.streaming) {
    node.append(el("div", { class: "stats" }, statsOf(a)));
    const actions = el("div", { class: "actions" });
    const copyButton = el("button", { type: "button", class: "copy" }, "Copy");
    copyButton.addEventListener("click", () =>
      copy(a.content || a.tool_calls.map((c) => `${c.name}(${c.arguments})`).join("\n"), copyButton),
    );
    actions.append(copyButton);
    if (last) {
      actions.append(
        el(
          "button",
          {
            type: "button",
            class: "regenerate",
            title: "Answer again with the current settings (and this side's adapter field)",
            onclick: () => regenerate(index, side),
            disabled: running.size > 0,
          },
          "Regenerate",
        ),
      );
    }
    node.append(actions);
    if (last && !compare && a.tool_calls.length && a.finish === "tool_calls") {
      node.append(toolResultsForm(index, a));
    }
  }
  return node;
}

function toolResultsForm(index, a) {
  const form = el("form", { class: "tool-results", "aria-label": "Tool results" });
  a.tool_calls.forEach((c, i) => {
    const id = `tool-result-${index}-${i}`;
    form.append(el("label", { for: id }, `Result of ${c.name}`));
    form.append(el("textarea", { id, rows: 2, "data-call": i, spellcheck: "false" }));
  });
  form.append(el("button", { type: "submit", disabled: running.size > 0 }, "Send tool results"));
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    sendToolResults(index, form);
  });
  return form;
}

function lastAssistant() {
  for (let i = turns.length - 1; i >= 0; i--) if (turns[i].role === "assistant") return i;
  return -1;
}

function turnNode(index) {
  const t = turns[index];
  if (t.role === "user") {
    return el("article", { class: "turn user", "aria-label": "You" }, el("h3", {}, "You"), el("div", { class: "text" }, t.content));
  }
  if (t.role === "tool") {
    return el(
      "article",
      { class: "turn tool", "aria-label": "Tool results" },
      el("h3", {}, "Tool results"),
      ...t.results.map((r) => el("div", { class: "text" }, `${r.name}: ${r.content}`)),
    );
  }
  const ids = Object.keys(t.sides).sort();
  const box = el("div", { class: "turn answers" + (ids.length > 1 ? " compare" : ""), "data-turn": index });
  const last = index === lastAssistant();
  for (const side of ids) box.append(answerNode(index, side, t.sides[side], last));
  return box;
}

// The log, rebuilt only where a turn changed (what it shows, whether it is the last answer), so
// the nodes of earlier turns stay put: focus, selection and what a screen reader has read.
function render() {
  const log = $("log");
  if (!turns.length) {
    log.replaceChildren(
      el(
        "p",
        { class: "empty" },
        "Ask something. Pick an adapter (or stacked ones, a+b) on the left; tick Compare to see " +
          "two adapter specs answer the same conversation side by side. The conversation stays in " +
          "this browser tab.",
      ),
    );
    return;
  }
  const old = [...log.children].filter((n) => n.dataset.sig !== undefined);
  if (old.length !== log.children.length) log.replaceChildren(...old);
  const last = lastAssistant();
  turns.forEach((t, i) => {
    const sig = JSON.stringify([t, i === last]);
    if (old[i] && old[i].dataset.sig === sig) return;
    const node = turnNode(i);
    node.dataset.sig = sig;
    if (old[i]) old[i].replaceWith(node);
    else log.append(node);
  });
  for (const extra of old.slice(turns.length)) extra.remove();
  updateBusy();
  log.scrollTop = log.scrollHeight;
}

// One answer re-rendered while it streams (the rest of the log stays as it is).
function renderAnswer(index, side) {
  const box = document.querySelector(`.answers[data-turn="${index}"]`);
  if (!box || box.children.length !== Object.keys(turns[index].sides).length) return render();
  const old = box.querySelector(`.answer[data-side="${side}"]`);
  if (!old) return render();
  const a = turns[index].sides[side];
  if (a.streaming && old.classList.contains("streaming")) {
    // the text grows in place, token by token
    old.querySelector(".content").textContent = a.content;
    const r = old.querySelector("details.reasoning .text");
    if (a.reasoning && !r) return old.replaceWith(answerNode(index, side, a, index === lastAssistant()));
    if (r) r.textContent = a.reasoning;
    const calls = old.querySelector(".tool-calls");
    if (a.tool_calls.length || calls) old.replaceWith(answerNode(index, side, a, index === lastAssistant()));
  } else {
    old.replaceWith(answerNode(index, side, a, index === lastAssistant()));
  }
  const log = $("log");
  log.scrollTop = log.scrollHeight;
}

// --- adapters and model -----------------------------------------------------------------------

async function refreshAdapters() {
  const list = $("adapter-options");
  try {
    const models = await apiJSON("/v1/models");
    const select = $("model");
    const ids = models.data.map((m) => m.id);
    if (select.options.length !== ids.length || [...select.options].some((o, i) => o.value !== ids[i])) {
      select.replaceChildren(...models.data.map((m) => el("option", { value: m.id }, m.id)));
      // ?model=NAME (the runs page's link to an adapter it mounted on that model): once
      const wanted = new URLSearchParams(location.search).get("model");
      if (wanted && ids.includes(wanted) && !refreshAdapters.picked) select.value = wanted;
      refreshAdapters.picked = true;
    }
    model = select.value || ids[0] || null;
    // each model has its own adapters: the selected one's
    const adapters = await apiJSON("/v1/adapters" + (model ? "?model=" + encodeURIComponent(model) : ""));
    const mounted = adapters.adapters.map((a) => a.id);
    const options = ["none", ...mounted];
    for (let i = 0; i < Math.min(mounted.length, 4); i++) {
      for (let j = i + 1; j < Math.min(mounted.length, 4); j++) options.push(`${mounted[i]}+${mounted[j]}`);
    }
    list.replaceChildren(...options.map((o) => el("option", { value: o })));
    $("adapter-help").textContent = mounted.length
      ? `Mounted: ${mounted.join(", ")}. Stack with a+b; none is the base model.`
      : "No adapter is mounted (serve adapters.NAME=DIR, or mount one from the Runs page).";
    $("adapter-help").dataset.mounted = mounted.join(",");
  } catch (e) {
    $("adapter-help").textContent = "Could not list the adapters: " + e.message;
  }
}

function download() {
  const blob = new Blob([JSON.stringify({ model, system: $("system").value, turns }, null, 2)], {
    type: "application/json",
  });
  const a = el("a", { href: URL.createObjectURL(blob), download: "mlxlab-chat.json" });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

function start() {
  keyButton($("key-button"));
  loadSettings();
  load();
  render();
  for (const id of SETTINGS) $(id).addEventListener("change", saveSettings);
  $("compare").addEventListener("change", () => ($("compare-b").hidden = !$("compare").checked));
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) send(e);
  });
  $("stop-button").addEventListener("click", () => {
    for (const c of running.values()) c.abort();
  });
  $("new-chat").addEventListener("click", () => {
    for (const c of running.values()) c.abort();
    turns = [];
    save();
    render();
  });
  $("download").addEventListener("click", download);
  $("tools-example").addEventListener("click", () => {
    $("tools").value = JSON.stringify(EXAMPLE_TOOLS, null, 2);
    saveSettings();
  });
  $("model").addEventListener("change", () => {
    model = $("model").value;
    refreshAdapters();
  });
  document.addEventListener("mlxlab:key", refreshAdapters);
  health($("status"));
  refreshAdapters();
  setInterval(refreshAdapters, 15000);
  setInterval(() => health($("status")), 15000);
}

start();
