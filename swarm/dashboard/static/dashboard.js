// The swarm's live dashboard. Everything a peer said (ids, device names...) goes into the page as text
// (textContent), never as markup. Snapshots arrive as server-sent events from /dashboard/events.
"use strict";

const STATES = ["online", "standby", "joining", "leaving", "unreachable"];
const sections = new Map(); // model id -> its section element

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

function short(id) {
  return id ? ".." + String(id).slice(-6) : "-";
}

function num(x, digits) {
  const n = Number(x);
  if (!Number.isFinite(n)) return "-";
  return n.toFixed(digits === undefined ? 1 : digits);
}

function stateClass(state) {
  return STATES.includes(state) ? state : "unreachable";
}

function when(t) {
  const d = new Date(Number(t) * 1000);
  return Number.isFinite(d.getTime()) ? d.toLocaleTimeString() : "-";
}

function section(modelId) {
  let s = sections.get(modelId);
  if (!s) {
    const tpl = document.getElementById("model-template");
    s = tpl.content.firstElementChild.cloneNode(true);
    s.dataset.model = modelId;
    document.getElementById("models").appendChild(s);
    sections.set(modelId, s);
  }
  return s;
}

const DENSE = 20; // more peers than this: compact rows, so a swarm of 50 fits on one screen
const CHURN_WINDOW = 600; // seconds of joins and quits counted in the summary

function replicaClass(k) {
  return k === 0 ? "gap" : k === 1 ? "r1" : "covered";
}

function renderMap(s, snap) {
  const table = s.querySelector("table.map");
  const n = Math.max(0, Math.min(Number(snap.num_blocks) || 0, 4096));
  table.classList.toggle("dense", snap.peers.length > DENSE);
  // the block numbers and the per-block replica counts head the map (sticky while its rows scroll)
  const head = el("tr", "blocks");
  head.appendChild(el("th", "peer", "block"));
  for (let b = 0; b < n; b++) head.appendChild(el("th", "block", b % 5 === 0 ? b : ""));
  const cover = el("tr", "coverage");
  cover.appendChild(el("th", "peer", "online replicas"));
  const standby = el("tr", "standbys");
  standby.appendChild(el("th", "peer", "standbys"));
  for (let b = 0; b < n; b++) {
    const k = Number(snap.online[b]) || 0;
    const td = el("td", "count " + replicaClass(k), k);
    td.title = "block " + b + ": " + k + " online";
    cover.appendChild(td);
    standby.appendChild(el("td", "count", Number(snap.standby[b]) || ""));
  }
  table.tHead.replaceChildren(head, cover, standby);

  const rows = [];
  let previous = null;
  for (const p of snap.peers) { // in span order (the snapshot's): replicas of a span sit together
    const tr = el("tr", "peer-row");
    tr.dataset.peerId = p.peer_id;
    const span = p.start + ":" + p.end;
    if (previous !== null && span !== previous) tr.classList.add("new-span");
    previous = span;
    const name = el("td", "peer", short(p.peer_id));
    name.title = p.peer_id + " (" + p.state + " " + span + ")";
    tr.appendChild(name);
    const cls = stateClass(p.state);
    for (let b = 0; b < n; b++) {
      const inside = b >= p.start && b < p.end;
      const td = el("td", "cell " + (inside ? cls : "empty"));
      if (inside) td.title = p.state + " " + span;
      tr.appendChild(td);
    }
    rows.push(tr);
  }
  table.tBodies[0].replaceChildren(...rows);
}

function where(counts, value) {
  // the blocks holding value, as runs: "3:5, 9"
  const runs = [];
  counts.forEach((k, b) => {
    if (k !== value) return;
    const last = runs[runs.length - 1];
    if (last && last[1] === b) last[1] = b + 1; else runs.push([b, b + 1]);
  });
  const text = runs.map(([a, b]) => (b === a + 1 ? String(a) : a + ":" + b)).join(", ");
  return text.length <= 40 ? text : text.slice(0, 40) + "\u2026";
}

function renderSummary(s, snap) {
  const counts = {};
  for (const p of snap.peers) counts[stateClass(p.state)] = (counts[stateClass(p.state)] || 0) + 1;
  const parts = STATES.filter((st) => counts[st] || st === "online").map((st) => (counts[st] || 0) + " " + st);
  s.querySelector(".peer-count").textContent = snap.peers.length + " (" + parts.join(", ") + ")";

  const online = (snap.online || []).map((k) => Number(k) || 0);
  const low = online.length ? Math.min(...online) : 0;
  const high = online.length ? Math.max(...online) : 0;
  const replicas = s.querySelector(".replicas");
  replicas.textContent = online.length
    ? "min " + low + " (block " + where(online, low) + "), max " + high + " (block " + where(online, high) + ")"
    : "-";
  replicas.className = "replicas " + (low === 0 ? "bad" : low === 1 ? "thin" : "");

  const since = Number(snap.taken_at) - CHURN_WINDOW;
  const seen = { joined: 0, left: 0, unreachable: 0 };
  for (const e of snap.events) if (e.kind in seen && Number(e.at) >= since) seen[e.kind] += 1;
  s.querySelector(".churn").textContent =
    seen.joined + " joined, " + seen.left + " left, " + seen.unreachable + " stopped answering";
}

function renderPeers(s, snap) {
  const rows = snap.peers.map((p) => {
    const tr = el("tr", "peer-row");
    tr.dataset.peerId = p.peer_id;
    const id = el("td", "mono", short(p.peer_id));
    id.title = p.peer_id;
    const state = el("span", "state cell " + stateClass(p.state), p.state);
    const stateTd = el("td");
    stateTd.appendChild(state);
    const load = p.reachable === null ? "-" : p.active + " active, " + p.open_sessions + " sessions";
    tr.append(
      id, stateTd, el("td", "mono", p.start + ":" + p.end), el("td", "", p.device), el("td", "", p.dtype),
      el("td", "", p.runtime), el("td", "", p.reached + (p.relays_for_others ? " +relay" : "")),
      el("td", "num", num(p.forward_tps)), el("td", "num", num(p.inference_sps)),
      el("td", "num", load), el("td", "num", p.cache_free + " / " + p.cache_total), el("td", "num", p.served),
    );
    return tr;
  });
  const table = s.querySelector("table.peers");
  table.classList.toggle("dense", snap.peers.length > DENSE);
  table.tBodies[0].replaceChildren(...rows);
}

const CHURN = ["joined", "left", "unreachable", "reachable"]; // listed apart: the broker's and others' can be many

function eventItem(e) {
  const li = el("li");
  li.append(el("span", "time", when(e.at)), " ", el("span", "kind kind-" + e.kind, e.kind), " ");
  if (e.peer_id) {
    const who = el("span", "mono", short(e.peer_id));
    who.title = e.peer_id;
    li.append(who, " ");
  }
  li.appendChild(el("span", "detail", e.detail));
  return li;
}

function renderEvents(s, snap) {
  const newest = snap.events.slice().reverse();
  for (const [selector, wanted] of [[".churn-events", true], [".other-events", false]]) {
    const items = newest.filter((e) => CHURN.includes(e.kind) === wanted).map(eventItem);
    if (items.length === 0) items.push(el("li", "muted", "none yet"));
    s.querySelector(selector).replaceChildren(...items);
  }
}

function renderAccusations(s, snap) {
  const rows = (snap.accusations || []).map((a) => {
    const tr = el("tr", "accusation-row");
    const accused = el("td", "mono", short(a.accused));
    accused.title = a.accused;
    const accuser = el("td", "mono", short(a.accuser));
    accuser.title = a.accuser;
    tr.append(
      accused, el("td", "mono", a.span), accuser, el("td", "", a.evidence_checks ? "signed, checks" : "does not check"),
      el("td", "", a.reason), el("td", "time", when(a.made)),
    );
    return tr;
  });
  if (rows.length === 0) {
    const tr = el("tr");
    const td = el("td", "muted", "none");
    td.colSpan = 6;
    tr.appendChild(td);
    rows.push(tr);
  }
  s.querySelector("table.accusations tbody").replaceChildren(...rows);
}

function render(state) {
  if (!state || state.v !== 1 || typeof state.models !== "object") return;
  document.getElementById("chat-link").hidden = !state.chat;
  const empty = document.getElementById("empty");
  if (empty) empty.remove();
  for (const [modelId, snap] of Object.entries(state.models)) {
    if (!snap || snap.v !== 1) continue;
    const s = section(modelId);
    s.querySelector(".model-id").textContent = snap.model_id + " (" + snap.num_blocks + " blocks)";
    const badge = s.querySelector(".coverage-badge");
    badge.textContent = snap.covered ? "fully covered" : "NOT covered";
    badge.className = "coverage-badge " + (snap.covered ? "ok" : "bad");
    s.querySelector(".broker").textContent = snap.broker
      ? short(snap.broker.holder) + " (term " + snap.broker.term + ")" : "none";
    s.querySelector(".broker").title = snap.broker ? snap.broker.holder : "";
    s.querySelector(".throughput").textContent =
      num(snap.forward_tps) + " fwd tok/s, " + num(snap.inference_sps) + " inference steps/s";
    s.querySelector(".dropped").textContent = String(snap.dropped);
    s.querySelector(".updated").textContent = when(snap.taken_at);
    renderSummary(s, snap);
    renderMap(s, snap);
    renderPeers(s, snap);
    renderAccusations(s, snap);
    renderEvents(s, snap);
  }
}

function connect() {
  const conn = document.getElementById("conn");
  const source = new EventSource("/dashboard/events");
  source.onopen = () => { conn.textContent = "live"; conn.className = "conn live"; };
  source.onmessage = (msg) => {
    try { render(JSON.parse(msg.data)); } catch (err) { console.warn("bad snapshot", err); }
  };
  source.onerror = () => { conn.textContent = "reconnecting\u2026"; conn.className = "conn down"; };
}

document.addEventListener("DOMContentLoaded", () => {
  fetch("/dashboard/state", { cache: "no-store" })
    .then((r) => (r.ok ? r.json() : null))
    .then(render)
    .catch(() => {})
    .finally(connect);
});
