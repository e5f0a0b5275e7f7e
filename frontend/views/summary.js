/**
 * The answer for a run, in the words the diagnosis chose (`summary.answer`, `summary.timeline`; docs/API.md): how
 * many layers are in each status, the headline ("First to go wrong: dense_3/kernel: exploding since step 38,
 * nonfinite since step 54") with the first thing to do, then the timeline, each entry with its label
 * ("first to go wrong", "first layer to reach nonfinite"), and the episodes that began before the cause's chain
 * ("earlier, recovered").
 * Nothing here decides which layer was first: the answer and the timeline say so, and every view prints them.
 */

import { el } from '../dom.js';
import { count } from '../format.js';
import { STATUSES, STATUS_STYLE, isFlagged } from '../status.js';
import { statusChain } from './episodes.js';

/** The run's answer (`summary.answer`), or null when no layer is flagged. */
export function answerOf(health) {
  return (health && health.summary && health.summary.answer) || null;
}

/** `summary.timeline` entries that are problems (an inert parameter is no part of what went wrong). */
export function flaggedTimeline(health) {
  return ((health.summary && health.summary.timeline) || []).filter((t) => isFlagged(t.status));
}

/** One timeline entry as nodes: "exploding from 38 — first to go wrong: dense_3/kernel (+4 other layers)". */
function entryContent(entry) {
  const others = entry.layers > 1 ? ` (+${count(entry.layers - 1)} other layer${entry.layers > 2 ? 's' : ''})` : '';
  return [`${entry.status} from ${entry.step}`,
    entry.layer ? [' — ', el('span', { class: 'timeline-label', text: `${entry.label}: ` }),
      el('span', { class: 'mono', text: entry.layer }), others] : ''];
}

/** A labelled chain of timeline entries (`data-testid` names it for tests), or null when it is empty. */
function chainLine(entries, title, testid, tip) {
  if (!entries.length) return null;
  const chain = statusChain(entries.map((e) => [e.status, entryContent(e), { 'data-layer': e.layer || '', 'data-step': String(e.step) }]));
  return el('span', { class: 'timeline', title: tip, attrs: { 'data-testid': testid } }, el('b', { text: `${title}: ` }), chain);
}

function storyLine(health) {
  const earlier = ((health.summary && health.summary.earlier) || []).filter((t) => isFlagged(t.status));
  const parts = [
    chainLine(flaggedTimeline(health), 'Timeline', 'timeline',
      'when each status first appeared in the run, on which layer first (+ how many other layers ever had it)'),
    chainLine(earlier, 'Earlier', 'earlier', 'episodes that began before the cause\'s chain of trouble began'),
  ].filter(Boolean);
  return parts.length ? el('div', { class: 'summary-story' }, parts) : null;
}

/** The headline text, the layer name set in monospace when the headline starts with it. */
function headlineText(answer) {
  const text = answer.headline;
  const lead = `${answer.layer}:`;
  if (!text.startsWith(lead)) return el('span', { class: 'headline-text', text });
  return el('span', { class: 'headline-text' }, el('span', { class: 'mono', text: answer.layer }), text.slice(answer.layer.length));
}

/** "First to go wrong: LAYER: exploding since step 31, nonfinite since step 54", the chain when the headline skips
 * a status, and the first fix. */
function headline(answer) {
  const story = answer.chain && answer.chain.length > 2 && answer.story ? answer.story.replaceAll(' -> ', ' → ') : null;
  return el('div', { class: 'headline', attrs: { 'data-testid': 'headline', 'data-layer': answer.layer, 'data-step': String(answer.step) } },
    el('b', { class: 'headline-label', text: 'First to go wrong: ' }), headlineText(answer),
    story ? el('span', { class: 'headline-story hint', text: ` (${story})` }) : null,
    answer.fixes && answer.fixes.length
      ? el('div', { class: 'cause-fix', attrs: { 'data-testid': 'cause-fix' } }, el('b', { text: 'What to do: ' }), answer.fixes[0])
      : null);
}

/** @param {object} health the `health` route answer */
export function summaryLine(health) {
  const counts = (health.summary && health.summary.counts) || {};
  const chips = STATUSES.filter((s) => counts[s]).map((s) => el('span', {
    class: `count-chip count-${s}`,
    title: s === 'inert' ? `${count(counts[s])} parameter(s) receive only round-off gradient (informational, not flagged)`
      : s === 'frozen' ? `${count(counts[s])} parameter(s) frozen by the user (no gradient by choice; not flagged)`
        : `${count(counts[s])} layer(s) ${s}`,
    style: { borderColor: STATUS_STYLE[s].color },
  }, el('span', { class: 'count-glyph', text: STATUS_STYLE[s].glyph, style: { color: STATUS_STYLE[s].color } }),
  el('b', { text: count(counts[s]) }), ` ${s}`));
  const total = (health.layers || []).length;
  const answer = answerOf(health);
  let verdict = null;
  if (!answer) {
    const quiet = ['inert', 'frozen'].filter((s) => counts[s]).map((s) => `${count(counts[s])} ${s}`).join(', ');
    verdict = el('span', { class: 'first-bad ok', text: `No layer flagged at step ${health.step}${quiet ? ` (${quiet})` : ''}.` });
  }
  return el('div', { class: 'summary-line', attrs: { 'data-testid': 'summary' } },
    el('div', { class: 'summary-counts' },
      el('span', { class: 'summary-total', text: `${count(total)} layers · step ${health.step ?? '—'}` }), chips, verdict),
    answer ? headline(answer) : null,
    storyLine(health));
}
