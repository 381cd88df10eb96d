// What both pages share: calls to this server with the key kept in the tab, the key dialog,
// and a DOM helper that only ever sets text (never HTML).

const KEY = "mlxlab.key";

export function getKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function setKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
  document.dispatchEvent(new CustomEvent("mlxlab:key"));
}

// el("div", {class: "x", onclick: f}, "text", child): an element with attributes, listeners
// (on...), properties (a leading "."), and text or element children.
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (name.startsWith(".")) node[name.slice(1)] = value;
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export class ApiError extends Error {
  constructor(message, status, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

let dialog = null;
let pending = null;

function keyDialog() {
  if (dialog) return dialog;
  const input = el("input", {
    id: "key-input",
    type: "password",
    autocomplete: "off",
    spellcheck: "false",
  });
  const reason = el("p", { id: "key-reason", class: "muted" });
  dialog = el(
    "dialog",
    { class: "key", id: "key-dialog", "aria-labelledby": "key-title", "aria-describedby": "key-reason" },
    el(
      "form",
      { method: "dialog" },
      el("h2", { id: "key-title" }, "API key"),
      reason,
      el("label", { for: "key-input" }, "Key (kept in this tab only)"),
      input,
      el(
        "div",
        { class: "buttons" },
        el("button", { type: "submit", value: "cancel", formnovalidate: true }, "Cancel"),
        el("button", { type: "submit", value: "ok", class: "primary", id: "key-ok" }, "Use key"),
      ),
    ),
  );
  document.body.append(dialog);
  return dialog;
}

// Ask for the key (the server said 401, or 403 for the admin key); resolves true when one was
// given. One dialog at a time: concurrent callers share it.
export function askKey(why) {
  if (pending) return pending;
  const d = keyDialog();
  d.querySelector("#key-reason").textContent = why;
  const input = d.querySelector("#key-input");
  input.value = "";
  pending = new Promise((resolve) => {
    d.addEventListener(
      "close",
      () => {
        pending = null;
        const ok = d.returnValue === "ok" && input.value.trim() !== "";
        if (ok) setKey(input.value.trim());
        resolve(ok);
      },
      { once: true },
    );
  });
  d.returnValue = "";
  d.showModal();
  input.focus();
  return pending;
}

async function errorOf(res) {
  let message = `${res.status} ${res.statusText}`;
  let code = null;
  try {
    const body = await res.clone().json();
    const e = body.error || body;
    if (e && e.message) message = e.message;
    if (e && e.code) code = e.code;
  } catch (_) {
    // not JSON: the status line says it
  }
  return new ApiError(message, res.status, code);
}

// fetch() on this server with the key; asks for a key and retries on 401 (any key) and on 403
// admin_key_required (the admin key). Resolves to the Response of the last attempt.
export async function api(path, { method = "GET", body, signal, headers = {} } = {}) {
  for (;;) {
    const h = { ...headers };
    const key = getKey();
    if (key) h.authorization = `Bearer ${key}`;
    if (body !== undefined) h["content-type"] = "application/json";
    const res = await fetch(path, {
      method,
      headers: h,
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
      cache: "no-store",
    });
    if (res.status === 401 || res.status === 403) {
      const err = await errorOf(res);
      const admin = res.status === 403 && err.code === "admin_key_required";
      if (res.status === 401 || admin) {
        const why = admin
          ? "Mounting adapters needs the server's admin key (serve.admin_key)."
          : key
            ? "The server refused this key: " + err.message
            : "This server wants an API key (serve.api_key).";
        if (await askKey(why)) continue;
      }
    }
    return res;
  }
}

export async function apiJSON(path, options) {
  const res = await api(path, options);
  if (!res.ok) throw await errorOf(res);
  return res.json();
}

export function fmt(value, digits = 4) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (typeof value !== "number") return String(value);
  if (value !== 0 && (Math.abs(value) < 1e-3 || Math.abs(value) >= 1e5)) return value.toExponential(2);
  return Number(value.toPrecision(digits)).toString();
}

// The header's key button: shows whether a key is set; click to set, change or forget it.
export function keyButton(button) {
  const show = () => {
    button.textContent = getKey() ? "Key: set" : "Key";
    button.title = getKey() ? "A key is kept in this tab; click to change or forget it" : "Set the API key";
  };
  button.addEventListener("click", async () => {
    if (getKey() && confirm("Forget the key kept in this tab?")) {
      setKey("");
      return;
    }
    await askKey("The key goes with every call this page makes, and stays in this tab only.");
  });
  document.addEventListener("mlxlab:key", show);
  show();
}

export async function health(statusEl) {
  try {
    const res = await fetch("/health", { cache: "no-store" });
    const body = await res.json();
    statusEl.textContent = `${body.model} · ${body.status}`;
    return body;
  } catch (e) {
    statusEl.textContent = "server unreachable";
    return null;
  }
}
