/**
 * The run's headline when a NaN/Inf was recorded and its step replayed: where it was made ("NaN/Inf made at step 512
 * in attention/softmax (Exp, forward) — model.py:88"), with the line of code on hover; or why it could not be
 * found. Fetched from the `nan_origin` route; absent for runs without one.
 */

import { el, replace } from '../dom.js';
import { api } from '../model.js';

const base = (path) => String(path || '').split(/[\\/]/).pop();

/** The headline element of one origin (the `nan_origin` route's `origin`). */
export function originLine(origin) {
  const attrs = { 'data-testid': 'nan-origin', 'data-step': String(origin.step) };
  if (!origin.found) {
    return el('div', { class: 'notice notice-warn nan-origin', attrs },
      el('b', { text: `NaN/Inf at step ${origin.step}: ` }), `origin not found (${origin.reason})`);
  }
  const where = origin.file ? `${base(origin.file)}:${origin.line}` : '';
  const inputs = (origin.input_nonfinite || []).length ? `, non-finite input: ${origin.input_nonfinite.join(', ')}` : '';
  return el('div', { class: 'notice notice-error nan-origin', attrs, title: origin.code || '' },
    el('b', { text: `NaN/Inf made at step ${origin.step}` }), ' in ',
    el('span', { class: 'mono', text: origin.layer || 'code outside any layer' }),
    ` (${origin.op}, ${origin.direction}${inputs})`,
    where ? [' — ', el('span', { class: 'mono', text: where })] : null,
    origin.code ? [' ', el('code', { text: origin.code })] : null);
}

/** A box that loads and shows the origin of `run` (empty when the run has none). */
export function originBox(run) {
  const root = el('div', { class: 'origin-box' });
  return {
    root,
    async reload() {
      try {
        const body = await api('nan_origin', { run });
        replace(root, body.origin ? originLine(body.origin) : null);
      } catch (err) {
        replace(root); // no origin to show: the health answer carries the run's real errors
      }
    },
  };
}

/** Whether the layer detail of `layer` should show the run's origin: its variable belongs to the origin's layer, or
 * its own gradient went non-finite (the NaN it shows was made there). */
function concerns(origin, layer, entry) {
  if (origin.layer && (layer === origin.layer || layer.startsWith(`${origin.layer}/`))) return true;
  const episodes = (entry && entry.episodes) || [];
  return Boolean(entry && (entry.status === 'nonfinite' || episodes.some((ep) => ep.status === 'nonfinite')));
}

/** For the layer detail: an element (filled when the answer arrives) with the run's origin if it concerns `layer`. */
export function originNote(run, layer, entry) {
  const slot = el('div', { class: 'origin-note' });
  api('nan_origin', { run }).then((body) => {
    if (body.origin && concerns(body.origin, layer, entry)) replace(slot, originLine(body.origin));
  }).catch(() => {});
  return slot;
}
