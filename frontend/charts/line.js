/**
 * Multi-series line chart over steps with a log10 y axis, horizontal threshold lines and a hover read-out.
 * Canvas-drawn (≤ 500 points per series by the series route), redrawn on hover for the crosshair.
 */

import { el, replace } from '../dom.js';
import { magnitude } from '../format.js';
import { statusColor } from '../status.js';
import {
  beginFrame, drawDecadeGrid, drawEmpty, drawOnResize, linearTicks, log10OrNull, logDomain, stepLabel,
} from './scale.js';

const MARGIN = { left: 52, right: 12, top: 8, bottom: 22 };

/** Shade each episode from half a step before its first step to half a step after its last (one step stays visible). */
function drawEpisodes(ctx, episodes, steps, x, h) {
  if (!episodes.length) return;
  const half = steps.length > 1 ? (steps[steps.length - 1] - steps[0]) / (steps.length - 1) / 2 : 0.5;
  const left = x(steps[0]);
  const right = x(steps[steps.length - 1]);
  ctx.save();
  ctx.globalAlpha = 0.16;
  for (const e of episodes) {
    const x0 = Math.max(left, x(e.from - half));
    const x1 = Math.min(right, x(e.to + half));
    ctx.fillStyle = statusColor(e.status);
    ctx.fillRect(x0, MARGIN.top, Math.max(x1 - x0, 2), h);
  }
  ctx.restore();
}

/**
 * @param {object} opts
 * @param {number[]} opts.steps x values
 * @param {{name:string, values:(number|null)[], color:string, dash?:number[], format?:(v:number)=>string}[]} opts.series
 *   `format` prints a value in the read-out (default: a magnitude, 3 significant figures; counts pass `count`)
 * @param {{value:number, label:string, color:string, reach?:number}[]} [opts.thresholds] horizontal lines; `reach`:
 *   how many decades beyond the data a line may widen the axis to be shown (default 4)
 * @param {{status:string, from:number, to:number, label:string}[]} [opts.episodes] the layer's episodes (inclusive logged steps),
 *   shaded behind the lines in their status colour, listed in the legend and named in the hover read-out
 * @param {string} opts.title
 * @param {number} [opts.height]
 * @returns {HTMLElement} a `.chart` block: title, legend, canvas, read-out line
 */
export function lineChart({ steps, series, thresholds: allThresholds = [], episodes: allEpisodes = [], title, height = 170 }) {
  const domain = logDomain(series.flatMap((s) => s.values),
    allThresholds.map((t) => ({ value: t.value, reach: t.reach ?? 4 })));
  // Only the lines that fall inside the plotted range get drawn and listed in the legend.
  const thresholds = allThresholds.filter((t) => {
    const l = log10OrNull(t.value);
    return domain && l !== null && l >= domain[0] && l <= domain[1];
  });
  const episodes = steps.length ? allEpisodes.filter((e) => e.to >= steps[0] && e.from <= steps[steps.length - 1]) : [];
  const canvas = el('canvas', { class: 'chart-canvas' });
  const readout = el('div', { class: 'chart-readout', text: 'hover for values' });
  const legend = el('div', { class: 'chart-legend' },
    episodes.map((e) => el('span', { class: 'legend-item legend-episode', attrs: { 'data-status': e.status } },
      el('span', { class: 'legend-band', style: { background: statusColor(e.status) } }), e.label)),
    series.map((s) => el('span', { class: 'legend-item' },
      el('span', { class: 'legend-swatch', style: { background: s.color } }), s.name)),
    thresholds.map((t) => el('span', { class: 'legend-item' },
      el('span', { class: 'legend-swatch legend-dotted', style: { borderColor: t.color } }), t.label)));
  const plot = el('div', { class: 'chart-plot' }, canvas);
  const root = el('div', { class: 'chart' }, el('div', { class: 'chart-title', text: title }), legend, plot, readout);
  root.dataset.episodes = String(episodes.length);
  root.dataset.points = String(series.reduce((n, s) => n + s.values.filter((v) => log10OrNull(v) !== null).length, 0));

  let geometry = null;
  let hoverIndex = null;

  function draw(width) {
    const { ctx, w, h } = beginFrame(canvas, width, height, MARGIN);
    if (!domain || steps.length === 0) {
      drawEmpty(ctx, MARGIN, h, 'no positive values to plot on a log axis');
      geometry = null;
      return;
    }
    const [lo, hi] = domain;
    const s0 = steps[0];
    const s1 = steps[steps.length - 1];
    const x = (s) => MARGIN.left + (s1 === s0 ? w / 2 : ((s - s0) / (s1 - s0)) * w);
    const y = (l) => MARGIN.top + h - ((l - lo) / (hi - lo)) * h;
    geometry = { x, y, s0, s1, w };
    drawEpisodes(ctx, episodes, steps, x, h);
    // grid + axes
    ctx.lineWidth = 1;
    drawDecadeGrid(ctx, domain, y, MARGIN.left, w, h);
    ctx.textAlign = 'center';
    ctx.textBaseline = 'top';
    for (const t of linearTicks(s0, s1, Math.max(2, Math.floor(w / 80)))) {
      ctx.fillText(stepLabel(t), x(t), MARGIN.top + h + 5);
    }
    ctx.strokeStyle = '#999';
    ctx.strokeRect(MARGIN.left + 0.5, MARGIN.top + 0.5, w, h);
    // thresholds
    for (const t of thresholds) {
      const l = log10OrNull(t.value);
      if (l === null || l < lo || l > hi) continue;
      ctx.save();
      ctx.setLineDash([2, 3]);
      ctx.strokeStyle = t.color;
      ctx.lineWidth = 1;
      ctx.beginPath();
      ctx.moveTo(MARGIN.left, y(l));
      ctx.lineTo(MARGIN.left + w, y(l));
      ctx.stroke();
      ctx.textAlign = 'right';
      ctx.textBaseline = 'bottom';
      const tw = ctx.measureText(t.label).width;
      // label above the line, or below it when the line runs along the top edge
      const below = y(l) - 13 < MARGIN.top;
      const base = below ? y(l) + 13 : y(l) - 1;
      ctx.fillStyle = 'rgba(255,255,255,0.8)';
      ctx.fillRect(MARGIN.left + w - tw - 6, base - 12, tw + 4, 12);
      ctx.fillStyle = t.color;
      ctx.fillText(t.label, MARGIN.left + w - 4, base);
      ctx.restore();
    }
    // series
    for (const s of series) {
      ctx.save();
      ctx.strokeStyle = s.color;
      ctx.fillStyle = s.color;
      ctx.lineWidth = 1.6;
      if (s.dash) ctx.setLineDash(s.dash);
      ctx.beginPath();
      let pen = false;
      let points = 0;
      s.values.forEach((v, i) => {
        const l = log10OrNull(v);
        if (l === null) {
          pen = false;
          return;
        }
        if (pen) ctx.lineTo(x(steps[i]), y(l));
        else ctx.moveTo(x(steps[i]), y(l));
        pen = true;
        points += 1;
      });
      ctx.stroke();
      if (points < 40) {
        s.values.forEach((v, i) => {
          const l = log10OrNull(v);
          if (l === null) return;
          ctx.beginPath();
          ctx.arc(x(steps[i]), y(l), 2, 0, 2 * Math.PI);
          ctx.fill();
        });
      }
      ctx.restore();
    }
    if (hoverIndex !== null) {
      const xx = Math.round(x(steps[hoverIndex])) + 0.5;
      ctx.strokeStyle = 'rgba(0,0,0,0.45)';
      ctx.beginPath();
      ctx.moveTo(xx, MARGIN.top);
      ctx.lineTo(xx, MARGIN.top + h);
      ctx.stroke();
    }
  }

  let currentWidth = 0;
  drawOnResize(plot, (width) => {
    currentWidth = width;
    draw(width);
  });

  canvas.addEventListener('mousemove', (event) => {
    if (!geometry) return;
    const rect = canvas.getBoundingClientRect();
    const px = event.clientX - rect.left;
    const { s0, s1, w } = geometry;
    const target = s1 === s0 ? s0 : s0 + ((px - MARGIN.left) / w) * (s1 - s0);
    let best = 0;
    for (let i = 1; i < steps.length; i += 1) {
      if (Math.abs(steps[i] - target) < Math.abs(steps[best] - target)) best = i;
    }
    hoverIndex = best;
    draw(currentWidth);
    const inside = episodes.find((e) => e.from <= steps[best] && steps[best] <= e.to);
    replace(readout, el('b', { text: `step ${steps[best]}` }),
      inside ? el('span', { class: 'readout-item readout-episode', text: `in episode: ${inside.label}` }) : null,
      series.map((s) => el('span', { class: 'readout-item' },
        el('span', { class: 'legend-swatch', style: { background: s.color } }), `${s.name} ${(s.format || magnitude)(s.values[best])}`)));
  });
  canvas.addEventListener('mouseleave', () => {
    hoverIndex = null;
    draw(currentWidth);
  });
  return root;
}
