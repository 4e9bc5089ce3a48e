// Chat through the swarm's OpenAI-compatible API: POST /v1/chat/completions with stream: true, read as server-sent
// events with fetch + ReadableStream. The last chunk carries "route": the servers and blocks the answer went through.
// Everything received goes into the page as text (textContent), never as markup.
"use strict";

const KEY_STORE = "swarm.apiKey";
let history = [];
let busy = false;

function $(id) { return document.getElementById(id); }

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("apikey").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function setStatus(text, cls) {
  const s = $("status");
  s.textContent = text;
  s.className = "conn" + (cls ? " " + cls : "");
}

function routeText(route) {
  if (!Array.isArray(route) || route.length === 0) return "";
  return "route: " + route.map((h) => "blocks " + Number(h.start) + ":" + Number(h.end) + " -> .." +
    String(h.peer_id).slice(-6)).join(", ");
}

function errorText(err) {
  if (err && typeof err === "object") return String(err.message || err.type || JSON.stringify(err));
  return String(err);
}

async function loadModels() {
  try {
    const r = await fetch("/v1/models", { headers: headers(), cache: "no-store" });
    if (!r.ok) { setStatus("models: HTTP " + r.status, "down"); return; }
    const body = await r.json();
    const select = $("model");
    const current = select.value;
    select.replaceChildren(...(body.data || []).map((m) => el("option", "", m.id)));
    if (current) select.value = current;
    setStatus("ready", "live");
  } catch (err) {
    setStatus("cannot list models", "down");
  }
}

function addMessage(role, text) {
  const m = el("div", "msg " + role);
  const body = el("span", "content", text);
  m.appendChild(body);
  $("messages").appendChild(m);
  m.scrollIntoView({ block: "end" });
  return m;
}

function handleEvent(data, msg, state) {
  if (data === "[DONE]") return true;
  let obj;
  try { obj = JSON.parse(data); } catch (err) { return false; }
  if (obj.error) {
    msg.appendChild(el("span", "error", "error: " + errorText(obj.error)));
    state.failed = true;
    return true;
  }
  const choice = Array.isArray(obj.choices) && obj.choices.length ? obj.choices[0] : null;
  const piece = choice && choice.delta ? choice.delta.content : null;
  if (typeof piece === "string" && piece) {
    state.text += piece;
    msg.querySelector(".content").textContent = state.text;
  }
  if (obj.route) {
    const r = el("span", "route", routeText(obj.route));
    msg.appendChild(r);
  }
  return false;
}

function request() {
  const body = { model: $("model").value, messages: history, stream: true };
  const max = parseInt($("max-tokens").value, 10);
  if (Number.isFinite(max) && max > 0) body.max_tokens = max;
  return body;
}

async function send(text) {
  busy = true;
  $("send").disabled = true;
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const msg = addMessage("assistant", "");
  msg.classList.add("streaming");
  const state = { text: "", failed: false };
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(request()),
    });
    if (!r.ok || !r.body) {
      let detail = "HTTP " + r.status;
      try { const b = await r.json(); if (b.error) detail = errorText(b.error); } catch (err) { /* not JSON */ }
      msg.appendChild(el("span", "error", "error: " + detail));
      state.failed = true;
    } else {
      const reader = r.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      let done = false;
      while (!done) {
        const chunk = await reader.read();
        if (chunk.done) break;
        buffer += decoder.decode(chunk.value, { stream: true }).replace(/\r\n/g, "\n");
        let cut;
        while (!done && (cut = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          const data = block.split("\n").filter((l) => l.startsWith("data:"))
            .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
          if (data) done = handleEvent(data, msg, state);
        }
        msg.scrollIntoView({ block: "end" });
      }
      if (done) reader.cancel().catch(() => {});
    }
  } catch (err) {
    msg.appendChild(el("span", "error", "error: " + errorText(err)));
    state.failed = true;
  } finally {
    msg.classList.remove("streaming");
    msg.classList.add(state.failed ? "failed" : "done");
    if (!state.failed) history.push({ role: "assistant", content: state.text });
    else history.pop();
    busy = false;
    $("send").disabled = false;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  const key = $("apikey");
  key.value = localStorage.getItem(KEY_STORE) || "";
  key.addEventListener("change", () => {
    if (key.value.trim()) localStorage.setItem(KEY_STORE, key.value.trim());
    else localStorage.removeItem(KEY_STORE);
    loadModels();
  });
  $("clear").addEventListener("click", () => { history = []; $("messages").replaceChildren(); });
  $("form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("message").value.trim();
    if (!text || busy) return;
    $("message").value = "";
    send(text);
  });
  $("message").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("form").requestSubmit(); }
  });
  loadModels();
});
