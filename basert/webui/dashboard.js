// The server dashboard: polls GET /v1/models, GET /metrics (Prometheus text) and GET /slots every second, draws
// the last minutes on <canvas> charts, and offers the slot and model admin actions to clients allowed to use them.

import {
  ApiError, api, askText, el, forgetApiKey, formatBytes, formatRate, hideBanner, postJson, showBanner, showKeyButton,
} from "./common.js";

const POLL_MS = 1000;
const HIDDEN_POLL_MS = 5000;
const CHART_SECONDS = 300;   // what the charts show
const PREFILL_SECONDS = 10;  // the prefill average
const HIT_SECONDS = 30;      // the hit-rate chart's window
const REFUSED = new Set(["503", "429"]);

const $ = (id) => document.getElementById(id);

const history = [];          // one sample per poll: {t, prompt, cached, refusals, waiting, decode}
let previousSlots = new Map();
let admin = null;            // whether this client may use the slot and model admin routes (null: not known yet)
const snapshots = new Map(); // "model/slot" -> the last snapshot saved from this page (file id or file name)
let queue = Promise.resolve(); // the polls and the unloads, one at a time

// --- Prometheus text ------------------------------------------------------------------------------------------

/** The samples of a Prometheus text exposition: [{name, labels, value}]. */
export function parsePrometheus(textBody) {
  const samples = [];
  for (const line of textBody.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?[ \t]+(\S+)/.exec(line);
    if (!m) continue;
    const labels = {};
    for (const label of (m[2] || "").matchAll(/([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"/g)) {
      labels[label[1]] = label[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    }
    const special = { "+Inf": Infinity, "-Inf": -Infinity, NaN: NaN };
    samples.push({ name: m[1], labels, value: m[3] in special ? special[m[3]] : Number(m[3]) });
  }
  return samples;
}

function total(samples, name, keep = () => true) {
  return samples.filter((s) => s.name === name && keep(s.labels)).reduce((sum, s) => sum + s.value, 0);
}

function perModel(samples, name) {
  const values = new Map();
  for (const s of samples) if (s.name === name && s.labels.model !== undefined) values.set(s.labels.model, s.value);
  return values;
}

// --- charts ---------------------------------------------------------------------------------------------------

class Chart {
  constructor(canvas, format, fixedMax = null) {
    this.canvas = canvas;
    this.format = format;
    this.fixedMax = fixedMax;
  }

  /** Draw `points` ([{t, v}], v null for a gap) over the last CHART_SECONDS ending at `now`. */
  draw(points, now) {
    const { canvas } = this;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    if (!width || !height) return;
    if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(height * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const style = getComputedStyle(document.body);
    const values = points.filter((p) => p.v !== null && Number.isFinite(p.v)).map((p) => p.v);
    const top = this.fixedMax ?? Math.max(...values, 0);
    const max = top > 0 ? top : 1;
    const y = (v) => height - 4 - (v / max) * (height - 18);
    const x = (t) => ((t - (now - CHART_SECONDS)) / CHART_SECONDS) * width;
    ctx.strokeStyle = style.getPropertyValue("--grid").trim() || "#8884";
    ctx.lineWidth = 1;
    ctx.beginPath();
    ctx.moveTo(0, y(0) + 0.5);
    ctx.lineTo(width, y(0) + 0.5);
    ctx.moveTo(0, y(max) + 0.5);
    ctx.lineTo(width, y(max) + 0.5);
    ctx.stroke();
    ctx.strokeStyle = style.getPropertyValue("--accent").trim() || "#2563eb";
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let drawing = false;
    for (const p of points) {
      if (p.v === null || !Number.isFinite(p.v)) {
        drawing = false;
        continue;
      }
      if (drawing) ctx.lineTo(x(p.t), y(p.v));
      else ctx.moveTo(x(p.t), y(p.v));
      drawing = true;
    }
    ctx.stroke();
    ctx.fillStyle = style.getPropertyValue("--muted").trim() || "#888";
    ctx.font = "10px system-ui, sans-serif";
    ctx.fillText(this.format(top), 2, 10);
    ctx.textAlign = "right";
    ctx.fillText(`${CHART_SECONDS / 60} min`, width - 2, 10);
    ctx.textAlign = "left";
  }
}

const percent = (v) => `${(100 * v).toFixed(v > 0 && v < 0.1 ? 1 : 0)}%`;
const charts = {
  queue: new Chart($("chart-queue"), (v) => `${v}`),
  hit: new Chart($("chart-hit"), percent, 1),
  prefill: new Chart($("chart-prefill"), formatRate),
  decode: new Chart($("chart-decode"), formatRate),
};

/** The sample at least `seconds` before the last one (the oldest one when the history is shorter). */
function sampleBefore(seconds) {
  const last = history.at(-1);
  for (let i = history.length - 2; i >= 0; i--) if (last.t - history[i].t >= seconds) return history[i];
  return history.length > 1 ? history[0] : null;
}

function windowRates(sample, seconds, i) {
  let before = null;
  for (let j = i - 1; j >= 0; j--) {
    before = history[j];
    if (sample.t - history[j].t >= seconds) break;
  }
  if (!before) return { prefill: null, hit: null };
  const prompt = sample.prompt - before.prompt;
  const cached = sample.cached - before.cached;
  return {
    prefill: Math.max(0, prompt - cached) / (sample.t - before.t),
    hit: prompt > 0 ? Math.min(1, cached / prompt) : null,
  };
}

// --- polling --------------------------------------------------------------------------------------------------

async function poll() {
  const [listed, metrics] = await Promise.allSettled([
    api("/v1/models").then((r) => r.json()),
    api("/metrics").then((r) => r.text()),
  ]);
  showKeyButton($("key-button"));
  const failure = [listed, metrics].find((r) => r.status === "rejected");
  if (failure && failure.reason instanceof ApiError && failure.reason.status === 429) throw failure.reason;
  if (listed.status === "rejected") {
    showBanner(`Could not list the models: ${listed.reason.message}`);
    return;
  }
  const models = Array.isArray(listed.value.data) ? listed.value.data : [];
  const loaded = models.filter((m) => (m.status?.value ?? "loaded") === "loaded");
  // GET /slots lists one model's slots; only loaded ones are asked (asking loads a model on demand).
  const slotLists = await Promise.allSettled(loaded.map((m) =>
    api(`/slots?model=${encodeURIComponent(m.id)}`, {}, { keyPrompt: false }).then((r) => r.json())));
  const now = performance.now() / 1000;
  if (metrics.status === "rejected") showBanner(`Metrics: ${metrics.reason.message}`);
  else hideBanner();
  const samples = metrics.status === "fulfilled" ? parsePrometheus(metrics.value) : [];
  const slotNote = slotLists.map((r) => r.status === "rejected" ? r.reason : null).find(Boolean);
  if (slotNote?.status === 401) admin = false;
  else if (slotLists.length) admin = true;
  $("slots-note").hidden = !slotNote;
  $("slots-note").textContent = slotNote?.status === 401
    ? `Slots and admin actions are not available to this client: ${slotNote.message}`
    : slotNote ? `Slots: ${slotNote.message}` : "";

  const slotsByModel = new Map();
  loaded.forEach((m, i) => {
    if (slotLists[i].status === "fulfilled" && Array.isArray(slotLists[i].value)) slotsByModel.set(m.id, slotLists[i].value);
  });
  const decoded = decodedSince(slotsByModel);
  const last = history.at(-1);
  const sample = {
    t: now,
    prompt: total(samples, "basert_prompt_tokens_total"),
    cached: total(samples, "basert_cached_prompt_tokens_total"),
    refusals: total(samples, "basert_requests_total", (l) => REFUSED.has(l.status)),
    waiting: total(samples, "basert_waiting_requests"),
    decode: last && decoded !== null ? decoded / (now - last.t) : null,
  };
  if (last && (sample.prompt < last.prompt || sample.refusals < last.refusals)) history.length = 0;  // restarted
  history.push(sample);
  while (history.length && history[0].t < now - CHART_SECONDS - 60) history.shift();
  showSummary(samples, sample);
  showModels(models, samples, slotsByModel);
  showSlots(loaded, slotsByModel);
  $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
}

/** Tokens added since the last poll to slots that ran the same request then and now (decoding). */
function decodedSince(slotsByModel) {
  let decoded = 0;
  const seen = new Map();
  for (const [model, slots] of slotsByModel) {
    for (const slot of slots) {
      const key = `${model}/${slotName(slot)}`;
      const before = previousSlots.get(key);
      if (before && before.is_processing && slot.is_processing && before.request_id === slot.request_id) {
        decoded += Math.max(0, slot.cache_tokens - before.cache_tokens);
      }
      seen.set(key, slot);
    }
  }
  const first = previousSlots.size === 0 && history.length === 0;
  previousSlots = seen;
  return first ? null : decoded;
}

function showSummary(samples, sample) {
  $("queue").textContent = `${sample.waiting}`;
  const hitRate = sample.prompt > 0 ? sample.cached / sample.prompt : null;
  $("hit-rate").textContent = hitRate === null ? "–" : percent(hitRate);
  const hitTokens = total(samples, "basert_prefix_cache_hit_tokens");
  const blocks = total(samples, "basert_prefix_cache_blocks_cached");
  $("hit-rate-detail").textContent = `${sample.cached} of ${sample.prompt} prompt tokens since the server started; ` +
    `prefix cache: ${hitTokens} hit tokens, ${blocks} blocks cached`;
  const i = history.length - 1;
  const prefill = windowRates(sample, PREFILL_SECONDS, i).prefill;
  $("prefill-rate").textContent = formatRate(prefill ?? NaN);
  $("decode-rate").textContent = formatRate(sample.decode ?? NaN);
  const minuteAgo = sampleBefore(60);
  $("refusals").textContent = `${sample.refusals}`;
  $("refusals-detail").textContent = `503 and 429 answers since the server started` +
    (minuteAgo ? `; ${sample.refusals - minuteAgo.refusals} in the last minute` : "");
  const points = (pick) => history.map((s, j) => ({ t: s.t, v: pick(s, j) }));
  charts.queue.draw(points((s) => s.waiting), sample.t);
  charts.hit.draw(points((s, j) => windowRates(s, HIT_SECONDS, j).hit), sample.t);
  charts.prefill.draw(points((s, j) => windowRates(s, PREFILL_SECONDS, j).prefill), sample.t);
  charts.decode.draw(points((s) => s.decode), sample.t);
}

// --- tables ---------------------------------------------------------------------------------------------------

/** Keep `tbody`'s rows in step with `items` by key: new rows made once (their buttons stay), cells updated. */
function syncRows(tbody, items, keyOf, make, update) {
  const rows = new Map([...tbody.rows].map((row) => [row.dataset.key, row]));
  const wanted = items.map((item) => {
    const key = keyOf(item);
    const row = rows.get(key) || make(item, key);
    row.dataset.key = key;
    update(row, item);
    return row;
  });
  replaceIfChanged(tbody, wanted);
}

/** Set `parent`'s children unless they are these already (moving a node would drop a selection or a click). */
function replaceIfChanged(parent, children) {
  const same = parent.children.length === children.length && children.every((child, i) => parent.children[i] === child);
  if (!same) parent.replaceChildren(...children);
}

function setCell(row, index, ...content) {
  const cell = row.cells[index];
  const textOnly = content.length === 1 && typeof content[0] === "string";
  if (textOnly && cell.textContent === content[0] && !cell.firstElementChild) return;
  cell.replaceChildren(...content);
}

function usage(used, size) {
  if (!Number.isFinite(used) || !Number.isFinite(size) || size <= 0) return "–";
  return el("span", { class: "usage" }, el("meter", { min: 0, max: size, value: used }), ` ${used} / ${size}`);
}

function showModels(models, samples, slotsByModel) {
  const busy = perModel(samples, "basert_busy_slots");
  const waiting = perModel(samples, "basert_waiting_requests");
  const used = perModel(samples, "basert_kv_blocks_used");
  const size = perModel(samples, "basert_kv_blocks_total");
  const memory = perModel(samples, "basert_model_memory_bytes");
  syncRows($("models").tBodies[0], models, (m) => m.id,
    (m) => el("tr", { class: "model" }, el("td"), el("td"), el("td"), el("td"), el("td"), el("td"),
      el("td", {}, el("button", { type: "button", class: "unload", text: "Unload", onclick: () => unload(m.id) }))),
    (row, m) => {
      const state = m.status?.value ?? "loaded";
      const slots = slotsByModel.get(m.id);
      row.dataset.state = state;
      setCell(row, 0, el("span", { class: "model-id", text: m.id }),
        (m.aliases || []).length ? el("div", { class: "muted", text: m.aliases.join(", ") }) : "");
      setCell(row, 1, state);
      setCell(row, 2, memory.has(m.id) ? formatBytes(memory.get(m.id)) : "–");
      const slotCount = slots ? slots.length : m.meta?.slots;
      setCell(row, 3, busy.has(m.id) ? `${busy.get(m.id)}${slotCount ? ` / ${slotCount}` : ""}` : "–");
      setCell(row, 4, waiting.has(m.id) ? `${waiting.get(m.id)}` : "–");
      setCell(row, 5, usage(used.get(m.id), size.get(m.id)));
      for (const button of row.cells[6].children) button.hidden = !(admin && state === "loaded");
    });
}

function showSlots(loaded, slotsByModel) {
  const container = $("slots");
  const sections = new Map([...container.children].map((section) => [section.dataset.model, section]));
  const wanted = loaded.filter((m) => slotsByModel.has(m.id)).map((m) => {
    const section = sections.get(m.id) || el("div", { class: "slot-model", dataset: { model: m.id } },
      el("h3", { text: m.id }),
      el("div", { class: "table-wrap" }, el("table", { class: "slots" },
        el("thead", {}, el("tr", {}, ...["Slot", "State", "Context", "Request", ""].map((h) => el("th", { text: h })))),
        el("tbody"))));
    syncRows(section.querySelector("tbody"), slotsByModel.get(m.id), slotName,
      (s) => el("tr", { class: "slot" }, el("td", { text: slotName(s) }), el("td"), el("td"), el("td"),
        el("td", { class: "slot-actions" },
          el("button", { type: "button", class: "save", text: "Save", onclick: () => slotAction(m.id, s, "save") }),
          el("button", { type: "button", class: "restore", text: "Restore",
            onclick: () => slotAction(m.id, s, "restore") }),
          el("button", { type: "button", class: "erase", text: "Erase",
            onclick: () => slotAction(m.id, s, "erase") }))),
      (row, s) => {
        row.className = s.is_processing ? "slot busy" : "slot idle";
        setCell(row, 1, s.is_processing ? "busy" : "idle");
        setCell(row, 2, usage(s.cache_tokens, s.n_ctx));
        setCell(row, 3, s.request_id || "");
        for (const button of row.cells[4].children) button.hidden = !admin;
      });
    return section;
  });
  replaceIfChanged(container, wanted);
}

// --- admin actions --------------------------------------------------------------------------------------------

function notify(message, failed = false) {
  const notice = $("notice");
  notice.textContent = message;
  notice.className = failed ? "error" : "ok";
  notice.hidden = false;
}

function fileName(model, listed) {
  return `slot-${model}-${slotName(listed)}.bin`.replace(/[^\w.-]+/g, "_");
}

/** A slot's name: its id, after its replica's number behind `basert cluster` (which lists every replica's). */
function slotName(slot) {
  return slot.replica === undefined ? `${slot.id}` : `${slot.replica}/${slot.id}`;
}

async function slotAction(model, listed, action) {
  const slot = listed.id;
  const replica = listed.replica === undefined ? "" : `&replica=${encodeURIComponent(listed.replica)}`;
  const query = `model=${encodeURIComponent(model)}${replica}`;
  const key = `${model}/${slotName(listed)}`;
  const what = `slot ${slotName(listed)} of ${model}`;
  try {
    if (action === "erase") {
      const result = await postJson(`/slots/${slot}/erase?${query}`, {});
      notify(`Erased ${what}: ${result.n_erased} tokens`);
    } else if (action === "save") {
      notify(`Saving ${what} (a busy slot is saved when its request ends)…`);
      let result;
      try {
        result = await postJson(`/slots/${slot}/save?${query}`, {});
        snapshots.set(key, result.file_id);
      } catch (error) {
        if (!(error instanceof ApiError) || error.status !== 501) throw error;
        // No --files-dir: llama.cpp's style, by file name under --slot-save-path (a 501 too without it).
        const filename = fileName(model, listed);
        try {
          result = await postJson(`/slots/${slot}?action=save&${query}`, { filename });
        } catch (second) {
          if (second instanceof ApiError && second.status === 501) throw new Error(`${error.message}; ${second.message}`);
          throw second;
        }
        snapshots.set(key, filename);
      }
      notify(`Saved ${what}: ${result.n_saved} tokens as ${snapshots.get(key)}`);
    } else {
      const snapshot = await askText({
        title: `Restore ${what}`,
        label: "A snapshot: its file id (file-…, saved with --files-dir) or file name (under --slot-save-path)",
        value: snapshots.get(key) || "",
      });
      if (!snapshot) return;
      const result = snapshot.startsWith("file-")
        ? await postJson(`/slots/${slot}/restore?${query}`, { file_id: snapshot })
        : await postJson(`/slots/${slot}?action=restore&${query}`, { filename: snapshot });
      notify(`Restored ${what}: ${result.n_restored} tokens from ${snapshot}`);
    }
  } catch (error) {
    notify(`Could not ${action} ${what}: ${error.message}`, true);
  }
}

async function unload(model) {
  try {
    // Between polls: a poll's own request holds the model for a moment, and an unload then is refused (409).
    const result = await exclusive(() => postJson("/models/unload", { model }));
    notify(result.unloaded ? `Unloaded ${model}` : `${model} was not loaded`);
  } catch (error) {
    notify(`Could not unload ${model}: ${error.message}`, true);
  }
}

// --- start ----------------------------------------------------------------------------------------------------

/** Run `task` after every task run through here before it has ended. */
function exclusive(task) {
  const run = queue.then(task, task);
  queue = run.catch(() => {});
  return run;
}

async function loop() {
  let delay = document.hidden ? HIDDEN_POLL_MS : POLL_MS;
  try {
    await exclusive(poll);
  } catch (error) {
    showBanner(error.message);
    if (error instanceof ApiError && error.status === 429) delay = Math.max(delay, 1000 * (Number(error.retryAfter) || 5));
  }
  setTimeout(loop, delay);
}

$("key-button").addEventListener("click", forgetApiKey);
loop();
