// The leasecore dashboard: plain JavaScript over the public /v1 API of the node that served it.
// It polls the cluster, keys, leases and members, follows events by long-poll watch, and keeps
// going through node restarts (a banner while the node does not answer). With auth on, a 401
// shows the sign-in box; the token is kept in sessionStorage and sent as a bearer token.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  token: sessionStorage.getItem("leasecore-token") || "",
  selectedKey: null,
  leases: [], leasesFetchedAt: 0,
  eventsPaused: false, eventsPrefix: "", eventsFrom: null, eventsGen: 0,
};

class ApiError extends Error {
  constructor(status, body) {
    super((body && body.error && body.error.message) || `HTTP ${status}`);
    this.status = status; this.code = body && body.error && body.error.code;
  }
}

async function api(method, path, body) {
  const headers = {};
  if (state.token) headers.Authorization = `Bearer ${state.token}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let resp;
  try {
    resp = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  } catch (e) {
    disconnected(true);
    throw e;
  }
  disconnected(false);
  const text = await resp.text();
  const doc = text ? JSON.parse(text) : null;
  if (resp.status === 401) { showLogin(true); throw new ApiError(401, doc); }
  if (!resp.ok) throw new ApiError(resp.status, doc);
  return doc;
}

function disconnected(down) {
  const b = $("banner");
  if (down) { b.textContent = "This node does not answer; retrying…"; b.hidden = false; setHealth("down", "bad"); }
  else if (!b.hidden) { b.hidden = true; }
}

function showLogin(show) {
  $("login").hidden = !show;
  $("main").hidden = show;
}

function setHealth(text, cls) {
  const h = $("health");
  h.textContent = text; h.className = `pill ${cls}`;
}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function ago(ms) {
  if (ms === null || ms === undefined) return "–";
  return ms < 1000 ? `${ms} ms ago` : `${(ms / 1000).toFixed(1)} s ago`;
}

// ---- cluster ----------------------------------------------------------------------------
async function refreshCluster() {
  const v = await api("GET", "/v1/cluster");
  $("leader").textContent = v.leader_id ?? "none";
  $("term").textContent = v.term;
  $("revision").textContent = v.revision;
  $("served-by").textContent = `node ${v.node_id} (${v.state})`;
  // Only the leader hears from every node: a follower knows its leader's contact, not its peers'.
  $("view-of").textContent = `as node ${v.node_id} sees it`;
  if (v.leader_id == null) setHealth("no leader", "bad");
  else if (!v.ready) setHealth("not ready", "warn");
  else setHealth("healthy", "ok");
  const body = $("nodes").tBodies[0];
  body.replaceChildren(...v.nodes.map((n) => el("tr", { "data-node": n.id },
    el("td", {}, n.id),
    el("td", {}, n.address),
    el("td", {}, (n.voter ? "voter" : "learner") + (n.id === v.leader_id ? " (leader)" : "")),
    el("td", { class: n.reachable === true ? "yes" : n.reachable === false ? "no" : "" },
      n.reachable === true ? "yes" : n.reachable === false ? "no" : "–"),
    el("td", { class: "num" }, ago(n.last_contact_ms)),
    el("td", { class: "num" }, n.lag ?? "–"))));
}

// ---- keys -------------------------------------------------------------------------------
async function refreshKeys() {
  const prefix = $("key-prefix").value;
  const doc = await api("GET", `/v1/kv?prefix=${encodeURIComponent(prefix)}&limit=1000`);
  const root = {};
  for (const item of doc.items) {
    const parts = item.key.split("/");
    let node = root;
    parts.forEach((p, i) => {
      const leaf = i === parts.length - 1;
      const name = leaf ? p : `${p}/`;
      node[name] = node[name] || (leaf ? { item } : { children: {} });
      if (leaf) node[name].item = item; else node = node[name].children || (node[name].children = {});
    });
  }
  $("key-tree").replaceChildren(doc.items.length ? renderTree(root) : el("p", { class: "hint" }, "no keys"));
}

function renderTree(node) {
  const ul = el("ul");
  for (const name of Object.keys(node).sort()) {
    const n = node[name];
    if (n.item) {
      const it = n.item;
      const label = el("span", { class: "key" + (it.key === state.selectedKey ? " selected" : ""), "data-key": it.key,
        onclick: () => selectKey(it) }, name);
      const lease = it.lease ? el("a", { class: "lease-link", onclick: () => highlightLease(it.lease) }, ` lease ${it.lease}`) : "";
      ul.append(el("li", {}, label, " ", el("span", { class: "rev" }, `rev ${it.mod_revision}`), lease));
    }
    if (n.children) {
      const d = el("details", { open: "" }, el("summary", {}, name), renderTree(n.children));
      ul.append(el("li", {}, d));
    }
  }
  return ul;
}

function selectKey(item) {
  state.selectedKey = item.key;
  state.selectedRevision = item.mod_revision;
  $("key-form-title").textContent = "Edit key";
  $("key-name").value = item.key; $("key-name").readOnly = true;
  $("key-value").value = item.value;
  $("key-lease").value = item.lease || "";
  $("key-save").textContent = "Save";
  $("key-delete").hidden = false;
  $("key-cas").textContent = `Saving and deleting check that the key is still at revision ${item.mod_revision}.`;
  $("key-error").textContent = "";
  refreshKeys().catch(() => {});
}

function newKey() {
  state.selectedKey = null; state.selectedRevision = 0;
  $("key-form-title").textContent = "New key";
  $("key-name").value = ""; $("key-name").readOnly = false;
  $("key-value").value = ""; $("key-lease").value = "";
  $("key-save").textContent = "Create";
  $("key-delete").hidden = true;
  $("key-cas").textContent = "Creating checks that the key does not exist yet.";
  $("key-error").textContent = "";
}

async function saveKey(ev) {
  ev.preventDefault();
  const key = $("key-name").value;
  const body = { value: $("key-value").value };
  if ($("key-lease").value) body.lease = $("key-lease").value;
  const rev = state.selectedKey ? state.selectedRevision : 0;
  try {
    const r = await api("PUT", `/v1/kv/${encodeKey(key)}?prev_revision=${rev}`, body);
    state.selectedKey = key; state.selectedRevision = r.revision;
    $("key-error").textContent = "";
    selectKey({ key, value: body.value, lease: body.lease || null, mod_revision: r.revision });
  } catch (e) { $("key-error").textContent = e.message; }
}

async function deleteKey() {
  try {
    await api("DELETE", `/v1/kv/${encodeKey(state.selectedKey)}?prev_revision=${state.selectedRevision}`);
    newKey(); refreshKeys();
  } catch (e) { $("key-error").textContent = e.message; }
}

function encodeKey(k) { return k.split("/").map(encodeURIComponent).join("/"); }

// ---- leases -----------------------------------------------------------------------------
async function refreshLeases() {
  const doc = await api("GET", "/v1/leases?limit=1000");
  state.leases = doc.leases; state.leasesFetchedAt = performance.now();
  const body = $("leases").tBodies[0];
  body.replaceChildren(...doc.leases.map((l) => el("tr", { "data-lease": l.name },
    el("td", {}, l.name),
    el("td", { class: "num countdown", "data-remaining": l.remaining_ms ?? "" }, fmtLeft(l.remaining_ms)),
    el("td", { class: "num" }, `${(l.ttl_ms / 1000).toFixed(1)} s`),
    el("td", { class: "num", title: "fencing token" }, l.revision),
    el("td", {}, ...l.keys.flatMap((k, i) => [i ? ", " : "", el("a", { onclick: () => selectKeyByName(k) }, k)])),
    el("td", {}, el("button", { class: "danger", "data-revoke": l.name, onclick: () => revokeLease(l.name) }, "Revoke")))));
}

function fmtLeft(ms) { return ms === null || ms === undefined ? "–" : `${(Math.max(0, ms) / 1000).toFixed(1)} s`; }

function tickCountdowns() {
  const elapsed = performance.now() - state.leasesFetchedAt;
  for (const td of document.querySelectorAll("#leases td.countdown")) {
    const r = td.dataset.remaining;
    if (r !== "") td.textContent = fmtLeft(Number(r) - elapsed);
  }
}

async function grantLease(ev) {
  ev.preventDefault();
  try {
    await api("POST", "/v1/leases", { name: $("lease-name").value, ttl_ms: Number($("lease-ttl").value) });
    $("lease-error").textContent = ""; $("lease-name").value = "";
    refreshLeases();
  } catch (e) { $("lease-error").textContent = e.message; }
}

async function revokeLease(name) {
  try {
    await api("DELETE", `/v1/leases/${encodeURIComponent(name)}`);
    refreshLeases(); refreshKeys();
  } catch (e) { $("lease-error").textContent = e.message; }
}

function highlightLease(name) {
  const row = document.querySelector(`#leases tr[data-lease="${CSS.escape(name)}"]`);
  if (row) { row.scrollIntoView({ block: "nearest" }); row.classList.remove("flash"); void row.offsetWidth; row.classList.add("flash"); }
}

async function selectKeyByName(key) {
  const doc = await api("GET", `/v1/kv/${encodeKey(key)}`);
  selectKey(doc);
}

// ---- members ----------------------------------------------------------------------------
async function refreshMembers() {
  const doc = await api("GET", "/v1/members");
  const leases = new Map(state.leases.map((l) => [l.name, l]));
  const body = $("members").tBodies[0];
  body.replaceChildren(...doc.members.map((m) => {
    const l = leases.get(`members/${m.id}`);
    const since = l && l.remaining_ms != null ? ago(l.ttl_ms - l.remaining_ms) : "–";
    const meta = Object.entries(m.meta || {}).map(([k, v]) => `${k}=${v}`).join(", ");
    return el("tr", {}, el("td", {}, m.id), el("td", {}, m.address), el("td", {}, meta || "–"), el("td", { class: "num" }, since));
  }));
}

// ---- flease -----------------------------------------------------------------------------
async function lookupFlease(ev) {
  ev.preventDefault();
  const kind = $("flease-kind").value, res = $("flease-resource").value;
  try {
    const v = await api("GET", `/v1/${kind}/${encodeURIComponent(res)}`);
    $("flease-result").textContent = v.holder
      ? `${res}: held by ${v.holder}, epoch ${v.epoch}, ${(v.valid_ms / 1000).toFixed(1)} s left`
      : `${res}: free`;
  } catch (e) { $("flease-result").textContent = e.message; }
}

// ---- events -----------------------------------------------------------------------------
async function followEvents() {
  const gen = ++state.eventsGen;
  while (gen === state.eventsGen) {
    if (state.eventsPaused) { await sleep(300); continue; }
    const prefix = encodeURIComponent(state.eventsPrefix);
    const from = state.eventsFrom ? `&from_revision=${state.eventsFrom}` : "";
    try {
      const doc = await api("GET", `/v1/watch?prefix=${prefix}${from}&timeout_ms=20000`);
      if (gen !== state.eventsGen) return;
      for (const e of doc.events) addEvent(e);
      state.eventsFrom = doc.revision + 1;
      $("events-state").textContent = `following from revision ${state.eventsFrom}`;
    } catch (e) {
      if (e.status === 410) { state.eventsFrom = null; $("events-state").textContent = "history compacted: following from now"; }
      else await sleep(1000);
    }
  }
}

function addEvent(e) {
  const list = $("events");
  const text = `#${e.revision} ${e.type} ${e.key}` + (e.type === "put" ? ` = ${e.value}` : "") + (e.cause && e.cause !== "client" ? ` (${e.cause})` : "");
  list.prepend(el("li", { class: e.type }, text));
  while (list.children.length > 200) list.lastChild.remove();
}

function sleep(ms) { return new Promise((r) => setTimeout(r, ms)); }

// ---- wiring -----------------------------------------------------------------------------
async function login(ev) {
  ev.preventDefault();
  try {
    state.token = "";
    const r = await api("POST", "/v1/auth/authenticate", { name: $("login-user").value, password: $("login-password").value });
    state.token = r.token;
    sessionStorage.setItem("leasecore-token", r.token);
    showLogin(false);
    refreshAll();
  } catch (e) { $("login-error").textContent = e.message; }
}

async function refreshAll() {
  try {
    await refreshCluster();
    await refreshLeases();
    await Promise.all([refreshKeys(), refreshMembers()]);
  } catch (e) { /* the banner or the login box says what went wrong */ }
}

function every(ms, f) { f(); setInterval(f, ms); }

window.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", login);
  $("key-form").addEventListener("submit", saveKey);
  $("key-delete").addEventListener("click", deleteKey);
  $("key-new").addEventListener("click", newKey);
  $("key-prefix").addEventListener("input", () => refreshKeys().catch(() => {}));
  $("lease-form").addEventListener("submit", grantLease);
  $("flease-form").addEventListener("submit", lookupFlease);
  $("events-pause").addEventListener("click", () => {
    state.eventsPaused = !state.eventsPaused;
    $("events-pause").textContent = state.eventsPaused ? "Resume" : "Pause";
  });
  $("events-prefix").addEventListener("change", () => {
    state.eventsPrefix = $("events-prefix").value; state.eventsFrom = null;
    $("events").replaceChildren(); followEvents();
  });
  newKey();
  every(1000, refreshAll);
  setInterval(tickCountdowns, 100);
  followEvents();
});
