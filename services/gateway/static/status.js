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

// Disaggregated prefill / decode: an engine's transfers (producer: pulled by decode engines, expired,
// held now; consumer: pulled, failed) and the KV bytes moved.
function transfers(t) {
  if (!t) return "-";
  const n = (v) => Number(v || 0);
  const mib = (v) => (n(v) / (1 << 20)).toFixed(1) + " MiB";
  if (t.kv_role === "kv_producer") {
    return `sent ${n(t.transfers_sent)} (${mib(t.bytes_sent)}), expired ${n(t.transfers_expired)}, released ${n(t.transfers_released)}, ` +
           `held ${n(t.transfers_held)} (${n(t.held_blocks)} blocks)`;
  }
  const received = `received ${n(t.transfers_received)} (${mib(t.bytes_received)}), failed ${n(t.transfers_failed)}`;
  return t.kv_role === "kv_both" ? `${received}; sent ${n(t.transfers_sent)} (${mib(t.bytes_sent)}), ` +
                                   `held ${n(t.transfers_held)}` : received;
}

function renderEngines(engines) {
  statusEl.engines.replaceChildren(...engines.map((e) => {
    const tr = document.createElement("tr");
    tr.dataset.name = e.name;
    tr.dataset.kvRole = e.kv_role || "";
    tr.append(cell(e.name), cell(e.address), cell(e.kv_role || "-", "kv-role"), cell(e.num_waiting, "num"), cell(e.num_running, "num running"),
              cell((100 * e.kv_cache_usage).toFixed(1) + " %", "num"),
              cell((100 * (e.prefix_cache_hit_rate || 0)).toFixed(1) + " %", "num prefix-hits"),
              cell(e.generation_tokens_per_second.toFixed(1), "num"), cell(e.num_workers, "num"),
              cell(transfers(e.kv_transfers), "kv-transfers"));
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
