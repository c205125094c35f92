// The operators' status page: GET /v1/status every second while the page is shown, rendered as a
// table of processes (every role, workers included) and one of engine load.
"use strict";

const REFRESH_MS = 1000;
const statusEl = {
  roles: document.querySelector("#roles tbody"),
  engines: document.querySelector("#engines tbody"),
  time: document.getElementById("status-time"),
  error: document.getElementById("status-error"),
};
let statusTimer = null;

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function renderRoles(roles) {
  statusEl.roles.replaceChildren(...roles.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.name = r.name;
    tr.dataset.health = r.health;
    tr.append(cell(r.name), cell(r.role), cell(r.address), cell(r.health, "health " + r.health),
              cell(r.ready ? "yes" : "no"), cell(r.detail));
    return tr;
  }));
}

function renderEngines(engines) {
  statusEl.engines.replaceChildren(...engines.map((e) => {
    const tr = document.createElement("tr");
    tr.dataset.name = e.name;
    tr.append(cell(e.name), cell(e.address), cell(e.num_waiting, "num"), cell(e.num_running, "num running"),
              cell((100 * e.kv_cache_usage).toFixed(1) + " %", "num"),
              cell((100 * (e.prefix_cache_hit_rate || 0)).toFixed(1) + " %", "num prefix-hits"),
              cell(e.generation_tokens_per_second.toFixed(1), "num"), cell(e.num_workers, "num"));
    return tr;
  }));
}

async function refreshStatus() {
  try {
    const response = await fetch("/v1/status", { headers: apiHeaders() });
    if (!response.ok) throw new Error(await errorText(response));
    const body = await response.json();
    renderRoles(body.roles);
    renderEngines(body.engines);
    statusEl.time.textContent = new Date(body.time * 1000).toLocaleTimeString();
    statusEl.error.textContent = "";
  } catch (err) {
    statusEl.error.textContent = err.message;
  }
}

document.addEventListener("page", (e) => {
  clearInterval(statusTimer);
  statusTimer = null;
  if (e.detail === "status") {
    refreshStatus();
    statusTimer = setInterval(refreshStatus, REFRESH_MS);
  }
});
showPage();
