/**
 * The one-line answer for a run: how many layers are in each status, and which layer went bad first and when.
 */

import { el } from '../dom.js';
import { STATUSES, STATUS_STYLE, badge } from '../status.js';

/** @param {object} health the `health` route answer */
export function summaryLine(health) {
  const counts = (health.summary && health.summary.counts) || {};
  const firstBad = health.summary ? health.summary.first_bad : null;
  const chips = STATUSES.filter((s) => counts[s]).map((s) => el('span', {
    class: `count-chip count-${s}`,
    title: `${counts[s]} layer(s) ${s}`,
    style: { borderColor: STATUS_STYLE[s].color },
  }, el('span', { class: 'count-glyph', text: STATUS_STYLE[s].glyph, style: { color: STATUS_STYLE[s].color } }),
  el('b', { text: String(counts[s]) }), ` ${s}`));
  const total = (health.layers || []).length;
  let verdict;
  if (firstBad) {
    verdict = el('span', { class: 'first-bad' }, 'First to go bad: ', el('span', { class: 'mono', text: firstBad.layer }),
      ' ', badge(firstBad.status), firstBad.step === null || firstBad.step === undefined ? '' : ` at step ${firstBad.step}`);
  } else {
    verdict = el('span', { class: 'first-bad ok', text: `All ${total} layers healthy at step ${health.step}.` });
  }
  const order = health.summary && health.summary.order;
  return el('div', { class: 'summary-line', attrs: { 'data-testid': 'summary' } },
    el('span', { class: 'summary-total', text: `${total} layers · step ${health.step ?? '—'}` }),
    chips, verdict, order ? el('span', { class: 'summary-order', title: order, text: 'how ranked?' }) : null);
}
