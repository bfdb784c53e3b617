// The live view's script: it reads /api/state every second, and the followed
// order's /api/journey, and sends the buttons to /api/actions/{name}.
//
// It changes the page in place: a text is written only when it differs from
// what is shown, and the journey's rows are kept from one reading to the
// next, so a selection survives (a message id can be copied) and a screen
// reader is not interrupted every second. A count that could not be read is
// shown as "unknown", never as 0; when /api/state fails, a banner says so,
// and numbers read more than STALE_AFTER seconds ago are marked stale.
"use strict";

const STALE_AFTER = 5; // seconds

let followed = "";
let journeyOf = "";  // the order whose rows the journey table holds
let lastRead = null; // the last state read: {at, age, received}

function $(sel, root) { return (root || document).querySelector(sel); }
function byId(id) { return document.getElementById(id); }
function known(v) { return v !== null && v !== undefined; }
function num(v) { return known(v) ? String(v) : "unknown"; }

// setText writes an element's text only when it changes.
function setText(el, s) {
  if (el.textContent !== s) el.textContent = s;
  return el;
}

function setClassName(el, name) {
  if (el.className !== name) el.className = name;
}

function setData(el, key, value) {
  if (el.dataset[key] !== value) el.dataset[key] = value;
}

function age(s) {
  if (!known(s)) return "unknown";
  if (s < 60) return s.toFixed(1) + " s";
  const m = Math.floor(s / 60);
  return m + " min " + Math.floor(s - 60 * m) + " s";
}

function clock(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  return isNaN(d) ? "" : d.toISOString().slice(11, 23);
}

// setStage shows a stage's count and its state: cls colours it (hot, bad or
// good) and flag says the same in words.
function setStage(id, count, cls, flag) {
  const el = byId(id);
  const c = $(".count", el);
  setText(c, num(count));
  c.classList.toggle("unknown", !known(count));
  setData(el, "count", known(count) ? String(count) : "");
  for (const k of ["hot", "bad", "good"]) el.classList.toggle(k, k === cls);
  setText($(".flag", el), flag || "");
}

function renderState(s) {
  const st = s.stages;
  setStage("stage-created", st.orders_created);

  let pendingCls = null, pendingFlag = "";
  if (st.pending > 0) {
    const stuck = st.oldest_pending_age_seconds > 5;
    pendingCls = stuck ? "bad" : "hot";
    pendingFlag = stuck ? "⚠ waiting for more than 5 s" : "waiting to be published";
  }
  setStage("stage-pending", st.pending, pendingCls, pendingFlag);
  const oldest = byId("oldest-age");
  setText(oldest, !known(st.pending) ? "oldest: unknown" : st.pending > 0 ? "oldest " + age(st.oldest_pending_age_seconds) : "none waiting");
  setData(oldest, "seconds", known(st.pending) && known(st.oldest_pending_age_seconds) ? String(st.oldest_pending_age_seconds) : "");

  setStage("stage-published", st.published);
  setText(byId("events-written"), num(st.events_written));

  setStage("stage-queue", st.queue_ready, st.queue_ready > 0 ? "hot" : null, st.queue_ready > 0 ? "waiting for shipping" : "");
  setText($("#stage-queue .sub"), "ready; consumers " + num(st.queue_consumers) + ", delay queue " + num(st.delay_queue));

  setStage("stage-delivered", st.delivered);
  const caughtUp = known(st.applied) && known(st.events_written) && st.applied === st.events_written && st.pending === 0;
  setStage("stage-applied", st.applied, caughtUp ? "good" : null, caughtUp ? "✓ caught up: applied = events written" : "");

  const dups = st.duplicates_inbox + st.duplicates_version;
  setStage("stage-duplicates", dups, dups > 0 ? "good" : null, dups > 0 ? "✓ absorbed, none applied twice" : "");
  setText($("#stage-duplicates .sub"), "inbox " + st.duplicates_inbox + ", version " + st.duplicates_version + ", deferred " + st.deferred);

  // Shipping records a dead letter in MongoDB and publishes it to the
  // dead-letter queue: the queue counts it, the record is its copy.
  const outboxDead = st.outbox_dead_letters, queueDead = st.dead_letter_queue;
  const dead = known(outboxDead) && known(queueDead) ? outboxDead + queueDead : null;
  setStage("stage-dead", dead, dead > 0 ? "bad" : null, dead > 0 ? "⚠ an operator must look" : "");
  let deadSub = "outbox " + num(outboxDead) + ", dead-letter queue " + num(queueDead) + "; shipping keeps " + num(st.shipping_dead_letters) + " for replay";
  if (st.parked_aggregates) deadSub += ", " + st.parked_aggregates + " orders held";
  setText($("#stage-dead .sub"), deadSub);

  for (const p of s.processes || []) renderProc(p);
  renderAudit(s);

  const errs = Object.entries(s.errors || {}).map(([k, v]) => k + ": " + v);
  const line = byId("status-line");
  setText(line, "read " + clock(s.at) + " UTC" + (errs.length ? " · cannot read " + errs.join("; ") : ""));
  setData(line, "at", s.at || "");
  setClassName(line, errs.length ? "status bad" : "status");

  renderNotes(s.notes || []);
}

// AUDIT_BUCKETS are the audit report's buckets the panel shows.
const AUDIT_BUCKETS = ["applied", "unrecorded", "held", "pending", "dead_lettered", "discarded", "missing", "phantom"];

// renderAudit shows the loss audit's last result: its counts, when it ran,
// and whether the flow is whole; when something is missing or a phantom,
// an alarm says so in words, with example ids.
function renderAudit(s) {
  const a = s.audit;
  const err = (s.errors || {}).audit;
  const panel = byId("audit");
  const verdict = byId("audit-verdict");
  const alarm = byId("audit-alarm");
  const setBucket = (name, count, bad) => {
    const box = byId("audit-" + name);
    setText($("dd", box), num(count));
    setData(box, "count", known(count) ? String(count) : "");
    box.classList.toggle("bad", !!bad);
  };
  if (!a) {
    let state = "none", text = "No loss audit runs in this mode.";
    if (err === "no audit has completed yet") { state = "waiting"; text = "Waiting for the first audit to complete."; }
    else if (err) { state = "unknown"; text = "Result unknown: cannot read the audit (" + err + ")."; }
    setData(panel, "state", state);
    setText(verdict, text);
    setClassName(verdict, "audit-verdict");
    setText(byId("audit-when"), "–");
    setBucket("checked", null);
    for (const b of AUDIT_BUCKETS) setBucket(b, null);
    if (!alarm.hidden) { alarm.hidden = true; alarm.textContent = ""; }
    return;
  }
  setData(panel, "state", a.whole ? "whole" : "not-whole");
  setData(panel, "auditedAt", a.audited_at);
  setBucket("checked", a.checked);
  for (const b of AUDIT_BUCKETS) setBucket(b, a[b].count, (b === "missing" || b === "phantom") && a[b].count > 0);
  setText(verdict, a.whole ? "✓ Whole: nothing missing, no phantom." : "⚠ NOT WHOLE: " + a.missing.count + " missing, " + a.phantom.count + " phantom.");
  setClassName(verdict, "audit-verdict " + (a.whole ? "good" : "bad"));
  const before = known(s.at) ? (new Date(s.at) - new Date(a.audited_at)) / 1000 : null;
  setText(byId("audit-when"), "Last audit ran at " + clock(a.audited_at) + " UTC" +
    (known(before) && before >= 0 ? " (" + age(before) + " before this reading)" : "") +
    " in " + a.duration_seconds.toFixed(3) + " s; it judged the events created from " + dateTime(a.since) + " to " + dateTime(a.until) +
    " UTC; " + a.inbox_records + " inbox records read.");
  if (a.whole) {
    if (!alarm.hidden) { alarm.hidden = true; alarm.textContent = ""; }
    return;
  }
  const bits = [];
  if (a.missing.count > 0) bits.push(a.missing.count + " event(s) committed and never applied (missing" + examples(a.missing) + ")");
  if (a.phantom.count > 0) bits.push(a.phantom.count + " inbox record(s) of events never committed (phantom" + examples(a.phantom) + ")");
  setText(alarm, "Alarm: the flow is not whole: " + bits.join("; ") + ".");
  alarm.hidden = false;
}

function dateTime(iso) {
  const d = new Date(iso);
  return isNaN(d) ? "unknown" : d.toISOString().slice(0, 19).replace("T", " ");
}

function examples(b) {
  return b.examples && b.examples.length ? ": " + b.examples.join(", ") : "";
}

function renderProc(p) {
  const card = byId("proc-" + p.name);
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
  setText(badge, state);
  setClassName(badge, "badge " + cls);
  setData(card, "state", p.state);
  setData(card, "pid", p.pid ? String(p.pid) : "");
  const bits = [];
  if (p.pid) bits.push("pid " + p.pid);
  if (p.restarts) bits.push("started again " + p.restarts + "×");
  if (known(p.published)) bits.push("published " + p.published + " since start");
  if (p.armed) bits.push("armed: " + p.armed);
  if (p.ready === false && p.detail) bits.push(p.detail.length > 160 ? p.detail.slice(0, 160) + "…" : p.detail);
  if (p.state !== "running" && p.last_exit) bits.push("last exit: " + p.last_exit);
  setText($(".proc-detail", card), bits.join(" · ") || "–");
}

// renderNotes adds the new notes at the top and drops those the demo no
// longer keeps; the others stay as they are.
function renderNotes(notes) {
  const list = byId("notes");
  const keys = new Set(notes.map(n => n.at + " " + n.text));
  for (const li of [...list.children]) if (!keys.has(li.dataset.key)) li.remove();
  const have = new Set([...list.children].map(li => li.dataset.key));
  for (const n of notes) {
    const key = n.at + " " + n.text;
    if (have.has(key)) continue;
    const li = document.createElement("li");
    li.dataset.key = key;
    li.textContent = clock(n.at) + "  " + n.text;
    list.prepend(li);
  }
}

// showBanner shows msg in the alert banner, or hides it for "". The text
// changes only with the problem, so it is announced once.
function showBanner(msg) {
  const b = byId("banner");
  if (msg) {
    setText(b, msg);
    b.hidden = false;
  } else if (!b.hidden) {
    b.hidden = true;
    b.textContent = "";
  }
}

function updateStaleness() {
  const note = byId("stale-note");
  if (!lastRead) return;
  const old = lastRead.age + (performance.now() - lastRead.received) / 1000;
  const stale = old > STALE_AFTER;
  document.body.classList.toggle("stale", stale);
  setData(document.body, "stale", String(stale));
  note.hidden = !stale;
  if (stale) setText(note, "Stale: the numbers below were read at " + clock(lastRead.at) + " UTC, " + Math.round(old) + " s ago.");
}

function cell(tr) {
  const td = document.createElement("td");
  tr.appendChild(td);
  return td;
}

function setCell(td, text, cls) {
  setText(td, text);
  setClassName(td, "step " + cls);
}

// newEventRow builds an event's row; what does not change (its type, message
// id and trace) is written once.
function newEventRow(e) {
  const tr = document.createElement("tr");
  tr.id = "event-" + e.message_id;
  tr.dataset.version = e.version;
  const first = cell(tr);
  first.append(e.event_type + " v" + e.version);
  const msg = document.createElement("div");
  msg.className = "small";
  const id = document.createElement("code");
  id.className = "message-id";
  id.textContent = e.message_id;
  msg.append("message ", id);
  first.append(msg);
  const trace = document.createElement("div");
  trace.className = "small trace";
  if (e.trace_id) {
    const code = document.createElement("code");
    code.className = "trace-id";
    code.textContent = e.trace_id;
    if (e.trace_url) {
      const a = document.createElement("a");
      a.href = e.trace_url;
      a.target = "_blank";
      a.rel = "noopener";
      a.append(code);
      trace.append("trace ", a, " (Jaeger)");
    } else {
      trace.append("trace ", code);
    }
  } else {
    trace.append("no trace id (the event carries no traceparent: tracing is off)");
  }
  first.append(trace);
  for (let i = 0; i < 4; i++) cell(tr);
  return tr;
}

function updateEventRow(tr, e) {
  const [, written, published, delivered, applied] = tr.children;
  setCell(written, clock(e.written_at), "done");
  const tries = e.attempts + " attempt" + (e.attempts === 1 ? "" : "s");
  switch (e.state) {
    case "published": setCell(published, "published " + clock(e.published_at) + " after " + tries, "done"); break;
    case "in_flight": setCell(published, "in flight: claimed by a relay that has not marked it (" + tries + ")", "wait"); break;
    case "dead_lettered": setCell(published, "dead-lettered after " + tries + ": " + (e.last_error || ""), "bad"); break;
    case "discarded": setCell(published, "discarded by an operator", "bad"); break;
    default: setCell(published, "pending" + (e.attempts ? " (" + tries + ", last error: " + (e.last_error || "") + ")" : ""), "wait");
  }
  const d = e.deliveries || [];
  setCell(delivered, d.length ? "delivered " + d.length + "×: " + d.map(x => x.outcome + " " + clock(x.at)).join(", ") : "not delivered yet",
    d.length ? "done" : "wait");
  if (e.applied === 1) setCell(applied, "applied once " + clock(e.applied_at), "done");
  else if (e.applied > 1) setCell(applied, "applied " + e.applied + " times!", "bad");
  else setCell(applied, "not applied yet", "wait");
}

function renderJourney(j) {
  const rows = byId("journey-rows");
  if (journeyOf !== j.order_id) {
    rows.replaceChildren();
    journeyOf = j.order_id;
  }
  const head = byId("journey-head");
  head.classList.remove("muted");
  setText(head, "Order " + j.order_id + ": " + j.status + ", version " + j.version + ", created " + clock(j.created_at) +
    " UTC; shipment: " + (j.shipment || "none yet"));
  byId("journey-error").hidden = true;
  byId("journey-table").hidden = false;
  const shown = new Set();
  for (const e of j.events) {
    let tr = byId("event-" + e.message_id);
    if (!tr) {
      tr = newEventRow(e);
      rows.appendChild(tr);
    }
    shown.add(tr.id);
    updateEventRow(tr, e);
  }
  for (const tr of [...rows.children]) if (!shown.has(tr.id)) tr.remove();
}

function journeyFailed(msg) {
  if (journeyOf !== followed) {
    byId("journey-rows").replaceChildren();
    byId("journey-table").hidden = true;
    journeyOf = "";
    setText(byId("journey-head"), "Order " + followed);
  }
  const err = byId("journey-error");
  setText(err, msg);
  err.hidden = false;
}

async function refreshJourney() {
  if (!followed) return;
  const want = followed;
  let r, body;
  try {
    r = await fetch("/api/journey?order=" + encodeURIComponent(want), { cache: "no-store", signal: AbortSignal.timeout(10000) });
    body = await r.json();
  } catch (e) {
    return; // the demo is not answering: the banner says so; the next tick retries
  }
  if (want !== followed) return;
  if (!r.ok) {
    journeyFailed("Order " + want + ": " + (body.error ? body.error.message : "HTTP " + r.status));
    return;
  }
  renderJourney(body);
}

async function readState() {
  let r;
  try {
    r = await fetch("/api/state", { cache: "no-store", signal: AbortSignal.timeout(5000) });
  } catch (e) {
    return { problem: "the demo is not answering (stopped?)" };
  }
  if (r.status === 503) return { starting: true };
  if (!r.ok) return { problem: "it answered HTTP " + r.status + (r.statusText ? " " + r.statusText : "") };
  try {
    return { state: await r.json() };
  } catch (e) {
    return { problem: "its answer is not JSON" };
  }
}

async function refresh() {
  const { state, problem, starting } = await readState();
  if (starting) setText(byId("status-line"), "connecting: the demo is reading the system for the first time…");
  if (state) {
    lastRead = { at: state.at, age: state.age_seconds || 0, received: performance.now() };
    renderState(state);
  }
  showBanner(problem ? "Cannot read the demo's state: " + problem + ". The numbers below are the last ones read." : "");
  updateStaleness();
  await refreshJourney();
}

async function loop() {
  try {
    await refresh();
  } finally {
    setTimeout(loop, 1000);
  }
}

function follow(id) {
  followed = id.trim();
  byId("follow-id").value = followed;
  refreshJourney();
}

async function act(btn) {
  const name = btn.dataset.action;
  if (btn.dataset.confirm && !window.confirm(btn.dataset.confirm)) return;
  const params = new URLSearchParams();
  if (btn.dataset.process) params.set("process", btn.dataset.process);
  if (followed) params.set("order", followed);
  const out = byId("action-result");
  out.textContent = btn.textContent + "…";
  out.className = "small";
  btn.disabled = true;
  try {
    const r = await fetch("/api/actions/" + name + "?" + params, { method: "POST" });
    const body = await r.json().catch(() => ({}));
    if (!r.ok) {
      out.textContent = btn.textContent + ": failed: " + (body.error ? body.error.message : "HTTP " + r.status);
      out.className = "small step bad";
      return;
    }
    out.textContent = btn.textContent + ": " + body.message;
    if (body.order_id) follow(body.order_id);
  } catch (e) {
    out.textContent = btn.textContent + ": failed: " + e;
    out.className = "small step bad";
  } finally {
    btn.disabled = false;
    refresh();
  }
}

document.addEventListener("click", ev => {
  const btn = ev.target.closest("button[data-action]");
  if (btn) act(btn);
});
byId("follow-form").addEventListener("submit", ev => {
  ev.preventDefault();
  follow(byId("follow-id").value);
});
// live view?order=ID follows that order from the start.
const wanted = new URLSearchParams(location.search).get("order");
if (wanted) follow(wanted);
loop();
