// The live view's script: it reads /api/state every second, and the followed
// order's /api/journey, and sends the buttons to /api/actions/{name}.
"use strict";

let followed = "";

function $(sel, root) { return (root || document).querySelector(sel); }

function num(v) { return v === null || v === undefined ? "?" : String(v); }

function age(s) {
  if (s === null || s === undefined) return "?";
  if (s < 60) return s.toFixed(1) + " s";
  const m = Math.floor(s / 60);
  return m + " min " + Math.floor(s - 60 * m) + " s";
}

function clock(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  return isNaN(d) ? "" : d.toISOString().slice(11, 23);
}

function setStage(id, count, cls) {
  const el = document.getElementById(id);
  $(".count", el).textContent = num(count);
  el.dataset.count = count === null || count === undefined ? "" : String(count);
  el.classList.remove("hot", "bad", "good");
  if (cls) el.classList.add(cls);
}

function text(el, s) { el.textContent = s; return el; }

function renderState(s) {
  const st = s.stages;
  setStage("stage-created", st.orders_created);
  const pendingCls = st.pending > 0 ? (st.oldest_pending_age_seconds > 5 ? "bad" : "hot") : null;
  setStage("stage-pending", st.pending, pendingCls);
  const oldest = document.getElementById("oldest-age");
  oldest.textContent = st.pending > 0 ? age(st.oldest_pending_age_seconds) : "none waiting";
  oldest.dataset.seconds = st.oldest_pending_age_seconds === null ? "" : String(st.oldest_pending_age_seconds);
  setStage("stage-published", st.published);
  text(document.getElementById("events-written"), num(st.events_written));
  setStage("stage-queue", st.queue_ready, st.queue_ready > 0 ? "hot" : null);
  const q = document.querySelector("#stage-queue .sub");
  q.textContent = "ready; consumers " + num(st.queue_consumers) + ", delay queue " + num(st.delay_queue);
  setStage("stage-delivered", st.delivered);
  const caughtUp = st.applied !== null && st.applied === st.events_written && st.pending === 0;
  setStage("stage-applied", st.applied, caughtUp ? "good" : null);
  const dups = st.duplicates_inbox + st.duplicates_version;
  setStage("stage-duplicates", dups, dups > 0 ? "good" : null);
  $("#stage-duplicates .sub").textContent = "inbox " + st.duplicates_inbox + ", version " + st.duplicates_version + ", deferred " + st.deferred;
  const outboxDead = st.outbox_dead_letters, shipDead = st.shipping_dead_letters;
  const dead = (outboxDead || 0) + (shipDead || 0) + (st.dead_letter_queue || 0);
  setStage("stage-dead", dead, dead > 0 ? "bad" : null);
  let deadSub = "outbox " + num(outboxDead) + ", shipping " + num(shipDead) + ", DLQ " + num(st.dead_letter_queue);
  if (st.parked_aggregates) deadSub += ", parked orders " + st.parked_aggregates;
  $("#stage-dead .sub").textContent = deadSub;

  for (const p of s.processes) renderProc(p);

  const errs = Object.entries(s.errors || {}).map(([k, v]) => k + ": " + v);
  const line = document.getElementById("status-line");
  line.textContent = "updated " + clock(s.at) + " UTC" + (errs.length ? " — cannot read " + errs.join("; ") : "");
  line.className = errs.length ? "small step bad" : "small muted";

  const notes = document.getElementById("notes");
  notes.replaceChildren(...(s.notes || []).slice().reverse().map(n => {
    const li = document.createElement("li");
    li.textContent = clock(n.at) + "  " + n.text;
    return li;
  }));
}

function renderProc(p) {
  const card = document.getElementById("proc-" + p.name);
  if (!card) return;
  const badge = $(".badge", card);
  let state, cls;
  switch (p.state) {
    case "running":
      if (p.ready === false) { state = "up, not ready"; cls = "warn"; }
      else { state = "up"; cls = "up"; }
      break;
    case "restarting": state = "restarting"; cls = "warn"; break;
    case "stopped": state = "down (stopped)"; cls = "down"; break;
    default: state = "down"; cls = "down";
  }
  badge.textContent = state;
  badge.className = "badge " + cls;
  card.dataset.state = p.state;
  const bits = [];
  if (p.pid) bits.push("pid " + p.pid);
  if (p.restarts) bits.push("started again " + p.restarts + "×");
  if (p.published !== undefined && p.published !== null) bits.push("published " + p.published + " since start");
  if (p.armed) bits.push("armed: " + p.armed);
  if (p.ready === false && p.detail) bits.push(p.detail.length > 160 ? p.detail.slice(0, 160) + "…" : p.detail);
  if (p.state !== "running" && p.last_exit) bits.push("last exit: " + p.last_exit);
  $(".proc-detail", card).textContent = bits.join(" · ") || "–";
}

function cell(tr, content, cls) {
  const td = document.createElement("td");
  td.textContent = content;
  if (cls) td.className = "step " + cls;
  tr.appendChild(td);
  return td;
}

function renderJourney(j) {
  const box = document.getElementById("journey");
  box.classList.remove("muted");
  const head = document.createElement("p");
  head.textContent = "Order " + j.order_id + ": " + j.status + ", version " + j.version + ", created " + clock(j.created_at) +
    " UTC; shipment: " + (j.shipment || "none yet");
  const table = document.createElement("table");
  const hr = document.createElement("tr");
  for (const h of ["event", "outbox row written", "published", "delivered", "applied"]) {
    const th = document.createElement("th"); th.textContent = h; hr.appendChild(th);
  }
  table.appendChild(hr);
  for (const e of j.events) {
    const tr = document.createElement("tr");
    tr.dataset.version = e.version;
    cell(tr, e.event_type + " v" + e.version + " (message " + e.message_id + ")");
    cell(tr, clock(e.written_at), "done");
    const tries = e.attempts + " attempt" + (e.attempts === 1 ? "" : "s");
    switch (e.state) {
      case "published": cell(tr, "published " + clock(e.published_at) + " after " + tries, "done"); break;
      case "in_flight": cell(tr, "in flight: claimed by a relay that has not marked it (" + tries + ")", "wait"); break;
      case "dead_lettered": cell(tr, "dead-lettered after " + tries + ": " + (e.last_error || ""), "bad"); break;
      case "discarded": cell(tr, "discarded by an operator", "bad"); break;
      default: cell(tr, "pending" + (e.attempts ? " (" + tries + ", last error: " + (e.last_error || "") + ")" : ""), "wait");
    }
    const d = e.deliveries || [];
    cell(tr, d.length ? "delivered " + d.length + "×: " + d.map(x => x.outcome + " " + clock(x.at)).join(", ") : "not delivered yet",
      d.length ? "done" : "wait");
    if (e.applied === 1) cell(tr, "applied once " + clock(e.applied_at), "done");
    else if (e.applied > 1) cell(tr, "applied " + e.applied + " times!", "bad");
    else cell(tr, "not applied yet", "wait");
    table.appendChild(tr);
  }
  box.replaceChildren(head, table);
}

async function refreshJourney() {
  if (!followed) return;
  try {
    const r = await fetch("/api/journey?order=" + encodeURIComponent(followed));
    const body = await r.json();
    if (!r.ok) { text(document.getElementById("journey"), "Order " + followed + ": " + body.error.message); return; }
    renderJourney(body);
  } catch (e) { /* the next tick retries */ }
}

async function refresh() {
  try {
    const r = await fetch("/api/state");
    if (r.ok) renderState(await r.json());
  } catch (e) {
    text(document.getElementById("status-line"), "the demo is not answering (stopped?)");
  }
  await refreshJourney();
}

function follow(id) {
  followed = id.trim();
  document.getElementById("follow-id").value = followed;
  refreshJourney();
}

async function act(btn) {
  const name = btn.dataset.action;
  if (btn.dataset.confirm && !window.confirm(btn.dataset.confirm)) return;
  const params = new URLSearchParams();
  if (btn.dataset.process) params.set("process", btn.dataset.process);
  if (followed) params.set("order", followed);
  const out = document.getElementById("action-result");
  out.textContent = btn.textContent + "…";
  btn.disabled = true;
  try {
    const r = await fetch("/api/actions/" + name + "?" + params, { method: "POST" });
    const body = await r.json();
    if (!r.ok) { out.textContent = btn.textContent + ": " + body.error.message; out.className = "small step bad"; return; }
    out.textContent = btn.textContent + ": " + body.message;
    out.className = "small";
    if (body.order_id) follow(body.order_id);
  } catch (e) {
    out.textContent = btn.textContent + ": " + e;
  } finally {
    btn.disabled = false;
    refresh();
  }
}

document.addEventListener("click", ev => {
  const btn = ev.target.closest("button[data-action]");
  if (btn) act(btn);
});
document.getElementById("follow-form").addEventListener("submit", ev => {
  ev.preventDefault();
  follow(document.getElementById("follow-id").value);
});
// live view?order=ID follows that order from the start.
const wanted = new URLSearchParams(location.search).get("order");
if (wanted) follow(wanted);
refresh();
setInterval(refresh, 1000);
