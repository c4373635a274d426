// The chat playground: a conversation with the served model over /v1/chat/completions, streamed, with a stop
// button. The conversation lives in this page (and its tab's sessionStorage, so a reload keeps it); every request
// sends all of it.
//
// Tool use is drawn apart from the text. The bundled model's calculator calls arrive as text,
// "[calculator: 12*34] ", and their results as chunks whose delta says "tool_output": true (docs/server.md);
// a model answering with OpenAI's `tool_calls` deltas gets the same chips.

import { apiFetch, errorMessage, readEvents } from "./api.js";

const STORE_ITEM = "nanoserve.chat";
const CALL = /\[calculator: ([^\]]*)(\] ?|$)/g; // a call's text; `$`: still streaming

export function startChat() {
  const el = (id) => document.getElementById(id);
  const messagesEl = el("messages");
  const input = el("input");
  const send = el("send");
  const stop = el("stop");
  const state = { messages: load(), controller: null };

  // -- settings ----------------------------------------------------------------------------------------
  el("settings-toggle").addEventListener("click", (e) => {
    const open = el("settings").hidden;
    el("settings").hidden = !open;
    e.target.setAttribute("aria-expanded", String(open));
  });
  for (const [id, digits] of [["temperature", 2], ["top-p", 2]]) {
    const show = () => { el(`${id}-value`).textContent = Number(el(id).value).toFixed(digits); };
    el(id).addEventListener("input", show);
    show();
  }

  // -- conversation ---------------------------------------------------------------------------------------
  function render() {
    messagesEl.querySelectorAll(".msg").forEach((m) => m.remove());
    el("empty").hidden = state.messages.length > 0;
    for (const m of state.messages) messagesEl.append(messageElement(m));
    messagesEl.scrollTop = messagesEl.scrollHeight;
  }

  el("clear").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.messages = [];
    save(state.messages);
    render();
  });
  messagesEl.querySelectorAll(".suggestion").forEach((b) => b.addEventListener("click", () => {
    input.value = b.textContent;
    submit();
  }));
  el("composer").addEventListener("submit", (e) => { e.preventDefault(); submit(); });
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); submit(); }
  });
  stop.addEventListener("click", () => state.controller && state.controller.abort());

  async function submit() {
    const text = input.value.trim();
    if (!text || state.controller) return;
    let body;
    try {
      body = requestBody(el, state.messages, text);
    } catch (err) {
      alert(err.message); // a settings field the page can check itself (the server checks the rest)
      return;
    }
    input.value = "";
    const user = { role: "user", content: text };
    const reply = { role: "assistant", content: "", parts: [], toolCalls: [], meta: {} };
    state.messages.push(user, reply);
    render();
    const replyEl = messagesEl.lastElementChild;
    replyEl.classList.add("streaming");
    setBusy(true);
    state.controller = new AbortController();
    try {
      await stream(body, reply, state.controller.signal, () => update(replyEl, reply));
    } catch (err) {
      if (err.name === "AbortError") reply.meta.stopped = true;
      else reply.meta.error = err.message;
    }
    state.controller = null;
    replyEl.classList.remove("streaming");
    if (!reply.content && !reply.toolCalls.length && reply.meta.error) {
      // Nothing came: the question goes back to the input box, and the reason is shown (not kept).
      state.messages.splice(-2, 2);
      input.value = text;
      render();
      const note = document.createElement("div");
      note.className = "msg note";
      note.textContent = reply.meta.error;
      messagesEl.append(note);
    } else {
      update(replyEl, reply);
    }
    save(state.messages);
    setBusy(false);
    input.focus();
  }

  function setBusy(busy) {
    send.hidden = busy;
    stop.hidden = !busy;
  }

  render();
  return {
    setModels(names) {
      const select = el("model");
      select.replaceChildren(...names.map((n) => new Option(n, n)));
    },
  };
}

// The request for the conversation so far plus the new user message `text`.
function requestBody(el, messages, text) {
  const body = {
    model: el("model").value || undefined,
    messages: [],
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number(el("temperature").value),
    top_p: Number(el("top-p").value),
  };
  const maxTokens = el("max-tokens").value.trim();
  if (maxTokens) body.max_tokens = Number(maxTokens);
  const system = el("system").value.trim();
  if (system) body.messages.push({ role: "system", content: system });
  for (const m of messages) body.messages.push({ role: m.role, content: m.content });
  body.messages.push({ role: "user", content: text });
  const extra = el("extra").value.trim();
  if (extra) {
    let fields;
    try {
      fields = JSON.parse(extra);
    } catch (err) {
      throw new Error(`Extra request fields: not valid JSON (${err.message})`);
    }
    if (typeof fields !== "object" || fields === null || Array.isArray(fields)) {
      throw new Error("Extra request fields: must be a JSON object");
    }
    Object.assign(body, fields);
  }
  return body;
}

// Streams one reply into `reply` (content, parts, toolCalls, meta), calling changed() as it grows.
async function stream(body, reply, signal, changed) {
  const started = performance.now();
  const response = await apiFetch("/v1/chat/completions", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal,
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  let tokens = 0;
  await readEvents(response, (data) => {
    if (data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.usage) reply.meta.tokens = chunk.usage.completion_tokens;
    for (const choice of chunk.choices || []) {
      const delta = choice.delta || {};
      if (delta.content) {
        if (reply.meta.ttft === undefined) reply.meta.ttft = performance.now() - started;
        const kind = delta.tool_output ? "result" : "text";
        const last = reply.parts[reply.parts.length - 1];
        if (last && last.kind === kind) last.text += delta.content;
        else reply.parts.push({ kind, text: delta.content });
        reply.content += delta.content;
        tokens += 1;
      }
      for (const call of delta.tool_calls || []) {
        const slot = (reply.toolCalls[call.index || 0] ||= { name: "", arguments: "" });
        if (call.function && call.function.name) slot.name += call.function.name;
        if (call.function && call.function.arguments) slot.arguments += call.function.arguments;
      }
      if (choice.finish_reason) reply.meta.finish = choice.finish_reason;
    }
    reply.meta.seconds = (performance.now() - started) / 1000;
    reply.meta.chunks = tokens;
    changed();
  });
}

// -- drawing a message ------------------------------------------------------------------------------------
function messageElement(m) {
  const wrap = document.createElement("div");
  wrap.className = `msg ${m.role}`;
  const bubble = document.createElement("div");
  bubble.className = "bubble";
  const meta = document.createElement("div");
  meta.className = "meta";
  wrap.append(bubble, meta);
  update(wrap, m);
  return wrap;
}

function update(wrap, m) {
  const [bubble, meta] = wrap.children;
  if (m.role === "assistant") {
    bubble.replaceChildren(...replyNodes(m));
  } else {
    bubble.textContent = m.content;
  }
  meta.replaceChildren(...metaNodes(m));
  const list = wrap.parentElement;
  if (list && list.scrollHeight - list.scrollTop - list.clientHeight < 120) list.scrollTop = list.scrollHeight;
}

function replyNodes(m) {
  const nodes = [];
  for (const part of m.parts || [{ kind: "text", text: m.content }]) {
    if (part.kind === "result") {
      nodes.push(chip("result", "result", part.text.replace(/\n$/, "")));
      if (part.text.endsWith("\n")) nodes.push(document.createTextNode("\n"));
      continue;
    }
    let at = 0;
    for (const match of part.text.matchAll(CALL)) {
      if (match.index > at) nodes.push(document.createTextNode(part.text.slice(at, match.index)));
      nodes.push(chip("call", "calculator", match[1] + (match[2] ? "" : "…")));
      at = match.index + match[0].length;
    }
    if (at < part.text.length) nodes.push(document.createTextNode(part.text.slice(at)));
  }
  for (const call of m.toolCalls || []) nodes.push(chip("call", call.name || "tool", call.arguments));
  return nodes;
}

function chip(kind, name, text) {
  const span = document.createElement("span");
  span.className = `tool ${kind}`;
  span.dataset.kind = kind;
  const label = document.createElement("span");
  label.className = "name";
  if (kind === "call") {
    label.textContent = name;
    span.append(label, document.createTextNode(`(${text})`));
  } else {
    label.textContent = "→ ";
    span.append(label, document.createTextNode(text));
  }
  return span;
}

function metaNodes(m) {
  const meta = m.meta || {};
  const bits = [];
  if (m.role === "assistant") {
    const tokens = meta.tokens ?? meta.chunks;
    if (tokens) bits.push(`${tokens} tokens`);
    if (tokens && meta.seconds && meta.ttft !== undefined) {
      const decode = meta.seconds - meta.ttft / 1000;
      if (tokens > 1 && decode > 0) bits.push(`${((tokens - 1) / decode).toFixed(0)} tok/s`);
    }
    if (meta.ttft !== undefined) bits.push(`first token ${meta.ttft.toFixed(0)} ms`);
    if (meta.finish && !meta.stopped) bits.push(`finish: ${meta.finish}`);
  }
  const nodes = [document.createTextNode(bits.join(" · "))];
  for (const [cls, text] of [["stopped", meta.stopped && "stopped"], ["error", meta.error]]) {
    if (!text) continue;
    const span = document.createElement("span");
    span.className = cls;
    span.textContent = (bits.length ? " · " : "") + text;
    nodes.push(span);
  }
  return nodes;
}

function load() {
  try {
    return JSON.parse(sessionStorage.getItem(STORE_ITEM)) || [];
  } catch (_) {
    return [];
  }
}

function save(messages) {
  sessionStorage.setItem(STORE_ITEM, JSON.stringify(messages));
}
