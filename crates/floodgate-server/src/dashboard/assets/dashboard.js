// floodgate's dashboard: reads /admin/v1/dashboard/stream (one JSON line a
// second) with fetch, so the admin token goes in an Authorization header
// (kept in sessionStorage, never a cookie). Nothing is fetched while the
// tab is hidden. No dependencies, nothing loaded from elsewhere.
'use strict';

const TOKEN_KEY = 'floodgate-admin-token';
const HISTORY = 300;
const SERIES = ['allowed', 'denied', 'shadow_denied', 'failure_policy'];
const $ = (id) => document.getElementById(id);

let token = sessionStorage.getItem(TOKEN_KEY) || '';
let streaming = null;
let retry = null;
let reloadMark = null;
let loaded = [];
let keysCursor = null;

function authHeaders(extra) {
  const h = Object.assign({}, extra || {});
  if (token) h.Authorization = 'Bearer ' + token;
  return h;
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === 'class') e.className = v;
    else if (k === 'text') e.textContent = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

function svg(tag, attrs) {
  const e = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}

async function api(method, path, body) {
  const init = { method, headers: authHeaders(body === undefined ? {} : { 'Content-Type': 'application/json' }) };
  if (body !== undefined) init.body = JSON.stringify(body);
  const r = await fetch(path, init);
  if (r.status === 401) {
    needToken('the token was refused');
    throw new Error('unauthorized');
  }
  const text = await r.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (_) { data = { error: text }; }
  if (!r.ok) throw new Error((data && (data.error || data.message)) || JSON.stringify(data) || r.statusText);
  return data;
}

function needToken(why) {
  stop();
  $('main').hidden = true;
  $('login').hidden = false;
  $('login-error').textContent = token ? why : '';
  setLive('token needed', '');
  $('token').focus();
}

function setLive(text, cls) {
  const l = $('live');
  l.textContent = text;
  l.className = 'pill ' + cls;
}

function stop() {
  if (streaming) streaming.abort();
  streaming = null;
  clearTimeout(retry);
}

// Follow the stream until it ends, then try again in 2 s.
async function follow() {
  stop();
  if (document.hidden) return;
  const ctl = new AbortController();
  streaming = ctl;
  try {
    const r = await fetch('/admin/v1/dashboard/stream?top=10', { headers: authHeaders(), signal: ctl.signal });
    if (r.status === 401) {
      needToken('the token was refused');
      return;
    }
    if (!r.ok || !r.body) throw new Error('HTTP ' + r.status);
    $('login').hidden = true;
    $('main').hidden = false;
    setLive('live', 'ok');
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buf.indexOf('\n')) >= 0) {
        const line = buf.slice(0, nl);
        buf = buf.slice(nl + 1);
        if (line.trim()) render(JSON.parse(line));
      }
    }
  } catch (e) {
    if (ctl.signal.aborted) return;
  }
  if (streaming !== ctl) return;
  setLive('disconnected: retrying', 'down');
  retry = setTimeout(follow, 2000);
}

function when(unixS) {
  return unixS ? new Date(unixS * 1000).toLocaleString() : '—';
}

function kv(pairs) {
  const dl = el('dl');
  for (const [k, v] of pairs) {
    dl.append(el('dt', { text: k }), el('dd', { text: v === null || v === undefined ? '—' : String(v) }));
  }
  return dl;
}

function render(snap) {
  const st = snap.status || {};
  const rules = st.rules || {};
  $('updated').textContent = 'updated ' + new Date(snap.now_unix_ms).toLocaleTimeString();

  // Problems first: a failed reload (with file:line), then warnings.
  const problems = $('problems');
  problems.replaceChildren();
  if (rules.last_error) {
    problems.append(el('div', { id: 'reload-error', class: 'problem' },
      'The last reload failed (' + when(rules.failed_at_unix_s) + '); the last good rules still serve:\n' + rules.last_error));
  }
  for (const w of st.warnings || []) problems.append(el('div', { class: 'problem warning', text: w }));
  if (st.store && st.store.ok === false) {
    problems.append(el('div', { class: 'problem', text: 'The store is failing: ' + (st.store.error || '') }));
  }

  $('rules-status').replaceChildren(kv([
    ['source', rules.source], ['domains', rules.domains], ['rules', rules.rules],
    ['loaded', when(rules.loaded_at_unix_s)],
    ['last reload', rules.last_error ? 'failed ' + when(rules.failed_at_unix_s) : 'ok'],
    ['reloads / refused', (rules.reloads || 0) + ' / ' + (rules.reload_failures || 0)],
  ]));
  const store = st.store || {};
  const storeRows = [
    ['kind', store.kind], ['reachable', store.ok ? 'yes' : 'no: ' + (store.error || '')],
    ['round trip', store.round_trip_ms === undefined ? null : store.round_trip_ms.toFixed(2) + ' ms'],
  ];
  if (store.kind === 'redis') {
    storeRows.push(['breaker', store.breaker_open ? 'OPEN (failure policy decides)' : 'closed'],
      ['breaker trips', store.breaker_trips], ['cached denials', store.cached_denials],
      ['errors / timeouts', store.errors + ' / ' + store.timeouts]);
  } else if (store.kind === 'memory') {
    storeRows.push(['keys', store.keys + ' of ' + store.max_keys], ['evictions', store.evictions]);
  }
  $('store-status').replaceChildren(kv(storeRows));
  const regions = st.regions;
  $('regions-card').hidden = !regions;
  if (regions) {
    const rows = [['region', regions.region], ['warming', regions.warming]];
    for (const p of regions.peers || []) {
      rows.push(['peer ' + p.region, (p.reachable ? 'up' : 'DOWN') + ', lag ' + (p.lag_ms ?? '—') + ' ms, rtt ' +
        (p.rtt_ms || 0).toFixed(1) + ' ms, queued ' + p.queued_keys]);
    }
    if (regions.note) rows.push(['note', regions.note]);
    $('regions-status').replaceChildren(kv(rows));
  }

  const mark = rules.loaded_at_unix_s + '/' + rules.reloads;
  if (mark !== reloadMark) {
    reloadMark = mark;
    loadRules();
  }
  renderRules((snap.dashboard || {}).rules || []);
  const b = (snap.dashboard || {}).budget || {};
  $('budget').textContent = b.on === false
    ? 'The dashboard\'s data is off on this server (--dashboard off).'
    : `Watching ${b.rules_watched} of at most ${b.max_rules} rules (${b.refused} times a rule found no place); ` +
      `at most ${(b.max_bytes / 1048576).toFixed(1)} MiB; ${b.top_keys_per_table} keys per table, keys cut at ${b.key_bytes} bytes.`;
}

function recent(r) {
  const a = (r.per_second || {}).allowed || [];
  const d = (r.per_second || {}).denied || [];
  let s = 0;
  for (let i = Math.max(0, a.length - 10); i < a.length; i++) s += a[i] + (d[i] || 0);
  return s;
}

function chart(perSecond) {
  const w = HISTORY, h = 60;
  let max = 1;
  for (const s of SERIES) for (const v of perSecond[s] || []) max = Math.max(max, v);
  const g = svg('svg', { viewBox: `0 0 ${w} ${h + 4}`, preserveAspectRatio: 'none', role: 'img' });
  for (const s of SERIES) {
    const vals = perSecond[s] || [];
    if (!vals.some((v) => v > 0)) continue;
    const off = w - vals.length;
    const pts = vals.map((v, i) => `${off + i},${(h + 2 - (v / max) * h).toFixed(1)}`).join(' ');
    g.append(svg('polyline', { class: s, points: pts }));
  }
  const label = svg('text', { x: 2, y: 10, 'font-size': 9, fill: '#777' });
  label.textContent = 'max ' + max + '/s';
  g.append(label);
  return g;
}

function topList(title, cls, t) {
  const box = el('div', { class: 'top ' + cls });
  const keys = (t && t.keys) || [];
  box.append(el('div', { text: `${title} (of ${t ? t.seen : 0}; each count ≤ ${t ? t.bound : 0} over)` }));
  const ol = el('ol');
  for (const k of keys) {
    ol.append(el('li', { 'data-key': k.key, text: `${k.key} — ${k.count}` + (k.error ? ` (±${k.error})` : '') }));
  }
  if (!keys.length) ol.append(el('li', { class: 'muted', text: 'none' }));
  box.append(ol);
  return box;
}

function ruleAt(domain, rule) {
  const r = loaded.find((x) => x.domain === domain && (x.name === rule || x.descriptor === rule));
  return r ? r.at : '';
}

function renderRules(rules) {
  const filter = $('filter').value.trim().toLowerCase();
  const shown = rules
    .filter((r) => !filter || (r.domain + '/' + r.rule).toLowerCase().includes(filter))
    .sort((a, b) => recent(b) - recent(a) || (a.domain + a.rule).localeCompare(b.domain + b.rule))
    .slice(0, 50);
  const box = $('rules');
  box.replaceChildren();
  if (!shown.length) box.append(el('p', { class: 'muted', text: 'No decisions yet.' }));
  for (const r of shown) {
    const ps = r.per_second || {};
    const last = (s) => {
      const v = ps[s] || [];
      return v.length ? v[v.length - 1] : 0;
    };
    const rates = el('div', { class: 'rates' });
    for (const s of SERIES) {
      rates.append(el('span', { class: 'rate-' + s, 'data-value': String(last(s)), text: `${last(s)}/s ${s.replace('_', ' ')}` }));
    }
    box.append(el('div', { class: 'rule', 'data-rule': r.domain + '/' + r.rule },
      el('div', {}, el('div', { class: 'name', text: r.domain + ' / ' + r.rule }),
        el('div', { class: 'muted at', text: ruleAt(r.domain, r.rule) }), rates),
      el('div', {}, chart(ps)),
      topList('top keys by hits', 'top-hits', r.top_hits),
      topList('top keys by denials', 'top-denials', r.top_denials)));
  }
}

// Windows in words: the largest unit that divides the window.
const UNITS = [[31536000000, 'year'], [2592000000, 'month'], [604800000, 'week'], [86400000, 'day'],
  [3600000, 'hour'], [60000, 'minute'], [1000, 'second']];

function perWindow(ms) {
  for (const [size, name] of UNITS) {
    if (ms >= size && ms % size === 0) {
      const n = ms / size;
      return n === 1 ? name : `${n.toLocaleString('en')} ${name}s`;
    }
  }
  return `${ms.toLocaleString('en')} ms`;
}

// "20,000 per hour", "10 per second, bursts of 20": a burst only where the
// algorithm has one.
function limitText(r) {
  if (r.unlimited) return 'unlimited';
  const bursty = /bucket|gcra/.test(r.algorithm || '');
  const burst = bursty && r.burst ? `, bursts of ${r.burst.toLocaleString('en')}` : '';
  return `${r.limit.toLocaleString('en')} per ${perWindow(r.window_ms)}${burst}`;
}

async function loadRules() {
  try {
    const data = await api('GET', '/admin/v1/rules');
    loaded = [];
    const body = $('loaded').tBodies[0];
    body.replaceChildren();
    for (const d of data.domains || []) {
      for (const r of d.rules || []) {
        loaded.push(Object.assign({ domain: d.domain }, r));
        const limit = limitText(r);
        const mode = [r.shadow_mode ? 'shadow' : '', 'failure ' + r.failure_mode].filter(Boolean).join(', ');
        body.append(el('tr', {}, el('td', { text: d.domain }), el('td', { text: r.descriptor }), el('td', { text: r.name || '' }),
          el('td', { text: limit }), el('td', { text: r.algorithm || '' }), el('td', { text: mode }), el('td', { class: 'at', text: r.at })));
      }
    }
  } catch (_) { /* shown by the stream's status */ }
}

function parseDescriptor(text) {
  return text.split(',').map((p) => p.trim()).filter(Boolean).map((p) => {
    const i = p.indexOf('=');
    if (i <= 0) throw new Error(`"${p}": write key=value`);
    return { key: p.slice(0, i).trim(), value: p.slice(i + 1).trim() };
  });
}

async function listKeys(cursor) {
  const q = new URLSearchParams({ limit: '50' });
  if ($('keys-domain').value.trim()) q.set('domain', $('keys-domain').value.trim());
  if ($('keys-prefix').value) q.set('prefix', $('keys-prefix').value);
  if ($('keys-exact').checked) q.set('exact', 'true');
  if (cursor) q.set('cursor', cursor);
  const body = $('keys').tBodies[0];
  body.replaceChildren();
  try {
    const data = await api('GET', '/admin/v1/keys?' + q);
    for (const o of data.entries || []) {
      const del = el('button', { type: 'button', text: 'Delete' });
      del.addEventListener('click', async () => {
        try {
          await api('DELETE', '/admin/v1/keys', { domain: o.domain, descriptor: o.descriptor });
          listKeys(null);
        } catch (e) { $('edit-result').textContent = e.message; }
      });
      body.append(el('tr', {}, el('td', { text: o.domain }),
        el('td', { text: o.descriptor.map((e) => e.key + '=' + e.value).join(', ') }),
        el('td', {}, o.tier ? el('span', { text: 'tier ' + o.tier }) : el('code', { text: JSON.stringify(o.limits) })),
        el('td', { text: when(o.updated_at_unix_s) }), el('td', {}, del)));
    }
    if (!(data.entries || []).length) body.append(el('tr', {}, el('td', { class: 'muted', text: 'none' })));
    keysCursor = data.next_cursor;
    $('keys-next').hidden = !keysCursor;
  } catch (e) {
    body.append(el('tr', {}, el('td', { class: 'bad', text: e.message })));
  }
}

function setup() {
  $('login').addEventListener('submit', (ev) => {
    ev.preventDefault();
    token = $('token').value.trim();
    sessionStorage.setItem(TOKEN_KEY, token);
    follow();
  });
  $('keys-find').addEventListener('submit', (ev) => {
    ev.preventDefault();
    listKeys(null);
  });
  $('keys-next').addEventListener('click', () => listKeys(keysCursor));
  $('keys-edit').addEventListener('submit', async (ev) => {
    ev.preventDefault();
    const out = $('edit-result');
    try {
      const body = {
        domain: $('edit-domain').value.trim(),
        descriptor: parseDescriptor($('edit-descriptor').value),
      };
      // A tier's name, or limits as JSON.
      const what = $('edit-limits').value.trim();
      if (/^[\[{]/.test(what)) body.limits = JSON.parse(what); else body.tier = what;
      await api('PUT', '/admin/v1/keys', body);
      out.className = 'good';
      out.textContent = 'set';
      listKeys(null);
    } catch (e) {
      out.className = 'bad';
      out.textContent = e.message;
    }
  });
  document.addEventListener('visibilitychange', () => (document.hidden ? stop() : follow()));
  // Ask for the token first when one is needed and none is kept, rather
  // than be refused.
  fetch('/dashboard/config').then((r) => r.json()).then((c) => {
    if (c.token_required && !token) needToken('');
    else follow();
  }, () => follow());
}

setup();
