/**
 * One run's section of the page: header (steps, notices), summary line (and the loss trend where it was recorded),
 * depth profile, the forward depth profile where the layers' outputs were recorded, and the ranked table.
 * Several panels stack when several runs are selected, sharing the table's sort and filter.
 */

import { el, replace } from '../dom.js';
import { count } from '../format.js';
import { afterPaint, timing } from '../model.js';
import { downsampledNotice, problemsNotice } from './empty.js';
import { lossLine } from './evidence.js';
import { forwardProfile } from './forward.js';
import { originBox } from './origin.js';
import { profileView } from './profile.js';
import { summaryLine } from './summary.js';
import { layerTable } from './table.js';

/**
 * @param {import('../model.js').Model} model
 * @param {string} run
 * @param {(run: string, layer: string) => void} openDetail
 */
export function runPanel(model, run, openDetail) {
  const onSelect = (layer) => openDetail(run, layer);
  const title = el('h2', { class: 'run-title' }, el('span', { class: 'run-name', text: run }));
  const meta = el('span', { class: 'run-meta' });
  const notices = el('div', { class: 'notices' });
  const summary = el('div', { class: 'summary-box' }, el('span', { class: 'loading', text: 'diagnosing…' }));
  const origin = originBox(run); // where the first NaN/Inf was made, when it was replayed
  const profile = profileView(model, run, onSelect);
  const table = layerTable(model, onSelect);
  const profileBox = el('details', { class: 'profile-box', open: true }, el('summary', { text: 'Depth profile' }), profile.root);
  const forwardBox = el('div', { class: 'forward-holder' });
  const root = el('section', { class: 'panel run-panel', attrs: { 'data-run': run } },
    el('div', { class: 'run-head' }, title, meta), notices, origin.root, summary, profileBox, forwardBox, table.root);

  function drawHead() {
    const info = model.runInfo(run);
    if (!info) return;
    meta.textContent = `${count(info.layers.length)} layers · ${count(info.num_steps)} logged steps (${info.first_step}–${info.last_step})`;
    replace(notices, info.maybe_downsampled ? downsampledNotice(info) : null, problemsNotice(info.problems));
    origin.reload();
  }

  function drawHealth() {
    const error = model.errors.get(run);
    table.root.hidden = Boolean(error);
    if (error) {
      // no stale table under an error: the rows would not match the thresholds shown
      replace(summary, el('div', { class: 'notice notice-error', text: `Diagnosis failed: ${error}` }));
      return;
    }
    const health = model.health.get(run);
    if (!health) {
      replace(summary, el('span', { class: 'loading', text: 'diagnosing…' }));
      return;
    }
    replace(summary, summaryLine(health), lossLine(health));
    replace(forwardBox, forwardProfile(health));
    table.update(health);
    const arrived = health.__arrived;
    afterPaint().then(() => {
      if (model.health.get(run) !== health) return;
      timing.tti[run] = performance.now() - arrived;
      timing.mark(`interactive:${run}`);
    });
  }

  drawHead();
  drawHealth();
  profile.reload();
  return {
    root,
    run,
    drawHead,
    drawHealth,
    /** sort/filter changed */
    drawView() {
      if (model.health.get(run)) table.update();
    },
    reloadProfile(followLatest) {
      profile.reload(followLatest);
    },
  };
}
