// What the chat page and the dashboard share: building DOM nodes, a small modal prompt, and calls to the server's
// API with its key (asked once when the server answers 401 invalid_api_key, kept in sessionStorage).

const KEY_STORAGE = "basert.apiKey";

/** An element: `attrs` sets properties (class, text, on<event> listeners, dataset, other attributes). */
export function el(tag, attrs = {}, ...children) {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") element.className = value;
    else if (name === "text") element.textContent = value;
    else if (name === "dataset") Object.assign(element.dataset, value);
    else if (name.startsWith("on")) element.addEventListener(name.slice(2), value);
    else element.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined && child !== false) element.append(child);
  }
  return element;
}

/** An error answer of the API: its HTTP status and the error envelope's fields. */
export class ApiError extends Error {
  constructor(status, body, retryAfter = null) {
    const error = body && typeof body === "object" ? body.error : null;
    const message = error && typeof error === "object" ? error.message : (typeof error === "string" ? error : null);
    super(message || `HTTP ${status}`);
    this.status = status;
    this.code = error && typeof error === "object" ? error.code : null;
    this.retryAfter = retryAfter;
  }
}

let pendingKey = null;
let keyDeclined = false;

export function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE);
}

/** Forget the stored key (and a declined prompt): the next refused request asks again. */
export function forgetApiKey() {
  sessionStorage.removeItem(KEY_STORAGE);
  keyDeclined = false;
}

/** Show `button` as "Forget API key" while a key is stored, "Enter API key" after the prompt was cancelled. */
export function showKeyButton(button) {
  button.hidden = !apiKey() && !keyDeclined;
  button.textContent = apiKey() ? "Forget API key" : "Enter API key";
}

/** Ask for the API key (one dialog however many requests were refused at once); null when the user cancels. */
function askApiKey(refused) {
  if (pendingKey === null) {
    pendingKey = askText({
      title: "API key",
      label: refused ? "The server refused the API key. Enter its API key:" : "This server needs an API key:",
      password: true,
    }).then((key) => {
      pendingKey = null;
      if (key) sessionStorage.setItem(KEY_STORAGE, key);
      else keyDeclined = true;
      return key || null;
    });
  }
  return pendingKey;
}

/** fetch() on the server's API with its key; resolves to the Response when it is 2xx, else throws ApiError.
 * A 401 invalid_api_key asks for the key and sends the request again (unless `keyPrompt` is false). */
export async function api(path, init = {}, { keyPrompt = true } = {}) {
  for (;;) {
    const headers = new Headers(init.headers || {});
    const key = apiKey();
    if (key) headers.set("Authorization", `Bearer ${key}`);
    if (init.body !== undefined && !headers.has("Content-Type")) headers.set("Content-Type", "application/json");
    const response = await fetch(path, { ...init, headers });
    if (response.ok) return response;
    const body = await response.json().catch(() => null);
    const error = new ApiError(response.status, body, response.headers.get("Retry-After"));
    if (response.status === 401 && error.code === "invalid_api_key" && keyPrompt && !keyDeclined) {
      if (await askApiKey(Boolean(key)) !== null) continue;
    }
    throw error;
  }
}

/** POST a JSON body; the parsed JSON answer. */
export async function postJson(path, body, init = {}) {
  const response = await api(path, { ...init, method: "POST", body: JSON.stringify(body) });
  return response.json();
}

/** A modal prompt for one line of text; resolves to the text, or null when cancelled. */
export function askText({ title, label, value = "", password = false }) {
  return new Promise((resolve) => {
    const input = el("input", { type: password ? "password" : "text", class: "ask-input", autocomplete: "off" });
    input.value = value;
    const dialog = el("dialog", { class: "ask" },
      el("h2", { text: title }),
      el("label", {}, el("span", { text: label }), input),
      el("div", { class: "ask-buttons" },
        el("button", { type: "button", class: "ask-cancel", text: "Cancel", onclick: () => finish(null) }),
        el("button", { type: "button", class: "ask-ok primary", text: "OK", onclick: () => finish(input.value) })));
    let done = false;
    const finish = (result) => {
      if (done) return;
      done = true;
      dialog.close();
      dialog.remove();
      resolve(result);
    };
    input.addEventListener("keydown", (event) => {
      if (event.key === "Enter") {
        event.preventDefault();
        finish(input.value);
      }
    });
    dialog.addEventListener("cancel", () => finish(null));
    document.body.append(dialog);
    dialog.showModal();
    input.focus();
  });
}

export function formatBytes(n) {
  if (!Number.isFinite(n)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let unit = 0;
  while (n >= 1024 && unit < units.length - 1) {
    n /= 1024;
    unit++;
  }
  return `${n.toFixed(unit === 0 ? 0 : 1)} ${units[unit]}`;
}

export function formatRate(perSecond) {
  return Number.isFinite(perSecond) ? `${perSecond >= 100 ? perSecond.toFixed(0) : perSecond.toFixed(1)} tok/s` : "–";
}

/** Show `message` in the page's error banner (the element with id "banner"). */
export function showBanner(message) {
  const banner = document.getElementById("banner");
  banner.textContent = message;
  banner.hidden = false;
}

export function hideBanner() {
  document.getElementById("banner").hidden = true;
}
