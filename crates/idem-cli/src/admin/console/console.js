// The idem console: the admin API of this server (docs/operations/console.md), in a page.
// No framework and nothing fetched from elsewhere: the page's Content-Security-Policy allows
// this origin only. The admin token lives in this tab's sessionStorage and goes with each call.
'use strict';

const TOKEN = 'idem-admin-token';
const SVG = 'http://www.w3.org/2000/svg';
// Outcomes get a colour each in the order they are first met, so a renamed label is just
// another series.
const PALETTE = ['#2f6fb0', '#3a9a5b', '#d08a1e', '#c2413b', '#7b4fb0', '#1c9aa6', '#8a6d3b',
  '#b04f86', '#5f6b7a', '#9aa61c', '#3b4fd0', '#d0561e'];
const colours = new Map();

const view = { state: 'unknown', open: null, retention: undefined, poll: null };

const $ = (id) => document.getElementById(id);

/** An answer of the admin API other than 2xx. */
class ApiError extends Error {
  constructor(status, detail, body) {
    super(detail);
    this.status = status;
    this.body = body;
  }
}

/** Calls the admin API with the token; throws ApiError on any answer but 2xx. */
async function api(path, options = {}) {
  const headers = { Authorization: 'Bearer ' + (sessionStorage.getItem(TOKEN) || '') };
  if (options.body !== undefined) headers['Content-Type'] = 'application/json';
  const response = await fetch(path, {
    method: options.method || 'GET',
    headers,
    body: options.body === undefined ? undefined : JSON.stringify(options.body),
    cache: 'no-store',
    credentials: 'omit',
  });
  const text = await response.text();
  let body = null;
  try {
    body = JSON.parse(text);
  } catch (_) {
    body = null;
  }
  if (!response.ok) {
    const detail = (body && (body.detail || body.title)) || text || response.statusText;
    if (response.status === 401) refused(detail);
    throw new ApiError(response.status, detail, body);
  }
  return body;
}

/** The server refused the token: forget it and ask again. */
function refused(detail) {
  sessionStorage.removeItem(TOKEN);
  showLogin();
  showError(`The server refused the admin token (401 Unauthorized): ${detail}. ` +
    'Log in again with the token idem was started with (--admin-token).');
}

function showError(text) {
  $('error').textContent = text;
  $('error').hidden = false;
}

function clearError() {
  $('error').hidden = true;
  $('error').textContent = '';
}

/** Shows an error of a call, unless it was the token's (already shown by refused()). */
function failed(e) {
  if (e instanceof ApiError && e.status === 401) return;
  showError(e instanceof ApiError ? `The server answered ${e.status}: ${e.message}` : String(e));
}

function showLogin() {
  $('login').hidden = false;
  $('console').hidden = true;
  $('logout').hidden = true;
  $('who').hidden = true;
  if (view.poll) clearInterval(view.poll);
  view.poll = null;
  $('token').focus();
}

async function showConsole() {
  $('login').hidden = true;
  $('console').hidden = false;
  $('logout').hidden = false;
  $('who').hidden = false;
  selectState(view.state);
  await Promise.all([loadKeys(), loadOutcomes(), loadRetention()]);
  if (!view.poll) view.poll = setInterval(() => loadOutcomes(), 10000);
}

async function logIn(event) {
  event.preventDefault();
  clearError();
  sessionStorage.setItem(TOKEN, $('token').value.trim());
  $('token').value = '';
  try {
    // A call that needs the token: the page itself is served without it.
    await api('/admin/keys?limit=1');
  } catch (e) {
    failed(e);
    return;
  }
  await showConsole();
}

function logOut() {
  sessionStorage.removeItem(TOKEN);
  clearError();
  showLogin();
}

// --- Times ---------------------------------------------------------------------------------

function when(ms) {
  if (ms === undefined || ms === null) return '—';
  return new Date(ms).toISOString().replace('T', ' ').replace('Z', ' UTC');
}

// --- Keys ----------------------------------------------------------------------------------

const STATE_HINTS = {
  unknown: 'In progress with the lease run out: the worker crashed or stalled, and whether ' +
    'the work happened is unknown until the key is resolved.',
  'in-progress': 'Every key in progress, those of unknown outcome included.',
  completed: 'Completed: retries replay the stored answer until it expires.',
};

function selectState(state) {
  view.state = state;
  for (const tab of document.querySelectorAll('[role=tab]')) {
    tab.setAttribute('aria-selected', String(tab.dataset.state === state));
  }
  $('state-hint').textContent = STATE_HINTS[state];
}

async function loadKeys() {
  clearError();
  const account = $('search-account').value.trim();
  const key = $('search-key').value.trim();
  const query = new URLSearchParams({ state: view.state, limit: '500' });
  if (account) query.set('account', account);
  let listed;
  try {
    listed = await api('/admin/keys?' + query);
  } catch (e) {
    failed(e);
    return;
  }
  // A key may be typed as the sf-string the header carries.
  const wanted = key.replace(/^"|"$/g, '');
  const needle = wanted.toLowerCase();
  const keys = listed.keys.filter((k) => !needle || k.key.toLowerCase().includes(needle));
  const body = $('key-table').querySelector('tbody');
  body.replaceChildren(...keys.map(keyRow));
  $('key-count').textContent = `${keys.length} of ${listed.keys.length} ${view.state} ` +
    `record${listed.keys.length === 1 ? '' : 's'} listed` + (needle ? ` match “${needle}”` : '');
  if (account && wanted && !keys.some((k) => k.key === wanted)) {
    // Not among the listed: it may be in another state, or older than the newest 500.
    await openRecord(account, wanted);
  }
}

function keyRow(record) {
  const row = document.createElement('tr');
  const open = document.createElement('button');
  open.type = 'button';
  open.className = 'link';
  open.textContent = record.key;
  open.title = 'Open this record';
  open.addEventListener('click', () => openRecord(record.account, record.key));
  const cells = [
    text(record.account),
    open,
    badge(record.state),
    text(when(record.created_at_ms)),
    text(when(record.lease_until_ms ?? record.expires_at_ms)),
  ];
  for (const content of cells) {
    const cell = document.createElement('td');
    cell.append(content);
    row.append(cell);
  }
  return row;
}

function text(value) {
  return document.createTextNode(value);
}

function badge(state) {
  const span = document.createElement('span');
  span.className = 'badge ' + state;
  span.textContent = state.replace('_', ' ');
  return span;
}

// --- One record ----------------------------------------------------------------------------

function recordPath(account, key) {
  return `/admin/keys/${encodeURIComponent(account)}/${encodeURIComponent(key)}`;
}

async function openRecord(account, key) {
  clearError();
  view.open = { account, key };
  $('resolve-result').textContent = '';
  $('record').hidden = false;
  $('record-title').textContent = `${account} / ${key}`;
  let record = null;
  let events = [];
  try {
    record = await api(recordPath(account, key));
    events = record.events || [];
  } catch (e) {
    // No record: the key's history, kept by the store, may outlive it (a release).
    if (!(e instanceof ApiError && e.status === 404)) {
      failed(e);
      return;
    }
    events = (e.body && e.body.events) || [];
  }
  showRecord(record, events);
  $('record').scrollIntoView({ block: 'start' });
}

function showRecord(record, events) {
  const fields = $('record-fields');
  fields.replaceChildren();
  const field = (name, value, hint) => {
    const dt = document.createElement('dt');
    dt.textContent = name;
    const dd = document.createElement('dd');
    dd.append(value instanceof Node ? value : text(value));
    if (hint) {
      const small = document.createElement('small');
      small.textContent = ' ' + hint;
      dd.append(small);
    }
    fields.append(dt, dd);
  };
  // The store's event of this record's completion by an operator or the reconciler, if any:
  // the key's history may hold events of an earlier record of the same key too.
  const completedByUs = record ? events.filter((e) => e.at_ms >= record.created_at_ms &&
    /^(resolved|reconciled): completed/.test(e.what)).pop() : undefined;
  if (!record) {
    field('State', 'no record', 'none is stored for this key: never claimed, released, or ' +
      'expired and swept; its next copy runs afresh.');
  } else {
    field('Account', record.account);
    field('Key', record.key);
    field('State', badge(record.state), STATE_HINTS[record.state === 'in_progress' ?
      'in-progress' : record.state]);
    field('Fingerprint', record.fingerprint);
    field('Claimed at', when(record.created_at_ms));
    if (record.lease_until_ms !== undefined) {
      field('Lease until', when(record.lease_until_ms), 'the latest renewal: the record ' +
        'keeps only the last.');
      field('Fencing token', String(record.token));
    }
    if (record.expires_at_ms !== undefined) {
      field('Completed at', completedAt(record, completedByUs));
      field('Expires at', when(record.expires_at_ms), 'then the key may be used afresh.');
    }
  }
  showAnswer(record && record.response);
  showHistory(record, events, completedByUs);
  $('resolve').hidden = !record || record.state === 'completed';
}

/** When a completed record was completed: the record keeps no such time. */
function completedAt(record, completedByUs) {
  if (completedByUs) return `${when(completedByUs.at_ms)} (${completedByUs.what}, by ` +
    `${completedByUs.by})`;
  if (typeof view.retention === 'number') {
    return `${when(record.expires_at_ms - view.retention * 1000)} (derived: expires at ` +
      `less the retention of ${view.retention} s that /idempotency-policy publishes)`;
  }
  return 'not kept by the record (it expires the retention after its completion)';
}

function showAnswer(response) {
  const answer = $('record-answer');
  answer.replaceChildren();
  if (!response) {
    answer.append(text('None yet: the key is not completed.'));
    return;
  }
  const status = document.createElement('p');
  status.id = 'answer-stored-status';
  status.textContent = `Status ${response.status}`;
  const headers = document.createElement('pre');
  headers.textContent = response.headers.map(([name, value]) => `${name}: ${value}`).join('\n') ||
    '(no headers)';
  const body = document.createElement('pre');
  body.id = 'answer-stored-body';
  body.textContent = response.body_omitted ? '(body not stored: it was over the size limit)' :
    (response.body || '(empty body)');
  answer.append(status, headers, body);
}

/** The record's own times, and the key's history as the store keeps it (who resolved or
 * reconciled it, from any process), in time order. */
function showHistory(record, stored, completedByUs) {
  const events = [];
  if (record) {
    events.push({ at: record.created_at_ms, what: 'claimed: the first copy of the request ' +
      'took the key' });
    if (record.lease_until_ms !== undefined) {
      events.push({
        at: record.lease_until_ms,
        what: record.state === 'unknown' ?
          'lease ran out: the outcome is unknown until the key is resolved' :
          'lease held until then (renewed while the work runs)',
      });
    }
    if (record.state === 'completed' && !completedByUs) {
      const at = typeof view.retention === 'number' ?
        record.expires_at_ms - view.retention * 1000 : null;
      events.push({ at, what: `completed with status ${record.response.status}` +
        (at === null ? ' (time not kept by the record)' : ' (time derived from its expiry)') });
    }
  }
  for (const e of stored) {
    events.push({ at: e.at_ms, what: `${e.what}, by ${e.by}` });
  }
  events.sort((a, b) => (a.at ?? Infinity) - (b.at ?? Infinity));
  const list = $('record-history');
  list.replaceChildren(...events.map((event) => {
    const item = document.createElement('li');
    const time = document.createElement('time');
    time.textContent = event.at === null ? '—' : when(event.at);
    item.append(time, text(' ' + event.what));
    return item;
  }));
}

/** `Name: value` lines as the admin API's headers object. */
function parseHeaders(lines) {
  const headers = {};
  for (const line of lines.split('\n').map((l) => l.trim()).filter(Boolean)) {
    const colon = line.indexOf(':');
    if (colon < 1) throw new Error(`“${line}” is not a header: expected “Name: value”`);
    headers[line.slice(0, colon).trim()] = line.slice(colon + 1).trim();
  }
  return headers;
}

async function complete(event) {
  event.preventDefault();
  clearError();
  const { account, key } = view.open;
  const status = Number($('answer-status').value);
  let resolution;
  try {
    resolution = { status, headers: parseHeaders($('answer-headers').value) };
    const body = $('answer-body').value.trim();
    if (body) {
      try {
        resolution.body = JSON.parse(body);
      } catch (e) {
        throw new Error(`The body is not JSON: ${e.message}`);
      }
    }
  } catch (e) {
    showError(e.message);
    return;
  }
  const asked = `Complete ${account} / ${key} with status ${status}?\n\n` +
    'Every retry of this key will be answered with this stored answer. Do it only when you ' +
    'know the work happened with this outcome; it cannot be undone.';
  if (!confirm(asked)) return;
  await resolve(account, key, resolution);
}

async function release() {
  clearError();
  const { account, key } = view.open;
  const asked = `Release ${account} / ${key}?\n\nThe record is deleted and the next copy of ` +
    'the request runs the work again. Do it only when you know the work did not happen.';
  if (!confirm(asked)) return;
  await resolve(account, key, { release: true });
}

async function resolve(account, key, resolution) {
  try {
    const { resolved } = await api(recordPath(account, key) + '/resolve', {
      method: 'POST',
      body: { ...resolution, by: 'console' },
    });
    // The list first: with a search for this key it opens the record too.
    await loadKeys();
    await openRecord(account, key);
    $('resolve-result').textContent = `Resolved: ${resolved}.`;
  } catch (e) {
    failed(e);
  }
}

// --- Outcomes ------------------------------------------------------------------------------

/** The policy's retention, to date completions by; only idem serve's own policy has one. */
async function loadRetention() {
  view.retention = null;
  const get = (path) => fetch(path, { cache: 'no-store', credentials: 'omit' });
  try {
    // idem proxy answers this path itself (or refuses it), with retentions per route: no one
    // retention to date by, and /idempotency-policy would go to its upstream.
    if ((await get('/.well-known/idempotency-policy')).status !== 404) return;
    const response = await get('/idempotency-policy');
    const policy = response.ok ? await response.json() : null;
    // `lease_mode` marks idem serve's policy.
    if (policy && policy.lease_mode && typeof policy.retention_seconds === 'number') {
      view.retention = policy.retention_seconds;
    }
  } catch (_) {
    view.retention = null;
  }
}

async function loadOutcomes() {
  let series;
  try {
    series = await api('/admin/outcomes');
  } catch (e) {
    failed(e);
    return;
  }
  drawOutcomes(series);
}

function colour(outcome) {
  if (!colours.has(outcome)) colours.set(outcome, PALETTE[colours.size % PALETTE.length]);
  return colours.get(outcome);
}

function svg(name, attributes, content) {
  const element = document.createElementNS(SVG, name);
  for (const [attribute, value] of Object.entries(attributes)) {
    element.setAttribute(attribute, String(value));
  }
  if (content !== undefined) element.textContent = content;
  return element;
}

/** Stacked bars of each 10 s interval's increase, by outcome, over the window. */
function drawOutcomes(series) {
  const samples = series.samples;
  const chart = $('chart');
  const legend = $('legend');
  if (samples.length < 2) {
    chart.replaceChildren(text('Collecting: the first interval is drawn ' +
      `${series.every_seconds} s after the admin API started.`));
    legend.replaceChildren();
    return;
  }
  const intervals = [];
  const totals = new Map();
  for (let i = 1; i < samples.length; i++) {
    const increases = [];
    const outcomes = new Set([...Object.keys(samples[i].requests),
      ...Object.keys(samples[i - 1].requests)]);
    for (const outcome of [...outcomes].sort()) {
      const increase = Math.max(0, (samples[i].requests[outcome] || 0) -
        (samples[i - 1].requests[outcome] || 0));
      totals.set(outcome, (totals.get(outcome) || 0) + increase);
      if (increase > 0) increases.push([outcome, increase]);
    }
    intervals.push({ at: samples[i].at_ms, increases });
  }
  const width = 720;
  const height = 200;
  const left = 40;
  const bottom = 20;
  const end = samples[samples.length - 1].at_ms;
  const start = end - series.window_seconds * 1000;
  const slot = (width - left) * series.every_seconds / series.window_seconds;
  const highest = Math.max(1, ...intervals.map((i) => i.increases.reduce((s, [, n]) => s + n, 0)));
  const y = (n) => (height - bottom) * (1 - n / highest);
  const figure = svg('svg', {
    viewBox: `0 0 ${width} ${height}`, role: 'img',
    'aria-label': 'Requests by outcome per 10 seconds over the last hour',
  });
  figure.append(
    svg('line', { x1: left, y1: height - bottom, x2: width, y2: height - bottom, class: 'axis' }),
    svg('line', { x1: left, y1: 0, x2: left, y2: height - bottom, class: 'axis' }),
    svg('text', { x: left - 4, y: 10, 'text-anchor': 'end', class: 'tick' }, String(highest)),
    svg('text', { x: left - 4, y: height - bottom, 'text-anchor': 'end', class: 'tick' }, '0'),
    svg('text', { x: left, y: height - 4, class: 'tick' }, '−60 min'),
    svg('text', { x: left + (width - left) / 2, y: height - 4, 'text-anchor': 'middle',
      class: 'tick' }, '−30 min'),
    svg('text', { x: width, y: height - 4, 'text-anchor': 'end', class: 'tick' }, 'now'),
  );
  for (const interval of intervals) {
    const x = left + (width - left) * (interval.at - start) / (end - start) - slot;
    if (x < left) continue;
    let stacked = 0;
    for (const [outcome, increase] of interval.increases) {
      const bar = svg('rect', {
        x: x.toFixed(1), y: y(stacked + increase).toFixed(1),
        width: Math.max(1, slot - 1).toFixed(1),
        height: (y(stacked) - y(stacked + increase)).toFixed(1),
        fill: colour(outcome),
      });
      bar.append(svg('title', {}, `${when(interval.at)}: ${increase} ${outcome}`));
      figure.append(bar);
      stacked += increase;
    }
  }
  chart.replaceChildren(figure);
  legend.replaceChildren(...[...totals].map(([outcome, total]) => {
    const item = document.createElement('li');
    const swatch = svg('svg', { width: 12, height: 12, 'aria-hidden': 'true' });
    swatch.append(svg('rect', { width: 12, height: 12, fill: colour(outcome) }));
    item.dataset.outcome = outcome;
    item.append(swatch, text(` ${outcome}: ${total}`));
    return item;
  }));
  if (totals.size === 0) legend.append(text('No request through the layer in this hour.'));
}

// --- Wiring --------------------------------------------------------------------------------

document.addEventListener('DOMContentLoaded', () => {
  $('login-form').addEventListener('submit', logIn);
  $('logout').addEventListener('click', logOut);
  $('search-form').addEventListener('submit', (event) => {
    event.preventDefault();
    loadKeys();
  });
  for (const tab of document.querySelectorAll('[role=tab]')) {
    tab.addEventListener('click', () => {
      selectState(tab.dataset.state);
      loadKeys();
    });
  }
  $('complete-form').addEventListener('submit', complete);
  $('release').addEventListener('click', release);
  if (sessionStorage.getItem(TOKEN)) {
    // A reload keeps the session; a token refused since shows the login again.
    showConsole();
  } else {
    showLogin();
  }
});
