/**
 * The depth profile of one run: one bar per layer in network order at a chosen step (the classic
 * vanishing-gradient picture: bars shrinking towards the input), the healthy band drawn, and a step slider.
 */

import { debounce, el, replace } from '../dom.js';
import { depthBars } from '../charts/bars.js';
import { api } from '../model.js';

/**
 * @param {import('../model.js').Model} model
 * @param {string} run
 * @param {(layer: string) => void} onSelect
 */
export function profileView(model, run, onSelect) {
  const chartBox = el('div', { class: 'profile-chart', attrs: { 'data-testid': 'profile' } });
  const slider = el('input', { type: 'range', min: '0', max: '0', value: '0', class: 'step-slider',
    attrs: { 'aria-label': 'step of the depth profile' } });
  const stepLabel = el('span', { class: 'step-label mono', text: '' });
  const keySelect = el('select', { attrs: { 'aria-label': 'magnitude' } },
    el('option', { value: 'rms', text: 'RMS' }), el('option', { value: 'max_abs', text: 'max |g|' }),
    el('option', { value: 'norm', text: 'norm' }));
  // the step the profile opens at (chosen by the server: the last step where every layer's values are finite)
  const latest = el('button', { class: 'btn btn-quiet', text: 'last finite step',
    title: 'back to the step the profile opens at: the last logged step where every layer has finite values' });
  const root = el('div', { class: 'profile' },
    el('div', { class: 'profile-controls' },
      el('span', { class: 'hint', text: 'one bar per layer, input → output, log scale of' }),
      keySelect, el('span', { class: 'spacer' }), 'step ', slider, stepLabel, latest),
    chartBox);
  let data = null;
  let request = 0;

  function draw() {
    if (!data) return;
    replace(chartBox, depthBars({ layers: data.layers || [], key: keySelect.value, bands: data.bands || {}, onSelect }));
  }

  async function load(step) {
    request += 1;
    const mine = request;
    try {
      const body = await api('profile', { run, step, ...model.thresholdParams() });
      if (mine !== request) return;
      data = body;
      const steps = body.steps || [];
      slider.max = String(Math.max(0, steps.length - 1));
      const i = steps.indexOf(body.step);
      slider.value = String(i < 0 ? steps.length - 1 : i);
      stepLabel.textContent = String(body.step);
      chartBox.dataset.step = String(body.step);  // the step drawn (the label follows the slider at once)
      draw();
    } catch (err) {
      if (mine !== request) return;
      replace(chartBox, el('div', { class: 'notice notice-error', text: `Depth profile: ${err.message}` }));
    }
  }

  const onSlide = debounce(() => {
    const steps = (data && data.steps) || [];
    const step = steps[Number(slider.value)];
    if (step !== undefined) load(step);
  }, 120);
  slider.addEventListener('input', () => {
    const steps = (data && data.steps) || [];
    stepLabel.textContent = String(steps[Number(slider.value)] ?? '');
    onSlide();
  });
  keySelect.addEventListener('change', draw);
  latest.addEventListener('click', () => load(undefined));

  return {
    root,
    /** Reload at the current step (or the latest when following the run). */
    reload(followLatest = false) {
      const steps = (data && data.steps) || [];
      const atEnd = !data || Number(slider.value) >= steps.length - 1;
      load(followLatest && atEnd ? undefined : data ? data.step : undefined);
    },
  };
}
