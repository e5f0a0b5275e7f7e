/**
 * The run selector (tick several runs to compare them side by side), the refresh button and auto-refresh, which
 * polls the `runs` listing and reloads the runs whose last step moved (i.e. that are still training).
 */

import { el, replace } from '../dom.js';
import { count } from '../format.js';

export const AUTO_REFRESH_MS = 15000;

/**
 * @param {import('../model.js').Model} model
 * @param {() => Promise<void>} refresh reloads the listing and the data of changed runs
 */
export function runSelector(model, refresh) {
  const list = el('div', { class: 'run-list', attrs: { 'data-testid': 'run-list' } });
  const refreshBtn = el('button', { class: 'btn', text: '⟳ Refresh', attrs: { 'data-testid': 'refresh' } });
  const auto = el('input', { type: 'checkbox', checked: model.autoRefresh });
  const updated = el('span', { class: 'hint updated' });
  const all = el('button', { class: 'btn btn-quiet', text: 'all' });
  const none = el('button', { class: 'btn btn-quiet', text: 'none' });
  const root = el('div', { class: 'run-bar' }, el('b', { class: 'bar-label', text: 'Runs:' }), list, all, none,
    el('span', { class: 'spacer' }), refreshBtn,
    el('label', { class: 'auto-refresh', title: `poll every ${AUTO_REFRESH_MS / 1000} s for new steps` }, auto, 'auto-refresh'),
    updated);
  let timer = null;

  function choose(runs) {
    model.setSelected(runs);
  }
  all.addEventListener('click', () => choose(model.runs.map((r) => r.run)));
  none.addEventListener('click', () => choose([]));

  async function doRefresh() {
    refreshBtn.disabled = true;
    try {
      await refresh();
    } finally {
      refreshBtn.disabled = false;
    }
  }
  refreshBtn.addEventListener('click', doRefresh);

  function schedule() {
    clearInterval(timer);
    timer = model.autoRefresh ? setInterval(() => {
      if (!document.hidden) doRefresh();
    }, AUTO_REFRESH_MS) : null;
  }
  auto.addEventListener('change', () => {
    model.autoRefresh = auto.checked;
    schedule();
  });

  function draw() {
    const items = model.runs.map((info) => {
      const box = el('input', { type: 'checkbox', checked: model.selected.includes(info.run),
        attrs: { 'data-run': info.run } });
      box.addEventListener('change', () => {
        const chosen = model.runs.map((r) => r.run).filter((r) => (r === info.run ? box.checked : model.selected.includes(r)));
        choose(chosen);
      });
      const steps = info.num_steps ? `${count(info.layers.length)} layers · steps ${info.first_step}–${info.last_step}` : 'no steps';
      return el('label', { class: 'run-item', title: steps }, box, el('span', { class: 'run-name', text: info.run }),
        el('span', { class: 'run-meta', text: steps }),
        model.training.has(info.run) ? el('span', { class: 'training', text: 'training' }) : null,
        info.maybe_downsampled ? el('span', { class: 'run-warn', text: 'sampled', title: 'only some steps loaded' }) : null);
    });
    replace(list, items.length ? items : el('span', { class: 'hint', text: 'none yet' }));
    updated.textContent = model.lastRefresh ? `updated ${model.lastRefresh.toLocaleTimeString()}` : '';
  }

  model.on((what) => {
    if (what === 'runs' || what === 'selection') draw();
  });
  draw();
  schedule();
  return { root };
}
