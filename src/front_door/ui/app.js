// The fleet page: polls the admin API once a second with the bearer token from session
// storage (never from or into a URL) and renders with DOM calls and textContent only: every
// string shown came from the fleet and is untrusted.
'use strict';
(function () {
  const TOKEN_KEY = 'continuum.admin.token';
  const POLL_MS = 1000;
  const FETCH_TIMEOUT_MS = 5000;
  const HISTORY = 300; // polls kept for sparklines: 5 minutes at 1 s
  const ROW_CHUNK = 100; // rows rendered per group before "show more"
  const COLLAPSE_OVER = 100; // groups start collapsed when the fleet is larger

  const $ = (id) => document.getElementById(id);
  const state = {
    paused: false, timer: null, open: new Map(), shown: new Map(), pendingRestart: null,
    prevSummary: null, history: new Map(), queues: new Map(), renders: 0, lastWorkers: null, lastSummary: null,
  };

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === 'class') node.className = v;
      else if (k.startsWith('data-')) node.setAttribute(k, String(v));
      else if (k === 'onclick') node.addEventListener('click', v);
      else node[k] = v;
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  const token = () => sessionStorage.getItem(TOKEN_KEY);

  async function api(method, path) {
    const ctl = new AbortController();
    const t = setTimeout(() => ctl.abort(), FETCH_TIMEOUT_MS);
    try {
      const resp = await fetch(path, {
        method, signal: ctl.signal, cache: 'no-store',
        headers: { 'Authorization': 'Bearer ' + token(), 'Accept': 'application/json' },
      });
      if (resp.status === 401 || resp.status === 403) {
        const err = new Error(resp.status === 401 ? 'the token was refused' : 'the admin API is disabled');
        err.auth = true;
        throw err;
      }
      const body = await resp.json().catch(() => ({}));
      if (!resp.ok) throw new Error(method + ' ' + path + ': ' + resp.status + ' ' + JSON.stringify(body).slice(0, 200));
      return body;
    } finally {
      clearTimeout(t);
    }
  }

  // ----- login ---------------------------------------------------------------------------

  function showLogin(message) {
    stop();
    sessionStorage.removeItem(TOKEN_KEY);
    $('login').hidden = false;
    $('app').hidden = true;
    $('logout').hidden = true;
    $('login-error').textContent = message || '';
    $('status').textContent = 'signed out';
  }

  function showApp() {
    $('login').hidden = true;
    $('app').hidden = false;
    $('logout').hidden = false;
    start();
  }

  async function login(ev) {
    ev.preventDefault();
    const value = $('token').value.trim();
    if (!value) return;
    sessionStorage.setItem(TOKEN_KEY, value);
    $('token').value = '';
    try {
      await api('GET', '/admin/subsystems');
      showApp();
    } catch (e) {
      showLogin(e.auth ? 'Sign-in failed: ' + e.message : 'Sign-in failed: ' + e.message);
    }
  }

  // ----- polling -------------------------------------------------------------------------

  function start() { state.paused = false; if (!state.timer) tick(); }
  function stop() { state.paused = true; clearTimeout(state.timer); state.timer = null; }

  async function tick() {
    state.timer = null;
    const began = performance.now();
    try {
      const [workers, summary, tree] = await Promise.all([
        api('GET', '/admin/dynamo/workers'),
        api('GET', '/admin/fleet/summary'),
        api('GET', '/admin/subsystems'),
      ]);
      if (state.paused) return;
      render(workers, summary, tree.subsystems || []);
      $('status').textContent = 'live · updated ' + new Date().toLocaleTimeString();
      $('status').className = 'status ok';
    } catch (e) {
      if (e.auth) { showLogin('Signed out: ' + e.message); return; }
      $('status').textContent = 'update failed: ' + e.message;
      $('status').className = 'status bad';
    }
    if (!state.paused) {
      state.timer = setTimeout(tick, Math.max(0, POLL_MS - (performance.now() - began)));
    }
  }

  function render(workers, summary, subsystems) {
    state.lastWorkers = workers;
    state.lastSummary = summary;
    recordHistory(summary);
    renderOverview(workers, summary);
    renderMidStream(summary.mid_stream_fallback || {});
    renderSparks();
    renderFleet(workers, summary);
    renderQueues(summary);
    renderSubscriptions(workers);
    renderTree(subsystems);
    state.renders += 1;
    document.body.setAttribute('data-renders', String(state.renders));
  }

  // ----- overview and sparklines -----------------------------------------------------------

  function totalSelections(summary) {
    let n = 0;
    for (const reasons of Object.values(summary.selections || {})) {
      for (const v of Object.values(reasons)) n += Number(v) || 0;
    }
    return n;
  }

  function totalQueued(summary) {
    return Object.values(summary.queue_depth || {}).reduce((a, v) => a + (Number(v) || 0), 0);
  }

  function renderOverview(w, summary) {
    const workers = w.workers || [];
    const reachable = workers.filter((x) => x.reachable).length;
    const ranks = (w.load || []).length;
    const blocks = (summary.kv_blocks || []).reduce((a, r) => a + (Number(r.blocks) || 0), 0);
    const card = (id, k, v, cls) => el('div', { class: 'card' }, el('div', { class: 'v ' + (cls || ''), id }, v), el('div', { class: 'k' }, k));
    $('overview').replaceChildren(
      card('ov-discovery', 'discovery (' + (w.source || 'off') + ')', w.enabled === false ? 'disabled' : (w.connected ? 'connected' : 'disconnected'), w.connected ? 'ok' : 'bad'),
      card('ov-workers', 'workers reachable', reachable + ' / ' + workers.length, reachable === workers.length ? 'ok' : 'warn'),
      card('ov-ranks', 'ranks with load', ranks),
      card('ov-blocks', 'KV blocks indexed', blocks),
      card('ov-selections', 'selections', totalSelections(summary)),
      card('ov-queued', 'queued (admission)', totalQueued(summary), totalQueued(summary) > 0 ? 'warn' : ''),
      card('ov-picker', 'picker', (w.picker && w.picker.name) || '-'),
      card('ov-generation', 'fleet generation', w.generation === undefined ? '-' : w.generation),
      replicasCard(card, summary.replica_sync || w.replica_sync),
    );
  }

  // Peer router replicas sharing in-flight dispatches (replica_sync): count and ids.
  function replicasCard(card, rs) {
    if (!rs || !rs.enabled) return card('ov-replicas', 'peer replicas', 'off');
    const peers = (rs.peers || []).map((p) => p.replica + ' (' + p.entries + ')');
    const k = 'peer replicas of ' + rs.replica_id + (rs.connected ? '' : ', NATS down');
    return card('ov-replicas', k, peers.length + (peers.length ? ': ' + peers.join(', ') : ''), rs.connected ? 'ok' : 'bad');
  }

  // Mid-stream fallback (cumulative since start): cuts, continued, failed.
  function renderMidStream(m) {
    const n = (v) => Number(v) || 0;
    const card = (id, k, v, cls) => el('div', { class: 'card' }, el('div', { class: 'v ' + (cls || ''), id }, String(v)), el('div', { class: 'k' }, k));
    const box = $('mid-stream');
    box.dataset.attempts = String(n(m.attempts));
    box.dataset.continued = String(n(m.continued));
    box.dataset.failed = String(n(m.failed));
    box.replaceChildren(
      card('ms-attempts', 'mid-stream cuts', n(m.attempts)),
      card('ms-continued', 'continued', n(m.continued), 'ok'),
      card('ms-failed', 'continuation failed', n(m.failed), n(m.failed) > 0 ? 'bad' : 'ok'),
    );
  }

  function push(key, value) {
    let h = state.history.get(key);
    if (!h) { h = []; state.history.set(key, h); }
    h.push(value);
    if (h.length > HISTORY) h.shift();
  }

  function recordHistory(summary) {
    const prev = state.prevSummary;
    state.prevSummary = summary;
    if (!prev) return;
    for (const [role, reasons] of Object.entries(summary.selections || {})) {
      for (const [reason, v] of Object.entries(reasons)) {
        const before = ((prev.selections || {})[role] || {})[reason] || 0;
        push('sel|' + role + ' · ' + reason, Math.max(0, v - before));
      }
    }
    for (const [model, p] of Object.entries(summary.kv_hash_parity || {})) {
      const q = (prev.kv_hash_parity || {})[model] || { match: 0, mismatch: 0 };
      const dm = Math.max(0, p.match - q.match);
      const dx = Math.max(0, p.mismatch - q.mismatch);
      push('par|' + model, dm + dx > 0 ? dm / (dm + dx) : null);
    }
  }

  function sparkline(values, max) {
    const NS = 'http://www.w3.org/2000/svg';
    const svg = document.createElementNS(NS, 'svg');
    // The x axis spans at least a minute of polls and grows to the full window.
    const span = Math.max(60, values.length);
    svg.setAttribute('viewBox', '0 0 ' + span + ' 36');
    svg.setAttribute('preserveAspectRatio', 'none');
    const line = document.createElementNS(NS, 'polyline');
    const off = span - values.length;
    const top = max || Math.max(1, ...values.filter((v) => v !== null));
    const pts = [];
    values.forEach((v, i) => { if (v !== null) pts.push((off + i) + ',' + (34 - (v / top) * 32).toFixed(1)); });
    line.setAttribute('points', pts.join(' '));
    svg.append(line);
    return svg;
  }

  function renderSparks() {
    const cards = [];
    const idle = [];
    const keys = [...state.history.keys()].sort();
    for (const key of keys) {
      const values = state.history.get(key);
      const [kind, name] = [key.slice(0, 3), key.slice(4)];
      const last = values[values.length - 1];
      if (kind === 'sel') {
        const sum = values.reduce((a, v) => a + v, 0);
        // Reasons with no selection in the window are listed on one line, not plotted.
        if (sum === 0) { idle.push(name); continue; }
        cards.push(el('div', { class: 'spark', 'data-key': key },
          el('div', {}, 'selections ' + name, el('span', { class: 'sub' }, ' · ' + last + ' last poll, ' + sum + ' in window')),
          sparkline(values)));
      } else {
        const ratio = last === null || last === undefined ? 'no picks' : (last * 100).toFixed(0) + '% match';
        cards.push(el('div', { class: 'spark parity', 'data-key': key },
          el('div', {}, 'hash parity ' + name, el('span', { class: 'sub' }, ' · ' + ratio)),
          sparkline(values, 1)));
      }
    }
    if (!keys.length) cards.push(el('p', { class: 'sub' }, 'Waiting for a second poll.'));
    const nodes = [el('div', { class: 'sparks' }, ...cards)];
    if (idle.length) nodes.push(el('p', { class: 'sub', id: 'idle-series' }, 'No selections in the window: ' + idle.join(', ')));
    $('sparks').replaceChildren(...nodes);
  }

  // ----- workers -------------------------------------------------------------------------

  function rankKey(id, rank) { return id + '/' + rank; }

  function renderFleet(w, summary) {
    const workers = w.workers || [];
    const load = new Map((w.load || []).map((s) => [rankKey(s.instance_id, s.dp_rank), s]));
    const blocks = new Map((summary.kv_blocks || []).map((b) => [rankKey(b.instance_id, b.dp_rank), b.blocks]));
    const filter = $('filter').value.trim().toLowerCase();
    const groups = new Map();
    for (const wk of workers) {
      if (filter && ![wk.model, wk.namespace, wk.instance_id, wk.worker_id, wk.role].some((s) => String(s || '').toLowerCase().includes(filter))) continue;
      const key = (wk.namespace || '?') + ' · ' + (wk.role || '?');
      if (!groups.has(key)) groups.set(key, []);
      groups.get(key).push(wk);
    }
    $('worker-count').textContent = '(' + workers.length + ' in ' + groups.size + ' groups)';
    const nodes = [];
    for (const key of [...groups.keys()].sort()) {
      const members = groups.get(key);
      if (!state.open.has(key)) state.open.set(key, workers.length <= COLLAPSE_OVER);
      const open = state.open.get(key);
      const reach = members.filter((m) => m.reachable).length;
      let decode = 0, prefill = 0;
      for (const m of members) {
        for (let r = 0; r < (m.dp_size || 1); r++) {
          const s = load.get(rankKey(m.instance_id, (m.dp_start_rank || 0) + r));
          if (s) { decode += s.active_decode_blocks || 0; prefill += s.active_prefill_tokens || 0; }
        }
      }
      const details = el('details', { class: 'group', 'data-group': key });
      details.open = open;
      details.append(el('summary', {}, el('strong', {}, key), ' — ', members.length + ' workers, ',
        el('span', { class: reach === members.length ? 'ok' : 'bad' }, reach + ' reachable'),
        el('span', { class: 'sub' }, ' · decode blocks ' + decode + ' · prefill tokens ' + prefill)));
      details.addEventListener('toggle', () => {
        state.open.set(key, details.open);
        if (details.open && !details.querySelector('table')) fillGroup(details, key, members, load, blocks);
      });
      if (open) fillGroup(details, key, members, load, blocks);
      nodes.push(details);
    }
    if (w.enabled === false) nodes.push(el('p', { class: 'sub' }, 'Dynamo discovery is disabled in the running configuration.'));
    $('fleet').replaceChildren(...nodes);
  }

  // Renders a group's first rows; "show more" adds ROW_CHUNK at a time (bounded DOM).
  function fillGroup(details, key, members, load, blocks) {
    const limit = Math.min(members.length, state.shown.get(key) || ROW_CHUNK);
    const body = el('div', { class: 'group-body' });
    const table = el('table', {}, el('tr', {},
      el('th', {}, 'instance'), el('th', {}, 'model'), el('th', {}, 'capacity'),
      el('th', {}, 'reachable'), el('th', {}, 'ranks: load · KV blocks indexed')));
    for (let i = 0; i < limit; i++) table.append(workerRow(members[i], load, blocks));
    body.append(table);
    if (limit < members.length) {
      body.append(el('button', {
        class: 'more', type: 'button',
        onclick: () => { state.shown.set(key, limit + ROW_CHUNK); details.querySelector('.group-body').remove(); fillGroup(details, key, members, load, blocks); },
      }, 'Show ' + Math.min(ROW_CHUNK, members.length - limit) + ' more of ' + (members.length - limit)));
    }
    details.append(body);
  }

  function workerRow(wk, load, blocks) {
    const cap = wk.capacity || {};
    const total = Number(cap.total_kv_blocks) || 0;
    const ranks = el('td', {});
    const size = Math.max(1, Math.min(Number(wk.dp_size) || 1, 1024));
    for (let r = 0; r < size; r++) {
      const rank = (Number(wk.dp_start_rank) || 0) + r;
      const s = load.get(rankKey(wk.instance_id, rank));
      const indexed = blocks.get(rankKey(wk.instance_id, rank)) || 0;
      const used = s ? s.kv_used_blocks || 0 : 0;
      const dec = s ? s.active_decode_blocks || 0 : 0;
      const pre = s ? s.active_prefill_tokens || 0 : 0;
      const bar = el('div', { class: 'bar' });
      bar.style.width = (total ? Math.min(100, (100 * Math.max(used, dec)) / total) : 0) + '%';
      const kvbar = el('div', { class: 'bar kv' });
      kvbar.style.width = (total ? Math.min(100, (100 * indexed) / total) : 0) + '%';
      ranks.append(el('div', { class: 'rank', 'data-rank': rankKey(wk.instance_id, rank), 'data-decode': dec, 'data-prefill': pre, 'data-kv-indexed': indexed },
        el('span', { class: 'mono' }, 'dp' + rank),
        el('span', { class: 'mono' }, s ? dec + ' blk · ' + pre + ' tok' : 'no sample'),
        el('div', {}, el('div', { class: 'barbox', title: 'KV blocks in use / total' }, bar),
          el('div', { class: 'barbox', title: 'KV blocks indexed by the router / total' }, kvbar),
          el('span', { class: 'sub' }, indexed + ' indexed'))));
    }
    return el('tr', { 'data-worker': wk.instance_id },
      el('td', { class: 'mono' }, wk.instance_id),
      el('td', {}, wk.model || '-'),
      el('td', {}, total + ' blocks · ' + (cap.max_num_seqs || '-') + ' seqs · block ' + (wk.block_size || '-')),
      el('td', { class: wk.reachable ? 'ok' : 'bad' }, wk.reachable ? 'yes' : 'no (' + Math.round((wk.unreachable_for_ms || 0) / 1000) + ' s)'),
      ranks);
  }

  // ----- subscriptions -------------------------------------------------------------------

  // ----- admission queues ------------------------------------------------------------------

  // Per model: requests waiting now (the gauge), the peak and a sparkline over the window.
  function recordQueues(summary) {
    const depths = summary.queue_depth || {};
    for (const model of Object.keys(depths)) if (!state.queues.has(model)) state.queues.set(model, []);
    for (const [model, h] of state.queues) {
      h.push(Math.max(0, Number(depths[model]) || 0));
      if (h.length > HISTORY) h.shift();
    }
  }

  function renderQueues(summary) {
    recordQueues(summary);
    const depths = summary.queue_depth || {};
    const table = el('table', {}, el('tr', {}, el('th', {}, 'model'), el('th', {}, 'waiting now'),
      el('th', {}, 'peak in window'), el('th', {}, 'depth over the window')));
    for (const model of [...state.queues.keys()].sort()) {
      const h = state.queues.get(model);
      const now = Math.max(0, Number(depths[model]) || 0);
      const peak = Math.max(0, ...h);
      table.append(el('tr', { 'data-queue': model, 'data-depth': now, 'data-peak': peak },
        el('td', {}, model), el('td', { class: now > 0 ? 'warn' : 'ok' }, now), el('td', {}, peak),
        el('td', { class: 'spark-cell' }, sparkline(h))));
    }
    const nodes = [table];
    if (!state.queues.size) nodes.push(el('p', { class: 'sub' }, 'No request has waited in an admission queue.'));
    $('queues').replaceChildren(...nodes);
  }

  function renderSubscriptions(w) {
    const subs = w.subscriptions || [];
    const counts = new Map();
    for (const s of subs) {
      const key = s.family + ' · ' + s.state + ' · ' + s.transport;
      counts.set(key, (counts.get(key) || 0) + 1);
    }
    const table = el('table', {}, el('tr', {}, el('th', {}, 'family · state · transport'), el('th', {}, 'count')));
    for (const key of [...counts.keys()].sort()) {
      table.append(el('tr', { 'data-subs': key }, el('td', { class: key.includes('connected') && !key.includes('disconnected') ? 'ok' : 'warn' }, key), el('td', {}, counts.get(key))));
    }
    const down = subs.filter((s) => s.state !== 'connected').slice(0, 50);
    const nodes = [table];
    if (down.length) {
      const list = el('table', {}, el('tr', {}, el('th', {}, 'not connected (first 50)'), el('th', {}, 'namespace'), el('th', {}, 'state')));
      for (const s of down) list.append(el('tr', {}, el('td', { class: 'mono' }, s.family + ':' + s.publisher_id), el('td', {}, s.namespace), el('td', { class: 'warn' }, s.state)));
      nodes.push(list);
    }
    if (!subs.length) nodes.push(el('p', { class: 'sub' }, 'No subscriptions.'));
    $('subscriptions').replaceChildren(...nodes);
  }

  // ----- supervision tree ------------------------------------------------------------------

  function renderTree(subsystems) {
    const rows = [];
    for (const s of [...subsystems].sort((a, b) => String(a.id).localeCompare(String(b.id)))) {
      const depth = String(s.id).split('/').length - 1;
      const row = el('div', { class: 'tree-row', 'data-subsystem': s.id, 'data-restarts': s.restarts });
      const id = el('span', { class: 'id mono' }, '  '.repeat(depth) + s.id);
      id.style.paddingLeft = depth * 1.2 + 'em';
      row.append(id, el('span', { class: s.state === 'running' ? 'ok' : 'bad' }, s.state),
        el('span', { class: 'restarts' }, 'restarts ' + s.restarts));
      if (s.last_failure) row.append(el('span', { class: 'bad' }, String(s.last_failure).slice(0, 120)));
      if (s.parent !== null && s.parent !== undefined) {
        if (state.pendingRestart === s.id) {
          row.append(el('span', {}, 'Restart ' + s.id + '?'),
            el('button', { class: 'danger confirm-restart', type: 'button', onclick: () => restart(s.id) }, 'Confirm restart'),
            el('button', { class: 'cancel-restart', type: 'button', onclick: () => { state.pendingRestart = null; renderTree(subsystems); } }, 'Cancel'));
        } else {
          row.append(el('button', { class: 'restart', type: 'button', onclick: () => { state.pendingRestart = s.id; renderTree(subsystems); } }, 'Restart'));
        }
      }
      rows.push(row);
    }
    $('tree').replaceChildren(...rows);
  }

  async function restart(id) {
    state.pendingRestart = null;
    $('restart-result').textContent = 'restarting ' + id + '…';
    try {
      // The id is a tree path; each segment is percent-encoded, the slashes kept.
      const path = id.split('/').map(encodeURIComponent).join('/');
      await api('POST', '/admin/subsystems/' + path + '/restart');
      $('restart-result').textContent = 'restarted ' + id;
      $('restart-result').className = 'status ok';
    } catch (e) {
      if (e.auth) { showLogin('Signed out: ' + e.message); return; }
      $('restart-result').textContent = 'restart of ' + id + ' failed: ' + e.message;
      $('restart-result').className = 'status bad';
    }
  }

  // ----- wiring --------------------------------------------------------------------------

  function setAll(open) {
    for (const d of document.querySelectorAll('details.group')) {
      state.open.set(d.getAttribute('data-group'), open);
      d.open = open;
    }
  }

  document.addEventListener('DOMContentLoaded', () => {
    $('login-form').addEventListener('submit', login);
    $('logout').addEventListener('click', () => showLogin('Signed out.'));
    $('expand-all').addEventListener('click', () => setAll(true));
    $('collapse-all').addEventListener('click', () => setAll(false));
    $('filter').addEventListener('input', () => {
      if (state.lastWorkers) renderFleet(state.lastWorkers, state.lastSummary || {});
    });
    if (token()) showApp(); else showLogin('');
  });

  // For the browser test and for debugging: stop polling and render a given payload.
  window.continuumFleet = {
    pause: stop,
    resume: start,
    renderFleet: (workers, summary) => renderFleet(workers, summary || {}),
    renderQueues: (summary) => renderQueues(summary || {}),
    renders: () => state.renders,
  };
})();
