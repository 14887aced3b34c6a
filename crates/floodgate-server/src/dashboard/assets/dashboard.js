// floodgate's dashboard: reads /admin/v1/dashboard/stream (one JSON line a
// second) with fetch, so the admin token goes in an Authorization header
// (kept in sessionStorage, never a cookie). Nothing is fetched while the
// tab is hidden. No dependencies, nothing loaded from elsewhere.
'use strict';

const TOKEN_KEY = 'floodgate-admin-token';
const SERIES = ['allowed', 'denied', 'shadow_denied', 'failure_policy'];
const NAMES = { allowed: 'allowed', denied: 'denied', shadow_denied: 'shadow-denied', failure_policy: 'failure policy' };
// Each range's length in seconds and its name in sentences.
const RANGES = { '5m': [300, 'the last 5 minutes'], '1h': [3600, 'the last hour'], '1d': [86400, 'the last day'] };
// A page shows this many rules at a time ("show more" adds as many).
const PAGE = 50;
// No line for this long: the data on screen is no longer live.
const STALE_MS = 2500;
const $ = (id) => document.getElementById(id);

let token = sessionStorage.getItem(TOKEN_KEY) || '';
let streaming = null;
let retry = null;
let reloadMark = null;
let loaded = { rules: [], tiers: [] };
let keysCursor = null;
let range = '5m';
let zoom = null; // [from, to] in Unix seconds, or null
let snap = null;
let lastLine = 0; // Date.now() of the last line read
let lostAt = 0; // when the stream was lost (0: it is not)
let order = []; // rule ids in the order shown
let shown = PAGE;
let view = null; // the id of the rule whose page is open, or null
const rows = new Map(); // rule id -> its row's parts
const keySamples = new Map(); // on a rule's page: key -> [[t, count]]
let keyCounters = new Map(); // on a rule's page: key -> counters answer
let lastSampled = 0; // on a rule's page: when its keys were last sampled

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

// ---- numbers and words ----

function num(n) {
  if (n === null || n === undefined || Number.isNaN(n)) return '—';
  return Number(n).toLocaleString('en', { maximumFractionDigits: Math.abs(n) < 10 ? 1 : 0 });
}

// 1,234 -> "1.2k": for axes.
function short(n) {
  const a = Math.abs(n);
  if (a >= 1e9) return (n / 1e9).toFixed(a >= 1e10 ? 0 : 1) + 'G';
  if (a >= 1e6) return (n / 1e6).toFixed(a >= 1e7 ? 0 : 1) + 'M';
  if (a >= 1e3) return (n / 1e3).toFixed(a >= 1e4 ? 0 : 1) + 'k';
  return String(Math.round(n * 10) / 10);
}

function pct(part, whole) {
  if (!whole) return '0%';
  const p = (100 * part) / whole;
  return (p > 0 && p < 0.1 ? '<0.1' : p.toFixed(p < 10 ? 1 : 0)) + '%';
}

function clock(unixS, seconds) {
  const d = new Date(unixS * 1000);
  const two = (n) => String(n).padStart(2, '0');
  return two(d.getHours()) + ':' + two(d.getMinutes()) + (seconds ? ':' + two(d.getSeconds()) : '');
}

function when(unixS) {
  return unixS ? new Date(unixS * 1000).toLocaleString() : '—';
}

// 75 -> "1 min 15 s".
function duration(s) {
  s = Math.max(0, Math.round(s));
  if (s < 60) return s + ' s';
  if (s < 3600) return Math.floor(s / 60) + ' min' + (s % 60 ? ' ' + (s % 60) + ' s' : '');
  if (s < 86400) return Math.floor(s / 3600) + ' h' + (s % 3600 >= 60 ? ' ' + Math.floor((s % 3600) / 60) + ' min' : '');
  return Math.floor(s / 86400) + ' d' + (s % 86400 >= 3600 ? ' ' + Math.floor((s % 86400) / 3600) + ' h' : '');
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

// Whether an algorithm has a burst of its own (the GCRA family).
function bursty(algorithm) {
  return /bucket|gcra/.test(algorithm || '');
}

// "20,000 per hour", "10 per second, bursts of 20": a burst only where the
// algorithm has one.
function limitText(r) {
  if (r.unlimited) return 'unlimited';
  if (r.algorithm === 'concurrency') {
    return `${r.limit.toLocaleString('en')} in flight per key, leases end after ${duration(r.window_ms / 1000)}`;
  }
  const burst = bursty(r.algorithm) && r.burst ? `, bursts of ${r.burst.toLocaleString('en')}` : '';
  return `${r.limit.toLocaleString('en')} per ${perWindow(r.window_ms)}${burst}`;
}

// A per-key entry's own limits (rate_limit blocks as JSON) in words.
function ownLimitsText(limits) {
  const list = Array.isArray(limits) ? limits : [limits];
  return list.map((l) => {
    if (!l || typeof l !== 'object') return JSON.stringify(l);
    if (l.unlimited) return 'unlimited';
    const n = l.requests_per_unit;
    if (typeof n !== 'number') return JSON.stringify(l);
    const per = l.unit ? String(l.unit).toLowerCase() : (l.window || '?');
    const parts = [`${n.toLocaleString('en')} per ${per}`];
    if (l.algorithm && l.algorithm !== 'fixed_window') parts.push(l.algorithm.replace(/_/g, ' '));
    if (l.burst && bursty(l.algorithm)) parts.push(`bursts of ${Number(l.burst).toLocaleString('en')}`);
    if (l.name) parts.push(`named ${l.name}`);
    return parts.join(', ');
  }).join('; ');
}

function parseDescriptor(text) {
  return text.split(',').map((p) => p.trim()).filter(Boolean).map((p) => {
    const i = p.indexOf('=');
    if (i <= 0) throw new Error(`"${p}": write key=value`);
    return { key: p.slice(0, i).trim(), value: p.slice(i + 1).trim() };
  });
}

// ---- the stream, and whether what is shown is live ----

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
    const r = await fetch(`/admin/v1/dashboard/stream?top=10&range=${range}`, { headers: authHeaders(), signal: ctl.signal });
    if (r.status === 401) {
      needToken('the token was refused');
      return;
    }
    if (!r.ok || !r.body) throw new Error('HTTP ' + r.status);
    $('login').hidden = true;
    $('main').hidden = false;
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
        if (line.trim()) {
          lastLine = Date.now();
          lostAt = 0;
          render(JSON.parse(line));
        }
      }
    }
  } catch (e) {
    if (ctl.signal.aborted) return;
  }
  if (streaming !== ctl) return;
  if (!lostAt) lostAt = Date.now();
  freshness();
  retry = setTimeout(follow, 2000);
}

// Live, or stale with how long: checked twice a second, so a server that
// dies without closing the stream shows within STALE_MS.
function freshness() {
  if (!snap || $('main').hidden) return;
  const now = Date.now();
  const stale = lostAt !== 0 || now - lastLine > STALE_MS;
  document.body.classList.toggle('stale', stale);
  const since = Math.max(1, Math.round((now - lastLine) / 1000));
  if (stale) {
    setLive(`disconnected for ${duration(since)}: retrying`, 'down');
    $('updated').textContent = 'last data ' + clock(snap.now_unix_ms / 1000, true) + ', shown greyed';
    const reach = document.querySelector('#store-status dd[data-k="reachable"]');
    if (reach) reach.textContent = `unknown: no answer from this server for ${duration(since)}`;
  } else {
    setLive('live', 'ok');
  }
}

// ---- charts ----

// The time a chart shows: the zoom, else the whole range up to the data's end.
// The end of bucket `i` of a series whose first bucket starts at `t0`.
function bucketEnd(t0, i, step) {
  return t0 + (i + 1) * step;
}

function domainOf(end, spec) {
  if (spec && spec.noZoom) return [end - (spec.window || RANGES[range][0]), end];
  if (zoom) return zoom;
  return [end - RANGES[range][0], end];
}

// A series' bucket values as what the chart plots (a count over a bucket of
// step_s seconds is drawn per second; a gauge as it is).
function plotted(values, step, fold) {
  return fold === 'max' ? values.slice() : values.map((v) => v / step);
}

function niceMax(v) {
  if (v <= 0) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}

function timeTicks(from, to) {
  const span = to - from;
  const steps = [1, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200];
  const step = steps.find((s) => span / s <= 6) || 86400;
  const out = [];
  for (let t = Math.ceil(from / step) * step; t <= to; t += step) out.push(t);
  return { ticks: out, seconds: step < 60 };
}

// Draw `spec` into `box`: lanes stacked, each with its own scale, a time
// axis, grid lines and values on hover; dragging across selects a zoom.
//   spec = { step, end, lanes: [{ label, unit, fold: 'sum'|'max', series: [{ name, cls, values }] }] }
function drawChart(box, spec, laneHeight) {
  box._spec = spec;
  box._laneHeight = laneHeight;
  // Not under a drag: the selection would be lost (redrawn at pointerup).
  if (box._drag) return;
  const width = Math.max(200, Math.floor(box.clientWidth || 300));
  const left = 46, right = 8, gap = 16, axis = 16;
  const h = spec.lanes.length * (laneHeight + gap) + axis;
  const [from, to] = domainOf(spec.end, spec);
  const x = (t) => left + ((t - from) / Math.max(1, to - from)) * (width - left - right);
  const g = svg('svg', { viewBox: `0 0 ${width} ${h}`, width, height: h, role: 'img', class: 'chart' });
  const label = [];
  spec.lanes.forEach((lane, li) => {
    const top = li * (laneHeight + gap) + 12;
    const n = Math.max(0, ...lane.series.map((s) => s.values.length));
    const t0 = spec.end - n * spec.step;
    const visible = (i) => {
      const t = bucketEnd(t0, i, spec.step);
      return t >= from && t <= to;
    };
    let max = 0;
    for (const s of lane.series) {
      plotted(s.values, spec.step, lane.fold).forEach((v, i) => { if (visible(i)) max = Math.max(max, v); });
    }
    const ymax = niceMax(max);
    const y = (v) => top + laneHeight - (v / ymax) * laneHeight;
    for (const f of [0, 0.5, 1]) {
      g.append(svg('line', { class: 'grid', x1: left, x2: width - right, y1: y(ymax * f), y2: y(ymax * f) }));
      const t = svg('text', { class: 'ylabel', x: left - 4, y: y(ymax * f) + 3, 'text-anchor': 'end' });
      t.textContent = short(ymax * f);
      g.append(t);
    }
    const name = svg('text', { class: 'lane', x: left + 2, y: top - 3 });
    name.textContent = lane.label + (lane.unit ? ' (' + lane.unit + ')' : '');
    g.append(name);
    for (const s of lane.series) {
      const vals = plotted(s.values, spec.step, lane.fold);
      const pts = [];
      vals.forEach((v, i) => { if (visible(i)) pts.push(`${x(bucketEnd(t0, i, spec.step)).toFixed(1)},${y(v).toFixed(1)}`); });
      if (pts.length === 1) pts.push(pts[0].replace(/^[^,]+/, (v) => String(Number(v) - 2)));
      if (pts.length) g.append(svg('polyline', { class: 'line ' + s.cls, points: pts.join(' ') }));
    }
    label.push({ top, lane, t0 });
  });
  const axisY = h - axis + 2;
  g.append(svg('line', { class: 'axis', x1: left, x2: width - right, y1: axisY, y2: axisY }));
  const { ticks, seconds } = timeTicks(from, to);
  for (const t of ticks) {
    const tx = x(t);
    g.append(svg('line', { class: 'grid v', x1: tx, x2: tx, y1: 8, y2: axisY }));
    const tl = svg('text', { class: 'xlabel', x: tx, y: axisY + 12, 'text-anchor': 'middle' });
    tl.textContent = clock(t, seconds);
    g.append(tl);
  }
  const cursor = svg('line', { class: 'cursor', x1: 0, x2: 0, y1: 8, y2: axisY, visibility: 'hidden' });
  const sel = svg('rect', { class: 'selection', x: 0, y: 8, width: 0, height: axisY - 8, visibility: 'hidden' });
  g.append(cursor, sel);
  const tOf = (ev) => {
    const r = g.getBoundingClientRect();
    const px = ((ev.clientX - r.left) / r.width) * width;
    return from + ((px - left) / (width - left - right)) * (to - from);
  };
  let dragFrom = null;
  g.addEventListener('pointermove', (ev) => {
    box._hover = { clientX: ev.clientX, clientY: ev.clientY };
    const t = tOf(ev);
    const tip = $('tip');
    if (t < from || t > to) { cursor.setAttribute('visibility', 'hidden'); tip.hidden = true; return; }
    cursor.setAttribute('x1', x(t));
    cursor.setAttribute('x2', x(t));
    cursor.setAttribute('visibility', 'visible');
    const lines = [];
    let at = null;
    for (const { lane, t0 } of label) {
      const i = Math.floor((t - t0) / spec.step);
      for (const s of lane.series) {
        if (i < 0 || i >= s.values.length) continue;
        const v = plotted([s.values[i]], spec.step, lane.fold)[0];
        at = bucketEnd(t0, i, spec.step);
        lines.push(`${s.name}: ${num(v)}${lane.unit ? ' ' + lane.unit : ''}`);
      }
    }
    if (!lines.length) { tip.hidden = true; return; }
    const span = spec.step > 1 ? `${clock(at - spec.step, true)}–${clock(at, true)}` : clock(at, true);
    tip.textContent = span + '\n' + lines.join('\n');
    tip.hidden = false;
    tip.style.left = Math.min(ev.clientX + 12, window.innerWidth - tip.offsetWidth - 4) + 'px';
    tip.style.top = (ev.clientY + 12) + 'px';
    if (dragFrom !== null) {
      const a = Math.min(x(dragFrom), x(t)), b = Math.max(x(dragFrom), x(t));
      sel.setAttribute('x', a);
      sel.setAttribute('width', b - a);
      sel.setAttribute('visibility', 'visible');
    }
  });
  g.addEventListener('pointerleave', () => {
    box._hover = null;
    cursor.setAttribute('visibility', 'hidden');
    $('tip').hidden = true;
  });
  g.addEventListener('pointerdown', (ev) => {
    if (spec.noZoom) return;
    dragFrom = Math.min(to, Math.max(from, tOf(ev)));
    box._drag = true;
    g.setPointerCapture(ev.pointerId);
  });
  const endDrag = (ev, zoomIt) => {
    if (dragFrom === null) return;
    const t = Math.min(to, Math.max(from, tOf(ev)));
    const a = Math.min(dragFrom, t), b = Math.max(dragFrom, t);
    dragFrom = null;
    box._drag = false;
    sel.setAttribute('visibility', 'hidden');
    if (zoomIt && x(b) - x(a) >= 6 && b - a >= 2 * spec.step) {
      box._hover = null;
      $('tip').hidden = true;
      setZoom([a, b]);
    } else {
      drawChart(box, box._spec, box._laneHeight);
    }
  };
  g.addEventListener('pointerup', (ev) => endDrag(ev, true));
  g.addEventListener('pointercancel', (ev) => endDrag(ev, false));
  // A legend under the chart for lanes of more than one series (it wraps
  // on a narrow screen, where one drawn in the chart would not fit).
  const legend = el('div', { class: 'legend' });
  for (const lane of spec.lanes) {
    if (lane.series.length < 2) continue;
    for (const s of lane.series) legend.append(el('span', { class: 'item' }, el('span', { class: 'sw ' + s.cls }), ' ' + s.name));
  }
  box.replaceChildren(g);
  if (legend.childNodes.length) box.append(legend);
  // Redrawn under the pointer (a new second): the values follow.
  if (box._hover) g.dispatchEvent(new PointerEvent('pointermove', box._hover));
}

function setZoom(z) {
  zoom = z;
  $('unzoom').hidden = !zoom;
  redrawCharts();
  if (snap) render(snap);
}

function redrawCharts() {
  for (const box of document.querySelectorAll('.chart-box')) {
    if (box._spec) drawChart(box, box._spec, box._laneHeight);
  }
}

function ruleSpec(history) {
  const s = (name) => ({ name: NAMES[name], cls: name, values: history[name] || [] });
  return {
    step: history.step_s || 1,
    end: history.end_unix_s || Math.floor(Date.now() / 1000),
    lanes: [
      { label: 'allowed', unit: '/s', fold: 'sum', series: [s('allowed')] },
      { label: 'denied · by the failure policy', unit: '/s', fold: 'sum', series: [s('denied'), s('shadow_denied'), s('failure_policy')] },
    ],
  };
}

// Sums of a history's series over what the chart shows.
function sums(history) {
  const out = {};
  const step = history.step_s || 1;
  const end = history.end_unix_s || 0;
  const [from, to] = domainOf(end);
  for (const name of SERIES) {
    const v = history[name] || [];
    const t0 = end - v.length * step;
    let sum = 0;
    v.forEach((x, i) => { const t = bucketEnd(t0, i, step); if (t >= from && t <= to) sum += x; });
    out[name] = sum;
  }
  out.seconds = Math.max(1, Math.min(to, end) - from);
  return out;
}

function spanWords() {
  if (!zoom) return RANGES[range][1];
  return `${clock(zoom[0], true)}–${clock(zoom[1], true)}`;
}

// ---- rendering a line ----

function kv(pairs) {
  const dl = el('dl');
  for (const [k, v] of pairs) {
    dl.append(el('dt', { text: k }), el('dd', { 'data-k': k, text: v === null || v === undefined ? '—' : String(v) }));
  }
  return dl;
}

function render(s) {
  snap = s;
  // A zoom whose span the range no longer keeps shows nothing: let it go.
  if (zoom && zoom[1] < s.now_unix_ms / 1000 - RANGES[range][0]) {
    zoom = null;
    $('unzoom').hidden = true;
  }
  const st = s.status || {};
  const rules = st.rules || {};
  $('updated').textContent = 'updated ' + clock(s.now_unix_ms / 1000, true);
  freshness();

  // Problems first: a failed reload (one line per error), then warnings.
  const problems = $('problems');
  problems.replaceChildren();
  if (rules.last_error) {
    const errors = (rules.last_errors && rules.last_errors.length) ? rules.last_errors : rules.last_error.split('\n');
    const box = el('div', { id: 'reload-error', class: 'problem' },
      el('div', { text: `The last reload failed (${when(rules.failed_at_unix_s)}); the last good rules still serve. ` +
        `${errors.length} error${errors.length === 1 ? '' : 's'}:` }));
    const ul = el('ul');
    for (const e of errors) ul.append(el('li', { class: 'error-line', text: e }));
    box.append(ul);
    problems.append(box);
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
    storeRows.push(['keys', num(store.keys) + ' of ' + num(store.max_keys)], ['evictions', store.evictions]);
  }
  $('store-status').replaceChildren(kv(storeRows));
  renderRegions(st.regions, (s.dashboard || {}).peers || []);

  const mark = rules.loaded_at_unix_s + '/' + rules.reloads;
  if (mark !== reloadMark) {
    reloadMark = mark;
    loadRules();
  }
  const dash = s.dashboard || {};
  renderOverview(dash.rules || [], dash.budget || {});
  if (view) renderRulePage((dash.rules || []).find((r) => idOf(r) === view));
  else renderRules(dash.rules || [], dash.budget || {});
  const b = dash.budget || {};
  $('budget').textContent = b.on === false ? '' :
    `Keeping data for ${b.rules_watched} of at most ${num(b.max_rules)} rules` +
    (b.refused ? ` (${num(b.refused)} times a rule found no place)` : '') +
    `; at most ${(b.max_bytes / 1048576).toFixed(1)} MiB in all; ${b.top_keys_per_table} keys per table, keys cut at ${b.key_bytes} bytes; ` +
    `a rule idle for ${duration(b.idle_release_seconds || 0)} gives its place back.`;
}

function renderRegions(regions, peers) {
  $('regions-card').hidden = !regions;
  if (!regions) return;
  const rows = [['region', regions.region], ['warming', regions.warming ? 'yes' : 'no']];
  for (const p of regions.peers || []) {
    rows.push(['peer ' + p.region, (p.reachable ? 'up' : 'DOWN') + ', lag ' + (p.lag_ms ?? '—') + ' ms, round trip ' +
      (p.rtt_ms || 0).toFixed(1) + ' ms, queued ' + num(p.queued_keys)]);
  }
  if (regions.note) rows.push(['note', regions.note]);
  $('regions-status').replaceChildren(kv(rows));
  const box = $('peer-charts');
  for (const p of peers) {
    let c = box.querySelector(`[data-peer="${CSS.escape(p.region)}"]`);
    if (!c) {
      c = el('div', { 'data-peer': p.region }, el('div', { class: 'muted', text: 'peer ' + p.region + ' over ' + RANGES[range][1] }),
        el('div', { class: 'chart-box' }));
      box.append(c);
    }
    const spec = {
      step: p.step_s || 1, end: p.end_unix_s || 0,
      lanes: [
        { label: 'lag and round trip', unit: 'ms', fold: 'max', series: [
          { name: 'lag', cls: 'lag', values: p.lag_ms || [] }, { name: 'round trip', cls: 'rtt', values: p.rtt_ms || [] }] },
        { label: 'queued keys', unit: '', fold: 'max', series: [{ name: 'queued', cls: 'queued', values: p.queued_keys || [] }] },
        { label: 'unreachable', unit: 's/s', fold: 'sum', series: [{ name: 'unreachable', cls: 'down', values: p.down_s || [] }] },
      ],
    };
    drawChart(c.querySelector('.chart-box'), spec, 36);
  }
}

function idOf(r) {
  return r.domain + '/' + r.rule;
}

function lastRate(history, name) {
  const v = history[name] || [];
  return v.length ? v[v.length - 1] / (history.step_s || 1) : 0;
}

function renderOverview(rules, budget) {
  let rate = 0, denied = 0;
  const total = { allowed: 0, denied: 0, shadow_denied: 0, failure_policy: 0, seconds: 1 };
  for (const r of rules) {
    const h = r.history || {};
    rate += SERIES.reduce((a, n) => a + lastRate(h, n), 0);
    denied += lastRate(h, 'denied');
    const s = sums(h);
    for (const n of SERIES) total[n] += s[n];
    total.seconds = Math.max(total.seconds, s.seconds);
  }
  const decisions = SERIES.reduce((a, n) => a + total[n], 0);
  const step = ((rules[0] || {}).history || {}).step_s || 1;
  const latest = step === 1 ? 'the last second' : `the last ${duration(step)}`;
  $('ov-rate').textContent = num(rate);
  $('ov-rate').dataset.value = String(rate);
  $('ov-rate-note').textContent = `in ${latest}, every watched rule; ${num(decisions / total.seconds)}/s over ${spanWords()}`;
  $('ov-denied').textContent = num(denied);
  $('ov-denied').dataset.value = String(denied);
  $('ov-denied-note').textContent = `in ${latest}; ${num(total.denied / total.seconds)}/s over ${spanWords()}`;
  $('ov-pct-label').textContent = 'denied over ' + spanWords();
  $('ov-pct').textContent = pct(total.denied, decisions);
  $('ov-pct').dataset.value = String(decisions ? total.denied / decisions : 0);
  $('ov-pct-note').textContent = `${num(total.denied)} of ${num(decisions)} decisions`;
  // Most denied keys: every rule's surely-heavy denied keys, by their lower bound.
  const keys = [];
  for (const r of rules) {
    const t = r.top_denials || {};
    for (const k of t.keys || []) {
      if (surelyHeavy(t, k)) keys.push({ rule: idOf(r), key: k.key, lo: k.count - k.error, k });
    }
  }
  keys.sort((a, b) => b.lo - a.lo || a.key.localeCompare(b.key));
  const ol = $('ov-top');
  ol.replaceChildren();
  for (const k of keys.slice(0, 5)) {
    ol.append(el('li', { 'data-key': k.key }, el('span', { text: k.key + ' — ' + countText(k.k) + ' denied ' }),
      el('a', { href: '#rule=' + encodeURIComponent(k.rule), class: 'muted', text: k.rule })));
  }
  const none = budget.on === false ? 'not kept on this server (--dashboard off)'
    : rules.length ? 'no key was denied' : 'no decisions yet';
  if (!keys.length) ol.append(el('li', { class: 'muted empty', text: none }));
}

// Whether the sketch guarantees `k` is among its table's heavy keys: its
// count less its error still exceeds what any unlisted key could have.
function surelyHeavy(t, k) {
  return !t.bound || k.count - k.error > t.bound;
}

function countText(k) {
  return k.error ? `${num(k.count - k.error)}–${num(k.count)}` : num(k.count);
}

// A top-key table, honest: only the keys the sketch guarantees are heavy
// are listed by name; the rest are counted as uncertain.
function topList(title, cls, t, since, what) {
  const box = el('div', { class: 'top ' + cls });
  t = t || { seen: 0, bound: 0, keys: [] };
  box.append(el('div', { class: 'top-title', text: `${title} since ${clock(since)}` }));
  const keys = (t.keys || []).slice().sort((a, b) => (b.count - b.error) - (a.count - a.error) || a.key.localeCompare(b.key));
  const sure = keys.filter((k) => surelyHeavy(t, k));
  const unsure = keys.length - sure.length;
  const ol = el('ol');
  for (const k of sure) ol.append(el('li', { 'data-key': k.key, text: `${k.key} — ${countText(k)}` }));
  if (!keys.length) ol.append(el('li', { class: 'muted empty', text: `no ${what} since ${clock(since)}` }));
  box.append(ol);
  if (t.bound) {
    box.append(el('div', { class: 'muted note', text:
      `Of ${num(t.seen)} ${what} spread over more keys than the table holds: every key with more than ${num(t.bound)} is listed; ` +
      'a range is as sure as a count gets.' + (unsure ? ` ${unsure} more held key${unsure === 1 ? '' : 's'} may have far fewer, not listed.` : '') }));
  } else if (keys.length) {
    box.append(el('div', { class: 'muted note', text: `exact: all ${num(t.seen)} ${what} counted, every key held` }));
  }
  return box;
}

function resort(rules) {
  const key = $('order').value;
  const score = (r) => {
    const s = sums(r.history || {});
    if (key === 'denied') return s.denied;
    if (key === 'busy') return SERIES.reduce((a, n) => a + s[n], 0);
    return 0;
  };
  order = rules.slice().sort((a, b) => score(b) - score(a) || idOf(a).localeCompare(idOf(b))).map(idOf);
}

function renderRules(rules, budget) {
  const box = $('rules');
  $('rules-title').textContent = 'Decisions per second over ' + spanWords();
  const filter = $('filter').value.trim().toLowerCase();
  if (!order.length && rules.length) resort(rules);
  const known = new Set(order);
  for (const r of rules) if (!known.has(idOf(r))) order.push(idOf(r));
  const byId = new Map(rules.map((r) => [idOf(r), r]));
  const matching = order.filter((id) => byId.has(id) && (!filter || id.toLowerCase().includes(filter)));
  const visible = matching.slice(0, shown);
  let empty = null;
  if (budget.on === false) {
    empty = 'This server keeps no dashboard data (--dashboard off): its decisions are counted in /metrics only, nothing is charted here.';
  } else if (!rules.length) {
    empty = 'No decisions in the last day: a rule appears here from its first decision.';
  } else if (!matching.length) {
    empty = `No rule matches "${filter}" (${rules.length} rule${rules.length === 1 ? ' has' : 's have'} data).`;
  }
  let msg = box.querySelector('p.empty');
  if (empty) {
    if (!msg) { msg = el('p', { class: 'muted empty' }); box.prepend(msg); }
    msg.textContent = empty;
  } else if (msg) msg.remove();
  const want = new Set(visible);
  for (const [id, row] of rows) if (!want.has(id)) { row.root.remove(); rows.delete(id); }
  let prev = msg && empty ? msg : null;
  for (const id of visible) {
    let row = rows.get(id);
    if (!row) { row = makeRow(byId.get(id)); rows.set(id, row); }
    if (prev ? prev.nextSibling !== row.root : box.firstChild !== row.root) {
      if (prev) prev.after(row.root); else box.prepend(row.root);
    }
    updateRow(row, byId.get(id));
    prev = row.root;
  }
  const more = $('rules-more');
  more.replaceChildren();
  if (matching.length > visible.length) {
    const b = el('button', { type: 'button', id: 'show-more', text: `show ${Math.min(PAGE, matching.length - visible.length)} more` });
    b.addEventListener('click', () => { shown += PAGE; render(snap); });
    more.append(`Showing ${visible.length} of ${matching.length} rules. `, b);
  } else if (matching.length > PAGE) {
    more.append(`Showing all ${matching.length} rules.`);
  }
}

// What a rule label is in the loaded rules: a files' rule, a tier's limit, or
// per-key entries' own limits.
function ruleInfo(domain, rule) {
  const r = loaded.rules.find((x) => x.domain === domain && x.rule === rule);
  if (r) return { kind: 'rule', at: r.at, def: r };
  for (const t of loaded.tiers) {
    if (t.domain !== domain) continue;
    const l = (t.limits || []).find((x) => x.rule === rule);
    if (l) return { kind: 'tier', tier: t.tier, at: l.at, def: l, entries: t.entries };
  }
  if (rule === 'per-key') return { kind: 'own', at: '' };
  return { kind: 'other', at: '' };
}

function entriesText(n) {
  n = n || 0;
  return n === 1 ? '1 entry uses it' : `${num(n)} entries use it`;
}

function makeRow(r) {
  const id = idOf(r);
  const root = el('div', { class: 'rule', 'data-rule': id });
  const name = el('a', { class: 'name', href: '#rule=' + encodeURIComponent(id), text: r.domain + ' / ' + r.rule });
  const tags = el('div', { class: 'tags' });
  const at = el('div', { class: 'muted at' });
  const rates = el('div', { class: 'rates' });
  const totals = el('div', { class: 'totals' });
  const chart = el('div', { class: 'chart-box' });
  const tops = el('div', { class: 'tops' });
  root.append(el('div', { class: 'head' }, name, tags, at, rates, totals), chart, tops);
  return { root, tags, at, rates, totals, chart, tops };
}

function updateRow(row, r) {
  const info = ruleInfo(r.domain, r.rule);
  row.tags.replaceChildren();
  if (info.kind === 'tier') {
    row.tags.append(el('a', { class: 'tag perkey', href: '#tier-' + r.domain + '-' + info.tier, text: `per-key tier ${info.tier}` }),
      el('span', { class: 'muted', text: ` (${entriesText(info.entries)}; replaces the files' rules for their descriptors)` }));
  } else if (info.kind === 'own') {
    row.tags.append(el('span', { class: 'tag perkey', text: 'per-key entries\' own limits' }));
  } else if (info.def && info.def.shadow_mode) {
    row.tags.append(el('span', { class: 'tag', text: 'shadow' }));
  }
  row.at.textContent = info.at || '';
  const h = r.history || {};
  row.rates.replaceChildren();
  for (const s of SERIES) {
    const v = lastRate(h, s);
    row.rates.append(el('span', { class: 'rate-' + s, 'data-value': String(v), text: `${num(v)}/s ${NAMES[s]}` }));
  }
  if (r.concurrency !== undefined) {
    // A concurrency limit: its slots held now, against its limit per key
    // (null: the leases live in Redis, shared by every instance: a key's
    // slots show in its counters).
    const held = r.in_flight === null ? 'held in Redis (look a key up)' : `in flight now: ${num(r.in_flight)}`;
    row.rates.append(el('span', { class: 'in-flight', 'data-value': String(r.in_flight),
      text: `${held} (up to ${num(r.concurrency)} per key)` +
        (r.leases_expired ? `; ${num(r.leases_expired)} leases ended unreleased` : '') }));
  }
  const t = sums(h);
  const decisions = SERIES.reduce((a, n) => a + t[n], 0);
  row.totals.dataset.denied = String(t.denied);
  row.totals.dataset.decisions = String(decisions);
  row.totals.textContent = `denied over ${spanWords()}: ${num(t.denied)} of ${num(decisions)} (${pct(t.denied, decisions)})`;
  drawChart(row.chart, ruleSpec(h), 44);
  row.tops.replaceChildren(topList('top keys by hits', 'top-hits', r.top_hits, r.top_since_unix_s, 'hits'),
    topList('top keys by denials', 'top-denials', r.top_denials, r.top_since_unix_s, 'denials'));
  if (r.unsketched) {
    const n = r.unsketched;
    row.tops.append(el('div', { class: 'muted', text: `${num(n)} hit${n === 1 ? '' : 's'} not in these tables (the table was busy)` }));
  }
}

// ---- a rule's page ----

function openView() {
  const m = /^#rule=(.+)$/.exec(location.hash);
  const next = m ? decodeURIComponent(m[1]) : null;
  if (next !== view) { keySamples.clear(); keyCounters = new Map(); }
  view = next;
  $('list-view').hidden = !!view;
  $('rule-view').hidden = !view;
  $('overview').hidden = !!view;
  if (view) {
    $('rv-title').textContent = view.replace('/', ' / ');
    if (snap) render(snap);
    loadEntries();
  }
}

function renderRulePage(r) {
  if (!r) {
    $('rv-def').replaceChildren(el('p', { class: 'muted empty', text: 'This rule has no data now (no decision in the last day, or it is no longer loaded).' }));
    return;
  }
  const info = ruleInfo(r.domain, r.rule);
  const def = info.def;
  const defRows = [];
  if (def) {
    defRows.push(['limit', limitText(def)], ['algorithm', def.algorithm || '—']);
    if (def.scope) defRows.push(['scope', def.scope]);
    if (def.failure_mode) defRows.push(['on store failure', def.failure_mode]);
    if (def.shadow_mode) defRows.push(['mode', 'shadow: counted, never denies']);
  }
  if (info.kind === 'tier') defRows.push(['per-key tier', `${info.tier}: ${entriesText(info.entries)}`]);
  if (info.kind === 'own') defRows.push(['per-key', 'the own limits of per-key entries (each entry its own)']);
  defRows.push(['written at', info.at || '—']);
  $('rv-def').replaceChildren(kv(defRows));
  const box = $('rv-chart');
  drawChart(box, ruleSpec(r.history || {}), 110);
  // Its heaviest keys, with their counters now.
  const now = Date.now() / 1000;
  const hits = (r.top_hits || {}).keys || [];
  const denials = new Map(((r.top_denials || {}).keys || []).map((k) => [k.key, k]));
  const held = new Set(hits.map((k) => k.key));
  for (const m of [keySamples, keyCounters]) for (const k of [...m.keys()]) if (!held.has(k)) m.delete(k);
  // One sample a second (a render for a zoom or a reload adds none); a gap
  // (a hidden tab) starts the samples over.
  if (now - lastSampled > 5) keySamples.clear();
  const sampling = now - lastSampled >= 0.9;
  if (sampling) lastSampled = now;
  const body = $('rv-keys').tBodies[0];
  body.replaceChildren();
  for (const k of hits) {
    if (sampling) {
      const s = keySamples.get(k.key) || [];
      s.push([now, k.count]);
      if (s.length > 301) s.shift();
      keySamples.set(k.key, s);
    }
    const c = keyCounters.get(k.key);
    const d = denials.get(k.key);
    body.append(el('tr', { 'data-key': k.key }, el('td', { text: k.key }), el('td', { text: countText(k) }),
      el('td', { text: d ? countText(d) : '0' }), ...counterCells(c).map((t) => el('td', { class: 'counter', text: t }))));
  }
  if (!hits.length) body.append(el('tr', {}, el('td', { class: 'muted empty', colspan: '6', text: 'no hits yet' })));
  $('rv-keys-note').textContent = 'Used, remaining and reset are read from the store now, taking nothing. A key whose text ' +
    `was cut (at ${(snap.dashboard.budget || {}).key_bytes || 64} bytes) or holds ", " or "=" in a value cannot be looked up (—).`;
  refreshCounters(r, hits.map((k) => k.key));
  // The heaviest five over time: hits per second between samples, at the
  // samples' own times.
  const series = hits.slice(0, 5).map((k, i) => {
    const s = keySamples.get(k.key) || [];
    const vals = [];
    for (let j = 1; j < s.length; j++) {
      const slot = Math.round(s[j][0] - s[0][0]) - 1;
      while (vals.length < slot) vals.push(0);
      vals[slot] = Math.max(0, s[j][1] - s[j - 1][1]) / Math.max(0.5, s[j][0] - s[j - 1][0]);
    }
    return { name: k.key, cls: 'k' + i, values: vals, first: s.length ? s[0][0] : now };
  });
  const kb = $('rv-keys-chart');
  const longest = Math.max(0, ...series.map((x) => x.values.length));
  if (!longest) {
    kb.replaceChildren(el('p', { class: 'muted empty', text: 'sampling: a chart appears after two seconds' }));
    return;
  }
  // Each series starts at its own first sample; the chart ends at the latest.
  const end = Math.max(...series.map((x) => Math.round(x.first) + x.values.length));
  for (const x of series) while (Math.round(x.first) + x.values.length < end) x.values.unshift(0);
  drawChart(kb, { step: 1, end, noZoom: true, window: 300, lanes: [{ label: 'hits', unit: '/s', fold: 'max', series }] }, 90);
}

// The cells of a key's counters on a rule's page: used of the capacity,
// remaining, resets in (… while asked, — when it cannot be read).
function counterCells(c) {
  if (c === undefined) return ['…', '…', '…'];
  if (c === null) return ['—', '—', '—'];
  if (c.unlimited) return ['unlimited', '—', '—'];
  if (c.error) return [c.error, '—', '—'];
  return [`${num(c.used)} of ${num(c.capacity)}`, num(c.remaining), duration(c.reset_after_us / 1e6)];
}

let countersBusy = false;
async function refreshCounters(r, keys) {
  if (countersBusy) return;
  countersBusy = true;
  try {
    for (const key of keys) {
      if (key.endsWith('…')) { keyCounters.set(key, null); continue; }
      let descriptor;
      try { descriptor = parseDescriptor(key); } catch (_) { keyCounters.set(key, null); continue; }
      try {
        const a = await api('POST', '/admin/v1/counters', { domain: r.domain, descriptor });
        // This rule's own counters only (the key may match others).
        keyCounters.set(key, (a.limits || []).find((x) => x.rule === r.rule) || null);
      } catch (_) { keyCounters.set(key, null); }
    }
  } finally { countersBusy = false; }
}

async function loadEntries() {
  const box = $('rv-entries');
  if (!view) return;
  const domain = view.slice(0, view.indexOf('/'));
  const rule = view.slice(view.indexOf('/') + 1);
  const info = ruleInfo(domain, rule);
  box.replaceChildren(el('p', { class: 'muted', text: 'loading…' }));
  try {
    const data = await api('GET', '/admin/v1/keys?' + new URLSearchParams({ domain, limit: '20' }));
    const list = (data.entries || []).filter((o) => info.kind === 'tier' ? o.tier === info.tier : info.kind === 'own' ? !o.tier : true);
    const first = `among the first ${(data.entries || []).length} entries of domain ${domain}`;
    const intro = info.kind === 'tier' ? `${entriesText(info.entries)} (tier ${info.tier}); those ${first}:`
      : info.kind === 'own' ? `Entries with their own limits, ${first}:`
      : `Per-key entries replace this rule for their exact descriptors; the first ${(data.entries || []).length} of domain ${domain}:`;
    const ul = el('ul');
    for (const o of list) ul.append(el('li', { text: descText(o.descriptor) + ' — ' + entryLimits(o) }));
    box.replaceChildren(el('p', { text: intro }), list.length ? ul : el('p', { class: 'muted empty', text: 'none' }));
  } catch (e) {
    box.replaceChildren(el('p', { class: 'muted', text: 'Per-key entries: ' + e.message }));
  }
}

function descText(d) {
  return (d || []).map((e) => e.key + '=' + e.value).join(', ');
}

function entryLimits(o) {
  return o.tier ? 'tier ' + o.tier : ownLimitsText(o.limits);
}

// ---- the loaded rules, tiers, per-key limits, key lookup ----

async function loadRules() {
  try {
    const data = await api('GET', '/admin/v1/rules');
    loaded = { rules: [], tiers: [] };
    const body = $('loaded').tBodies[0];
    body.replaceChildren();
    const tiers = $('tiers').tBodies[0];
    tiers.replaceChildren();
    for (const d of data.domains || []) {
      for (const r of d.rules || []) {
        loaded.rules.push(Object.assign({ domain: d.domain }, r));
        const mode = [r.shadow_mode ? 'shadow' : '', 'failure ' + r.failure_mode].filter(Boolean).join(', ');
        body.append(el('tr', {}, el('td', { text: d.domain }), el('td', { text: r.descriptor }), el('td', { text: r.name || '' }),
          el('td', { text: limitText(r) }), el('td', { text: r.algorithm || '' }), el('td', { text: mode }), el('td', { class: 'at', text: r.at })));
      }
      for (const t of d.tiers || []) {
        loaded.tiers.push(Object.assign({ domain: d.domain }, t));
        tiers.append(el('tr', { 'data-tier': d.domain + '/' + t.tier, id: 'tier-' + d.domain + '-' + t.tier }, el('td', { text: d.domain }), el('td', { text: t.tier }),
          el('td', { text: (t.limits || []).map(limitText).join('; ') }),
          el('td', { class: 'entries', text: num(t.entries || 0) }), el('td', { class: 'at', text: t.at })));
      }
      if (d.own_entries) {
        tiers.append(el('tr', {}, el('td', { text: d.domain }), el('td', { class: 'muted', text: '(own limits)' }),
          el('td', { text: 'each entry its own' }), el('td', { class: 'entries', text: num(d.own_entries) }), el('td', {})));
      }
    }
    if (!tiers.rows.length) tiers.append(el('tr', {}, el('td', { class: 'muted empty', colspan: '5', text: 'No tiers in the rules and no per-key entries with limits of their own.' })));
    if (snap) render(snap);
  } catch (_) { /* shown by the stream's status */ }
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
      const del = el('button', { type: 'button', class: 'delete', text: 'Delete' });
      let armed = null;
      del.addEventListener('click', async () => {
        if (!armed) {
          // Two clicks: the first asks, the second (within 5 s) deletes.
          del.textContent = 'Delete ' + descText(o.descriptor) + '?';
          del.classList.add('armed');
          armed = setTimeout(() => { armed = null; del.textContent = 'Delete'; del.classList.remove('armed'); }, 5000);
          return;
        }
        clearTimeout(armed);
        try {
          await api('DELETE', '/admin/v1/keys', { domain: o.domain, descriptor: o.descriptor });
          $('edit-result').className = 'good';
          $('edit-result').textContent = 'deleted ' + descText(o.descriptor);
          listKeys(null);
          loadRules();
        } catch (e) { $('edit-result').className = 'bad'; $('edit-result').textContent = e.message; }
      });
      body.append(el('tr', {}, el('td', { text: o.domain }),
        el('td', { text: descText(o.descriptor) }),
        el('td', { class: 'limits', text: entryLimits(o) }),
        el('td', { text: when(o.updated_at_unix_s) }), el('td', {}, del)));
    }
    if (!(data.entries || []).length) {
      const filtered = q.has('domain') || q.has('prefix');
      body.append(el('tr', {}, el('td', { class: 'muted empty', colspan: '5',
        text: filtered ? 'No per-key limit matches.' : 'No per-key limits yet: set one below, or PUT /admin/v1/keys.' })));
    }
    keysCursor = data.next_cursor;
    $('keys-next').hidden = !keysCursor;
  } catch (e) {
    body.append(el('tr', {}, el('td', { class: 'bad', colspan: '5', text: e.message })));
  }
}

async function lookup() {
  const out = $('lookup-result');
  const domain = $('lookup-domain').value.trim();
  let descriptor;
  try { descriptor = parseDescriptor($('lookup-descriptor').value); } catch (e) {
    out.replaceChildren(el('p', { class: 'bad', text: e.message }));
    return;
  }
  try {
    const a = await api('POST', '/admin/v1/counters', { domain, descriptor });
    const d = descText(descriptor);
    if (!a.matched) {
      out.replaceChildren(el('p', { id: 'lookup-verdict', 'data-limited': 'false',
        text: `No limit applies to ${d} in domain ${domain}: no rule or per-key entry matches it, so its requests are allowed.` }));
      return;
    }
    const verdict = a.limited_now
      ? `${d} is limited now: a request of one hit would be denied.`
      : `${d} is not limited now: a request of one hit would be allowed.`;
    const t = el('table', { id: 'lookup-table' }, el('thead', {}, el('tr', {}, ...['limit', 'from', 'allows', 'used', 'remaining', 'resets in', 'limited now'].map((h) => el('th', { text: h })))));
    const tb = el('tbody');
    for (const l of a.limits) {
      const from = l.from === 'tier' ? `per-key entry, tier ${l.tier} (${l.at})`
        : l.from === 'per_key' ? 'per-key entry, its own limits'
        : l.from === 'request' ? 'carried by the request' : `rules, ${l.at}`;
      const name = el('td', { text: l.rule + (l.shadow ? ' (shadow)' : '') });
      if (l.unlimited || l.error) {
        tb.append(el('tr', { 'data-rule': l.rule }, name, el('td', { text: from }),
          el('td', { class: l.error ? 'bad' : '', colspan: '5', text: l.error || 'unlimited' })));
        continue;
      }
      tb.append(el('tr', { 'data-rule': l.rule, 'data-remaining': String(l.remaining), 'data-reset-us': String(l.reset_after_us) },
        name, el('td', { text: from }),
        el('td', { text: limitText({ limit: l.limit, window_ms: l.window_ms, algorithm: l.algorithm, burst: l.capacity }) }),
        el('td', { text: `${num(l.used)} of ${num(l.capacity)}` }), el('td', { class: 'remaining', text: num(l.remaining) }),
        el('td', { text: duration(l.reset_after_us / 1e6) }), el('td', { text: l.limited_now ? 'yes' : 'no' })));
    }
    t.append(tb);
    out.replaceChildren(el('p', { id: 'lookup-verdict', 'data-limited': String(a.limited_now), text: verdict }),
      el('div', { class: 'scroll' }, t),
      el('p', { class: 'muted', text: '"Limited now": a request of one hit for this descriptor would be denied (some non-shadow limit has nothing remaining). Read taking nothing, as /v1/check with hits 0.' }));
  } catch (e) {
    out.replaceChildren(el('p', { class: 'bad', text: e.message }));
  }
}

function setRange(r) {
  if (r === range) return;
  range = r;
  zoom = null;
  $('unzoom').hidden = true;
  for (const b of document.querySelectorAll('.range button')) b.classList.toggle('on', b.dataset.range === r);
  order = [];
  $('peer-charts').replaceChildren();
  follow();
}

function setup() {
  $('login').addEventListener('submit', (ev) => {
    ev.preventDefault();
    token = $('token').value.trim();
    sessionStorage.setItem(TOKEN_KEY, token);
    follow();
    listKeys(null);
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
      loadRules();
    } catch (e) {
      out.className = 'bad';
      out.textContent = e.message;
    }
  });
  $('lookup').addEventListener('submit', (ev) => { ev.preventDefault(); lookup(); });
  $('filter').addEventListener('input', () => { shown = PAGE; if (snap) render(snap); });
  $('order').addEventListener('change', () => { if (snap) { resort((snap.dashboard || {}).rules || []); render(snap); } });
  for (const b of document.querySelectorAll('.range button')) b.addEventListener('click', () => setRange(b.dataset.range));
  $('unzoom').addEventListener('click', () => setZoom(null));
  window.addEventListener('hashchange', openView);
  let resizing = null;
  window.addEventListener('resize', () => { clearTimeout(resizing); resizing = setTimeout(redrawCharts, 100); });
  setInterval(freshness, 500);
  document.addEventListener('visibilitychange', () => (document.hidden ? stop() : follow()));
  openView();
  // Ask for the token first when one is needed and none is kept, rather
  // than be refused.
  fetch('/dashboard/config').then((r) => r.json()).then((c) => {
    if (c.token_required && !token) needToken('');
    else { follow(); listKeys(null); }
  }, () => follow());
}

setup();
