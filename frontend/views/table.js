/**
 * The ranked layer table of one run: worst first by default, sortable by any column, filtered by status and
 * name (the filter and sort are shared by every run panel, so runs compare like for like).
 *
 * Cheap for 1,000+ layers: rows are built into one DocumentFragment, and only the first `ROW_PAGE` matching rows
 * are drawn until the user asks for more (the worst layers are at the top, which is what the table is for);
 * row elements are kept per diagnosis, so a sort or filter only reorders nodes, and sparklines draw when they
 * scroll into view.
 */

import { el, replace } from '../dom.js';
import { count, magnitude, severity } from '../format.js';
import { lazySparkline, sparklineObserver } from '../charts/sparkline.js';
import { afterPaint, timing } from '../model.js';
import { badge, isFlagged, statusColor, statusRank } from '../status.js';
import { chainGlyphs, chainText } from './episodes.js';
import { kindText } from './evidence.js';

export const ROW_PAGE = 50;

const LAST_FINITE_TIP = '; for a layer whose last record has NaN/Inf, its values at its last all-finite step, labelled';

const COLUMNS = [
  { key: 'rank', label: '#', title: 'rank: the cause first (marked), then by severity', num: true },
  { key: 'status', label: 'Status', title: 'diagnosis' },
  { key: 'layer', label: 'Layer', title: 'variable name' },
  { key: 'severity', label: 'Severity', title: 'how far outside the healthy band, times persistence', num: true },
  { key: 'first_step', label: 'Since', title: '<status> since: where the current status began; trouble since: where the '
    + 'chain of episodes began (sorts by it; hover a cell for the chain)', num: true },
  { key: 'rms', label: 'RMS', title: `root mean square of the gradient at the diagnosed step${LAST_FINITE_TIP}`, num: true },
  { key: 'max_abs', label: 'max |g|', title: `largest gradient magnitude at the diagnosed step${LAST_FINITE_TIP}`, num: true },
  { key: 'norm', label: 'Norm', title: `L2 norm of the gradient at the diagnosed step${LAST_FINITE_TIP}`, num: true },
  { key: 'spark', label: 'RMS over steps', title: 'log-scale RMS history', sortable: false },
  { key: 'reasons', label: 'Why', title: 'the rule(s) that fired, with the numbers', sortable: false },
];

function compareBy(key, dir) {
  const nullsLast = (a, b, cmp) => {
    const an = a === null || a === undefined || Number.isNaN(a);
    const bn = b === null || b === undefined || Number.isNaN(b);
    if (an && bn) return 0;
    if (an) return 1;
    if (bn) return -1;
    return cmp * dir;
  };
  switch (key) {
    case 'layer':
      return (a, b) => dir * a.layer.localeCompare(b.layer) || a.__rank - b.__rank;
    case 'status':
      return (a, b) => dir * (statusRank(a.status) - statusRank(b.status)) || a.__rank - b.__rank;
    case 'rank':
      return (a, b) => dir * (a.__rank - b.__rank);
    case 'index':
      return (a, b) => dir * (a.index - b.index);
    default:
      return (a, b) => nullsLast(a[key], b[key], a[key] < b[key] ? -1 : a[key] > b[key] ? 1 : 0) || a.__rank - b.__rank;
  }
}

/** Layers of a health answer, filtered and sorted by the shared view options. */
export function visibleLayers(health, view) {
  const needle = view.nameFilter.trim().toLowerCase();
  let layers = health.layers.map((layer, i) => {
    layer.__rank = layer.rank ?? i + 1;
    return layer;
  });
  if (view.statuses.size) layers = layers.filter((l) => view.statuses.has(l.status));
  if (needle) layers = layers.filter((l) => l.layer.toLowerCase().includes(needle));
  if (view.sortKey !== 'rank' || view.sortDir !== 1) layers = layers.slice().sort(compareBy(view.sortKey, view.sortDir));
  return layers;
}

const known = (x) => x !== null && x !== undefined;

/**
 * The "since" cell of a flagged layer: "<status> since N" (where its current status began) above "trouble since M"
 * (where its chain of episodes began), the chain's glyphs before it; the chain in full on hover. `—` when healthy.
 */
function sinceCell(layer) {
  const td = el('td', { class: 'num since', title: chainText(layer) });
  if (!isFlagged(layer.status) || !known(layer.first_step)) return replace(td, '—');
  return replace(td,
    el('span', { class: 'since-status', attrs: { 'data-testid': 'status-since' } },
      `${layer.status} since ${known(layer.status_since) ? layer.status_since : '—'}`),
    el('span', { class: 'since-trouble', attrs: { 'data-testid': 'trouble-since' } }, chainGlyphs(layer),
      `trouble since ${layer.first_step}`));
}

/** A magnitude cell: the value at the diagnosed step, or (NaN/Inf there) the last finite one, labelled with its step. */
export function magnitudeCell(layer, key) {
  const last = layer.last_finite;
  if (known(layer[key]) || !last) return el('td', { class: 'num', text: magnitude(layer[key]) });
  return el('td', { class: 'num last-finite', title: `no finite value at step ${layer.step}; the layer's values at step `
    + `${last.step}, its last record with every value finite` },
  el('span', { class: 'last-finite-value', text: magnitude(last[key]) }),
  el('span', { class: 'cell-note', text: `last finite (step ${last.step})` }));
}

/** The layer cell: the name, a "cause" tag on the row ranked first as the cause, the kind of a flagged layer. */
function layerCell(layer) {
  const kind = kindText(layer);
  return el('td', { class: 'layer-name mono', title: kind ? `${layer.layer} (${kind})` : layer.layer },
    el('span', { class: 'layer-name-text', text: layer.layer }),
    layer.rank_reason === 'cause' ? el('span', { class: 'cause-tag', attrs: { 'data-testid': 'cause-tag' },
      text: 'cause', title: 'ranked first as the cause: the first to go wrong (its severity may be lower than the rows below)' }) : null,
    kind && isFlagged(layer.status) ? el('span', { class: 'layer-kind-tag', text: kind }) : null);
}

function row(layer, history, onSelect, observer) {
  const reasons = layer.reasons || [];
  const tr = el('tr', { class: `row row-${layer.status}`, tabIndex: 0, attrs: { 'data-layer': layer.layer, 'data-rank': String(layer.__rank) } },
    el('td', { class: 'num rank', text: count(layer.__rank) }),
    el('td', {}, badge(layer.status)),
    layerCell(layer),
    el('td', { class: 'num', text: severity(layer.severity) }),
    sinceCell(layer),
    magnitudeCell(layer, 'rms'),
    magnitudeCell(layer, 'max_abs'),
    magnitudeCell(layer, 'norm'),
    el('td', { class: 'spark-cell' }, lazySparkline(layer.rms_history, observer, {
      color: statusColor(layer.status),
      title: history.length ? `RMS at steps ${history[0]}…${history[history.length - 1]}` : '',
    })),
    el('td', { class: 'reasons', text: reasons.length ? reasons[0] + (reasons.length > 1 ? ` (+${reasons.length - 1})` : '') : '',
      title: [...reasons, ...(layer.fixes || []).slice(0, 1).map((f) => `What to do: ${f}`)].join('\n') }));
  tr.addEventListener('click', () => onSelect(layer.layer));
  tr.addEventListener('keydown', (event) => {
    if (event.key === 'Enter') onSelect(layer.layer);
  });
  return tr;
}

/**
 * A table block for one run. `update(health)` redraws it (after new data, a sort or a filter change).
 * @param {import('../model.js').Model} model
 * @param {(layer: string) => void} onSelect
 */
export function layerTable(model, onSelect) {
  let health = null;
  let limit = ROW_PAGE;
  let rowCache = new Map();
  let observer = null;
  const thead = el('thead');
  const tbody = el('tbody');
  const more = el('div', { class: 'table-more' });
  const table = el('table', { class: 'layer-table' }, thead, tbody);
  const key = el('div', { class: 'table-key', attrs: { 'data-testid': 'table-key' } });
  const root = el('div', { class: 'table-wrap' }, key, table, more);

  /** The visible key of the order: what # means, without hovering (the full rule on hover). */
  function drawKey() {
    const order = health.summary && health.summary.order;
    const sorted = model.view.sortKey !== 'rank' || model.view.sortDir !== 1;
    replace(key, el('b', { text: 'Ranked: cause first, then severity' }),
      el('span', { class: 'hint', text: sorted ? ' (# keeps the rank; click # to return to it)' : ' · click a column to sort by it' }));
    key.title = order || '';
  }

  function header() {
    const { sortKey, sortDir } = model.view;
    const tr = el('tr');
    for (const col of COLUMNS) {
      const sortable = col.sortable !== false;
      const active = sortKey === col.key;
      const arrow = active ? (sortDir === 1 ? ' ▲' : ' ▼') : '';
      const th = el('th', {
        class: `${col.num ? 'num ' : ''}${sortable ? 'sortable' : ''}${active ? ' sorted' : ''}`,
        title: col.title, text: col.label + arrow, attrs: { 'data-key': col.key },
      });
      if (sortable) {
        th.setAttribute('aria-sort', active ? (sortDir === 1 ? 'ascending' : 'descending') : 'none');
        th.tabIndex = 0;
        th.addEventListener('keydown', (event) => {
          if (event.key === 'Enter' || event.key === ' ') {
            event.preventDefault();
            th.click();
          }
        });
        th.addEventListener('click', () => {
          const t0 = performance.now();
          // Numbers read naturally biggest first; names and ranks smallest first.
          const firstDir = col.num && col.key !== 'rank' && col.key !== 'first_step' ? -1 : 1;
          const dir = active ? -sortDir : firstDir;
          model.setView({ sortKey: col.key, sortDir: dir });
          afterPaint().then(() => {
            timing.sort = performance.now() - t0;
            timing.mark('sorted');
          });
        });
      }
      tr.appendChild(th);
    }
    replace(thead, tr);
  }

  function body() {
    const layers = visibleLayers(health, model.view);
    const history = health.history_steps || [];
    const fragment = document.createDocumentFragment();
    const shown = layers.slice(0, limit);
    for (const layer of shown) {
      let tr = rowCache.get(layer.layer);
      if (!tr) {
        tr = row(layer, history, onSelect, observer);
        rowCache.set(layer.layer, tr);
      }
      fragment.appendChild(tr);
    }
    if (!shown.length) {
      fragment.appendChild(el('tr', {}, el('td', { class: 'empty-row', colSpan: COLUMNS.length,
        text: health.layers.length ? 'No layer matches the filter.' : 'This run has no layers.' })));
    }
    replace(tbody, fragment);
    clearMore();
    if (layers.length > shown.length) {
      const rest = layers.length - shown.length;
      more.appendChild(el('span', { text: `Showing ${count(shown.length)} of ${count(layers.length)} layers. ` }));
      more.appendChild(el('button', { class: 'btn', text: `Show ${count(Math.min(rest, ROW_PAGE * 4))} more`,
        on: { click: () => grow(ROW_PAGE * 4) } }));
      more.appendChild(el('button', { class: 'btn', text: `Show all ${count(layers.length)}`,
        attrs: { 'data-testid': 'show-all' }, on: { click: () => grow(Infinity) } }));
    }
    table.dataset.rows = String(shown.length);
    table.dataset.matching = String(layers.length);
  }

  function clearMore() {
    while (more.firstChild) more.removeChild(more.firstChild);
  }

  function grow(n) {
    const t0 = performance.now();
    limit += n;
    body();
    afterPaint().then(() => {
      timing.showAll = performance.now() - t0;
      timing.mark('rows-grown');
    });
  }

  return {
    root,
    update(nextHealth) {
      if (nextHealth && nextHealth !== health) {
        health = nextHealth;
        rowCache = new Map();
        if (observer) observer.disconnect();
        observer = sparklineObserver();
      }
      if (!health) return;
      drawKey();
      header();
      body();
    },
  };
}
