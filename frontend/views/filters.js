/**
 * The table toolbar shared by every run panel: status toggles (show only the chosen statuses) and a name filter.
 */

import { debounce, el } from '../dom.js';
import { STATUSES, STATUS_STYLE } from '../status.js';

/** @param {import('../model.js').Model} model */
export function filterBar(model) {
  const toggles = STATUSES.map((status) => {
    const box = el('input', { type: 'checkbox', value: status, attrs: { 'data-status': status } });
    box.addEventListener('change', () => {
      const chosen = new Set(toggles.filter((t) => t.box.checked).map((t) => t.box.value));
      model.setView({ statuses: chosen });
    });
    const label = el('label', { class: 'status-toggle', title: `show only ${status} layers (tick several to combine)` },
      box, el('span', { class: 'count-glyph', text: STATUS_STYLE[status].glyph,
        style: { color: STATUS_STYLE[status].color } }), status);
    return { box, label };
  });
  const name = el('input', {
    type: 'search', class: 'name-filter', placeholder: 'filter layers by name…',
    attrs: { 'aria-label': 'filter layers by name', 'data-testid': 'name-filter' },
  });
  name.addEventListener('input', debounce(() => model.setView({ nameFilter: name.value }), 150));
  const reset = el('button', { class: 'btn btn-quiet', text: 'clear filters' });
  reset.addEventListener('click', () => {
    for (const t of toggles) t.box.checked = false;
    name.value = '';
    model.setView({ statuses: new Set(), nameFilter: '' });
  });
  return el('div', { class: 'filter-bar' }, el('span', { class: 'bar-label', text: 'Show:' }),
    toggles.map((t) => t.label), name, reset);
}
