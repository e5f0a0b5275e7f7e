/* The record's statistics of float32 values in one read, on the CPU (loaded by tb_gradhealth/_cpustats.py).
 *
 * For each run of values: the smallest and largest (exact, compared as integers that sort as the floats do), the
 * sum and the sum of squares (float32 lanes over a block of BLOCK values, then float64 across blocks), and the count
 * of normal values (exponent bits not zero: neither zero nor subnormal). A run that holds NaN or +-Inf gets NaN for
 * both extremes and nothing else is meaningful: the caller computes such a tensor again by its exact slow path.
 * The same of the difference of two runs (an update), read once and never written; and of a run while it is copied.
 *
 * Every loop over a block works on LANES independent accumulators, so the compiler vectorizes it without
 * reordering any one accumulator's additions (no -ffast-math).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { LANES = 32, BLOCK = 256, FIELDS = 5 };

static inline int32_t bits_of(float v) {
    int32_t b;
    memcpy(&b, &v, sizeof b);
    return b;
}

/* A float's bits as an int32 that orders as the float does (for all but NaN), and back. */
static inline int32_t key_of(int32_t b) { return b ^ (int32_t)((uint32_t)(b >> 31) >> 1); }

static inline float value_of(int32_t k) {
    const int32_t b = key_of(k); /* the map is its own inverse */
    float v;
    memcpy(&v, &b, sizeof v);
    return v;
}

static const int32_t EXPONENT = 0x7f800000;

enum { READ, MINUS, COPY };

/* The statistics of x[0 .. n) into o; with MINUS of x[i] - y[i] (float32, as the frameworks subtract); with COPY of
 * x[i] while writing it to to[i]. Inlined into each caller with `mode` a constant, so each loop is specialised and
 * vectorised. */
static inline __attribute__((always_inline)) void stats_of(const float *restrict x, const float *restrict y,
                                                           float *restrict to, int64_t n,
                                                           int mode, double *o) {
    int32_t lo[LANES], hi[LANES];
    for (int l = 0; l < LANES; l++) {
        lo[l] = INT32_MAX;
        hi[l] = INT32_MIN;
    }
    double sum = 0.0, squares = 0.0;
    int64_t normal = 0, i = 0;
    for (; i + BLOCK <= n; i += BLOCK) {
        float s[LANES] = {0}, q[LANES] = {0};
        int32_t c[LANES] = {0};
        for (int j = 0; j < BLOCK; j += LANES) {
            for (int l = 0; l < LANES; l++) {
                const float v = mode == MINUS ? x[i + j + l] - y[i + j + l] : x[i + j + l];
                if (mode == COPY) to[i + j + l] = v;
                const int32_t b = bits_of(v), k = key_of(b);
                lo[l] = k < lo[l] ? k : lo[l];
                hi[l] = k > hi[l] ? k : hi[l];
                c[l] += (b & EXPONENT) != 0;
                s[l] += v;
                q[l] += v * v;
            }
        }
        for (int l = 0; l < LANES; l++) {
            sum += s[l];
            squares += q[l];
            normal += c[l];
        }
    }
    int32_t mn = INT32_MAX, mx = INT32_MIN;
    for (int l = 0; l < LANES; l++) {
        mn = lo[l] < mn ? lo[l] : mn;
        mx = hi[l] > mx ? hi[l] : mx;
    }
    for (; i < n; i++) {
        const float v = mode == MINUS ? x[i] - y[i] : x[i];
        if (mode == COPY) to[i] = v;
        const int32_t b = bits_of(v), k = key_of(b);
        mn = k < mn ? k : mn;
        mx = k > mx ? k : mx;
        normal += (b & EXPONENT) != 0;
        sum += v;
        squares += (double)v * v;
    }
    if (n == 0) {
        o[0] = INFINITY;
        o[1] = -INFINITY;
    } else if (mx >= key_of(bits_of(INFINITY)) || mn <= key_of(bits_of(-INFINITY))) {
        o[0] = o[1] = NAN;
    } else {
        o[0] = value_of(mn);
        o[1] = value_of(mx);
    }
    o[2] = sum;
    o[3] = squares;
    o[4] = (double)normal;
}

/* out[FIELDS * t + ...] = min, max, sum, sum of squares, normal count of values[t][0 .. sizes[t]). */
void gh_stats(const float *const *values, const int64_t *sizes, int64_t count, double *out) {
    for (int64_t t = 0; t < count; t++) stats_of(values[t], NULL, NULL, sizes[t], READ, out + FIELDS * t);
}

/* The same of the differences firsts[t][i] - seconds[t][i] (an update: the weights before minus after), without
 * writing them. */
void gh_difference_stats(const float *const *firsts, const float *const *seconds, const int64_t *sizes,
                         int64_t count, double *out) {
    for (int64_t t = 0; t < count; t++) stats_of(firsts[t], seconds[t], NULL, sizes[t], MINUS, out + FIELDS * t);
}

/* The same of values[t] while copying them to copies[t] (a snapshot of the weights taken as they are read). */
void gh_copy_stats(const float *const *values, float *const *copies, const int64_t *sizes, int64_t count,
                   double *out) {
    for (int64_t t = 0; t < count; t++) stats_of(values[t], NULL, copies[t], sizes[t], COPY, out + FIELDS * t);
}

/* Each run's histogram: bins[t * width + b] counts its values binned b, read at the sample positions
 * (steps[t][j] + offsets[t]) % sizes[t] for j < samples[t] (offsets below the size, steps reduced modulo it), or
 * at every position where steps[t] is NULL. A value's bin from its magnitude bits by the exponent tables of
 * tb_gradhealth/_core.py: base[e] + 1 + ((bits - edge[e]) >> 31), always below width. */
void gh_bins(const float *const *values, const int64_t *sizes, const int64_t *const *steps, const int64_t *offsets,
             const int64_t *samples, int64_t count, const int32_t *base, const int32_t *edge, int64_t width,
             int64_t *bins) {
    for (int64_t t = 0; t < count; t++) {
        const float *x = values[t];
        const int64_t *s = steps[t];
        const int64_t n = sizes[t], off = offsets[t];
        int64_t *row = bins + width * t;
        for (int64_t j = 0; j < samples[t]; j++) {
            int64_t p = j;
            if (s != NULL) {
                p = s[j] + off;
                p -= p >= n ? n : 0;
            }
            const int32_t b = bits_of(x[p]) & 0x7fffffff, e = b >> 23;
            row[base[e] + 1 + ((b - edge[e]) >> 31)] += 1;
        }
    }
}
