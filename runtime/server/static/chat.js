// kiln's chat page: streams /v1/chat/completions of the server that served it (no other origin).
"use strict";

const $ = (id) => document.getElementById(id);
const SETTINGS = ["system", "temperature", "top-p", "max-tokens"];  // kept in localStorage as kiln.<id>
const KEY_ITEM = "kiln.api-key";

const history = [];      // the conversation as the server sees it: {role, content}, system prompt excluded
let model = null;        // the served model's id, from /v1/models
let takesImages = false; // the served model reads images (its card's input_modalities): the attach button shows
const attached = [];     // images for the next message: {url: a data: URL for the API, thumb: a blob: URL to show}
const thumbsOf = new WeakMap();  // a user message of `history` -> its images' thumbnails (to restore it unsent)
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
    takesImages = readsImages(card);
    $("attach").hidden = !takesImages;
  } catch (e) {
    label.textContent = e.message;
    label.classList.add("bad");
  }
}

function readsImages(card) {
  return Array.isArray(card.input_modalities) && card.input_modalities.includes("image");
}

// A user turn as OpenAI's API takes it: plain text, or the images (image_url parts with data: URLs, which the
// server decodes itself: it fetches nothing) followed by the text.
function userMessage(text, imageUrls) {
  if (!imageUrls.length) return {role: "user", content: text};
  const parts = imageUrls.map((url) => ({type: "image_url", image_url: {url}}));
  if (text) parts.push({type: "text", text});
  return {role: "user", content: parts};
}

function messageText(message) {
  if (typeof message.content === "string") return message.content;
  return message.content.filter((p) => p.type === "text").map((p) => p.text).join("");
}

function readDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attachFiles(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;  // the server takes data:image/...;base64 URLs only
    attached.push({url: await readDataUrl(file), thumb: URL.createObjectURL(file)});
  }
  $("image-file").value = "";  // the same file can be chosen again
  showAttached();
}

function thumbnails(thumbs) {
  const box = element("div", "thumbs");
  for (const src of thumbs) Object.assign(box.appendChild(element("img")), {src, alt: "attached image"});
  return box;
}

// The images waiting for the next message, under the input; a click on one takes it off.
function showAttached() {
  const box = $("attached");
  box.replaceChildren(...thumbnails(attached.map((a) => a.thumb)).children);
  box.querySelectorAll("img").forEach((img, i) => {
    img.title = "click to remove";
    img.addEventListener("click", () => {
      URL.revokeObjectURL(attached.splice(i, 1)[0].thumb);
      showAttached();
    });
  });
  box.hidden = attached.length === 0;
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

// Markdown of the model's answers, rendered as DOM nodes: every piece of the text goes in through text nodes or
// textContent, so nothing the model writes is ever parsed as HTML or run. Blocks: fenced code (with a copy button),
// headings, lists (nested by indentation), block quotes, rules, paragraphs; inline: code, links (http and https
// only, else shown as typed), strong, emphasis, strikethrough.
const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(\s+#+)?\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])(\s+|$)(.*)$/;
const INLINE = new RegExp([
  /(`+)([\s\S]*?[^`])\1(?!`)/.source,              // 1, 2: code span
  /\[([^\]\n]+)\]\(\s*([^\s()]+)\s*\)/.source,     // 3, 4: link
  /\*\*(?=\S)([\s\S]*?\S)\*\*/.source,             // 5: strong
  /(?<!\w)__(?=\S)([\s\S]*?\S)__(?!\w)/.source,    // 6: strong
  /~~(?=\S)([\s\S]*?\S)~~/.source,                 // 7: strikethrough
  /\*(?=[^\s*])([\s\S]*?[^\s*])\*/.source,         // 8: emphasis
  /(?<!\w)_(?=[^\s_])([\s\S]*?[^\s_])_(?!\w)/.source,  // 9: emphasis
].join("|"), "g");

function element(tag, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
}

function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  appendBlocks(fragment, text.split("\n"));
  return fragment;
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
}

function appendBlocks(parent, lines) {
  let i = 0, m;
  while (i < lines.length) {
    const line = lines[i];
    if (!line.trim()) {
      i += 1;
    } else if ((m = FENCE.exec(line))) {
      i = appendCode(parent, lines, i, m);
    } else if ((m = HEADING.exec(line))) {
      appendInline(parent.appendChild(element(`h${m[1].length}`)), m[2]);
      i += 1;
    } else if (RULE.test(line)) {
      parent.append(element("hr"));
      i += 1;
    } else if (QUOTE.test(line)) {
      const inner = [];
      for (; i < lines.length && (m = QUOTE.exec(lines[i])); i += 1) inner.push(m[1]);
      appendBlocks(parent.appendChild(element("blockquote")), inner);
    } else if (ITEM.test(line)) {
      i = appendList(parent, lines, i);
    } else {
      const start = i;
      for (i += 1; i < lines.length && lines[i].trim() && !startsBlock(lines[i]); i += 1);
      appendInline(parent.appendChild(element("p")), lines.slice(start, i).map((l) => l.trim()).join("\n"));
    }
  }
}

// A fenced block runs to its closing fence, or to the end of the text while the answer is still streaming.
function appendCode(parent, lines, start, [, fence, language]) {
  const close = new RegExp(`^ {0,3}${fence[0]}{${fence.length},}\\s*$`);
  let end = start + 1;
  while (end < lines.length && !close.test(lines[end])) end += 1;
  const block = element("div", "code-block");
  const head = block.appendChild(element("div", "code-head"));
  head.appendChild(element("span", "language")).textContent = language;
  const copy = head.appendChild(element("button", "copy"));
  copy.type = "button";
  copy.textContent = "Copy";
  const code = block.appendChild(element("pre")).appendChild(element("code"));
  code.textContent = lines.slice(start + 1, end).join("\n");
  copy.addEventListener("click", () => copyText(copy, code.textContent));
  parent.append(block);
  return end + 1;
}

// The clipboard API needs a secure context (localhost, https); elsewhere the code is selected and copied.
async function copyText(button, text) {
  let copied = false;
  try {
    await navigator.clipboard.writeText(text);
    copied = true;
  } catch (_) {
    const range = document.createRange();
    range.selectNodeContents(button.closest(".code-block").querySelector("code"));
    getSelection().removeAllRanges();
    getSelection().addRange(range);
    copied = document.execCommand("copy");
  }
  button.textContent = copied ? "Copied" : "Select and copy";
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}

// One list: the items at its first item's indentation and kind; deeper lines belong to the item above them.
function appendList(parent, lines, start) {
  const first = ITEM.exec(lines[start]);
  const indent = first[1].length, ordered = /\d/.test(first[2]);
  const sameList = (m) => m && m[1].length <= indent + 1 && /\d/.test(m[2]) === ordered;
  const items = [];  // each item's lines, its own indentation removed
  let i = start, offset = 0;
  for (; i < lines.length; i += 1) {
    const line = lines[i], m = ITEM.exec(line), depth = line.length - line.trimStart().length;
    const item = items[items.length - 1];
    if (sameList(m)) {
      items.push([m[4]]);
      offset = m[1].length + m[2].length + Math.max(1, m[3].length);
    } else if (!line.trim()) {
      const next = lines.slice(i + 1).find((l) => l.trim());
      if (!next || !(next.length - next.trimStart().length > indent || sameList(ITEM.exec(next)))) break;
      item.push("");
    } else if (depth > indent || (!m && !startsBlock(line) && item[item.length - 1] !== "")) {
      item.push(line.slice(Math.min(depth, offset)));  // a nested block, or the item's text going on
    } else {
      break;
    }
  }
  const list = parent.appendChild(element(ordered ? "ol" : "ul"));
  if (ordered && parseInt(first[2], 10) !== 1) list.start = parseInt(first[2], 10);
  for (const item of items) appendBlocks(list.appendChild(element("li")), item);
  return i;
}

function appendInline(parent, text) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.append(text.slice(last, m.index));
    parent.append(inlineNode(m));
    last = m.index + m[0].length;
  }
  if (last < text.length) parent.append(text.slice(last));
}

function inlineNode(m) {
  if (m[2] !== undefined) {
    const code = element("code");
    code.textContent = m[2];
    return code;
  }
  if (m[3] !== undefined) {
    const href = safeHref(m[4]);
    if (href === null) return document.createTextNode(m[0]);
    const link = element("a");
    Object.assign(link, {href, target: "_blank", rel: "noopener noreferrer"});
    appendInline(link, m[3]);
    return link;
  }
  const [tag, inner] = m[5] !== undefined ? ["strong", m[5]] : m[6] !== undefined ? ["strong", m[6]]
    : m[7] !== undefined ? ["del", m[7]] : ["em", m[8] !== undefined ? m[8] : m[9]];
  const node = element(tag);
  appendInline(node, inner);
  return node;
}

// Absolute http(s) URLs only: no javascript:, data: or relative links into this server.
function safeHref(raw) {
  try {
    const url = new URL(raw);
    return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
  } catch (_) {
    return null;
  }
}

function addMessage(role, text, thumbs = []) {
  const item = document.createElement("li");
  item.className = `message ${role}`;
  const who = document.createElement("div");
  who.className = "role";
  who.textContent = role;
  const body = document.createElement("div");
  body.className = role === "assistant" ? "text markdown" : "text";  // the user's text is shown as typed
  body.textContent = text;
  item.append(who);
  if (thumbs.length) item.append(thumbnails(thumbs));
  item.append(body);
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
  const controller = new AbortController();
  setBusy(controller);
  const timing = {start: performance.now(), first: null, last: null};
  let text = "", chunks = 0, usage = null, ended = false, state = "done", failure = null;
  // The answer is rendered again as it grows (a later line can close a code fence or continue a list), at most
  // once a frame however fast tokens arrive.
  let frame = null;
  const show = () => {
    frame = null;
    follow(() => textEl.replaceChildren(renderMarkdown(text)));
  };
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
        if (frame === null) frame = requestAnimationFrame(show);
      }
    }
    if (!ended) throw new ServerError("The connection closed before the answer was complete.");
  } catch (e) {
    state = e.name === "AbortError" ? "stopped" : "error";
    if (state === "error") failure = e;
  }
  if (frame !== null) cancelAnimationFrame(frame);
  show();  // the whole answer, before its state says it is complete
  if (failure) {
    item.classList.add("error");
    textEl.appendChild(element("p", "error-message")).textContent = failure.message;
    if (failure.status === 401) $("api-key").focus();
  }
  item.dataset.state = state;
  if (current !== conversation) return;
  if (!text && item.dataset.state !== "done") {
    // Nothing was answered (an error, or stopped before the first token): the user's turn leaves the history
    // and goes back to the input box, to edit or resend; both bubbles stay on screen until the next message.
    if (item.dataset.state === "stopped") textEl.textContent = "(stopped before the first token)";
    const asked = history.pop();
    if (!$("input").value) $("input").value = messageText(asked);
    if (!attached.length && thumbsOf.has(asked)) {
      const thumbs = thumbsOf.get(asked);
      asked.content.filter((p) => p.type === "image_url").forEach((p, i) => attached.push({url: p.image_url.url,
                                                                                            thumb: thumbs[i]}));
      showAttached();
    }
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
  if ((!text && !attached.length) || inflight) return;
  clearFailed();
  $("input").value = "";
  const images = attached.splice(0);
  const message = userMessage(text, images.map((a) => a.url));
  if (images.length) thumbsOf.set(message, images.map((a) => a.thumb));
  showAttached();
  history.push(message);
  addMessage("user", text, images.map((a) => a.thumb));
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
  const kept = new Set(attached.map((a) => a.thumb));
  for (const img of $("messages").querySelectorAll(".thumbs img")) {
    if (!kept.has(img.src)) URL.revokeObjectURL(img.src);
  }
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
  $("attach").addEventListener("click", () => $("image-file").click());
  $("image-file").addEventListener("change", () => attachFiles([...$("image-file").files]));
  loadModel();
  $("input").focus();
});
