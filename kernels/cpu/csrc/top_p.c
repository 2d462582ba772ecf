#include "ps_cpu.h"

#include <omp.h>
#include <stdlib.h>

/* ---------------------------------------------------------------------------------------------
 * Top-k / top-p (nucleus) sampling distribution without a sort.
 *
 *     out[s, :] = softmax over the kept tokens of logits[s, :], 0 elsewhere;   kept[s] = how many
 *
 * The kept set is vLLM's (and engine/sampler.py's reference, top_k_top_p_sorted): with the logits
 * in ascending order, top-k keeps the values >= the k-th largest; top-p then drops the leading tokens
 * whose cumulative probability (over the top-k set) is <= 1 - p and keeps every value >= the first
 * one it keeps. So the cut is a value:
 *
 *     kth = min { v : #(x <= v) > V - k }                         (k-th largest; ties kept)
 *     s   = min { v : mass(kth <= x <= v) > (1 - p) * mass(x >= kth) }
 *
 * Both are found by a radix select over the logits' order-preserving 32-bit keys, three passes of
 * 11 + 11 + 10 bits: each pass histograms (counts, or exp masses in double) the tokens whose key
 * starts with the prefix found so far, and walks the histogram up to the bucket where the running
 * sum passes the target. Why: numpy's and torch's sorts of 8 x 49,152 logits took 7.8 / 15 ms per
 * step on a 2-core AMD EPYC Zen 4 (27% of an n=8 request's time); this is three linear passes.
 * The masses sum in double where the reference sums float32 probabilities (torch's cumsum
 * accumulates in double too): the sets can differ only at a token whose cumulative probability
 * equals 1 - p to float32 rounding. NaN logits count as the largest (as torch's sort puts them). */

#define PS_TP_B1 11
#define PS_TP_B2 11
#define PS_TP_B3 10

static inline uint32_t ps_tp_key(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u); /* ascending keys for ascending floats */
}

/* The smallest key v with sum(w[i] : key[i] <= v) > target (w = NULL: every weight 1), over the
 * tokens with key >= lo. hist has 1 << 11 doubles. */
static uint32_t ps_tp_select(const uint32_t *keys, const float *w, const int64_t V, const uint32_t lo,
                             double target, double *hist) {
    static const int bits[3] = {PS_TP_B1, PS_TP_B2, PS_TP_B3};
    uint32_t prefix = 0;
    int shift = 32, known = 0; /* bits of the answer found so far */
    for (int level = 0; level < 3; ++level) {
        const int b = bits[level];
        shift -= b;
        const int nb = 1 << b;
        for (int j = 0; j < nb; ++j) hist[j] = 0.0;
        for (int64_t i = 0; i < V; ++i) {
            const uint32_t key = keys[i];
            if (key < lo || (known && (key >> (32 - known)) != prefix)) continue;
            hist[(key >> shift) & (uint32_t)(nb - 1)] += w ? (double)w[i] : 1.0;
        }
        int j = 0;
        double run = 0.0;
        for (; j < nb - 1; ++j) {
            if (run + hist[j] > target) break;
            run += hist[j];
        }
        target -= run;
        prefix = (prefix << b) | (uint32_t)j;
        known += b;
    }
    return prefix;
}

/* One row: keys into `keys`, exp(x - max) of the kept tokens into `out`, then the final scale. */
static int64_t ps_tp_row(const float *restrict x, const int64_t V, const int64_t k, const float p,
                         float *restrict out, uint32_t *restrict keys, double *hist) {
    float m = -INFINITY;
    int any_nan = 0;
    for (int64_t i = 0; i < V; ++i) {
        keys[i] = ps_tp_key(x[i]);
        any_nan |= x[i] != x[i];
        m = x[i] > m ? x[i] : m;
    }
    if (any_nan || m == -INFINITY) return -1; /* the caller keeps the reference for such a row */
    const uint32_t kth = k < V ? ps_tp_select(keys, NULL, V, 0u, (double)(V - k), hist) : 0u;
    double z = 0.0;
    for (int64_t i = 0; i < V; ++i) {
        const float e = (keys[i] >= kth && x[i] != -INFINITY) ? ps_exp(x[i] - m) : 0.0f;
        out[i] = e;
        z += e;
    }
    uint32_t cut = kth;
    if (p < 1.0f) cut = ps_tp_select(keys, out, V, kth, (1.0 - (double)p) * z, hist);
    double kept_mass = 0.0;
    int64_t kept = 0;
    for (int64_t i = 0; i < V; ++i) {
        if (keys[i] >= cut && out[i] > 0.0f) {
            kept_mass += out[i];
            ++kept;
        } else {
            out[i] = 0.0f;
        }
    }
    const float inv = (float)(1.0 / kept_mass);
    for (int64_t i = 0; i < V; ++i) out[i] *= inv;
    return kept;
}

/* logits [S, V] (row stride ld), ks [S] (k >= V: no top-k), ps [S] in (0, 1] -> out [S, V]
 * (contiguous), kept [S] (-1 for a row with a NaN or no finite logit: out undefined there).
 * Returns 0, or 2 when scratch memory could not be had. */
int64_t ps_top_k_top_p(const float *logits, const int64_t S, const int64_t V, const int64_t ld, const int64_t *ks,
                       const float *ps, float *out, int64_t *kept, const int nthreads) {
    const int nt = nthreads < 1 ? 1 : nthreads;
    const size_t per_thread = ((size_t)V * sizeof(uint32_t) + ((size_t)1 << PS_TP_B1) * sizeof(double) + 63) / 64 * 64;
    char *scratch = malloc((size_t)nt * per_thread);
    if (!scratch) return 2;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t s = 0; s < S; ++s) {
        char *mine = scratch + (size_t)omp_get_thread_num() * per_thread;
        double *hist = (double *)mine; /* 8-byte aligned first, then the keys */
        uint32_t *keys = (uint32_t *)(mine + ((size_t)1 << PS_TP_B1) * sizeof(double));
        kept[s] = ps_tp_row(logits + s * ld, V, ks[s], ps[s], out + s * V, keys, hist);
    }
    free(scratch);
    return 0;
}
