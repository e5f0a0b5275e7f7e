/**
 * How the tab prints numbers, one rule per kind of number, the same rules as `tb-gradhealth report` (docs/API.md,
 * "Printing numbers"), so a number read in the tab and in the terminal is the same text:
 *
 * - counts (NaN/Inf elements, sizes, layers): the exact integer with thousands separators, `1,024`;
 * - severity: rounded to an integer (half to even, as Python's `round`), with thousands separators, `6,052`;
 * - magnitudes (RMS, max |g|, norm, ratios): 3 significant figures in Python's `%.3g` form, `1.23e-05`, `0.0118`;
 * - a relative change (the loss's trend): a signed percentage up to 10x either way, `+38%`, `-62%`, beyond it the
 *   factor, `x7.1e19`, `x0.0012`.
 *
 * Unknown values (null, undefined, NaN) print as `—`, never as 0.
 */

export const UNKNOWN = '—';

const unknown = (x) => x === null || x === undefined || Number.isNaN(x);

/** Round half to even (Python's `round`), so 6050.5 prints as 6,050 here and in the CLI. */
function roundHalfEven(x) {
  const floor = Math.floor(x);
  const diff = x - floor;
  if (diff > 0.5) return floor + 1;
  if (diff < 0.5) return floor;
  return floor % 2 === 0 ? floor : floor + 1;
}

/** Group an integer's digits by thousands: 1234567 -> "1,234,567" (no locale dependence). */
function grouped(n) {
  const sign = n < 0 ? '-' : '';
  const digits = BigInt(Math.abs(n)).toString();
  return sign + digits.replace(/\B(?=(\d{3})+(?!\d))/g, ',');
}

/** An exact count: 1024 -> "1,024". A non-integer (an estimate) is rounded to the nearest integer. */
export function count(x) {
  if (unknown(x)) return UNKNOWN;
  if (!Number.isFinite(x)) return x > 0 ? '+inf' : '-inf';
  return grouped(roundHalfEven(x));
}

/** A severity: 6052.0 -> "6,052". */
export function severity(x) {
  return count(x);
}

/**
 * A magnitude with `digits` significant figures, exactly as Python's `format(x, '.3g')`: exponent form (two-digit
 * exponent with its sign) when the decimal exponent is below -4 or at least `digits`, trailing zeros dropped.
 */
export function magnitude(x, digits = 3) {
  if (unknown(x)) return UNKNOWN;
  if (x === Infinity) return '+inf';
  if (x === -Infinity) return '-inf';
  if (x === 0) return '0';
  const [mantissa, exp] = x.toExponential(digits - 1).split('e');
  const e = Number(exp);
  const trim = (s) => (s.includes('.') ? s.replace(/0+$/, '').replace(/\.$/, '') : s);
  if (e < -4 || e >= digits) {
    const abs = Math.abs(e);
    return `${trim(mantissa)}e${e < 0 ? '-' : '+'}${abs < 10 ? '0' : ''}${abs}`;
  }
  return trim(x.toFixed(Math.max(digits - 1 - e, 0)));
}

/** A step number as text (steps are exact: never abbreviated), `—` when unknown. */
export function step(x) {
  return unknown(x) ? UNKNOWN : String(x);
}

/** Beyond this factor either way a change prints as a factor, not a percentage. */
const FACTOR_BEYOND = 10;

/**
 * A ratio of a quantity to its earlier level: "x1.03", "x2.41", "x0.51" (3 significant figures below 10), "x12",
 * "x340", and in powers of ten from 10,000 (and below 0.001): "x7.1e19", "x1.2e-5".
 */
export function ratio(x) {
  if (unknown(x) || !Number.isFinite(x)) return UNKNOWN;
  if (Math.abs(x) >= 1e-3 && Math.abs(x) < 1e4) return `x${Number(x.toPrecision(Math.abs(x) < 10 ? 3 : 2))}`;
  const [mantissa, exp] = x.toExponential(1).split('e');
  return `x${mantissa.replace(/\.0$/, '')}e${Number(exp)}`;
}

/** A relative change `new / old - 1`: "+38%", "-62%", "0%"; beyond 10x either way "x12", "x7.1e19", "x0.0012". */
export function change(x) {
  if (unknown(x) || !Number.isFinite(x)) return UNKNOWN;
  const r = 1 + x;
  if (r > FACTOR_BEYOND || (r > 0 && r < 1 / FACTOR_BEYOND)) return ratio(r);
  const pct = Math.round(100 * x);
  if (pct === 0) return '0%';
  return `${pct > 0 ? '+' : '-'}${grouped(Math.abs(pct))}%`;
}
