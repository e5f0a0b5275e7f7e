/**
 * Log-scale helpers shared by the charts. Gradient magnitudes span many decades, so every magnitude axis is
 * log10; zeros, negatives and nulls have no place on it and become gaps.
 */

/** log10 of the positive finite values only (null otherwise). */
export function log10OrNull(v) {
  return typeof v === 'number' && v > 0 && Number.isFinite(v) ? Math.log10(v) : null;
}

/**
 * A decade-aligned log domain covering `values` (and `extra`, e.g. threshold lines: numbers or {value, reach}):
 * [lo, hi] in log10 units, at least one decade wide. Returns null when nothing is positive.
 */
export function logDomain(values, extra = []) {
  let lo = Infinity;
  let hi = -Infinity;
  for (const v of values) {
    const l = log10OrNull(v);
    if (l === null) continue;
    if (l < lo) lo = l;
    if (l > hi) hi = l;
  }
  if (lo === Infinity) return null;
  for (const item of extra) {
    // Threshold lines widen the domain only by their `reach` in decades (4 for a bare number), so a far-away
    // backstop does not squash the data.
    const { value, reach } = typeof item === 'object' && item !== null ? item : { value: item, reach: 4 };
    const l = log10OrNull(value);
    if (l === null) continue;
    if (l < lo && lo - l < reach) lo = l;
    if (l > hi && l - hi < reach) hi = l;
  }
  lo = Math.floor(lo);
  hi = Math.ceil(hi);
  if (hi - lo < 1) hi = lo + 1;
  return [lo, hi];
}

/** Decade ticks for a domain, thinned to at most `maxTicks`. */
export function decadeTicks([lo, hi], maxTicks = 8) {
  const span = hi - lo;
  const step = Math.max(1, Math.ceil(span / maxTicks));
  const ticks = [];
  for (let d = Math.ceil(lo / step) * step; d <= hi; d += step) ticks.push(d);
  return ticks;
}

/** Label of a decade: 1e-5, 1, 10, 1e3 ... */
export function decadeLabel(d) {
  if (d === 0) return '1';
  if (d === 1) return '10';
  return `1e${d}`;
}

/** A canvas sized for the device pixel ratio; returns {canvas, ctx, width, height} in CSS pixels. */
export function hiDpiCanvas(canvas, width, height) {
  const ratio = window.devicePixelRatio || 1;
  canvas.width = Math.max(1, Math.round(width * ratio));
  canvas.height = Math.max(1, Math.round(height * ratio));
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  const ctx = canvas.getContext('2d');
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  return { canvas, ctx, width, height };
}

/** Start a frame: the hi-DPI canvas, the plot area inside `margin` ({ctx, w, h}), and the charts' label font. */
export function beginFrame(canvas, width, height, margin) {
  const { ctx } = hiDpiCanvas(canvas, width, height);
  ctx.font = '11px system-ui, sans-serif';
  return { ctx, w: width - margin.left - margin.right, h: height - margin.top - margin.bottom };
}

/** The grey line a chart draws instead of a plot when it has nothing to show. */
export function drawEmpty(ctx, margin, h, text) {
  ctx.fillStyle = '#777';
  ctx.fillText(text, margin.left + 8, margin.top + h / 2);
}

/** Viridis-like sequential colour map (perceptually ordered, colour-blind safe) for t in [0, 1]. */
const VIRIDIS = [
  [68, 1, 84], [72, 40, 120], [62, 74, 137], [49, 104, 142], [38, 130, 142],
  [31, 158, 137], [53, 183, 121], [110, 206, 88], [181, 222, 43], [253, 231, 37],
];
export function viridis(t) {
  const x = Math.min(1, Math.max(0, t)) * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(x));
  const f = x - i;
  const a = VIRIDIS[i];
  const b = VIRIDIS[i + 1];
  return [0, 1, 2].map((k) => Math.round(a[k] + (b[k] - a[k]) * f));
}

/** About `count` round linear ticks over [lo, hi] (for step axes). */
export function linearTicks(lo, hi, count = 6) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const norm = raw / mag;
  const step = (norm >= 5 ? 10 : norm >= 2 ? 5 : norm >= 1 ? 2 : 1) * mag;
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + 1e-9; t += step) ticks.push(Math.round(t * 1e6) / 1e6);
  return ticks;
}

/** Compact step label: 1200 -> 1.2k. */
export function stepLabel(s) {
  if (Math.abs(s) >= 1e6) return `${Number((s / 1e6).toPrecision(3))}M`;
  if (Math.abs(s) >= 1e4) return `${Number((s / 1e3).toPrecision(3))}k`;
  return String(s);
}

/**
 * Keep a canvas chart drawn at its container's width: `draw(width)` runs when the container first gets a size
 * and whenever its width changes.
 */
export function drawOnResize(container, draw) {
  let lastWidth = 0;
  const redraw = () => {
    const w = container.clientWidth;
    if (w > 0 && w !== lastWidth) {
      lastWidth = w;
      draw(w);
    }
  };
  if (typeof ResizeObserver !== 'undefined') new ResizeObserver(redraw).observe(container);
  requestAnimationFrame(redraw);
  return () => {
    lastWidth = 0;
    redraw();
  };
}

/** Horizontal grid lines with decade labels (10^d) on a log-scale y axis, shared by the line and bar charts.
 * `y` maps a log10 value to a pixel row; the grid spans `width` from `left`. */
export function drawDecadeGrid(ctx, domain, y, left, width, height) {
  ctx.strokeStyle = '#e4e4e4';
  ctx.fillStyle = '#555';
  ctx.textAlign = 'right';
  ctx.textBaseline = 'middle';
  for (const d of decadeTicks(domain, Math.max(2, Math.floor(height / 22)))) {
    const yy = Math.round(y(d)) + 0.5;
    ctx.beginPath();
    ctx.moveTo(left, yy);
    ctx.lineTo(left + width, yy);
    ctx.stroke();
    ctx.fillText(decadeLabel(d), left - 5, yy);
  }
}
