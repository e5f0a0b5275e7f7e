/**
 * The depth profile: one bar per layer in network (forward) order, height = log10 of a magnitude (RMS by
 * default) at one step, coloured by status, with the healthy band drawn: shaded below the vanishing line and
 * above the exploding line, dashed at the reference (the layers nearest the loss). The axis floor sits at least one decade below the smallest
 * value and every bar is at least `MIN_BAR_PX` tall, so the weakest layer (often the one that matters) is a clear
 * bar. A layer with no finite value (NaN/Inf) gets a dark marker at the top; an all-zero or missing layer a hollow
 * dashed box at the floor (never filled like a bar), so no layer silently disappears or passes for a tiny bar.
 */

import { el, replace } from '../dom.js';
import { magnitude } from '../format.js';
import { STATUSES, STATUS_STYLE, statusColor } from '../status.js';
import {
  beginFrame, drawDecadeGrid, drawOnResize, linearTicks, log10OrNull, logDomain,
} from './scale.js';

const MARGIN = { left: 52, right: 12, top: 8, bottom: 22 };
/** The shortest bar drawn, in CSS pixels (a hollow `ABSENT_PX` box at the floor marks a layer with no value). */
export const MIN_BAR_PX = 6;
const ABSENT_PX = 8;
const LABEL_H = 13;

/** A layer drawn as the no-finite-value mark (else, without a value, as the hollow all-zero/missing box). */
function isNonfinite(layer, key) {
  return layer.status === 'nonfinite' || layer[key] === Infinity;
}

/** The plotted log range: `logDomain`, with the floor a full decade below the smallest value. */
function barDomain(values, extra) {
  const domain = logDomain(values, extra);
  if (!domain) return null;
  const smallest = Math.min(...values.map(log10OrNull).filter((l) => l !== null));
  return [Math.min(domain[0], Math.floor(smallest) - 1), domain[1]];
}

/**
 * Where a band line's label goes: above or below its line, at the left, right or middle, inside the plot and clear
 * of the labels already placed (`placed` collects their boxes).
 */
function labelBox(yLine, width, plot, placed) {
  const xs = [plot.left + 2, plot.left + plot.w - width - 6, plot.left + (plot.w - width) / 2];
  const ys = [yLine - LABEL_H - 1, yLine + 2];
  const inside = (b) => b.y >= plot.top && b.y + LABEL_H <= plot.top + plot.h;
  const clear = (b) => placed.every((p) => b.x + b.w < p.x || p.x + p.w < b.x || b.y + LABEL_H <= p.y || p.y + LABEL_H <= b.y);
  let fallback = null;
  for (const x of xs) {
    for (const y of ys) {
      const box = { x, y, w: width + 4 };
      if (!inside(box)) continue;
      fallback = fallback || box;
      if (clear(box)) return box;
    }
  }
  return fallback || { x: xs[0], y: Math.max(plot.top, Math.min(yLine + 2, plot.top + plot.h - LABEL_H)), w: width + 4 };
}

/**
 * The band's lines at this step, [log10 value, colour, label, name]: the reference the relative rules compare with
 * (the layers nearest the loss; the median layer when the answer has no reference), vanishing below, exploding above.
 */
function bandLines(bands) {
  const ref = bands.reference_rms !== undefined
    ? [log10OrNull(bands.reference_rms), '#333333', 'reference (layers nearest the loss)', 'reference']
    : [log10OrNull(bands.median_rms), '#333333', 'median', 'reference'];
  return [ref,
    [log10OrNull(bands.vanishing_below), '#0072B2', 'vanishing below', 'vanishing'],
    [log10OrNull(bands.exploding_above), '#D55E00', 'exploding above', 'exploding']];
}

/** Expose where each band line was drawn (`data-vanishing-y` ..., CSS pixels from the canvas top; larger is lower on
 * screen), so a reader or a test can check the lines' order without reading pixels. */
function exposeLines(root, lines, y) {
  for (const name of ['reference', 'vanishing', 'exploding']) delete root.dataset[`${name}Y`];
  for (const [v, , , name] of lines) root.dataset[`${name}Y`] = String(lineY(y, v));
}

/** The pixel row a band line at log value `v` is drawn on: the centre of a CSS pixel, so the line is crisp. */
const lineY = (y, v) => Math.round(y(v)) + 0.5;

/** Dashed lines with a white halo (readable on bars of the same colour), then their labels, so no line crosses a
 * label. */
function drawBandLines(ctx, lines, y, w, h) {
  for (const [v, color] of lines) {
    ctx.save();
    ctx.strokeStyle = 'rgba(255,255,255,0.85)';
    ctx.lineWidth = 3;
    ctx.beginPath();
    ctx.moveTo(MARGIN.left, lineY(y, v));
    ctx.lineTo(MARGIN.left + w, lineY(y, v));
    ctx.stroke();
    ctx.setLineDash([5, 4]);
    ctx.strokeStyle = color;
    ctx.lineWidth = 1.5;
    ctx.stroke();
    ctx.restore();
  }
  ctx.textAlign = 'left';
  ctx.textBaseline = 'top';
  const placed = [];
  for (const [v, color, label] of lines) {
    const box = labelBox(y(v), ctx.measureText(label).width, { left: MARGIN.left, top: MARGIN.top, w, h }, placed);
    placed.push(box);
    ctx.fillStyle = 'rgba(255,255,255,0.85)';
    ctx.fillRect(box.x, box.y, box.w, LABEL_H);
    ctx.fillStyle = color;
    ctx.fillText(label, box.x + 2, box.y + 1);
  }
}

/**
 * @param {object} opts
 * @param {{layer:string,index:number,status:string}[]} opts.layers network order
 * @param {string} opts.key the magnitude to plot ('rms', 'norm' or 'max_abs')
 * @param {{reference_rms?:number, median_rms?:number, vanishing_below?:number, exploding_above?:number}} [opts.bands]
 * @param {(layer:string)=>void} [opts.onSelect] click on a bar
 * @param {number} [opts.height]
 */
export function depthBars({ layers, key = 'rms', bands = {}, onSelect = null, height = 190 }) {
  const canvas = el('canvas', { class: 'chart-canvas profile-canvas' });
  const readout = el('div', { class: 'chart-readout', text: 'hover a bar for the layer; click to open it' });
  const plot = el('div', { class: 'chart-plot' }, canvas);
  // which colour is which status (only the statuses drawn), plus the two marks that are not bars
  const present = new Set(layers.map((l) => l.status));
  const noValue = layers.filter((l) => log10OrNull(l[key]) === null);
  const legend = el('div', { class: 'chart-legend profile-legend' },
    STATUSES.filter((s) => present.has(s)).map((s) => el('span', { class: 'legend-item', attrs: { 'data-status': s } },
      el('span', { class: 'legend-band legend-solid', style: { background: STATUS_STYLE[s].color } }),
      `${STATUS_STYLE[s].glyph} ${s}`)),
    noValue.some((l) => isNonfinite(l, key)) ? el('span', { class: 'legend-item' },
      el('span', { class: 'legend-band legend-solid', style: { background: '#000000' } }), 'mark at the top: no finite value') : null,
    noValue.some((l) => !isNonfinite(l, key)) ? el('span', { class: 'legend-item' },
      el('span', { class: 'legend-band legend-hollow' }), 'hollow box at the floor: all zero or missing') : null);
  const root = el('div', { class: 'chart' }, legend, plot, readout);
  root.dataset.bars = String(layers.length);
  const extra = [bands.reference_rms ?? bands.median_rms, bands.vanishing_below, bands.exploding_above];
  const domain = barDomain(layers.map((l) => l[key]), key === 'rms' ? extra : []);
  let geometry = null;
  let hover = null;
  let currentWidth = 0;

  function draw(width) {
    currentWidth = width;
    const { ctx, w, h } = beginFrame(canvas, width, height, MARGIN);
    if (!layers.length) {
      geometry = null;
      return;
    }
    const [lo, hi] = domain || [-1, 0];
    const n = layers.length;
    const slot = w / n;
    const y = (l) => MARGIN.top + h - ((l - lo) / (hi - lo)) * h;
    geometry = { slot, n };
    const base = MARGIN.top + h;
    // bands (RMS bands are the diagnosis' relative thresholds at this step)
    if (key === 'rms') {
      const vb = log10OrNull(bands.vanishing_below);
      const ea = log10OrNull(bands.exploding_above);
      if (vb !== null && vb > lo) {
        ctx.fillStyle = 'rgba(0,114,178,0.10)';
        const top = Math.max(MARGIN.top, y(Math.min(vb, hi)));
        ctx.fillRect(MARGIN.left, top, w, base - top);
      }
      if (ea !== null && ea < hi) {
        ctx.fillStyle = 'rgba(213,94,0,0.10)';
        const bottom = Math.min(base, y(Math.max(ea, lo)));
        ctx.fillRect(MARGIN.left, MARGIN.top, w, bottom - MARGIN.top);
      }
    }
    drawDecadeGrid(ctx, [lo, hi], y, MARGIN.left, w, h);
    ctx.textAlign = 'center';
    ctx.textBaseline = 'top';
    for (const t of linearTicks(0, n - 1, Math.max(2, Math.floor(w / 70)))) {
      if (Number.isInteger(t)) ctx.fillText(String(t), MARGIN.left + (t + 0.5) * slot, base + 5);
    }
    const gap = slot > 4 ? Math.min(2, slot * 0.2) : 0;
    layers.forEach((layer, i) => {
      const l = log10OrNull(layer[key]);
      const x0 = MARGIN.left + i * slot + gap / 2;
      const bw = Math.max(slot - gap, 0.6);
      if (l === null) {
        if (isNonfinite(layer, key)) {
          ctx.fillStyle = 'rgba(0,0,0,0.85)';
          ctx.fillRect(x0, MARGIN.top, bw, 6);
        } else {
          ctx.save();
          ctx.setLineDash([2, 2]);
          ctx.strokeStyle = '#444444';
          ctx.strokeRect(x0 + 0.5, base - ABSENT_PX + 0.5, Math.max(bw - 1, 1), ABSENT_PX - 1);
          ctx.restore();
        }
        return;
      }
      const top = Math.min(y(Math.min(Math.max(l, lo), hi)), base - MIN_BAR_PX);
      ctx.fillStyle = statusColor(layer.status);
      ctx.fillRect(x0, top, bw, base - top);
    });
    const lines = key === 'rms' ? bandLines(bands).filter(([v]) => v !== null && v >= lo && v <= hi) : [];
    drawBandLines(ctx, lines, y, w, h);
    exposeLines(root, lines, y);
    if (!domain) {
      ctx.fillStyle = '#555';
      ctx.textAlign = 'center';
      ctx.textBaseline = 'middle';
      ctx.fillText('no finite, non-zero value at this step: slide back to see the profile',
        MARGIN.left + w / 2, MARGIN.top + h / 2);
    }
    if (hover !== null) {
      ctx.strokeStyle = 'rgba(0,0,0,0.6)';
      ctx.strokeRect(MARGIN.left + hover * slot, MARGIN.top, Math.max(slot, 1), h);
    }
    ctx.strokeStyle = '#999';
    ctx.strokeRect(MARGIN.left + 0.5, MARGIN.top + 0.5, w, h);
  }

  drawOnResize(plot, draw);
  const indexAt = (event) => {
    if (!geometry) return null;
    const rect = canvas.getBoundingClientRect();
    const i = Math.floor((event.clientX - rect.left - MARGIN.left) / geometry.slot);
    return i >= 0 && i < geometry.n ? i : null;
  };
  canvas.addEventListener('mousemove', (event) => {
    const i = indexAt(event);
    if (i === hover) return;
    hover = i;
    draw(currentWidth);
    if (i === null) return;
    const layer = layers[i];
    replace(readout, el('b', { text: `#${layer.index} ` }), el('span', { class: 'mono', text: layer.layer }),
      ` · ${layer.status} · rms ${magnitude(layer.rms)} · max|g| ${magnitude(layer.max_abs)} · norm ${magnitude(layer.norm)}`);
  });
  canvas.addEventListener('mouseleave', () => {
    hover = null;
    draw(currentWidth);
  });
  if (onSelect) {
    canvas.style.cursor = 'pointer';
    canvas.addEventListener('click', (event) => {
      const i = indexAt(event);
      if (i !== null) onSelect(layers[i].layer);
    });
  }
  return root;
}
