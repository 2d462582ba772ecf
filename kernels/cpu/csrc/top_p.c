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

/* ---------------------------------------------------------------------------------------------
 * The exponential race: one draw per row from probs (>= 0, any scale), token = argmax p[i] / E[i]
 * over p[i] > 0, E[i] ~ Exp(1) independent, which picks i with probability p[i] / sum(p).
 *
 * E[i] = -log(u[i]), u[i] in (0, 1) from a counter-based hash of (the row's seed, i): the noise of a
 * token depends on its id and the seed alone, not on which other tokens are kept, and costs no
 * generator state. Why here: torch's nonzero over the kept tokens plus numpy's exponentials for
 * them took ~0.37 ms a row at SmolLM2's 49,152 tokens (2-core AMD EPYC Zen 4), ~3 ms a step for
 * n=8; this is one vectorised pass. u has 23 bits, so E >= 6e-8: a token can gain at most ~1e-7
 * of probability from the rounding. kernels/sampling.py's race_torch is the same draw in torch. */
static inline uint32_t ps_hash32(uint32_t x) { /* "lowbias32", C. Wellons: full avalanche */
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

static inline uint64_t ps_splitmix64(uint64_t z) { /* splitmix64's output function */
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* u for token i of a row seeded (s0, s1): the high 23 bits of two hash rounds, centred in (0, 1)
 * (23 so that the + 0.5 is exact in float32 and u stays below 1). */
static inline float ps_race_uniform(uint32_t i, uint32_t s0, uint32_t s1) {
    const uint32_t h = ps_hash32(ps_hash32(i ^ s0) + s1);
    return ((float)(h >> 9) + 0.5f) * 0x1p-23f;
}

/* -log(u) for u in (0, 1): u = 2^e m with m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(t), t = (m-1)/(m+1),
 * |t| < 0.172, by its series to t^9 (relative error < 1e-7); branch-free, so the loop vectorises. */
static inline float ps_neglog(float u) {
    uint32_t b;
    memcpy(&b, &u, 4);
    const uint32_t big = (b & 0x7fffffu) > 0x3504f3u; /* mantissa above sqrt(2): use m / 2 */
    const int32_t e = (int32_t)(b >> 23) - 127 + (int32_t)big;
    const uint32_t mb = (b & 0x7fffffu) | (big ? 0x3f000000u : 0x3f800000u);
    float m;
    memcpy(&m, &mb, 4);
    const float t = (m - 1.0f) / (m + 1.0f), t2 = t * t;
    const float series = 1.0f + t2 * (1.0f / 3.0f + t2 * (1.0f / 5.0f + t2 * (1.0f / 7.0f + t2 * (1.0f / 9.0f))));
    return -((float)e * 0.69314718055994531f + 2.0f * t * series);
}

#ifdef PS_AVX512
/* The same, 16 tokens at a time (the scalar functions above, lane by lane). */
static inline __m512i ps_hash32x16(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int32_t)0x846ca68bu));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

static inline __m512 ps_neglog16(__m512 u) {
    const __m512i b = _mm512_castps_si512(u), mant = _mm512_and_si512(b, _mm512_set1_epi32(0x7fffff));
    const __mmask16 big = _mm512_cmpgt_epi32_mask(mant, _mm512_set1_epi32(0x3504f3));
    __m512i e = _mm512_sub_epi32(_mm512_srli_epi32(b, 23), _mm512_set1_epi32(127));
    e = _mm512_mask_add_epi32(e, big, e, _mm512_set1_epi32(1));
    const __m512 m = _mm512_castsi512_ps(_mm512_or_si512(
        mant, _mm512_mask_blend_epi32(big, _mm512_set1_epi32(0x3f800000), _mm512_set1_epi32(0x3f000000))));
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 t = _mm512_div_ps(_mm512_sub_ps(m, one), _mm512_add_ps(m, one)), t2 = _mm512_mul_ps(t, t);
    __m512 series = _mm512_fmadd_ps(t2, _mm512_set1_ps(1.0f / 9.0f), _mm512_set1_ps(1.0f / 7.0f));
    series = _mm512_fmadd_ps(t2, series, _mm512_set1_ps(1.0f / 5.0f));
    series = _mm512_fmadd_ps(t2, series, _mm512_set1_ps(1.0f / 3.0f));
    series = _mm512_fmadd_ps(t2, series, one);
    const __m512 lg = _mm512_fmadd_ps(_mm512_cvtepi32_ps(e), _mm512_set1_ps(0.69314718055994531f),
                                      _mm512_mul_ps(_mm512_add_ps(t, t), series));
    return _mm512_sub_ps(_mm512_setzero_ps(), lg);
}
#endif

/* The winner of one row, or -1 when no p is > 0 (all zero or NaN): the first maximal ratio. */
static int64_t ps_race_row(const float *p, const int64_t V, uint64_t seed) {
    seed = ps_splitmix64(seed); /* nearby seeds (0, 1, 2 ...) get unrelated keys */
    const uint32_t s0 = (uint32_t)seed, s1 = (uint32_t)(seed >> 32);
    float best = 0.0f;
    int64_t winner = -1, i = 0;
#ifdef PS_AVX512
    /* per lane: its best ratio and where (the first such); lanes then agree on the first overall */
    __m512 vbest = _mm512_setzero_ps();
    __m512i vidx = _mm512_set1_epi32(-1), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 half = _mm512_set1_ps(0.5f), scale = _mm512_set1_ps(0x1p-23f);
    for (; i < V; i += 16, idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16))) {
        const __mmask16 in = V - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (V - i)) - 1u);
        const __m512i h = ps_hash32x16(_mm512_add_epi32(
            ps_hash32x16(_mm512_xor_si512(idx, _mm512_set1_epi32((int32_t)s0))), _mm512_set1_epi32((int32_t)s1)));
        const __m512 u = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepu32_ps(_mm512_srli_epi32(h, 9)), half), scale);
        const __m512 pv = _mm512_maskz_loadu_ps(in, p + i);
        const __m512 r = _mm512_div_ps(pv, ps_neglog16(u));
        const __mmask16 better = _mm512_cmp_ps_mask(pv, _mm512_setzero_ps(), _CMP_GT_OQ) &
                                 _mm512_cmp_ps_mask(r, vbest, _CMP_GT_OQ);
        vbest = _mm512_mask_mov_ps(vbest, better, r);
        vidx = _mm512_mask_mov_epi32(vidx, better, idx);
    }
    best = _mm512_reduce_max_ps(vbest);
    if (best > 0.0f) {
        const __mmask16 top = _mm512_cmp_ps_mask(vbest, _mm512_set1_ps(best), _CMP_EQ_OQ);
        winner = (int64_t)_mm512_mask_reduce_min_epu32(top, vidx);
    }
#else
    for (; i < V; ++i) {
        const float pi = p[i];
        if (!(pi > 0.0f)) continue;
        const float r = pi / ps_neglog(ps_race_uniform((uint32_t)i, s0, s1));
        if (r > best) {
            best = r;
            winner = i;
        }
    }
#endif
    return winner;
}

/* probs [S, V] (row stride ld), seeds [S] -> tokens [S] (-1 where a row has no p > 0). */
void ps_race(const float *probs, const int64_t S, const int64_t V, const int64_t ld, const int64_t *seeds,
             int64_t *tokens, const int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads < 1 ? 1 : nthreads) if (S > 1)
    for (int64_t s = 0; s < S; ++s) tokens[s] = ps_race_row(probs + s * ld, V, (uint64_t)seeds[s]);
}
