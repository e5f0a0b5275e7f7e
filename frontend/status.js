/**
 * Status words, colours and glyphs. Colours are the Okabe-Ito palette (distinguishable with the common colour
 * vision deficiencies); every badge also carries the status word and a distinct glyph, so colour is never the
 * only cue.
 */

import { el } from './dom.js';

/** Severity order, worst first (same as health.STATUSES). */
export const STATUSES = ['nonfinite', 'exploding', 'vanishing', 'dead', 'missing', 'inert', 'healthy', 'frozen'];

/**
 * Statuses that are not a disease: `healthy`, `inert` (a parameter that only ever receives round-off
 * gradient, e.g. a bias right before a BatchNorm; informational) and `frozen` (no gradient by the user's choice:
 * requires_grad=False, outside the optimizer). They never count as flagged.
 */
export const UNFLAGGED = new Set(['inert', 'healthy', 'frozen']);

/** Whether a status is a problem (counts in "flagged" totals, badges and the timeline). */
export function isFlagged(status) {
  return !UNFLAGGED.has(status);
}

export const STATUS_STYLE = {
  nonfinite: { color: '#000000', ink: '#ffffff', glyph: '✖', label: 'nonfinite' },
  exploding: { color: '#D55E00', ink: '#000000', glyph: '▲', label: 'exploding' },
  vanishing: { color: '#0072B2', ink: '#ffffff', glyph: '▼', label: 'vanishing' },
  dead: { color: '#CC79A7', ink: '#000000', glyph: '■', label: 'dead' },
  missing: { color: '#F0E442', ink: '#000000', glyph: '?', label: 'missing' },
  inert: { color: '#BDBDBD', ink: '#000000', glyph: '○', label: 'inert' },
  healthy: { color: '#009E73', ink: '#000000', glyph: '✓', label: 'healthy' },
  frozen: { color: '#56B4E9', ink: '#000000', glyph: '❄', label: 'frozen' },
};

/** A status badge: glyph + word on the status colour; class `badge badge-<status>` for tests and CSS. */
export function badge(status) {
  const style = STATUS_STYLE[status] || { color: '#999999', ink: '#000000', glyph: '·', label: String(status) };
  return el('span', {
    class: `badge badge-${STATUS_STYLE[status] ? status : 'unknown'}`,
    title: style.label,
    style: { background: style.color, color: style.ink },
    attrs: { 'data-status': String(status) },
  }, el('span', { class: 'badge-glyph', text: style.glyph, attrs: { 'aria-hidden': 'true' } }), style.label);
}

/** Colour of a status, for charts. */
export function statusColor(status) {
  return (STATUS_STYLE[status] || { color: '#999999' }).color;
}

/** Rank of a status in severity order (0 = worst). */
export function statusRank(status) {
  const i = STATUSES.indexOf(status);
  return i < 0 ? STATUSES.length : i;
}
