/* Obliviate audit page. Plain JS, no build step, no external resources.
 *
 * Talks to the sidecar's JSON endpoints (relative URLs, so the page also works behind a
 * path prefix). Admin endpoints get the bearer token kept in sessionStorage. Everything
 * that comes from the ledger is inserted as text (never as HTML): request ids and
 * reasons are user input.
 */
(function () {
  "use strict";

  const TOKEN_KEY = "obliviate.audit.token";
  const STEPS = ["received", "claimed", "applied", "verified"];
  const SVG_NS = "http://www.w3.org/2000/svg";
  const $ = (id) => document.getElementById(id);

  // ------------------------------------------------------------------ small helpers
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function setMsg(id, text, kind) {
    const node = $(id);
    node.textContent = text || "";
    node.className = "msg" + (kind ? " " + kind : "");
    node.setAttribute("role", kind === "error" ? "alert" : "status");
  }

  /** "2026-11-22T14:27:09.433906Z" -> "2026-11-22 14:27:09.433" */
  function fmtTime(s) {
    if (!s) return "—";
    return String(s).replace("T", " ").replace(/(\.\d{3})\d*/, "$1").replace(/Z$/, "");
  }

  /** "+0.13 s": how long after `from` the time `to` is. */
  function seconds(from, to) {
    const d = (Date.parse(to) - Date.parse(from)) / 1000;
    if (!isFinite(d)) return "";
    const sign = d < 0 ? "−" : "+", m = Math.abs(d);
    return m < 60 ? `${sign}${m.toFixed(m < 10 ? 2 : 1)} s` : `${sign}${(m / 60).toFixed(1)} min`;
  }

  function short(hex, n) {
    return hex ? String(hex).slice(0, n || 12) + "…" : "—";
  }

  function fmtEps(x) {
    const v = Number(x || 0);
    return v === 0 ? "0" : v >= 100 ? v.toFixed(0) : v >= 1 ? v.toFixed(2) : v.toPrecision(3);
  }

  function token() {
    return sessionStorage.getItem(TOKEN_KEY) || "";
  }

  /** fetch JSON; {status, body}; status 0 when the service did not answer. */
  async function api(path, admin) {
    const headers = { Accept: "application/json" };
    if (admin && token()) headers.Authorization = "Bearer " + token();
    let resp;
    try {
      resp = await fetch(path, { headers, cache: "no-store" });
    } catch (err) {
      return { status: 0, body: { error: String(err && err.message || err) } };
    }
    let body = null;
    try { body = await resp.json(); } catch (_) { body = null; }
    return { status: resp.status, body };
  }

  /** The message for a failed call, in words a person can act on. */
  function problem(r, what) {
    const detail = r.body && r.body.error ? ` (${r.body.error})` : "";
    switch (r.status) {
      case 0: return `The service did not answer while loading ${what}${detail}.`;
      case 401: return `Enter the admin token (top right) to see ${what}.`;
      case 403: return `The admin token was refused (403): it is not valid for this service. ` +
                       `Check it and enter it again.`;
      case 404: return `Not found: ${what}${detail}.`;
      case 503: return `The service is not ready${detail}.`;
      default: return `Could not load ${what}: HTTP ${r.status}${detail}.`;
    }
  }

  // ------------------------------------------------------------------ Merkle proofs (RFC 6962)
  function hexBytes(hex) {
    if (typeof hex !== "string" || hex.length !== 64 || /[^0-9a-f]/i.test(hex)) return null;
    const out = new Uint8Array(32);
    for (let i = 0; i < 32; i++) out[i] = parseInt(hex.substr(2 * i, 2), 16);
    return out;
  }

  async function sha256(...parts) {
    const n = parts.reduce((a, p) => a + p.length, 0);
    const buf = new Uint8Array(n);
    let o = 0;
    for (const p of parts) { buf.set(p, o); o += p.length; }
    return new Uint8Array(await crypto.subtle.digest("SHA-256", buf));
  }

  /** RFC 9162 section 2.1.3.2, over the leaf hash of the event's chain hash. */
  async function verifyInclusion(eventHash, index, size, proofHex, rootHex) {
    const h = hexBytes(eventHash), root = hexBytes(rootHex);
    const path = (proofHex || []).map(hexBytes);
    if (!h || !root || path.some((p) => !p) || !(index >= 0 && index < size)) return false;
    let r = await sha256(Uint8Array.of(0), h);
    let fn = index, sn = size - 1;
    const odd = (x) => x % 2 === 1;
    for (const p of path) {
      if (sn === 0) return false;
      if (odd(fn) || fn === sn) {
        r = await sha256(Uint8Array.of(1), p, r);
        if (!odd(fn)) {
          while (fn !== 0 && !odd(fn)) { fn = Math.floor(fn / 2); sn = Math.floor(sn / 2); }
        }
      } else {
        r = await sha256(Uint8Array.of(1), r, p);
      }
      fn = Math.floor(fn / 2);
      sn = Math.floor(sn / 2);
    }
    return sn === 0 && r.every((b, i) => b === root[i]);
  }

  // ------------------------------------------------------------------ token
  async function checkToken() {
    if (!token()) {
      setMsg("token-status", "no token: request history and budgets are hidden", "empty");
      return false;
    }
    const r = await api("v1/guard/usage?bucket_s=3600", true);
    if (r.status === 200) {
      setMsg("token-status", "token accepted", "ok");
      return true;
    }
    setMsg("token-status", r.status === 403 ? "token refused (403)" :
      r.status === 401 ? "token missing (401)" : `token not checked (HTTP ${r.status})`,
      "error");
    return false;
  }

  async function saveToken(ev) {
    if (ev) ev.preventDefault();
    const value = $("token-input").value.trim();
    if (value) sessionStorage.setItem(TOKEN_KEY, value);
    else sessionStorage.removeItem(TOKEN_KEY);
    await checkToken();
    loadUsage();
    const q = $("search-input").value.trim();
    if (q) search(q);
  }

  function clearToken() {
    sessionStorage.removeItem(TOKEN_KEY);
    $("token-input").value = "";
    checkToken();
    loadUsage();
  }

  // ------------------------------------------------------------------ search
  // Only the newest lookup may render: answers to older ones can arrive after it.
  let lookups = 0;

  async function search(q) {
    const me = ++lookups;
    q = (q || "").trim();
    $("request-section").hidden = true;
    $("subject-section").hidden = true;
    if (!q) {
      setMsg("search-message", "Enter a request id or a subject id.", "empty");
      return;
    }
    if (location.hash !== "#" + encodeURIComponent(q)) {
      history.replaceState(null, "", "#" + encodeURIComponent(q));
    }
    setMsg("search-message", `Looking up “${q}”…`, "info");
    const r = await api("v1/requests/" + encodeURIComponent(q), true);
    if (me !== lookups) return;
    if (r.status === 200) {
      setMsg("search-message", "", null);
      renderRequest(r.body, q);
      return;
    }
    if (r.status !== 404) {
      setMsg("search-message", problem(r, `request ${q}`), "error");
      return;
    }
    const s = await api(subjectPage(q, null), true);
    if (me !== lookups) return;
    if (s.status !== 200) {
      setMsg("search-message", problem(s, `the requests of subject ${q}`), "error");
      return;
    }
    if (!s.body.requests.length) {
      setMsg("search-message", `Nothing found: there is no request “${q}” and no request ` +
             `about a subject “${q}”.`, "empty");
      return;
    }
    setMsg("search-message", "", null);
    renderSubject(s.body, false);
  }

  const PAGE = 100;  // rows per page of the lists (the API's cap is 1,000)

  function subjectPage(subject, after) {
    return "v1/subjects/" + encodeURIComponent(subject) + "/requests?limit=" + PAGE +
      (after === null ? "" : "&after=" + encodeURIComponent(after));
  }

  async function moreSubjectRequests() {
    const button = $("subject-more"), me = lookups;
    button.disabled = true;
    const s = await api(subjectPage(button.dataset.subject, button.dataset.after), true);
    if (me !== lookups) return;
    button.disabled = false;
    if (s.status !== 200) {
      setMsg("search-message", problem(s, "more requests of this subject"), "error");
      return;
    }
    renderSubject(s.body, true);
  }

  async function showRequest(rid) {
    const me = ++lookups;
    const r = await api("v1/requests/" + encodeURIComponent(rid), true);
    if (me !== lookups) return;
    if (r.status !== 200) {
      setMsg("search-message", problem(r, `request ${rid}`), "error");
      return;
    }
    setMsg("search-message", "", null);
    history.replaceState(null, "", "#" + encodeURIComponent(rid));
    renderRequest(r.body, rid);
    $("request-section").scrollIntoView({ block: "nearest" });
  }

  // ------------------------------------------------------------------ a request
  function eventDetail(e) {
    const p = e.payload || {};
    switch (e.kind) {
      case "received": {
        const n = (p.record_ids || []).length;
        let s = `${p.op || "?"} ${n} record${n === 1 ? "" : "s"}`;
        if (p.expanded_from_subject) s += ` of subject ${p.subject_id}`;
        if (p.source && p.source.kind) s += ` via ${p.source.kind}`;
        return s;
      }
      case "claimed":
        return `by ${p.worker || "?"}` + (p.reclaimed_from ? ` (taken back from ${p.reclaimed_from})` : "");
      case "applied": {
        const parts = [];
        if (p.guarantee) parts.push(`${p.guarantee} unlearning`);
        if (p.purged_record_hashes) {
          const n = Object.keys(p.purged_record_hashes).length;
          parts.push(`${n} record${n === 1 ? "" : "s"} purged (fingerprints kept)`);
        }
        if (p.added !== undefined) parts.push(`${p.added} added`);
        if (p.retrained && p.retrained.records !== undefined) {
          parts.push(`retrained for ${p.retrained.records} record${p.retrained.records === 1 ? "" : "s"}`);
        }
        if (p.update_seconds !== undefined) parts.push(`${Number(p.update_seconds).toFixed(2)} s`);
        return parts.join(", ");
      }
      case "verified": {
        const parts = [];
        const x = p.exactness || {};
        if (x.exact === true) parts.push("exactness checked: retrain from scratch gives the same hash");
        else if (x.exact === false) parts.push("exactness check FAILED");
        if (p.guard) parts.push(`guard ${p.guard.ready === false ? "noise-all" : "refitted"}`);
        return parts.join("; ");
      }
      case "failed":
      case "rejected":
        return p.reason || "";
      default:
        return "";
    }
  }

  function renderRequest(h, rid) {
    const req = h.request;
    const events = h.events || [];
    const last = (kind) => events.filter((e) => e.kind === kind).pop();
    const status = req ? req.status : (last("rejected") ? "rejected" : "unknown");
    const first = events[0];

    $("request-id").textContent = rid;
    const badge = $("request-status");
    badge.textContent = status;
    badge.className = "badge " + status;
    badge.dataset.status = status;

    const summary = $("request-summary");
    summary.replaceChildren();
    const add = (k, v, key) => summary.append(el("dt", { text: k }),
      el("dd", { "data-field": key, text: v }));
    if (req) {
      add("Operation", req.op, "op");
      add("Subject", req.subject_id || "—", "subject");
      add("Records", (req.record_ids || []).join(", ") || "—", "records");
      add("Received", fmtTime(req.received_at) + " UTC", "received_at");
      if (req.requested_at) add("Requested", fmtTime(req.requested_at), "requested_at");
    } else {
      add("Operation", "— (the message was rejected at intake and never became a request)", "op");
    }

    const bad = last("failed") || last("rejected");
    const reason = $("request-reason");
    reason.hidden = !bad;
    reason.textContent = bad ? `${bad.kind === "failed" ? "Failed" : "Rejected"}: ` +
      (bad.payload && bad.payload.reason || "no reason recorded") : "";

    // the lifecycle: received -> claimed -> applied -> verified (or where it stopped)
    const life = $("lifecycle");
    life.replaceChildren();
    const steps = bad ? STEPS.filter((s) => last(s)) : STEPS;
    for (const step of steps) {
      const e = last(step);
      life.append(el("li", { class: e ? "done" : "pending", "data-step": step,
                             "data-testid": "step-" + step },
        el("span", { class: "step", text: step }),
        el("span", { class: "when", text: e ? fmtTime(e.created_at) +
          (first && e !== first ? "  " + seconds(first.created_at, e.created_at) : "") :
          "not yet" }),
        e && e.model_version ? el("span", { class: "version", text: "model " + e.model_version })
          : null));
    }
    if (bad) {
      life.append(el("li", { class: "bad", "data-step": bad.kind, "data-testid": "step-" + bad.kind },
        el("span", { class: "step", text: bad.kind }),
        el("span", { class: "when", text: fmtTime(bad.created_at) }),
        el("span", { class: "version", text: bad.payload && bad.payload.reason || "" })));
    }

    const head = h.tree_head || {};
    $("tree-head").textContent = head.tree_size ?
      `Tree head: ${head.tree_size} events, root ${short(head.root_hash, 16)} ` +
      `published ${fmtTime(head.created_at)} UTC.` : "No tree head published yet.";

    const body = $("timeline").tBodies[0];
    body.replaceChildren();
    for (const e of events) {
      const proof = el("td", { class: "proof unchecked", "data-field": "proof" },
        (e.inclusion_proof || []).length ?
          `proof of ${e.inclusion_proof.length} hashes, checking…` :
          (head.tree_size === 1 ? "single-event tree, checking…" : "no proof"));
      body.append(el("tr", { "data-kind": e.kind, "data-seq": e.seq, "data-testid": "event" },
        el("td", { class: "num", text: e.seq }),
        el("td", { text: fmtTime(e.created_at) }),
        el("td", { class: "kind " + e.kind, "data-field": "kind", text: e.kind }),
        el("td", { class: "mono", "data-field": "version", text: e.model_version || "—" }),
        el("td", { "data-field": "detail", text: eventDetail(e) }),
        el("td", { class: "hash", "data-field": "hash", title: e.hash, text: short(e.hash) }),
        proof));
      checkProof(e, head, proof);
    }
    $("request-section").hidden = false;
    $("forgotten").hidden = true;
    if (req && req.op === "delete") showForgotten(rid);
  }

  // what a deletion removed, when, and from which versions (GET /v1/forgotten/{id})
  async function showForgotten(rid) {
    const r = await api("v1/forgotten/" + encodeURIComponent(rid), true);
    if (r.status !== 200 || $("request-id").textContent !== rid) return;
    const f = r.body;
    const recs = $("forgotten-records").tBodies[0];
    recs.replaceChildren(...f.records.map((x) => el("tr", { "data-testid": "forgotten-record" },
      el("td", { class: "mono", text: x.record_id }),
      el("td", { class: "hash", title: x.fingerprint, text: short(x.fingerprint) }),
      el("td", { "data-field": "purged-at",
                 text: x.purged_at ? fmtTime(x.purged_at) : "still held (" + x.state + ")" }))));
    const first = f.first_version_without;
    $("forgotten-first").textContent = first ?
      `First version published without it: ${first.version} (${fmtTime(first.published_at)} ` +
      `UTC, event ${first.event_seq}).` : "Not applied yet: every version still holds it.";
    const vers = $("forgotten-versions").tBodies[0];
    vers.replaceChildren(...f.held_by.map((v) => el("tr", { "data-testid": "held-by",
                                                           "data-destroyed": v.destroyed },
      el("td", { class: "mono", text: v.version }),
      el("td", {}, el("span", { class: "badge " + (v.destroyed ? "ok" : "applied"),
        text: v.destroyed ? "destroyed " + fmtTime(v.destroyed_at) : "awaiting destruction" })),
      el("td", { class: "num", text: v.event_seq ?? "—" }),
      el("td", { class: "hash", title: v.manifest_sha256 || "",
                 text: v.manifest_sha256 ? short(v.manifest_sha256) : "—" }))));
    const ex = f.exactness;
    $("forgotten-exactness").textContent = !ex ? "Exactness: not verified yet." :
      ex.guarantee === "exact" ?
        `Exactness of ${ex.version}: retrained from scratch, hash ` +
        `${ex.exact ? "matches" : "DOES NOT match"} (${short(ex.retrained_hash)}; event ` +
        `${ex.event_seq}).` :
        `${ex.version} is approximate: its gap to a retrain is in event ${ex.event_seq}.`;
    $("forgotten").hidden = false;
  }

  async function checkProof(e, head, cell) {
    if (!head.tree_size || !head.root_hash) {
      cell.textContent = "no tree head to check against";
      return;
    }
    if (!(window.crypto && crypto.subtle)) {
      cell.textContent = `proof of ${(e.inclusion_proof || []).length} hashes ` +
        "(this browser cannot check it here: needs HTTPS or localhost)";
      return;
    }
    let ok = false;
    try {
      ok = await verifyInclusion(e.hash, e.seq - 1, head.tree_size, e.inclusion_proof,
                                 head.root_hash);
    } catch (_) { ok = false; }
    cell.className = "proof " + (ok ? "valid" : "invalid");
    cell.dataset.valid = ok ? "true" : "false";
    cell.textContent = ok ?
      `✓ included in tree head of ${head.tree_size} (${(e.inclusion_proof || []).length} hashes)` :
      "✗ inclusion proof does not verify";
  }

  // ------------------------------------------------------------------ a subject
  /** A page of a subject's requests: the first replaces the rows, the next are appended. */
  function renderSubject(data, append) {
    $("subject-id").textContent = data.subject_id;
    const body = $("subject-requests").tBodies[0];
    if (!append) body.replaceChildren();
    for (const r of data.requests) {
      const open = (ev) => { ev.preventDefault(); showRequest(r.request_id); };
      body.append(el("tr", { "data-request-id": r.request_id, "data-testid": "subject-request",
                             onclick: open },
        el("td", {}, el("a", { href: "#" + encodeURIComponent(r.request_id),
                               "data-testid": "subject-request-link", text: r.request_id })),
        el("td", { text: r.op }),
        el("td", {}, el("span", { class: "badge " + r.status, text: r.status })),
        el("td", { text: (r.record_ids || []).join(", ") }),
        el("td", { text: fmtTime(r.received_at) })));
    }
    const more = $("subject-more");
    more.hidden = data.next_after === null || data.next_after === undefined;
    more.dataset.subject = data.subject_id;
    more.dataset.after = more.hidden ? "" : String(data.next_after);
    $("subject-section").hidden = false;
  }

  // ------------------------------------------------------------------ lineage
  function changeText(m) {
    const c = m.change || {};
    if (c.op === "train") return `train (${c.n_records ?? "?"} records)`;
    if (c.op === "update") return `update (${c.requests ?? "?"} request${c.requests === 1 ? "" : "s"})`;
    if (c.op === "guard") {
      const x = c.exactness || {};
      return "guard refit" + (x.exact === true ? ", exactness ✓" : x.exact === false ? ", exactness ✗" : "");
    }
    return c.op || "—";
  }

  let lineageLoads = 0;
  let lineageCurrent = null;  // the version served when the first page was loaded

  /** The first page of the lineage (newest first), or with `older` the page after the
   * rows shown, appended. */
  async function loadLineage(older) {
    older = older === true;
    const me = older ? lineageLoads : ++lineageLoads;
    const more = $("lineage-more");
    const before = older ? "&before=" + encodeURIComponent(more.dataset.before) : "";
    setMsg("lineage-message", "Loading…", "info");
    more.disabled = true;
    const [r, cur] = await Promise.all([api("v1/models/lineage?limit=" + PAGE + before, false),
                                        older ? null : api("v1/models", false)]);
    if (me !== lineageLoads) return;
    more.disabled = false;
    const body = $("lineage-table").tBodies[0];
    if (r.status !== 200) {
      if (!older) body.replaceChildren();
      $("lineage-table").dataset.loads = me;
      setMsg("lineage-message", problem(r, "the model lineage"), "error");
      return;
    }
    if (!older) {
      lineageCurrent = cur.status === 200 && cur.body.current ? cur.body.current.version : null;
      body.replaceChildren();
    }
    const current = lineageCurrent;
    const versions = r.body.versions || [];
    more.hidden = r.body.next_before === null || r.body.next_before === undefined;
    more.dataset.before = more.hidden ? "" : String(r.body.next_before);
    for (const v of versions) {
      const m = v.manifest || {};
      const g = m.guard || {};
      const ts = m.training_set || {};
      body.append(el("tr", { "data-version": v.version, "data-testid": "lineage-row",
                             class: v.version === current ? "current" : null },
        el("td", { class: "mono", "data-field": "version" }, v.version,
          v.version === current ? el("span", { class: "badge ok", text: "current" }) : null),
        el("td", { class: "mono", "data-field": "parent", text: v.parent || "—" }),
        el("td", { "data-field": "op", "data-op": (m.change || {}).op || "", text: changeText(m) }),
        el("td", { "data-field": "learner", text: m.learner || "—" }),
        el("td", { "data-field": "guarantee", text: m.guarantee || "—" }),
        el("td", { "data-field": "guard" },
          el("span", { class: "badge " + (g.ready ? "ok" : "applied"),
                       text: g.ready ? "ready" : "noise-all" }),
          g.rule ? " " + g.rule : ""),
        el("td", { class: "num", "data-field": "count", text: ts.count ?? "—" }),
        el("td", { class: "root", "data-field": "merkle-root", title: ts.merkle_root || "",
                   text: short(ts.merkle_root) }),
        el("td", { "data-field": "created", text: fmtTime(v.created_at) }),
        el("td", { "data-field": "files", text: v.destroyed_at ?
          "destroyed " + fmtTime(v.destroyed_at) :
          v.superseded_by_deletion ? "to destroy (held deleted records)" : "kept" })));
    }
    $("lineage-table").dataset.loads = me;  // lets a test wait for this render
    const shown = body.rows.length;
    if (shown) {
      setMsg("lineage-message", `${shown} ${more.hidden ? "" : "newest "}published ` +
             `version${shown === 1 ? "" : "s"}` + (current ? `; serving ${current}.` : "."), null);
    } else {
      setMsg("lineage-message", "No model version is published yet: run `obliviate model train`.",
             "empty");
    }
  }

  // ------------------------------------------------------------------ guard usage
  let usageLoads = 0;

  async function loadUsage() {
    const me = ++usageLoads;
    const table = $("usage-table");
    const clear = () => {
      table.tBodies[0].replaceChildren();
      if (table.tFoot) table.tFoot.remove();
      $("usage-chart").replaceChildren();
      $("usage-total").textContent = "";
    };
    if (!token()) {
      clear();
      setMsg("usage-message", problem({ status: 401, body: null }, "guard outcomes and budgets"),
             "error");
      return;
    }
    const bucket = $("usage-bucket").value;
    const r = await api("v1/guard/usage?bucket_s=" + encodeURIComponent(bucket), true);
    if (me !== usageLoads) return;
    clear();
    table.dataset.loads = me;  // lets a test wait for this render
    if (r.status !== 200) {
      setMsg("usage-message", problem(r, "guard outcomes and budgets"), "error");
      return;
    }
    const u = r.body;
    const versions = u.versions || [];
    if (!versions.length) {
      setMsg("usage-message", "No guarded predictions recorded yet (each serving process " +
             "writes its counts every few seconds).", "empty");
      return;
    }
    setMsg("usage-message", "", null);
    let certain = 0, noised = 0;
    for (const v of versions) {
      certain += v.certain;
      noised += v.noised;
      table.tBodies[0].append(el("tr", { "data-version": v.version, "data-testid": "usage-row" },
        el("td", { class: "mono", text: v.version }),
        el("td", { class: "num", "data-field": "certain", text: v.certain }),
        el("td", { class: "num", "data-field": "noised", text: v.noised }),
        el("td", { class: "num", "data-field": "epsilon", text: fmtEps(v.epsilon_spent) }),
        el("td", { text: fmtTime(v.first) }),
        el("td", { text: fmtTime(v.last) })));
    }
    const foot = table.createTFoot();
    foot.append(el("tr", { "data-testid": "usage-totals" },
      el("td", { text: "all versions" }),
      el("td", { class: "num", "data-field": "certain", text: certain }),
      el("td", { class: "num", "data-field": "noised", text: noised }),
      el("td", { class: "num", "data-field": "epsilon", text: fmtEps(u.epsilon_spent_total) }),
      el("td", {}), el("td", {})));
    const total = $("usage-total");
    total.replaceChildren("ε spent in total: ", el("strong", { text: fmtEps(u.epsilon_spent_total) }),
      ` over ${certain + noised} guarded answers (${certain} certain, ${noised} noised).`);
    total.dataset.certain = certain;
    total.dataset.noised = noised;
    total.dataset.epsilon = u.epsilon_spent_total;
    drawChart(u.series || [], Number(bucket));
  }

  /** The server lists only buckets with answers; put the empty ones back so time is linear. */
  function fillGaps(rows, bucket) {
    const step = bucket * 1000;
    const first = Date.parse(rows[0].t), last = Date.parse(rows[rows.length - 1].t);
    if (!isFinite(first) || !isFinite(last) || (last - first) / step > 240) return rows;
    const byTime = new Map(rows.map((r) => [Date.parse(r.t), r]));
    const out = [];
    let cumulative = 0;
    for (let t = first; t <= last; t += step) {
      const r = byTime.get(t) || { t: new Date(t).toISOString(), certain: 0, noised: 0,
                                    epsilon_spent: 0, epsilon_spent_cumulative: cumulative };
      cumulative = r.epsilon_spent_cumulative;
      out.push(r);
    }
    return out;
  }

  /** Bars: certain and noised answers per bucket (left axis); line: cumulative ε (right). */
  function drawChart(rows, bucket) {
    const box = $("usage-chart");
    box.replaceChildren();
    if (!rows.length) return;
    const series = fillGaps(rows, bucket);
    const W = 760, H = 230, L = 52, R = 60, T = 16, B = 44;
    const pw = W - L - R, ph = H - T - B;
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "data-testid": "usage-svg",
                              "aria-label": "guard answers and cumulative epsilon over time" });
    const maxCount = Math.max(1, ...series.map((s) => s.certain + s.noised));
    const maxEps = Math.max(1e-9, ...series.map((s) => s.epsilon_spent_cumulative));
    const n = series.length;
    const slot = pw / n;
    const barW = Math.max(2, Math.min(40, slot * 0.7));
    const y = (c) => T + ph - (c / maxCount) * ph;
    const ye = (e) => T + ph - (e / maxEps) * ph;
    const xc = (i) => L + slot * (i + 0.5);

    for (let k = 0; k <= 4; k++) {           // gridlines and both axes' ticks
      const yy = T + ph - (k / 4) * ph;
      root.append(svg("line", { class: "gridline", x1: L, x2: L + pw, y1: yy, y2: yy }));
      root.append(svg("text", { x: L - 6, y: yy + 4, "text-anchor": "end" },
                      String(Math.round((k / 4) * maxCount))));
      root.append(svg("text", { x: L + pw + 6, y: yy + 4 }, fmtEps((k / 4) * maxEps)));
    }
    root.append(svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: T + ph }));
    root.append(svg("line", { class: "axis", x1: L + pw, x2: L + pw, y1: T, y2: T + ph }));
    root.append(svg("line", { class: "axis", x1: L, x2: L + pw, y1: T + ph, y2: T + ph }));

    const every = Math.max(1, Math.ceil(n / 8));
    series.forEach((s, i) => {
      const x = xc(i) - barW / 2;
      const yc = y(s.certain), yn = y(s.certain + s.noised);
      const title = `${fmtTime(s.t)}: ${s.certain} certain, ${s.noised} noised, ` +
        `ε ${fmtEps(s.epsilon_spent)} (total ${fmtEps(s.epsilon_spent_cumulative)})`;
      const bc = svg("rect", { class: "certain", x, y: yc, width: barW, height: T + ph - yc });
      bc.append(svg("title", {}, title));
      const bn = svg("rect", { class: "noised", x, y: yn, width: barW, height: yc - yn });
      bn.append(svg("title", {}, title));
      root.append(bc, bn);
      if (i % every === 0) {
        const label = bucket >= 86400 ? s.t.slice(5, 10) : s.t.slice(11, bucket >= 60 ? 16 : 19);
        root.append(svg("text", { x: xc(i), y: T + ph + 14, "text-anchor": "middle" }, label));
      }
    });
    const pts = series.map((s, i) => `${xc(i).toFixed(1)},${ye(s.epsilon_spent_cumulative).toFixed(1)}`);
    if (n > 1) root.append(svg("polyline", { class: "eps-line", points: pts.join(" ") }));
    series.forEach((s, i) => root.append(svg("circle", { class: "eps-dot", cx: xc(i),
      cy: ye(s.epsilon_spent_cumulative), r: 3 })));

    // legend and axis titles
    const ly = H - 10;
    root.append(svg("rect", { class: "certain", x: L, y: ly - 9, width: 10, height: 10 }));
    root.append(svg("text", { x: L + 14, y: ly }, "certain answers"));
    root.append(svg("rect", { class: "noised", x: L + 120, y: ly - 9, width: 10, height: 10 }));
    root.append(svg("text", { x: L + 134, y: ly }, "noised answers"));
    root.append(svg("line", { class: "eps-line", x1: L + 240, x2: L + 258, y1: ly - 4, y2: ly - 4 }));
    root.append(svg("text", { x: L + 262, y: ly }, "cumulative ε spent (right axis)"));
    root.append(svg("text", { x: 4, y: T - 4 }, "answers"));
    root.append(svg("text", { x: W - 4, y: T - 4, "text-anchor": "end" }, "ε"));
    box.append(root);
  }

  // ------------------------------------------------------------------ start
  function init() {
    $("token-input").value = token();
    $("token-form").addEventListener("submit", saveToken);
    $("token-clear").addEventListener("click", clearToken);
    $("search-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      search($("search-input").value);
    });
    $("lineage-refresh").addEventListener("click", () => loadLineage(false));
    $("lineage-more").addEventListener("click", () => loadLineage(true));
    $("subject-more").addEventListener("click", moreSubjectRequests);
    $("usage-refresh").addEventListener("click", loadUsage);
    $("usage-bucket").addEventListener("change", loadUsage);
    checkToken();
    loadLineage();
    loadUsage();
    const q = decodeURIComponent(location.hash.replace(/^#/, ""));
    if (q) {
      $("search-input").value = q;
      search(q);
    }
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
