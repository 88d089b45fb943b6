/* The Top-p working set of rows of attention weights, GrowPage's demand metric (Eq. 2/7;
   engine/kernels/top_p.py has the definition, its torch form `top_p_counts_torch`, which this
   equals): per row of n weights, K = min { k : the k largest sum to at least p x the row's
   total }, at least 1 and at most n.

   How: no sort. The weights are non-negative, and non-negative floats order as their bit
   patterns, so a bisection over the 31 bits finds the K-th largest weight v exactly: the largest
   threshold whose weights at or above it still reach the target, each step one vectorised pass
   summing the weights at or above the candidate. K is then the count above v plus the weights
   equal to v added one at a time until the target is met. The sums are in double, as the
   torch form's float64 prefix sums, in another order, so a K can differ only where a prefix
   sum lands within rounding of p x total (p = 1, where the answer is that rounding). One row
   per OpenMP iteration. */

#include <stdint.h>
#include <string.h>

#include "kvarena_native.h"

static inline uint32_t bits_of(float v) {
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    return b;
}

static inline float float_of(uint32_t b) {
    float v;
    memcpy(&v, &b, sizeof v);
    return v;
}

/* The sum of the weights at or above v, in double (one vector pass). */
static inline double mass_from(const float *row, int64_t n, float v) {
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += row[i] >= v ? (double)row[i] : 0.0;
    return s;
}

/* K of one row. */
static int64_t row_count(const float *row, int64_t n, double p) {
    double total = 0.0;
    float top = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        total += row[i];
        top = row[i] > top ? row[i] : top;
    }
    const double target = p * total;
    if (!(target > 0.0)) return 1;
    /* the largest threshold v whose weights at or above it reach the target: non-negative
       floats order as their bit patterns, so a bisection over those finds it exactly */
    uint32_t lo = 0, hi = bits_of(top);
    while (lo < hi) {
        const uint32_t mid = lo + (hi - lo + 1) / 2;
        if (mass_from(row, n, float_of(mid)) >= target)
            lo = mid;
        else
            hi = mid - 1;
    }
    const float v = float_of(lo);
    /* every weight above v is needed; then weights equal to v, one at a time */
    double mass = 0.0;
    int64_t above = 0, equal = 0;
    for (int64_t i = 0; i < n; i++) {
        if (row[i] > v) {
            mass += row[i];
            above++;
        } else if (row[i] == v) {
            equal++;
        }
    }
    int64_t taken = 0;
    while (taken < equal && mass < target) {
        mass += v;
        taken++;
    }
    const int64_t k = above + taken;
    return k < 1 ? 1 : (k > n ? n : k);
}

int kv_top_p_counts(const float *probs, int64_t rows, int64_t n, double p, int64_t *out) {
    if (rows < 0 || n < 1) return KV_BAD_SHAPE;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = row_count(probs + r * n, n, p);
    return KV_OK;
}
