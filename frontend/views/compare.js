/**
 * The compare strip, shown when several runs are selected: one line per run with its status counts and its answer's
 * headline (the first layer to go wrong, since when, and its status now), so runs can be compared at a glance before
 * reading their tables. A click on a run name scrolls to its panel.
 */

import { el, replace } from '../dom.js';
import { count } from '../format.js';
import { STATUSES, STATUS_STYLE, badge, isFlagged } from '../status.js';
import { answerOf } from './summary.js';

/** @param {import('../model.js').Model} model */
export function compareStrip(model) {
  const root = el('div', { class: 'panel compare', hidden: true, attrs: { 'data-testid': 'compare' } });

  function draw() {
    const runs = model.selected.filter((r) => model.health.has(r));
    root.hidden = model.selected.length < 2 || !runs.length;
    if (root.hidden) return;
    const head = el('tr', {}, el('th', { text: 'Run' }), el('th', { class: 'num', text: 'Step' }),
      STATUSES.map((s) => el('th', { class: 'num', title: s },
        el('span', { text: STATUS_STYLE[s].glyph, style: { color: STATUS_STYLE[s].color } }), ` ${s}`)),
      el('th', { text: 'First to go wrong' }));
    const body = runs.map((run) => {
      const h = model.health.get(run);
      const counts = (h.summary && h.summary.counts) || {};
      const answer = answerOf(h);
      const link = el('a', { href: '#', class: 'run-link', text: run });
      link.addEventListener('click', (event) => {
        event.preventDefault();
        const target = document.querySelector(`section.run-panel[data-run="${CSS.escape(run)}"]`);
        if (target) target.scrollIntoView({ behavior: 'smooth', block: 'start' });
      });
      return el('tr', { attrs: { 'data-run': run } }, el('td', {}, link), el('td', { class: 'num', text: String(h.step ?? '—') }),
        STATUSES.map((s) => el('td', { class: `num${counts[s] && isFlagged(s) ? ' bad-count' : ''}`,
          text: counts[s] ? count(counts[s]) : '·' })),
        el('td', { class: 'compare-answer', attrs: { 'data-layer': answer ? answer.layer : '' } },
          answer ? [badge(answer.now), ' ', el('span', { text: answer.headline })] : 'nothing flagged'));
    });
    replace(root, el('table', { class: 'compare-table' }, el('thead', {}, head), el('tbody', {}, body)));
  }

  model.on((what) => {
    if (what === 'health' || what === 'selection' || what === 'thresholds') draw();
  });
  return root;
}
