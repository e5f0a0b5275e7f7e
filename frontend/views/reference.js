/**
 * Which horizontal lines to draw on the detail charts. The run-relative lines (vanishing below / exploding above,
 * from the `profile` route's bands at the last step) are what the diagnosis compares each layer with; absolute
 * backstops come from the thresholds in force, recognised by name so that a threshold added later still shows.
 */

const RELATIVE = /decades|factor|window|steps|fraction|persist|count|min_|_min$|growth/;

function kindOf(name) {
  if (RELATIVE.test(name)) return null;
  if (/update/.test(name)) return 'update';
  if (/ratio/.test(name)) return 'ratio';
  if (/noise/.test(name)) return 'noise';
  if (/rms|max_abs|norm|abs/.test(name)) return 'magnitude';
  return null;
}

/**
 * @param {Object<string, number>} thresholds the thresholds in force (series route)
 * @param {{vanishing_below?: number, exploding_above?: number, reference_rms?: number, median_rms?: number}|null} bands
 * @returns {{magnitude: object[], update: object[], ratio: object[], noise: object[]}} lines {value, label, color}:
 *   `update` for the update/weight ratio, `ratio` for the other ratios to the weight (gradient/weight)
 */
export function thresholdLines(thresholds, bands) {
  const out = { magnitude: [], update: [], ratio: [], noise: [] };
  if (bands) {
    if (bands.exploding_above > 0) {
      out.magnitude.push({ value: bands.exploding_above, label: 'exploding above (RMS, now)', color: '#D55E00' });
    }
    if (bands.reference_rms > 0) {
      out.magnitude.push({ value: bands.reference_rms, label: 'reference RMS: layers nearest the loss (now)', color: '#777777' });
    } else if (bands.reference_rms === undefined && bands.median_rms > 0) {
      out.magnitude.push({ value: bands.median_rms, label: 'median layer RMS (now)', color: '#777777' });
    }
    if (bands.vanishing_below > 0) {
      out.magnitude.push({ value: bands.vanishing_below, label: 'vanishing below (RMS, now)', color: '#0072B2' });
    }
  }
  const drawn = out.magnitude.map((line) => line.value);
  for (const [name, value] of Object.entries(thresholds || {})) {
    const kind = kindOf(name);
    if (!kind || !(typeof value === 'number' && value > 0)) continue;
    // The bands already include an absolute backstop when it is the binding one: do not draw it twice.
    if (kind === 'magnitude' && drawn.some((v) => Math.abs(Math.log10(v / value)) < 0.01)) continue;
    const color = /vanish|low|small|tiny/.test(name) ? '#56B4E9' : '#E69F00';
    // Absolute backstops are shown when near the data (reach 1 decade); the run-relative lines reach further.
    out[kind].push({ value, label: name, color, reach: 1 });
  }
  out.update.push({ value: 1e-3, label: 'rule of thumb 1e-3', color: '#777777', reach: 2 });
  return out;
}
