// kiln's chat page: streams /v1/chat/completions of the server that served it (no other origin).
"use strict";

const $ = (id) => document.getElementById(id);
const SETTINGS = ["system", "temperature", "top-p", "max-tokens"];  // kept in localStorage as kiln.<id>
const KEY_ITEM = "kiln.api-key";

const history = [];      // the conversation as the server sees it: {role, content}, system prompt excluded
let model = null;        // the served model's id, from /v1/models
let inflight = null;     // the AbortController of the answer being streamed
let conversation = 0;    // bumped by "New chat", so an answer that ends after it leaves the new history alone

class ServerError extends Error {
  constructor(message, status) { super(message); this.status = status; }
}

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? {Authorization: `Bearer ${key}`} : {};
}

// The server's own sentence from OpenAI's error body; the status line when the body is not one.
async function serverError(resp) {
  let message = `HTTP ${resp.status} ${resp.statusText}`;
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (_) { /* not JSON: keep the status line */ }
  return new ServerError(message, resp.status);
}

async function loadModel() {
  const label = $("model");
  try {
    const resp = await fetch("/v1/models", {headers: authHeaders()});
    if (!resp.ok) throw await serverError(resp);
    const card = (await resp.json()).data[0];
    model = card.id;
    label.textContent = card.max_model_len ? `${card.id} · ${card.max_model_len} tokens` : card.id;
    label.classList.remove("bad");
  } catch (e) {
    label.textContent = e.message;
    label.classList.add("bad");
  }
}

// Server-sent events of a response body: yields each event's data field (one JSON chunk or "[DONE]").
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const lines = buffer.slice(0, cut).split("\n");
      buffer = buffer.slice(cut + 2);
      const data = lines.filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (data) yield data;
    }
  }
}

function addMessage(role, text) {
  const item = document.createElement("li");
  item.className = `message ${role}`;
  const who = document.createElement("div");
  who.className = "role";
  who.textContent = role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  item.append(who, body);
  if (role === "assistant") {
    const stats = document.createElement("div");
    stats.className = "stats";
    item.append(stats);
  }
  $("messages").append(item);
  item.scrollIntoView({block: "end"});
  return item;
}

// Keeps the newest text in view unless the reader has scrolled up to read something else.
function follow(grow) {
  const list = $("messages");
  const atBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 40;
  grow();
  if (atBottom) list.scrollTop = list.scrollHeight;
}

function numberSetting(id, parse) {
  const value = parse($(id).value);
  return Number.isFinite(value) ? value : undefined;  // empty: the server's default
}

function requestBody() {
  const system = $("system").value.trim();
  return {
    ...(model ? {model} : {}),
    messages: system ? [{role: "system", content: system}, ...history] : [...history],
    stream: true,
    stream_options: {include_usage: true},
    temperature: numberSetting("temperature", parseFloat),
    top_p: numberSetting("top-p", parseFloat),
    max_tokens: numberSetting("max-tokens", (v) => parseInt(v, 10)),
  };
}

// tokens/s counts the tokens after the first over the time after the first (TTFT is shown on its own).
function statsText(timing, tokens, exact) {
  const parts = [`${exact ? "" : "≈"}${tokens} tokens`];
  if (timing.first !== null) {
    if (tokens > 1 && timing.last > timing.first) {
      parts.push(`${((tokens - 1) / ((timing.last - timing.first) / 1000)).toFixed(1)} tok/s`);
    }
    parts.push(`TTFT ${Math.round(timing.first - timing.start)} ms`);
  }
  return parts.join(" · ");
}

function setBusy(controller) {
  inflight = controller;
  $("send").hidden = controller !== null;
  $("stop").hidden = controller === null;
  const last = history[history.length - 1];
  $("regenerate").disabled = controller !== null || !last || last.role !== "assistant";
}

// Streams one assistant answer to the conversation in `history` (which ends with the user's turn).
async function answer() {
  const item = addMessage("assistant", "");
  item.dataset.state = "streaming";
  const current = conversation;
  const textEl = item.querySelector(".text");
  const textNode = textEl.appendChild(document.createTextNode(""));  // appended to: no re-render of the whole
  const controller = new AbortController();
  setBusy(controller);
  const timing = {start: performance.now(), first: null, last: null};
  let text = "", chunks = 0, usage = null, ended = false;
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", signal: controller.signal,
      headers: {"Content-Type": "application/json", ...authHeaders()},
      body: JSON.stringify(requestBody()),
    });
    if (!resp.ok) throw await serverError(resp);
    for await (const data of sseData(resp.body)) {
      if (data === "[DONE]") {
        ended = true;
        break;
      }
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ServerError(chunk.error.message, chunk.error.code);
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta.content;
      if (delta) {
        timing.last = performance.now();
        if (timing.first === null) timing.first = timing.last;
        chunks += 1;
        text += delta;
        follow(() => textNode.appendData(delta));
      }
    }
    if (!ended) throw new ServerError("The connection closed before the answer was complete.");
    item.dataset.state = "done";
  } catch (e) {
    if (e.name === "AbortError") {
      item.dataset.state = "stopped";
    } else {
      item.dataset.state = "error";
      item.classList.add("error");
      textEl.textContent = text ? `${text}\n\n${e.message}` : e.message;
      if (e.status === 401) $("api-key").focus();
    }
  }
  if (current !== conversation) return;
  if (!text && item.dataset.state !== "done") {
    // Nothing was answered (an error, or stopped before the first token): the user's turn leaves the history
    // and goes back to the input box, to edit or resend; both bubbles stay on screen until the next message.
    if (item.dataset.state === "stopped") textEl.textContent = "(stopped before the first token)";
    const asked = history.pop();
    if (!$("input").value) $("input").value = asked.content;
    item.classList.add("failed");
    item.previousElementSibling.classList.add("failed", "unsent");
  } else {
    history.push({role: "assistant", content: text});
    const tokens = usage ? usage.completion_tokens : chunks;
    item.querySelector(".stats").textContent =
      statsText(timing, tokens, usage !== null) + (item.dataset.state === "stopped" ? " · stopped" : "");
  }
  setBusy(null);
}

function clearFailed() {
  for (const item of $("messages").querySelectorAll("li.failed")) item.remove();
}

async function send(event) {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || inflight) return;
  clearFailed();
  $("input").value = "";
  history.push({role: "user", content: text});
  addMessage("user", text);
  await answer();
}

async function regenerate() {
  if (inflight || history[history.length - 1].role !== "assistant") return;
  history.pop();
  clearFailed();
  const answers = $("messages").querySelectorAll("li.assistant");
  answers[answers.length - 1].remove();
  await answer();
}

function newChat() {
  if (inflight) inflight.abort();
  conversation += 1;
  history.length = 0;
  $("messages").replaceChildren();
  setBusy(null);
  $("input").focus();
}

function restoreSettings() {
  for (const id of SETTINGS) {
    const saved = localStorage.getItem(`kiln.${id}`);
    if (saved !== null) $(id).value = saved;
    $(id).addEventListener("change", () => localStorage.setItem(`kiln.${id}`, $(id).value));
  }
  $("api-key").value = localStorage.getItem(KEY_ITEM) || "";
  $("api-key").addEventListener("change", () => {
    const key = $("api-key").value.trim();
    if (key) localStorage.setItem(KEY_ITEM, key); else localStorage.removeItem(KEY_ITEM);
    loadModel();
  });
}

document.addEventListener("DOMContentLoaded", () => {
  restoreSettings();
  $("composer").addEventListener("submit", send);
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) send(e);
  });
  $("stop").addEventListener("click", () => inflight && inflight.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("new-chat").addEventListener("click", newChat);
  loadModel();
  $("input").focus();
});
