/**
 * Threshold controls, built generically from the `threshold_spec` the health route returns (name, default,
 * description, min, max, step), so a threshold added to the diagnosis appears here without frontend changes.
 * Changing a value re-queries `health` for every shown run; "reset to defaults" drops every override.
 */

import { debounce, el, replace } from '../dom.js';

/** @param {import('../model.js').Model} model */
export function thresholdPanel(model) {
  const body = el('div', { class: 'threshold-grid' });
  const status = el('span', { class: 'threshold-status' });
  const reset = el('button', { class: 'btn', text: 'Reset to defaults', attrs: { 'data-testid': 'reset-thresholds' } });
  const root = el('details', { class: 'panel thresholds-panel' },
    el('summary', {}, el('b', { text: 'Thresholds' }), ' ', status),
    el('p', { class: 'hint', text: 'Values used by the diagnosis. Change one and every shown run is re-diagnosed; '
      + 'the defaults and their reasons are in docs/DIAGNOSIS.md.' }),
    body, el('div', { class: 'threshold-actions' }, reset));
  const inputs = new Map();
  let builtFor = null;

  const apply = debounce(() => {
    const overrides = {};
    for (const [name, input] of inputs) {
      const spec = model.spec.find((s) => s.name === name);
      if (input.value === '' || !spec) continue;
      if (Number(input.value) !== Number(spec.default)) overrides[name] = input.value;
    }
    model.setOverrides(overrides);
  }, 350);

  reset.addEventListener('click', () => {
    for (const [name, input] of inputs) {
      const spec = model.spec.find((s) => s.name === name);
      if (spec) input.value = String(spec.default);
    }
    model.setOverrides({});
  });

  function build() {
    if (!model.spec || builtFor === model.spec) return;
    builtFor = model.spec;
    inputs.clear();
    const fields = model.spec.map((spec) => {
      const input = el('input', {
        type: 'number', value: String(model.overrides[spec.name] ?? spec.default),
        attrs: { name: spec.name, 'data-threshold': spec.name },
      });
      if (spec.min !== null && spec.min !== undefined) input.min = String(spec.min);
      if (spec.max !== null && spec.max !== undefined) input.max = String(spec.max);
      // Magnitudes edited on a log scale (spec.log) take any value; linear knobs step as the spec says.
      input.step = !spec.log && spec.step !== null && spec.step !== undefined ? String(spec.step) : 'any';
      input.addEventListener('input', apply);
      inputs.set(spec.name, input);
      return el('label', { class: 'threshold-field', title: spec.description || '' },
        el('span', { class: 'threshold-name mono', text: spec.name }), input,
        el('span', { class: 'threshold-desc', text: spec.description || '' }),
        el('span', { class: 'threshold-default', text: `default ${spec.default}` }));
    });
    replace(body, fields);
  }

  function refresh() {
    build();
    const n = Object.keys(model.overrides).length;
    status.textContent = n ? `${n} changed from the defaults` : 'defaults';
    root.classList.toggle('changed', n > 0);
    for (const [name, input] of inputs) {
      input.classList.toggle('changed', name in model.overrides);
    }
    const errors = [...model.errors.values()];
    if (errors.length && n) status.textContent += ` — ${errors[0]}`;
  }

  model.on((what) => {
    if (what === 'health' || what === 'thresholds') refresh();
  });
  refresh();
  return root;
}
