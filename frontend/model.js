/**
 * Data access and shared state. All requests use URLs relative to the plugin's base
 * (/data/plugin/gradhealth/), so the dashboard works behind any path prefix TensorBoard is served under.
 */

import { STATUSES, isFlagged, statusRank } from './status.js';

/** Error carrying the backend's `{"error": ...}` message. */
export class ApiError extends Error {}

/** GET `./<route>?<params>` and parse JSON; throws ApiError with the backend's message on a non-2xx answer. */
export async function api(route, params = {}) {
  const query = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) {
    if (value !== undefined && value !== null && value !== '') query.append(key, String(value));
  }
  const qs = query.toString();
  const response = await fetch(`./${route}${qs ? `?${qs}` : ''}`, { headers: { Accept: 'application/json' } });
  let body = null;
  try {
    body = await response.json();
  } catch (err) {
    body = null;
  }
  if (!response.ok) {
    const message = body && body.error ? body.error : `${route}: HTTP ${response.status}`;
    throw new ApiError(message);
  }
  return body;
}

/**
 * Timing marks for the performance goal (1,000 layers interactive within 1 s of the data arriving), kept in
 * the page's module state (no global): a profiler or a debugger reads them there.
 */
export const timing = {
  marks: [],
  /** run -> ms from the health JSON being parsed to its table being drawn and the page idle again */
  tti: {},
  /** ms of the last sort (click to drawn) */
  sort: null,
  /** ms of the last "show all rows" (click to drawn) */
  showAll: null,
  mark(name) {
    const t = performance.now();
    this.marks.push({ name, t });
    if (this.marks.length > 500) this.marks.shift();
    return t;
  },
};

/** Resolve after the browser has painted the current DOM and returned to the event loop. */
export function afterPaint() {
  return new Promise((resolve) => requestAnimationFrame(() => setTimeout(resolve, 0)));
}

/** How many runs are ticked when the page opens. */
export const INITIAL_RUNS = 4;
/** Diagnosis requests in flight at once while ranking the runs on first load. */
const PARALLEL = 4;

/**
 * How sick a run is, as a key that sorts sickest first: the rank of its worst flagged status (nonfinite first;
 * `inert` and `healthy` are not flagged), then more layers in that status, then more flagged layers in all. A run
 * whose diagnosis failed sorts after every run with a flagged layer and before the unflagged ones.
 */
export function sicknessKey(health) {
  if (!health) return [UNFLAGGED_RANK - 0.5, 0, 0];
  const counts = (health.summary && health.summary.counts) || {};
  const flagged = STATUSES.filter((s) => isFlagged(s) && counts[s] > 0);
  if (!flagged.length) return [UNFLAGGED_RANK, 0, 0];
  const worst = flagged[0];
  return [statusRank(worst), -counts[worst], -flagged.reduce((n, s) => n + counts[s], 0)];
}

const UNFLAGGED_RANK = STATUSES.findIndex((s) => !isFlagged(s));

function compareKeys(a, b) {
  for (let i = 0; i < a.length; i += 1) if (a[i] !== b[i]) return a[i] - b[i];
  return 0;
}

/**
 * The dashboard state: the runs listing, which runs are shown, threshold overrides, the health/profile answers
 * per run, and table view options shared by every run panel (so runs compare like for like).
 * Views subscribe with `on(fn)` and are told which part changed.
 */
export class Model {
  constructor() {
    this.runs = [];
    this.runsProblems = [];
    this.selected = [];
    this.overrides = {};
    this.spec = null;
    this.defaults = null;
    this.health = new Map();
    this.errors = new Map();
    this.loading = new Set();
    this.view = { sortKey: 'rank', sortDir: 1, statuses: new Set(), nameFilter: '' };
    this.autoRefresh = true;
    /** runs whose last step moved while the page was open */
    this.training = new Set();
    this.lastRefresh = null;
    this.listeners = [];
    this.generation = 0;
  }

  on(fn) {
    this.listeners.push(fn);
  }

  emit(what, detail) {
    for (const fn of this.listeners) fn(what, detail);
  }

  runInfo(run) {
    return this.runs.find((r) => r.run === run) || null;
  }

  /** Threshold overrides as query parameters (only values that differ from the defaults). */
  thresholdParams() {
    return { ...this.overrides };
  }

  /** Fetch the runs listing; returns the runs whose last step moved (training) or that are new. */
  async loadRuns() {
    const body = await api('runs');
    const first = this.lastRefresh === null;
    const before = new Map(this.runs.map((r) => [r.run, r.last_step]));
    this.runs = body.runs || [];
    this.runsProblems = body.problems || [];
    this.lastRefresh = new Date();
    const changed = first ? [] : this.runs.filter((r) => before.get(r.run) !== r.last_step).map((r) => r.run);
    for (const run of changed) {
      this.training.add(run);
      // a kept diagnosis of a run that is not shown is stale now: ticking the run fetches it again
      if (!this.selected.includes(run)) this.health.delete(run);
    }
    const known = new Set(this.runs.map((r) => r.run));
    this.selected = this.selected.filter((r) => known.has(r));
    if (!this.selected.length && this.runs.length && first) this.selected = await this.sickestRuns(INITIAL_RUNS);
    this.emit('runs');
    return changed;
  }

  /** Fetch the diagnosis of one run with the current threshold overrides. */
  async loadHealth(run) {
    const generation = this.generation;
    this.loading.add(run);
    this.emit('loading', run);
    try {
      const body = await api('health', { run, ...this.thresholdParams() });
      if (generation !== this.generation) return;
      timing.mark(`health-data:${run}`);
      body.__arrived = performance.now();
      this.health.set(run, body);
      this.errors.delete(run);
      if (body.threshold_spec && !this.spec) this.spec = body.threshold_spec;
      if (!this.defaults && body.threshold_spec) {
        this.defaults = Object.fromEntries(body.threshold_spec.map((s) => [s.name, s.default]));
      }
    } catch (err) {
      if (generation !== this.generation) return;
      this.errors.set(run, err.message);
    } finally {
      this.loading.delete(run);
    }
    this.emit('health', run);
  }

  /** Load the diagnosis of every selected run that has none yet (all of them after a threshold change). */
  async loadSelected() {
    await Promise.all(this.selected.filter((run) => !this.health.has(run)).map((run) => this.loadHealth(run)));
  }

  /**
   * The `count` sickest runs, sickest first (see `sicknessKey`). The runs listing carries no diagnosis, so every
   * run is diagnosed here, `PARALLEL` requests at a time; the answers are kept, so the ticked runs draw at once
   * and ticking another run later needs no new request.
   */
  async sickestRuns(count) {
    const queue = this.runs.map((r) => r.run);
    const worker = async () => {
      while (queue.length) await this.loadHealth(queue.shift());
    };
    await Promise.all(Array.from({ length: Math.min(PARALLEL, queue.length) }, worker));
    const keyed = this.runs.map((r) => ({ run: r.run, key: sicknessKey(this.health.get(r.run)) }));
    keyed.sort((a, b) => compareKeys(a.key, b.key) || (a.run < b.run ? -1 : a.run > b.run ? 1 : 0));
    return keyed.slice(0, count).map((k) => k.run);
  }

  setSelected(runs) {
    this.selected = runs;
    this.emit('selection');
    return Promise.all(runs.filter((r) => !this.health.has(r)).map((r) => this.loadHealth(r)));
  }

  /** Replace threshold overrides and re-query health for every shown run (older answers are dropped). */
  setOverrides(overrides) {
    this.overrides = overrides;
    this.generation += 1;
    this.health.clear();
    this.emit('thresholds');
    return this.loadSelected();
  }

  setView(patch) {
    Object.assign(this.view, patch);
    this.emit('view');
  }
}
