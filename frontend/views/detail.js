/**
 * The layer detail drawer: what the layer looks like over time. Magnitudes (RMS, max |g|, norm) on a log axis with
 * the run's vanishing/exploding lines, the update/weight and gradient/weight ratios and gradient noise when they
 * were recorded, NaN/Inf and zero counts when there are any, and the log-magnitude histogram as a heatmap.
 */

import { el, fmt, replace } from '../dom.js';
import { heatmap } from '../charts/heatmap.js';
import { lineChart } from '../charts/line.js';
import { api } from '../model.js';
import { badge } from '../status.js';
import { episodeText, episodesOf, statusChain } from './episodes.js';
import { kindText } from './evidence.js';
import { originNote } from './origin.js';
import { thresholdLines } from './reference.js';

const C = { rms: '#0072B2', max_abs: '#D55E00', norm: '#009E73', ratio: '#CC79A7', ratio2: '#56B4E9', noise: '#E69F00' };

const STATS = [
  ['severity', 'severity'], ['first_step', 'onset (step)'], ['status_since', 'current status since'],
  ['step', 'diagnosed at step'], ['index', 'network index'],
  ['rms', 'RMS'], ['max_abs', 'max |g|'], ['norm', 'norm'], ['mean', 'mean'], ['nan', 'NaN count'],
  ['inf', 'Inf count'], ['zero_fraction', 'zero fraction'], ['weight_norm', 'weight norm'],
  ['grad_to_weight', '|g| / |w|'], ['update_to_weight', '|Δw| / |w|'], ['noise', 'noise'],
];

/** The layer's episodes as a chain of status marks ("▲ exploding 38–43 → ■ dead 44–53"), or null. */
function episodeList(entry) {
  const episodes = episodesOf(entry);
  if (!episodes.length) return null;
  const chain = statusChain(episodes.map((ep) => [ep.status, episodeText(ep)]));
  return el('p', { class: 'episodes', attrs: { 'data-testid': 'episodes' } }, el('b', { text: 'Episodes: ' }), chain,
    el('span', { class: 'hint', text: ' (shaded on the charts below)' }));
}

const anyPositive = (values) => (values || []).some((v) => typeof v === 'number' && v > 0);

/** @param {import('../model.js').Model} model */
export function detailDrawer(model) {
  const content = el('div', { class: 'drawer-content' });
  const close = el('button', { class: 'btn drawer-close', text: '✕ close', attrs: { 'aria-label': 'close the layer detail' } });
  const root = el('aside', { class: 'drawer', hidden: true, attrs: { 'data-testid': 'detail', role: 'dialog' } },
    close, content);
  let request = 0;
  let current = null;

  function hide() {
    root.hidden = true;
    current = null;
    request += 1;
  }
  close.addEventListener('click', hide);
  document.addEventListener('keydown', (event) => {
    if (event.key === 'Escape' && !root.hidden) hide();
  });

  async function show(run, layer) {
    request += 1;
    const mine = request;
    current = { run, layer };
    root.hidden = false;
    const health = model.health.get(run);
    const entry = health ? health.layers.find((l) => l.layer === layer) : null;
    const charts = el('div', { class: 'detail-charts' }, el('div', { class: 'loading', text: 'loading…' }));
    replace(content,
      el('div', { class: 'detail-head' }, entry ? badge(entry.status) : null,
        el('h2', { class: 'detail-layer mono', text: layer }), el('span', { class: 'detail-run', text: `run ${run}` })),
      kindText(entry) ? el('p', { class: 'layer-kind', attrs: { 'data-testid': 'layer-kind' } },
        el('b', { text: 'Layer: ' }), kindText(entry)) : null,
      entry && entry.reasons && entry.reasons.length
        ? el('ul', { class: 'reasons-list' }, entry.reasons.map((r) => el('li', { text: r })))
        : el('p', { class: 'hint', text: entry && entry.status === 'healthy' ? 'No rule fired: this layer looks healthy.' : '' }),
      entry && entry.fixes && entry.fixes.length
        ? el('div', { class: 'fixes', attrs: { 'data-testid': 'fixes' } }, el('b', { text: 'What to do' }),
          el('ul', { class: 'fixes-list' }, entry.fixes.map((f) => el('li', { text: f }))))
        : null,
      episodeList(entry),
      originNote(run, layer, entry), // where the run's first NaN/Inf was made, if it concerns this layer
      entry ? el('dl', { class: 'stat-grid' }, STATS.filter(([k]) => entry[k] !== undefined).map(([k, label]) => [
        el('dt', { text: label }), el('dd', { class: 'mono', text: k.endsWith('step') || k === 'index'
          ? String(entry[k] ?? '—') : fmt(entry[k]) })])) : null,
      charts);
    try {
      const [series, hist, profile] = await Promise.all([
        api('series', { run, layer, ...model.thresholdParams() }),
        api('histograms', { run, layer }).catch((err) => ({ error: err.message })),
        api('profile', { run, ...model.thresholdParams() }).catch(() => null),
      ]);
      if (mine !== request) return;
      const f = series.fields || {};
      const steps = series.steps || [];
      const blocks = [];
      const lines = thresholdLines(series.thresholds || {}, profile && profile.bands);
      const episodes = episodesOf(entry).map((ep) => ({ ...ep, label: episodeText(ep) }));
      blocks.push(lineChart({
        title: 'Gradient magnitude (log scale)', steps,
        series: [
          { name: 'RMS', values: f.rms || [], color: C.rms },
          { name: 'max |g|', values: f.max_abs || [], color: C.max_abs, dash: [6, 3] },
          { name: 'norm', values: f.norm || [], color: C.norm, dash: [10, 3, 2, 3] },
        ],
        thresholds: lines.magnitude,
        episodes,
      }));
      if (anyPositive(f.update_to_weight) || anyPositive(f.grad_to_weight)) {
        blocks.push(lineChart({
          title: 'Ratios to the weight norm (log scale)', steps,
          series: [
            anyPositive(f.update_to_weight) ? { name: '|Δw| / |w| (update)', values: f.update_to_weight, color: C.ratio } : null,
            anyPositive(f.grad_to_weight) ? { name: '|g| / |w|', values: f.grad_to_weight, color: C.ratio2, dash: [6, 3] } : null,
          ].filter(Boolean),
          thresholds: [
            ...(anyPositive(f.update_to_weight) ? lines.update : []),
            ...(anyPositive(f.grad_to_weight) ? lines.ratio : []),
          ],
          episodes,
        }));
      }
      if (anyPositive(f.noise)) {
        blocks.push(lineChart({ title: 'Gradient noise (micro-batch spread / norm)', steps,
          series: [{ name: 'noise', values: f.noise, color: C.noise }], thresholds: lines.noise, episodes }));
      }
      const nonfinite = steps.map((_, i) => (f.nan ? f.nan[i] || 0 : 0) + (f.inf ? f.inf[i] || 0 : 0));
      if (anyPositive(nonfinite) || anyPositive(f.zero_fraction)) {
        blocks.push(lineChart({ title: 'NaN/Inf elements and zero fraction (log scale)', steps,
          series: [
            anyPositive(nonfinite) ? { name: 'NaN+Inf elements', values: nonfinite, color: '#000000' } : null,
            anyPositive(f.zero_fraction) ? { name: 'zero fraction', values: f.zero_fraction, color: C.ratio, dash: [4, 3] } : null,
          ].filter(Boolean),
          episodes }));
      }
      if (hist && !hist.error) blocks.push(heatmap(hist));
      else if (hist && hist.error) blocks.push(el('div', { class: 'notice notice-error', text: `Histogram: ${hist.error}` }));
      if (series.merged) {
        blocks.push(el('p', { class: 'hint', text: `Charts show ${series.total_steps} logged steps as ${steps.length} `
          + 'windows of consecutive steps, each point at its first step: NaN/Inf counts are the window\'s totals, '
          + 'max |g| its largest value, norms the root mean square of its steps\' norms. The last step and the '
          + 'first NaN/Inf step start windows of their own.' }));
      }
      replace(charts, blocks);
    } catch (err) {
      if (mine !== request) return;
      replace(charts, el('div', { class: 'notice notice-error', text: `Could not load ${layer}: ${err.message}` }));
    }
  }

  return {
    root,
    show,
    /** Reload the open layer (after a refresh or a threshold change). */
    reload() {
      if (current && !root.hidden) show(current.run, current.layer);
    },
  };
}
