/**
 * The ranked layer table of one run: worst first by default, sortable by any column, filtered by status and
 * name (the filter and sort are shared by every run panel, so runs compare like for like).
 *
 * Cheap for 1,000+ layers: rows are built into one DocumentFragment, and only the first `ROW_PAGE` matching rows
 * are drawn until the user asks for more (the worst layers are at the top, which is what the table is for);
 * row elements are kept per diagnosis, so a sort or filter only reorders nodes, and sparklines draw when they
 * scroll into view.
 */

import { el, fmt, replace } from '../dom.js';
import { lazySparkline, sparklineObserver } from '../charts/sparkline.js';
import { afterPaint, timing } from '../model.js';
import { badge, isFlagged, statusColor, statusRank } from '../status.js';
import { chainGlyphs, chainText } from './episodes.js';
import { kindText } from './evidence.js';

export const ROW_PAGE = 50;

const COLUMNS = [
  { key: 'rank', label: '#', title: 'rank (worst first)', num: true },
  { key: 'status', label: 'Status', title: 'diagnosis' },
  { key: 'layer', label: 'Layer', title: 'variable name' },
  { key: 'severity', label: 'Severity', title: 'how far outside the healthy band, times persistence', num: true },
  { key: 'first_step', label: 'Since step', title: 'onset of the current chain of episodes (hover a cell for the chain)', num: true },
  { key: 'rms', label: 'RMS', title: 'root mean square of the gradient at the diagnosed step', num: true },
  { key: 'max_abs', label: 'max |g|', title: 'largest gradient magnitude at the diagnosed step', num: true },
  { key: 'norm', label: 'Norm', title: 'L2 norm of the gradient at the diagnosed step', num: true },
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
    layer.__rank = i + 1;
    return layer;
  });
  if (view.statuses.size) layers = layers.filter((l) => view.statuses.has(l.status));
  if (needle) layers = layers.filter((l) => l.layer.toLowerCase().includes(needle));
  if (view.sortKey !== 'rank' || view.sortDir !== 1) layers = layers.slice().sort(compareBy(view.sortKey, view.sortDir));
  return layers;
}

/** The "since" cell: the onset of the layer's episode chain, the chain's glyphs, and the chain in full on hover. */
function sinceCell(layer) {
  const known = layer.first_step !== null && layer.first_step !== undefined;
  return el('td', { class: 'num since', title: chainText(layer) }, chainGlyphs(layer), known ? String(layer.first_step) : '—');
}

function row(layer, history, onSelect, observer) {
  const reasons = layer.reasons || [];
  const kind = kindText(layer);
  const tr = el('tr', { class: `row row-${layer.status}`, tabIndex: 0, attrs: { 'data-layer': layer.layer } },
    el('td', { class: 'num rank', text: String(layer.__rank) }),
    el('td', {}, badge(layer.status)),
    el('td', { class: 'layer-name mono', title: kind ? `${layer.layer} (${kind})` : layer.layer },
      el('span', { class: 'layer-name-text', text: layer.layer }),
      kind && isFlagged(layer.status) ? el('span', { class: 'layer-kind-tag', text: kind }) : null),
    el('td', { class: 'num', text: fmt(layer.severity) }),
    sinceCell(layer),
    el('td', { class: 'num', text: fmt(layer.rms) }),
    el('td', { class: 'num', text: fmt(layer.max_abs) }),
    el('td', { class: 'num', text: fmt(layer.norm) }),
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
  const root = el('div', { class: 'table-wrap' }, table, more);

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
      more.appendChild(el('span', { text: `Showing ${shown.length} of ${layers.length} layers. ` }));
      more.appendChild(el('button', { class: 'btn', text: `Show ${Math.min(rest, ROW_PAGE * 4)} more`,
        on: { click: () => grow(ROW_PAGE * 4) } }));
      more.appendChild(el('button', { class: 'btn', text: `Show all ${layers.length}`,
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
      header();
      body();
    },
  };
}
