/**
 * The log-magnitude histogram over steps: columns are logged steps, rows are decades of |g| (the record's fixed
 * decade bins), colour is the element count on a log colour scale (viridis: ordered and colour-blind safe).
 * Two extra rows keep what a log axis cannot show: exact zeros (bottom) and NaN/Inf (top, vermillion).
 * Hovering a cell reads out the step, the decade and the count (marked "estimated" when the histogram was sampled).
 */

import { el, replace } from '../dom.js';
import { count } from '../format.js';
import { beginFrame, decadeLabel, drawEmpty, drawOnResize, linearTicks, stepLabel, viridis } from './scale.js';

const MARGIN = { left: 58, right: 12, top: 8, bottom: 22 };

/**
 * @param {object} data the `histograms` route answer: steps, decades, counts, zero, nonfinite, exact
 * @param {{title?: string, height?: number}} [opts]
 */
export function heatmap(data, { title = 'Log-magnitude histogram (|g| decades x steps)', height = 220 } = {}) {
  const canvas = el('canvas', { class: 'chart-canvas heatmap-canvas' });
  const readout = el('div', { class: 'chart-readout', text: 'hover a cell for the count' });
  const plot = el('div', { class: 'chart-plot' }, canvas);
  const root = el('div', { class: 'chart' }, el('div', { class: 'chart-title', text: title }), plot, readout);
  const steps = data.steps || [];
  const decades = data.decades || [];
  const counts = data.counts || [];
  const zero = data.zero || [];
  const nonfinite = data.nonfinite || [];
  const exact = data.exact || [];
  root.dataset.cells = String(steps.length * decades.length);
  // rows, bottom to top: zero, decade bins..., nonfinite
  const rows = [{ kind: 'zero', label: '0' }, ...decades.map((d, b) => ({ kind: 'bin', b, d, label: decadeLabel(d) })),
    { kind: 'nonfinite', label: 'NaN/Inf' }];
  const cell = (s, row) => {
    if (row.kind === 'zero') return zero[s] || 0;
    if (row.kind === 'nonfinite') return nonfinite[s] || 0;
    return (counts[s] && counts[s][row.b]) || 0;
  };
  let maxCount = 0;
  for (let s = 0; s < steps.length; s += 1) for (const row of rows) maxCount = Math.max(maxCount, cell(s, row));
  const scale = Math.log1p(maxCount) || 1;
  let geometry = null;

  function draw(width) {
    const { ctx, w, h } = beginFrame(canvas, width, height, MARGIN);
    if (!steps.length || !rows.length) {
      drawEmpty(ctx, MARGIN, h, 'no histogram recorded');
      return;
    }
    const cw = w / steps.length;
    const rh = h / rows.length;
    geometry = { cw, rh, h };
    ctx.fillStyle = '#f3f3f3';
    ctx.fillRect(MARGIN.left, MARGIN.top, w, h);
    for (let s = 0; s < steps.length; s += 1) {
      rows.forEach((row, r) => {
        const c = cell(s, row);
        if (!(c > 0)) return;
        const t = Math.log1p(c) / scale;
        if (row.kind === 'nonfinite') ctx.fillStyle = `rgba(213,94,0,${0.35 + 0.65 * t})`;
        else {
          const [red, green, blue] = viridis(t);
          ctx.fillStyle = `rgb(${red},${green},${blue})`;
        }
        ctx.fillRect(MARGIN.left + s * cw, MARGIN.top + h - (r + 1) * rh, Math.ceil(cw), Math.ceil(rh));
      });
    }
    ctx.fillStyle = '#555';
    ctx.textAlign = 'right';
    ctx.textBaseline = 'middle';
    const every = Math.max(1, Math.ceil(rows.length / Math.max(2, Math.floor(h / 14))));
    rows.forEach((row, r) => {
      if (row.kind === 'bin' && r % every !== 0) return;
      ctx.fillText(row.label, MARGIN.left - 5, MARGIN.top + h - (r + 0.5) * rh);
    });
    ctx.textAlign = 'center';
    ctx.textBaseline = 'top';
    for (const t of linearTicks(0, steps.length - 1, Math.max(2, Math.floor(w / 80)))) {
      if (Number.isInteger(t)) ctx.fillText(stepLabel(steps[t]), MARGIN.left + (t + 0.5) * cw, MARGIN.top + h + 5);
    }
    ctx.strokeStyle = '#999';
    ctx.strokeRect(MARGIN.left + 0.5, MARGIN.top + 0.5, w, h);
  }

  drawOnResize(plot, draw);
  canvas.addEventListener('mousemove', (event) => {
    if (!geometry) return;
    const rect = canvas.getBoundingClientRect();
    const s = Math.floor((event.clientX - rect.left - MARGIN.left) / geometry.cw);
    const r = Math.floor((MARGIN.top + geometry.h - (event.clientY - rect.top)) / geometry.rh);
    if (s < 0 || s >= steps.length || r < 0 || r >= rows.length) return;
    const row = rows[r];
    const c = cell(s, row);
    let what;
    if (row.kind === 'zero') what = 'exact zeros';
    else if (row.kind === 'nonfinite') what = 'NaN/Inf elements';
    else what = `|g| in [${decadeLabel(row.d)}, ${decadeLabel(row.d + 1)})`;
    const estimated = row.kind === 'bin' && exact[s] === false ? ' (estimated from a sample)' : '';
    replace(readout, el('b', { text: `step ${steps[s]}` }), ` · ${what} · ${count(c)} elements${estimated}`);
  });
  return root;
}
