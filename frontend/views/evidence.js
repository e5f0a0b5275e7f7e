/**
 * What the writer recorded beside the gradients, as text: a layer's kind and activation ("Dense, activation
 * sigmoid") and the run's training loss with its trend ("Loss -50% from the first to the last quarter of
 * steps 0–29: falling"), the evidence the diagnosis weighed. Both are absent from runs whose writer did not record them.
 */

import { el } from '../dom.js';
import { change, count, magnitude, ratio } from '../format.js';
import { sparkline } from '../charts/sparkline.js';

/** "Dense, activation sigmoid" (or "" when the writer did not record the layer's kind). */
export function kindText(layer) {
  if (!layer || !(layer.kind || layer.activation)) return '';
  return `${layer.kind || 'unknown kind'}${layer.activation ? `, activation ${layer.activation}` : ''}`;
}

function trendWord(trend) {
  if (trend.converged) return 'came down and levelled off';
  if (trend.flat) return 'flat';
  return trend.falls ? 'falling' : 'rising';
}

/** " (last finite 3.1e+03 at step 53, 1.23e+03x its early level)" for `summary.loss_nonfinite`, as the CLI words it. */
function lastFiniteLoss(blowup) {
  if (blowup.last_finite === null || blowup.last_finite === undefined) return '';
  const early = blowup.ratio ? `, ${ratio(blowup.ratio)} its early level` : '';
  return ` (last finite ${magnitude(blowup.last_finite)} at step ${blowup.last_finite_step}${early})`;
}

/** Why the loss's first NaN/Inf step and the gradients' differ, in one clause, as the CLI words it. */
function gradientsLater(blowup) {
  const grads = blowup.gradients_step;
  if (grads === null || grads === undefined || grads === blowup.step) return '';
  if (grads > blowup.step) {
    return `, before the gradients (NaN/Inf from step ${grads}): the forward pass overflowed first, and a loss `
      + 'of Inf can still have finite gradients';
  }
  return `, after the gradients (NaN/Inf from step ${grads})`;
}

/** The run's loss line and trend, or null when no loss was recorded. @param {object} health the `health` answer */
export function lossLine(health) {
  const loss = health.loss;
  if (!loss || !loss.steps || !loss.steps.length) return null;
  const trend = health.summary ? health.summary.loss_trend : null;
  const first = loss.steps[0];
  const last = loss.steps[loss.steps.length - 1];
  const blowup = health.summary ? health.summary.loss_nonfinite : null;
  let text;
  if (trend && trend.episode) {
    text = `Loss ${ratio(trend.episode.ratio)} its level before step ${trend.episode.step}, `
      + `for ${count(trend.episode.since)} logged steps since: not recovered`;
  } else if (trend) {
    text = `Loss ${change(trend.change)} from the first to the last quarter `
      + `of steps ${trend.first_step}–${trend.last_step}: ${trendWord(trend)}`;
  } else if (blowup) {
    text = `Loss NaN/Inf from step ${blowup.step}${lastFiniteLoss(blowup)}${gradientsLater(blowup)}`;
  } else {
    text = `Loss at ${count(loss.steps.length)} logged step(s) ${first}–${last}: too few finite positive values to judge a trend`;
  }
  const latest = loss.values[loss.values.length - 1];
  return el('div', { class: 'loss-trend', attrs: { 'data-testid': 'loss-trend' } },
    el('span', { class: 'loss-text', text }),
    sparkline(loss.values, { width: 160, height: 24, color: '#333333',
      title: `training loss at steps ${first}…${last} (log scale); last ${magnitude(latest)}` }));
}
