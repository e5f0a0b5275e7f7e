/**
 * Empty states that say what to do: no gradient-health data yet (how to write it), and runs whose steps were
 * sampled down by TensorBoard (the flag that keeps them all).
 */

import { el } from '../dom.js';
import { count } from '../format.js';

const WRITER_EXAMPLE = `# numpy / any framework
from tb_gradhealth import Writer
with Writer("logs/run1") as w:
    w.add_gradients(step, {"dense_1/kernel": grad_array, ...})

# Keras
from tb_gradhealth.keras import GradientHealthCallback
model.fit(x, y, callbacks=[GradientHealthCallback("logs/run1")])

# TF2 custom loop (inside a tf.summary writer's as_default())
import tb_gradhealth.summary as ghs
ghs.gradients(zip(grads, model.trainable_variables), step=step)`;

/** The page shown when no run has gradient-health data. */
export function noData(problems = []) {
  return el('div', { class: 'panel empty-state', attrs: { 'data-testid': 'empty-state' } },
    el('h2', { text: 'No gradient-health data yet' }),
    el('p', { text: 'Record per-layer gradient health while training, into the logdir TensorBoard reads:' }),
    el('pre', { class: 'code', text: WRITER_EXAMPLE }),
    el('p', { text: 'Then press Refresh (or leave auto-refresh on): runs appear here as soon as their first step is written.' }),
    problems.length ? el('div', { class: 'problems' }, el('b', { text: 'Problems reading the logdir:' }),
      el('ul', {}, problems.map((p) => el('li', { text: p })))) : null);
}

/** The notice for a run whose steps TensorBoard sampled down (reservoir sampling keeps 100 tensors per tag
 * with the Rust data server, 10 with the Python loader). */
export function downsampledNotice(run) {
  const kept = run.num_steps;
  const limit = run.sample_limit;
  return el('div', { class: 'notice notice-warn', attrs: { 'data-testid': 'downsampled' } },
    el('b', { text: 'Only some steps are loaded. ' }),
    `TensorBoard kept ${count(kept)} logged steps of this run${limit ? ` (its limit is ${count(limit)})` : ''}, so first-bad `
    + 'steps and trends are approximate. Restart TensorBoard with ',
    el('code', { text: '--samples_per_plugin=gradhealth=0' }), ' to keep every step.');
}

/** Problems the backend reported for a run (corrupt file, unknown record version...), as text. */
export function problemsNotice(problems) {
  if (!problems || !problems.length) return null;
  return el('div', { class: 'notice notice-info' }, el('b', { text: 'Some data could not be read: ' }),
    el('ul', {}, problems.map((p) => el('li', { text: p }))));
}
