/**
 * The forward depth profile: each recorded layer output's RMS through depth at the diagnosed step (a bar on a log
 * scale), with its units' dead and saturated fractions, from the health answer's `forward_profile`. Absent from
 * runs whose writer did not record the layers' outputs. Text as the CLI's forward depth line prints it.
 */

import { el } from '../dom.js';
import { magnitude } from '../format.js';

/** "69% dead, 12% saturated" (the fractions an output has), or "". */
function fractions(o) {
  const parts = [];
  if (o.dead_fraction) parts.push(`${Math.round(o.dead_fraction * 100)}% dead`);
  if (o.saturated_fraction) parts.push(`${Math.round(o.saturated_fraction * 100)}% saturated`);
  return parts.join(', ');
}

/** The bar's width in percent: log10 RMS placed between the profile's smallest and largest. */
function widths(outputs) {
  const logs = outputs.map((o) => (o.rms > 0 ? Math.log10(o.rms) : null));
  const finite = logs.filter((v) => v !== null);
  const lo = Math.min(...finite) - 1;
  const hi = Math.max(...finite);
  return logs.map((v) => (v === null ? 0 : 5 + 95 * ((v - lo) / Math.max(hi - lo, 1e-9))));
}

/**
 * The forward depth profile box, or null when the run has no recorded outputs.
 * @param {object} health the `health` answer
 */
export function forwardProfile(health) {
  const profile = health.forward_profile;
  if (!profile || !profile.outputs || !profile.outputs.length) return null;
  const width = widths(profile.outputs);
  const flagged = new Set(health.layers
    .filter((lj) => lj.forward && lj.status !== 'healthy' && lj.status !== 'frozen' && lj.status !== 'inert')
    .map((lj) => lj.forward.output));
  const rows = profile.outputs.map((o, k) => el('tr', {
    class: flagged.has(o.output) ? 'forward-row forward-flagged' : 'forward-row',
    attrs: { 'data-output': o.output },
  },
  el('td', { class: 'forward-name', text: o.output }),
  el('td', { class: 'forward-activation', text: o.activation || '' }),
  el('td', { class: 'forward-bar-cell' }, el('div', { class: 'forward-bar', style: { width: `${width[k].toFixed(1)}%` } })),
  el('td', { class: 'forward-rms', text: magnitude(o.rms) }),
  el('td', { class: 'forward-fractions', text: fractions(o) })));
  return el('details', { class: 'profile-box forward-box', open: true, attrs: { 'data-testid': 'forward-profile' } },
    el('summary', { text: `Forward depth profile: output RMS at step ${profile.step}` }),
    el('table', { class: 'forward-table' }, el('tbody', {}, rows)));
}
