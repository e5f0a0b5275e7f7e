/**
 * The answer for a run: how many layers are in each status and one story of what went wrong, cause first: the layer
 * whose chain began first and what followed ("dense_3: exploding from step 38 → dead from step 44"); then the
 * timeline of the whole run ("exploding from 38 (dense_3 +4) → dead from 44 → nonfinite from 54").
 */

import { el } from '../dom.js';
import { STATUSES, STATUS_STYLE, badge, isFlagged } from '../status.js';
import { statusChain } from './episodes.js';

const known = (x) => x !== null && x !== undefined;

/** `summary.timeline` entries that are problems (an inert parameter is no part of what went wrong). */
export function flaggedTimeline(health) {
  return ((health.summary && health.summary.timeline) || []).filter((t) => isFlagged(t.status));
}

/** "exploding from 38 (dense_3 +4)" for one timeline entry. */
function timelineText(entry) {
  const others = entry.layers > 1 ? ` +${entry.layers - 1}` : '';
  return `${entry.status} from ${entry.step}${entry.layer ? ` (${entry.layer}${others})` : ''}`;
}

function storyLine(health) {
  const timeline = flaggedTimeline(health);
  if (!timeline.length) return null;
  const parts = [];
  if (timeline.length) {
    const chain = statusChain(timeline.map((entry) => [entry.status, timelineText(entry)]));
    parts.push(el('span', { class: 'timeline', attrs: { 'data-testid': 'timeline' },
      title: 'when each status first appeared in the run, on which layer first (+ how many other layers had it)' },
    'Timeline: ', chain));
  }
  return el('div', { class: 'summary-story' }, parts);
}

/** @param {object} health the `health` route answer */
export function summaryLine(health) {
  const counts = (health.summary && health.summary.counts) || {};
  const firstBad = health.summary ? health.summary.first_bad : null;
  const chips = STATUSES.filter((s) => counts[s]).map((s) => el('span', {
    class: `count-chip count-${s}`,
    title: s === 'inert' ? `${counts[s]} parameter(s) receive only round-off gradient (informational, not flagged)`
      : `${counts[s]} layer(s) ${s}`,
    style: { borderColor: STATUS_STYLE[s].color },
  }, el('span', { class: 'count-glyph', text: STATUS_STYLE[s].glyph, style: { color: STATUS_STYLE[s].color } }),
  el('b', { text: String(counts[s]) }), ` ${s}`));
  const total = (health.layers || []).length;
  let verdict;
  const cause = health.summary ? health.summary.cause : null;
  if (firstBad) {
    const story = cause && cause.story ? cause.story.replaceAll(' -> ', ' → ') : null;
    verdict = el('span', { class: 'first-bad onset',
      attrs: { 'data-testid': 'onset', 'data-step': String(cause ? cause.step : firstBad.step) } },
    'First went wrong: ', el('span', { class: 'mono', text: firstBad.layer }), ' ',
    story ? el('b', { text: story }) : badge(firstBad.status),
    story ? [' (now ', badge(firstBad.status), ')'] : (known(firstBad.step) ? ` — in trouble since step ${firstBad.step}` : ''),
    cause && cause.fixes && cause.fixes.length
      ? el('span', { class: 'cause-fix', attrs: { 'data-testid': 'cause-fix' }, text: ` What to do: ${cause.fixes[0]}.` })
      : null);
  } else {
    const inert = counts.inert ? ` (${counts.inert} inert)` : '';
    verdict = el('span', { class: 'first-bad ok', text: `No layer flagged at step ${health.step}${inert}.` });
  }
  const order = health.summary && health.summary.order;
  return el('div', { class: 'summary-line', attrs: { 'data-testid': 'summary' } },
    el('div', { class: 'summary-counts' },
      el('span', { class: 'summary-total', text: `${total} layers · step ${health.step ?? '—'}` }),
      chips, verdict, order ? el('span', { class: 'summary-order', title: order, text: 'how ranked?' }) : null),
    storyLine(health));
}
