/**
 * The per-row RMS sparkline: a tiny log-scale line on canvas. Null / non-positive points are gaps; a
 * non-finite point (null where the layer went NaN) is marked by a red tick at the top so "it ended in NaN" shows.
 */

import { hiDpiCanvas, log10OrNull } from './scale.js';

/**
 * Draw `values` (aligned with history steps) into a new canvas of width x height CSS pixels.
 * `color` is the line colour (the row's status colour).
 */
export function sparkline(values, { width = 96, height = 22, color = '#333333', title = '' } = {}) {
  const canvas = document.createElement('canvas');
  canvas.className = 'sparkline';
  if (title) canvas.title = title;
  drawSparkline(canvas, values, { width, height, color });
  return canvas;
}

/**
 * Like `sparkline`, but drawn only when it scrolls into view (one IntersectionObserver per table): a table of
 * 1,000 rows then costs 1,000 empty canvases, not 1,000 drawings.
 */
export function lazySparkline(values, observer, { width = 96, height = 22, color = '#333333', title = '' } = {}) {
  const canvas = document.createElement('canvas');
  canvas.className = 'sparkline';
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  if (title) canvas.title = title;
  canvas.__draw = () => drawSparkline(canvas, values, { width, height, color });
  observer.observe(canvas);
  return canvas;
}

/** An observer for `lazySparkline` canvases (draws each once, when first visible). */
export function sparklineObserver() {
  if (typeof IntersectionObserver === 'undefined') return { observe: (c) => c.__draw(), disconnect() {} };
  const observer = new IntersectionObserver((entries) => {
    for (const entry of entries) {
      if (!entry.isIntersecting) continue;
      observer.unobserve(entry.target);
      entry.target.__draw();
      entry.target.dataset.drawn = '1';
    }
  }, { rootMargin: '200px' });
  return observer;
}

function drawSparkline(canvas, values, { width, height, color }) {
  const { ctx } = hiDpiCanvas(canvas, width, height);
  const logs = (values || []).map(log10OrNull);
  let lo = Infinity;
  let hi = -Infinity;
  for (const l of logs) {
    if (l === null) continue;
    if (l < lo) lo = l;
    if (l > hi) hi = l;
  }
  if (lo === Infinity || logs.length === 0) {
    ctx.fillStyle = '#bbbbbb';
    ctx.fillRect(2, height / 2, width - 4, 1);
    return;
  }
  if (hi - lo < 0.5) {
    const mid = (hi + lo) / 2;
    lo = mid - 0.25;
    hi = mid + 0.25;
  }
  const pad = 2;
  const n = logs.length;
  const x = (i) => pad + (n === 1 ? (width - 2 * pad) / 2 : (i * (width - 2 * pad)) / (n - 1));
  const y = (l) => height - pad - ((l - lo) / (hi - lo)) * (height - 2 * pad);
  ctx.strokeStyle = color;
  ctx.lineWidth = 1.25;
  ctx.beginPath();
  let pen = false;
  logs.forEach((l, i) => {
    if (l === null) {
      pen = false;
      return;
    }
    if (pen) ctx.lineTo(x(i), y(l));
    else ctx.moveTo(x(i), y(l));
    pen = true;
  });
  ctx.stroke();
  // The last point as a dot: where the layer is now.
  for (let i = n - 1; i >= 0; i -= 1) {
    if (logs[i] !== null) {
      ctx.fillStyle = color;
      ctx.beginPath();
      ctx.arc(x(i), y(logs[i]), 1.8, 0, 2 * Math.PI);
      ctx.fill();
      break;
    }
  }
  // Trailing gaps after data: mark them (the layer stopped producing finite gradients).
  if (logs[n - 1] === null && logs.some((l) => l !== null)) {
    ctx.fillStyle = '#D55E00';
    ctx.fillRect(width - pad - 2, pad, 2, height - 2 * pad);
  }
}
