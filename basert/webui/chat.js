// The chat page: conversations kept in localStorage, replies streamed from POST /v1/chat/completions.

import { api, el, forgetApiKey, formatRate, hideBanner, showBanner, showKeyButton } from "./common.js";
import { renderMarkdown } from "./markdown.js";

const CONVERSATIONS_KEY = "basert.chat.conversations";
const SETTINGS_KEY = "basert.chat.settings";
const EXPORT_FORMAT = "basert.chat";
const ROLES = new Set(["system", "user", "assistant", "tool"]);
const MAX_TOOL_CALLS = 64;
const SETTING_FIELDS = ["system", "temperature", "top-p", "max-tokens", "seed", "think", "tools", "tool-choice"];

const $ = (id) => document.getElementById(id);

const state = {
  conversations: [],
  currentId: null,
  models: [],
  generation: null,     // {conversation, message, controller} while a reply streams
  liveView: null,       // the streaming message's element, when its conversation is shown
  renderQueued: false,
};

// --- storage --------------------------------------------------------------------------------------------------

function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 10);
}

function loadConversations() {
  try {
    const stored = JSON.parse(localStorage.getItem(CONVERSATIONS_KEY) || "[]");
    return Array.isArray(stored) ? stored.map(normalizeConversation).filter(Boolean) : [];
  } catch {
    return [];
  }
}

function saveConversations() {
  try {
    localStorage.setItem(CONVERSATIONS_KEY, JSON.stringify(state.conversations));
  } catch (error) {
    showBanner(`The conversations could not be saved in this browser: ${error.message}`);
  }
}

function text(value) {
  if (typeof value === "string") return value;
  if (Array.isArray(value)) {
    // OpenAI content parts: the text parts joined.
    return value.map((part) => (part && typeof part.text === "string" ? part.text : "")).join("");
  }
  return value === undefined || value === null ? "" : String(value);
}

function finite(value) {
  return typeof value === "number" && Number.isFinite(value) ? value : undefined;
}

/** A message as the page keeps it, from what storage or an imported file holds (OpenAI's shape accepted). */
function normalizeMessage(raw) {
  if (!raw || typeof raw !== "object" || !ROLES.has(raw.role)) return null;
  const message = { role: raw.role, content: text(raw.content) };
  const reasoning = text(raw.reasoning ?? raw.reasoning_content);
  if (reasoning) message.reasoning = reasoning;
  if (Array.isArray(raw.tool_calls) && raw.tool_calls.length) {
    message.tool_calls = raw.tool_calls.slice(0, MAX_TOOL_CALLS).map((call) => ({
      id: text(call?.id),
      name: text(call?.name ?? call?.function?.name),
      arguments: text(call?.arguments ?? call?.function?.arguments),
    }));
  }
  if (raw.role === "tool" && raw.tool_call_id) message.tool_call_id = text(raw.tool_call_id);
  for (const field of ["model", "error", "finish_reason"]) {
    if (typeof raw[field] === "string") message[field] = raw[field];
  }
  if (raw.stopped === true) message.stopped = true;
  if (raw.stats && typeof raw.stats === "object") {
    message.stats = {};
    for (const [name, value] of Object.entries(raw.stats)) {
      if (finite(value) !== undefined) message.stats[name] = value;
    }
  }
  return message;
}

function normalizeConversation(raw) {
  if (!raw || typeof raw !== "object" || !Array.isArray(raw.messages)) return null;
  const messages = raw.messages.map(normalizeMessage).filter(Boolean);
  return {
    id: typeof raw.id === "string" && raw.id ? raw.id : newId(),
    title: text(raw.title).slice(0, 200) || titleOf(messages),
    updated: finite(raw.updated) ?? Date.now(),
    messages,
  };
}

function titleOf(messages) {
  const first = messages.find((m) => m.role === "user" && m.content.trim());
  return first ? first.content.trim().replace(/\s+/g, " ").slice(0, 60) : "New chat";
}

function current() {
  return state.conversations.find((c) => c.id === state.currentId) || null;
}

// --- settings -------------------------------------------------------------------------------------------------

function loadSettings() {
  let stored = {};
  try {
    stored = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}") || {};
  } catch {
    stored = {};
  }
  for (const id of SETTING_FIELDS) {
    if (typeof stored[id] === "string") $(id).value = stored[id];
  }
  return stored;
}

function saveSettings() {
  const stored = { model: $("model").value };
  for (const id of SETTING_FIELDS) stored[id] = $(id).value;
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(stored));
}

/** The request fields the settings ask for; throws an Error with a message for a field that is not valid. */
function requestSettings() {
  const fields = {};
  const number = (id, name, integer) => {
    const raw = $(id).value.trim();
    if (raw === "") return;
    const value = Number(raw);
    if (!Number.isFinite(value) || (integer && !Number.isInteger(value))) {
      throw new Error(`${name} must be ${integer ? "an integer" : "a number"}`);
    }
    fields[name] = value;
  };
  number("temperature", "temperature", false);
  number("top-p", "top_p", false);
  number("max-tokens", "max_tokens", true);
  number("seed", "seed", true);
  if ($("think").value) fields.chat_template_kwargs = { enable_thinking: $("think").value === "on" };
  const tools = $("tools").value.trim();
  if (tools) {
    let parsed;
    try {
      parsed = JSON.parse(tools);
    } catch (error) {
      throw new Error(`Tools are not valid JSON: ${error.message}`);
    }
    if (!Array.isArray(parsed) || !parsed.every((t) => t && typeof t === "object")) {
      throw new Error("Tools must be a JSON list of tool definitions");
    }
    fields.tools = parsed;
    fields.tool_choice = $("tool-choice").value;
  }
  return fields;
}

// --- models ---------------------------------------------------------------------------------------------------

async function refreshModels() {
  let listed;
  try {
    listed = await (await api("/v1/models")).json();
  } catch (error) {
    showBanner(`Could not list the models: ${error.message}`);
    showKeyButton($("key-button"));
    return;
  }
  hideBanner();
  state.models = Array.isArray(listed.data) ? listed.data : [];
  const select = $("model");
  const wanted = select.value || loadSettingsModel();
  select.replaceChildren(...state.models.map((model) => el("option", {
    value: model.id,
    text: `${model.id} (${model.status?.value ?? "loaded"})`,
    title: (model.aliases || []).length ? `also: ${model.aliases.join(", ")}` : null,
  })));
  const ids = state.models.map((m) => m.id);
  if (ids.includes(wanted)) select.value = wanted;
  else {
    const loaded = state.models.find((m) => (m.status?.value ?? "loaded") === "loaded");
    if (loaded) select.value = loaded.id;
  }
  showModelState();
  showKeyButton($("key-button"));
}

function loadSettingsModel() {
  try {
    return JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}").model || "";
  } catch {
    return "";
  }
}

function showModelState() {
  const model = state.models.find((m) => m.id === $("model").value);
  const badge = $("model-state");
  const status = model?.status?.value ?? "";
  badge.textContent = status === "unloaded" ? "unloaded: loads on the first message" : status;
  badge.dataset.state = status;
}

// --- the transcript -------------------------------------------------------------------------------------------

function renderConversationList() {
  $("conversations").replaceChildren(...state.conversations.map((conversation) => el("li", {
    class: conversation.id === state.currentId ? "conversation active" : "conversation",
    dataset: { id: conversation.id },
  },
  el("button", { type: "button", class: "open", text: conversation.title, title: conversation.title,
    onclick: () => openConversation(conversation.id) }),
  el("button", { type: "button", class: "delete", text: "×", title: "Delete this conversation",
    onclick: () => deleteConversation(conversation.id) }))));
}

function renderTranscript() {
  const conversation = current();
  state.liveView = null;
  const views = (conversation?.messages || []).map((message, index) => {
    const view = messageView(conversation, message, index);
    if (state.generation && state.generation.message === message) state.liveView = view;
    return view;
  });
  $("transcript").replaceChildren(...views);
  if (!views.length) {
    $("transcript").append(el("p", { class: "empty", text: "Send a message to start a conversation." }));
  }
  scrollToEnd();
}

function messageView(conversation, message, index) {
  const isLast = index === conversation.messages.length - 1;
  const idle = !state.generation;
  const actions = [];
  if (message.role === "user" && idle) {
    actions.push(el("button", { type: "button", class: "edit", text: "Edit",
      onclick: (event) => editMessage(event.target.closest(".msg"), conversation, index) }));
  }
  if (message.role === "assistant" && isLast && idle) {
    actions.push(el("button", { type: "button", class: "regenerate", text: "Regenerate",
      onclick: () => regenerate(conversation) }));
    if (!message.tool_calls?.length && message.content) {
      actions.push(el("button", { type: "button", class: "continue", text: "Continue",
        onclick: () => generate(conversation, { continueLast: true }) }));
    }
  }
  const label = { user: "You", system: "System", tool: "Tool result", assistant: message.model || "Assistant" };
  const view = el("article", { class: `msg ${message.role}`, dataset: { index } },
    el("header", {}, el("span", { class: "role", text: label[message.role] }), el("span", { class: "actions" }, actions)),
    el("div", { class: "content" }),
    el("div", { class: "tool-calls" }),
    el("footer", { class: "stats" }));
  fillMessage(view, message);
  return view;
}

/** Put `message`'s reasoning, text, tool calls and numbers into its element (again while it streams). */
function fillMessage(view, message) {
  const streaming = state.generation?.message === message;
  view.classList.toggle("streaming", streaming);
  let details = view.querySelector(":scope > details.reasoning");
  if (message.reasoning) {
    if (!details) {
      details = el("details", { class: "reasoning" }, el("summary"), el("div", { class: "reasoning-body" }));
      view.querySelector(":scope > .content").before(details);
    }
    const thinking = streaming && !message.content && !message.tool_calls?.length;
    details.querySelector("summary").textContent = thinking ? "Thinking…" : "Reasoning";
    details.querySelector(".reasoning-body").textContent = message.reasoning;
  } else if (details) {
    details.remove();
  }
  const content = view.querySelector(":scope > .content");
  if (message.role === "assistant") content.replaceChildren(renderMarkdown(message.content));
  else content.textContent = message.content;
  view.querySelector(":scope > .tool-calls").replaceChildren(...(message.tool_calls || []).map(toolCallView));
  view.querySelector(":scope > footer").replaceChildren(...statsView(message, streaming));
}

function toolCallView(call) {
  let args = call.arguments;
  try {
    args = JSON.stringify(JSON.parse(call.arguments), null, 2);
  } catch {
    // still streaming, or not JSON: shown as it came
  }
  return el("div", { class: "tool-call" },
    el("div", { class: "tool-call-head" }, "Tool call ", el("code", { class: "tool-name", text: call.name }),
      call.id ? el("span", { class: "tool-id", text: call.id }) : null),
    el("pre", { class: "tool-args", text: args }));
}

function statsView(message, streaming) {
  const parts = [];
  if (streaming) parts.push(el("span", { class: "waiting", text: message.content || message.reasoning ||
    message.tool_calls ? "generating…" : "waiting for the model…" }));
  const stats = message.stats || {};
  const stat = (name, value) => parts.push(el("span", { class: `stat stat-${name}`, text: value }));
  if (stats.prompt_tokens !== undefined) stat("prompt", `${stats.prompt_tokens} prompt tokens`);
  if (stats.cached_tokens !== undefined) stat("cached", `${stats.cached_tokens} cached`);
  if (stats.prompt_per_second !== undefined) stat("prefill", `prefill ${formatRate(stats.prompt_per_second)}`);
  if (stats.predicted_per_second !== undefined) stat("decode", `decode ${formatRate(stats.predicted_per_second)}`);
  if (stats.completion_tokens !== undefined) stat("completion", `${stats.completion_tokens} generated`);
  if (message.finish_reason) stat("finish", message.finish_reason);
  if (message.stopped) stat("stopped", "stopped");
  if (message.error) parts.push(el("span", { class: "error", text: message.error }));
  return parts;
}

function scrollToEnd() {
  const transcript = $("transcript");
  transcript.scrollTop = transcript.scrollHeight;
}

/** Redraw the streaming message once per frame, however many pieces arrived. */
function scheduleRender() {
  if (state.renderQueued) return;
  state.renderQueued = true;
  requestAnimationFrame(() => {
    state.renderQueued = false;
    if (state.liveView && state.generation) {
      const transcript = $("transcript");
      const atEnd = transcript.scrollHeight - transcript.scrollTop - transcript.clientHeight < 40;
      fillMessage(state.liveView, state.generation.message);
      if (atEnd) scrollToEnd();
    }
  });
}

// --- conversations --------------------------------------------------------------------------------------------

function openConversation(id) {
  state.currentId = id;
  renderConversationList();
  renderTranscript();
}

function newConversation() {
  state.currentId = null;
  renderConversationList();
  renderTranscript();
  $("prompt").focus();
}

function deleteConversation(id) {
  if (state.generation?.conversation.id === id) state.generation.controller.abort();
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (state.currentId === id) state.currentId = null;
  saveConversations();
  renderConversationList();
  renderTranscript();
}

function touch(conversation) {
  conversation.updated = Date.now();
  state.conversations = [conversation, ...state.conversations.filter((c) => c !== conversation)];
}

// --- sending and streaming ------------------------------------------------------------------------------------

function send() {
  if (state.generation) return;
  const prompt = $("prompt").value;
  if (!prompt.trim()) return;
  if (!validSettings()) return;
  let conversation = current();
  if (!conversation) {
    conversation = { id: newId(), title: "", updated: Date.now(), messages: [] };
    state.conversations.unshift(conversation);
    state.currentId = conversation.id;
  }
  conversation.messages.push({ role: "user", content: prompt });
  if (!conversation.title) conversation.title = titleOf(conversation.messages);
  $("prompt").value = "";
  generate(conversation);
}

function validSettings() {
  try {
    requestSettings();
  } catch (error) {
    $("settings-error").textContent = error.message;
    $("settings-error").hidden = false;
    $("settings").open = true;
    return false;
  }
  $("settings-error").hidden = true;
  return true;
}

function regenerate(conversation) {
  while (conversation.messages.length && conversation.messages.at(-1).role === "assistant") conversation.messages.pop();
  if (conversation.messages.length) generate(conversation);
  else renderTranscript();
}

function editMessage(view, conversation, index) {
  const editor = el("textarea", { class: "edit-box", rows: 4 });
  editor.value = conversation.messages[index].content;
  const resend = () => {
    if (state.generation || !editor.value.trim() || !validSettings()) return;
    conversation.messages = conversation.messages.slice(0, index);
    conversation.messages.push({ role: "user", content: editor.value });
    generate(conversation);
  };
  view.querySelector(":scope > .content").replaceChildren(editor, el("div", { class: "edit-buttons" },
    el("button", { type: "button", class: "primary resend", text: "Send", onclick: resend }),
    el("button", { type: "button", class: "cancel-edit", text: "Cancel", onclick: renderTranscript })));
  editor.focus();
}

/** The conversation as the request's messages: the system prompt first, what the page keeps per message dropped. */
function requestMessages(conversation, upTo) {
  const messages = [];
  const system = $("system").value;
  if (system.trim()) messages.push({ role: "system", content: system });
  for (const message of conversation.messages.slice(0, upTo)) {
    if (message.role === "assistant") {
      if (!message.content && !message.tool_calls?.length) continue;  // a failed or empty reply
      const sent = { role: "assistant", content: message.content };
      if (message.tool_calls?.length) {
        sent.tool_calls = message.tool_calls.map((call, i) => ({
          id: call.id || `call_${i}`, type: "function", function: { name: call.name, arguments: call.arguments },
        }));
      }
      messages.push(sent);
    } else if (message.role === "tool") {
      messages.push({ role: "tool", content: message.content, tool_call_id: message.tool_call_id || "" });
    } else {
      messages.push({ role: message.role, content: message.content });
    }
  }
  return messages;
}

async function generate(conversation, { continueLast = false } = {}) {
  let settings;
  try {
    settings = requestSettings();
  } catch {
    validSettings();
    return;
  }
  const model = $("model").value;
  let message;
  let messages;
  if (continueLast) {
    message = conversation.messages.at(-1);
    messages = requestMessages(conversation, conversation.messages.length);
    delete message.stats;
    delete message.finish_reason;
    delete message.stopped;
    delete message.error;
  } else {
    messages = requestMessages(conversation, conversation.messages.length);
    message = { role: "assistant", content: "", model };
    conversation.messages.push(message);
  }
  const body = { model: model || undefined, messages, stream: true, stream_options: { include_usage: true },
    ...settings };
  if (continueLast) body.continue_final_message = true;
  const controller = new AbortController();
  state.generation = { conversation, message, controller };
  touch(conversation);
  saveConversations();
  setBusy(true);
  renderConversationList();
  if (state.currentId === conversation.id) renderTranscript();
  setTimeout(refreshModels, 500);  // a model loaded on demand shows as loading
  let lastSave = Date.now();
  try {
    const response = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
      signal: controller.signal });
    for await (const event of serverSentEvents(response.body)) {
      if (event === "[DONE]") break;
      applyEvent(message, event);
      scheduleRender();
      if (Date.now() - lastSave > 2000) {
        saveConversations();
        lastSave = Date.now();
      }
    }
  } catch (error) {
    if (error.name === "AbortError") message.stopped = true;
    else message.error = error.message;
  } finally {
    state.generation = null;
    state.liveView = null;
    saveConversations();
    setBusy(false);
    if (state.currentId === conversation.id) renderTranscript();
    refreshModels();
  }
}

/** One chunk of the stream into the message: text, reasoning and tool-call pieces, the end, usage and timings. */
function applyEvent(message, event) {
  if (event.error) {
    message.error = text(event.error.message ?? event.error);
    return;
  }
  const choice = (event.choices || []).find((c) => (c.index ?? 0) === 0);
  const delta = choice?.delta || {};
  if (typeof delta.content === "string") message.content += delta.content;
  if (typeof delta.reasoning_content === "string") message.reasoning = (message.reasoning || "") + delta.reasoning_content;
  for (const piece of Array.isArray(delta.tool_calls) ? delta.tool_calls : []) {
    const calls = (message.tool_calls ||= []);
    const index = Number.isInteger(piece.index) ? piece.index : calls.length;
    if (index < 0 || index >= MAX_TOOL_CALLS) continue;
    while (calls.length <= index) calls.push({ id: "", name: "", arguments: "" });
    const call = calls[index];
    if (typeof piece.id === "string") call.id = piece.id;
    if (typeof piece.function?.name === "string") call.name += piece.function.name;
    if (typeof piece.function?.arguments === "string") call.arguments += piece.function.arguments;
  }
  if (choice?.finish_reason) message.finish_reason = choice.finish_reason;
  const stats = (message.stats ||= {});
  const usage = event.usage;
  if (usage) {
    stats.prompt_tokens = finite(usage.prompt_tokens);
    stats.completion_tokens = finite(usage.completion_tokens);
    stats.cached_tokens = finite(usage.prompt_tokens_details?.cached_tokens) ?? 0;
  }
  if (event.timings) {
    stats.prompt_per_second = finite(event.timings.prompt_per_second);
    stats.predicted_per_second = finite(event.timings.predicted_per_second);
  }
  for (const [name, value] of Object.entries(stats)) if (value === undefined) delete stats[name];
}

/** The data of each server-sent event of a streamed answer: parsed JSON, or the final "[DONE]". */
async function* serverSentEvents(stream) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      for (let end = buffer.search(/\r?\n\r?\n/); end >= 0; end = buffer.search(/\r?\n\r?\n/)) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
        const data = block.split(/\r?\n/).filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
        if (data) yield data === "[DONE]" ? data : JSON.parse(data);
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// --- export and import ----------------------------------------------------------------------------------------

function exportConversations() {
  const data = { format: EXPORT_FORMAT, version: 1, exported: new Date().toISOString(),
    conversations: state.conversations };
  const url = URL.createObjectURL(new Blob([JSON.stringify(data, null, 2)], { type: "application/json" }));
  const link = el("a", { href: url, download: `basert-chats-${new Date().toISOString().slice(0, 10)}.json` });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

async function importConversations(file) {
  let data;
  try {
    data = JSON.parse(await file.text());
  } catch (error) {
    showBanner(`${file.name} is not JSON: ${error.message}`);
    return;
  }
  const list = Array.isArray(data) ? data : Array.isArray(data?.conversations) ? data.conversations : [data];
  const imported = list.map(normalizeConversation).filter(Boolean);
  if (!imported.length) {
    showBanner(`${file.name} holds no conversation (a list of {"messages": [...]} or this page's export)`);
    return;
  }
  const known = new Set(state.conversations.map((c) => c.id));
  for (const conversation of imported) if (known.has(conversation.id)) conversation.id = newId();
  state.conversations = [...imported, ...state.conversations];
  state.currentId = imported[0].id;
  saveConversations();
  hideBanner();
  renderConversationList();
  renderTranscript();
}

// --- start ----------------------------------------------------------------------------------------------------

function start() {
  state.conversations = loadConversations();
  loadSettings();
  state.currentId = state.conversations[0]?.id ?? null;
  for (const id of SETTING_FIELDS) $(id).addEventListener("change", saveSettings);
  $("model").addEventListener("change", () => {
    saveSettings();
    showModelState();
  });
  $("send").addEventListener("click", send);
  $("stop").addEventListener("click", () => state.generation?.controller.abort());
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  $("new-chat").addEventListener("click", newConversation);
  $("export").addEventListener("click", exportConversations);
  $("import").addEventListener("change", (event) => {
    const file = event.target.files[0];
    event.target.value = "";
    if (file) importConversations(file);
  });
  $("key-button").addEventListener("click", () => {
    forgetApiKey();
    refreshModels();
  });
  renderConversationList();
  renderTranscript();
  setBusy(false);
  refreshModels();
  setInterval(() => {
    if (!document.hidden) refreshModels();
  }, 5000);
}

start();
