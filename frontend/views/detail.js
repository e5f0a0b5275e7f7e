/**
 * The layer detail drawer: what the layer looks like over time. Magnitudes (RMS, max |g|, norm) on a log axis with
 * the run's vanishing/exploding lines, the update/weight and gradient/weight ratios and gradient noise when they
 * were recorded, NaN/Inf and zero counts when there are any, the layer's output (RMS, dead and saturated
 * fractions) where the writer recorded it, and the log-magnitude histogram as a heatmap.
 */

import { el, replace } from '../dom.js';
import { count, magnitude, severity, step } from '../format.js';
import { heatmap } from '../charts/heatmap.js';
import { lineChart } from '../charts/line.js';
import { api } from '../model.js';
import { badge, isFlagged } from '../status.js';
import { episodeText, episodesOf, statusChain } from './episodes.js';
import { kindText } from './evidence.js';
import { originNote } from './origin.js';
import { answerOf } from './summary.js';
import { thresholdLines } from './reference.js';

const C = { rms: '#0072B2', max_abs: '#D55E00', norm: '#009E73', ratio: '#CC79A7', ratio2: '#56B4E9', noise: '#E69F00' };

/** The numbers of the layer at the diagnosed step: [field, label, kind]; kind picks the printing rule. */
const STATS = [
  ['severity', 'severity', 'severity'], ['status_since', null, 'step'], ['first_step', 'trouble since (step)', 'step'],
  ['step', 'diagnosed at step', 'step'], ['index', 'network index', 'step'],
  ['rms', 'RMS', 'magnitude'], ['max_abs', 'max |g|', 'magnitude'], ['norm', 'norm', 'magnitude'],
  ['mean', 'mean', 'magnitude'], ['size', 'values', 'count'], ['nan', 'NaN count', 'count'], ['inf', 'Inf count', 'count'],
  ['zero_fraction', 'zero fraction', 'magnitude'], ['weight_norm', 'weight norm', 'magnitude'],
  ['grad_to_weight', '|g| / |w|', 'magnitude'], ['update_to_weight', '|Δw| / |w|', 'magnitude'], ['noise', 'noise', 'magnitude'],
];
const PRINT = { severity, step, magnitude, count };
const LAST_FINITE = new Set(['rms', 'max_abs', 'norm']);

/** One stat: [label, text]; a magnitude with no finite value now shows the last finite one, labelled with its step. */
function stat(entry, [key, label, kind]) {
  const name = label || `${entry.status} since (step)`;
  const last = entry.last_finite;
  if (LAST_FINITE.has(key) && (entry[key] === null || entry[key] === undefined) && last) {
    return [`${name}, last finite (step ${last.step})`, magnitude(last[key])];
  }
  return [name, PRINT[kind](entry[key])];
}

/** The stat grid of a layer (`data-testid=stats`; each value's `data-key` names its field). */
function statGrid(entry) {
  return el('dl', { class: 'stat-grid', attrs: { 'data-testid': 'stats' } }, STATS.filter(([k]) => entry[k] !== undefined).map((spec) => {
    const [label, text] = stat(entry, spec);
    return [el('dt', { text: label }), el('dd', { class: 'mono', text, attrs: { 'data-key': spec[0] } })];
  }));
}

/** "nonfinite since 54 · trouble since 31" for a flagged layer, or null. */
function sinceLine(entry) {
  if (!entry || !isFlagged(entry.status) || entry.first_step === null || entry.first_step === undefined) return null;
  return el('p', { class: 'drawer-since', attrs: { 'data-testid': 'drawer-since' } },
    el('span', { class: 'since-status', text: `${entry.status} since ${step(entry.status_since)}` }), ' · ',
    el('span', { class: 'since-trouble', text: `trouble since ${step(entry.first_step)}` }));
}

/** The run's cause (its answer's headline), saying whether it is this layer; its name opens it otherwise. */
function causeLine(answer, layer, open) {
  if (!answer) return null;
  const self = answer.layer === layer;
  const name = self ? el('span', { class: 'mono', text: answer.layer })
    : el('a', { href: '#', class: 'mono cause-link', text: answer.layer,
      on: { click: (event) => { event.preventDefault(); open(answer.layer); } } });
  const rest = answer.headline.startsWith(`${answer.layer}:`) ? answer.headline.slice(answer.layer.length) : `: ${answer.headline}`;
  return el('p', { class: 'drawer-cause', attrs: { 'data-testid': 'drawer-cause', 'data-layer': answer.layer } },
    el('b', { text: self ? 'This layer is the run\'s cause, first to go wrong: ' : 'The run\'s cause, first to go wrong: ' }),
    name, rest);
}

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
      sinceLine(entry),
      causeLine(answerOf(health), layer, (other) => show(run, other)),
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
      entry ? statGrid(entry) : null,
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
            anyPositive(nonfinite) ? { name: 'NaN+Inf elements', values: nonfinite, color: '#000000', format: count } : null,
            anyPositive(f.zero_fraction) ? { name: 'zero fraction', values: f.zero_fraction, color: C.ratio, dash: [4, 3] } : null,
          ].filter(Boolean),
          episodes }));
      }
      const out = series.outputs;
      if (out && out.steps && out.steps.length) {
        const act = out.activation ? ` (${out.activation})` : '';
        blocks.push(lineChart({ title: `Layer output ${out.output}${act} (log scale)`, steps: out.steps,
          series: [
            { name: 'output RMS', values: out.rms, color: C.rms },
            anyPositive(out.dead_fraction) ? { name: 'dead unit fraction', values: out.dead_fraction, color: C.max_abs, dash: [6, 3] } : null,
            anyPositive(out.saturated_fraction) ? { name: 'saturated fraction', values: out.saturated_fraction, color: C.ratio, dash: [4, 3] } : null,
          ].filter(Boolean),
          episodes }));
      }
      if (hist && !hist.error) blocks.push(heatmap(hist));
      else if (hist && hist.error) blocks.push(el('div', { class: 'notice notice-error', text: `Histogram: ${hist.error}` }));
      if (series.merged) {
        blocks.push(el('p', { class: 'hint', text: `Charts show ${count(series.total_steps)} logged steps as ${count(steps.length)} `
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
