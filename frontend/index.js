/**
 * Entry point of the Gradient Health tab. TensorBoard loads this ES module inside the plugin's iframe
 * (`/data/plugin_entry.html?name=gradhealth`, base URL `/data/plugin/gradhealth/`) and calls `render()`;
 * the iframe's document body is ours.
 *
 * Layout: run bar (selection, refresh) · thresholds · table filters · compare strip (several runs) · one panel
 * per selected run (summary, depth profile, ranked table) · the layer detail drawer.
 */

import { clear, el, replace } from './dom.js';
import { Model, timing } from './model.js';
import { compareStrip } from './views/compare.js';
import { detailDrawer } from './views/detail.js';
import { noData, problemsNotice } from './views/empty.js';
import { filterBar } from './views/filters.js';
import { runPanel } from './views/runpanel.js';
import { runSelector } from './views/runs.js';
import { thresholdPanel } from './views/thresholds.js';

function addStylesheet() {
  if (document.querySelector('link[data-gradhealth]')) return;
  const link = el('link', { rel: 'stylesheet', href: './style.css', attrs: { 'data-gradhealth': '1' } });
  document.head.appendChild(link);
}

/** Build the dashboard into the document body. */
export async function render() {
  timing.mark('render');
  addStylesheet();
  const model = new Model();
  const drawer = detailDrawer(model);
  const openDetail = (run, layer) => drawer.show(run, layer);
  const banner = el('div', { class: 'banner' });
  const empty = el('div', { class: 'empty-box' });
  const panels = el('div', { class: 'panels' });
  const byRun = new Map();

  async function refresh() {
    try {
      const changed = await model.loadRuns();
      replace(banner, model.runs.length && model.runsProblems.length ? problemsNotice(model.runsProblems) : null);
      const moved = changed.filter((r) => byRun.has(r));
      for (const run of moved) {
        model.loadHealth(run);
        byRun.get(run).reloadProfile(true);
      }
      if (moved.length) drawer.reload();
    } catch (err) {
      replace(banner, el('div', { class: 'notice notice-error', text: `Could not list runs: ${err.message}` }));
    }
  }

  const selector = runSelector(model, refresh);
  const controls = el('div', { class: 'controls' }, thresholdPanel(model), filterBar(model));
  const page = el('div', { class: 'gradhealth' },
    el('header', { class: 'top' }, el('h1', { text: 'Gradient Health' }),
      el('span', { class: 'tagline', text: 'which layer, since when, how bad — worst first' })),
    selector.root, banner, empty, controls, compareStrip(model), panels, drawer.root);
  clear(document.body);
  document.body.appendChild(page);

  function syncPanels() {
    const wanted = model.selected;
    for (const [run, panel] of byRun) {
      if (!wanted.includes(run)) {
        panel.root.remove();
        byRun.delete(run);
      }
    }
    for (const run of wanted) {
      if (!byRun.has(run)) byRun.set(run, runPanel(model, run, openDetail));
      panels.appendChild(byRun.get(run).root);
    }
    if (model.runs.length && !wanted.length) {
      replace(empty, el('p', { class: 'hint', text: 'Tick one or more runs above to see their layers.' }));
    } else if (model.runs.length) {
      replace(empty);
    }
  }

  model.on((what, run) => {
    if (what === 'runs') {
      if (!model.runs.length) {
        replace(empty, noData(model.runsProblems));
        controls.hidden = true;
      } else {
        controls.hidden = false;
        for (const panel of byRun.values()) panel.drawHead();
      }
      syncPanels();
    } else if (what === 'selection') {
      syncPanels();
    } else if (what === 'health' && byRun.has(run)) {
      byRun.get(run).drawHealth();
    } else if (what === 'view') {
      for (const panel of byRun.values()) panel.drawView();
    } else if (what === 'thresholds') {
      for (const panel of byRun.values()) {
        panel.drawHealth();
        panel.reloadProfile(false);
      }
      drawer.reload();
    }
  });

  await refresh();
  timing.mark('runs-listed');
  await model.loadSelected();
  timing.mark('first-health');
}
