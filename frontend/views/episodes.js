/**
 * A layer's episodes (`episodes` in the health answer: chronological `{status, from, to}`, inclusive logged steps,
 * healthy stretches left out) as text and as a compact chain of status glyphs, shared by the table's "since" cell
 * and the detail panel; and chains of statuses in general (the run's timeline).
 */

import { el } from '../dom.js';
import { STATUS_STYLE } from '../status.js';

/** The layer's episodes, or [] when the answer has none. */
export function episodesOf(layer) {
  return (layer && Array.isArray(layer.episodes)) ? layer.episodes : [];
}

/** "exploding 38–43" (one step: "dead 44"). */
export function episodeText(ep) {
  return `${ep.status} ${ep.from === ep.to ? ep.from : `${ep.from}–${ep.to}`}`;
}

/** "exploding 38–43 → dead 44–53 → nonfinite 54–99", or '' without episodes. */
export function chainText(layer) {
  return episodesOf(layer).map(episodeText).join(' → ');
}

/** The chain as status glyphs in their colours (▲■✖), for a table cell; null for fewer than two episodes. */
export function chainGlyphs(layer) {
  const episodes = episodesOf(layer);
  if (episodes.length < 2) return null;
  return el('span', { class: 'episode-chain', attrs: { 'data-episodes': String(episodes.length), 'aria-hidden': 'true' } },
    episodes.map((ep) => {
      const style = STATUS_STYLE[ep.status] || { color: '#999999', glyph: '·' };
      return el('span', { text: style.glyph, style: { color: style.color } });
    }));
}

/** A status glyph in its colour, then `content` (text or nodes); `attrs` are added to the mark. */
function statusMark(status, content, attrs = {}) {
  const style = STATUS_STYLE[status] || { color: '#999999', glyph: '·' };
  return el('span', { class: `status-mark status-mark-${status}`, attrs: { ...attrs, 'data-status': status } },
    el('span', { class: 'count-glyph', text: style.glyph, style: { color: style.color }, attrs: { 'aria-hidden': 'true' } }),
    content);
}

/**
 * `[[status, content, attrs?], ...]` as status marks joined by arrows ("▲ exploding from 38 → ■ dead from 44");
 * `content` is text or nodes, `attrs` extra attributes of the mark (e.g. the layer it names).
 */
export function statusChain(items) {
  const out = [];
  items.forEach(([status, content, attrs], i) => {
    if (i) out.push(el('span', { class: 'chain-arrow', text: ' → ' }));
    out.push(statusMark(status, content, attrs));
  });
  return out;
}
