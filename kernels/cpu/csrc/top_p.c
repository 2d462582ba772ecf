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
#define PS_TP_COPIES 4

static inline uint32_t ps_tp_key(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u); /* ascending keys for ascending floats */
}

#ifdef PS_AVX512
/* Lanes i .. i+15 that fall inside a row of V. */
static inline __mmask16 ps_tp_tail(int64_t V, int64_t i) {
    return V - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (V - i)) - 1u);
}
#elif defined(PS_AVX2)
/* AVX2: 8 tokens at a time over V rounded down to 8, the scalar code for the rest. Unsigned 32-bit
 * compares through signed ones on keys with the top bit flipped. 8 rows of 49,152 logits on a 2-core
 * AMD EPYC Zen 3 (benchmarks/cpu_kernels.py --cases sampling, before -> after): top-p 0.95 filter
 * 3.2-3.3 -> 1.1 ms, race 0.68-0.70 -> 0.35 ms; n = 8 requests did not move measurably (~1 ms of a
 * ~100 ms step); 64 rows (in-process A/B, /tmp harness): filter 23.5 -> 7.6 ms, race 5.4 -> 2.8 ms a step. */
static inline __m256i ps_tp_flip(__m256i k) { return _mm256_xor_si256(k, _mm256_set1_epi32((int32_t)0x80000000u)); }

static inline __m256i ps_tp_geu(__m256i a, __m256i b) { /* a >= b, unsigned, lane-wise (all ones) */
    return _mm256_xor_si256(_mm256_cmpgt_epi32(ps_tp_flip(b), ps_tp_flip(a)), _mm256_set1_epi32(-1));
}

static inline __m256d ps_tp_sum4_pd(__m256d acc, __m256 v) { /* acc + the 8 floats of v, in double */
    acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    return _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

static inline double ps_tp_hadd_pd(__m256d v) {
    double d[4];
    _mm256_storeu_pd(d, v);
    return (d[0] + d[1]) + (d[2] + d[3]);
}
#endif

/* Token i into histogram copy i % PS_TP_COPIES, at its bucket (of nb) for the bits below `shift`. */
static inline void ps_tp_count(double *hist, const int nb, const int shift, const uint32_t *keys, const float *w,
                               const int64_t i) {
    hist[(i % PS_TP_COPIES) * nb + ((keys[i] >> shift) & (uint32_t)(nb - 1))] += w ? (double)w[i] : 1.0;
}

/* The smallest key v with sum(w[i] : key[i] <= v) > target (w = NULL: every weight 1), over the
 * tokens with key >= lo. hist has PS_TP_COPIES << 11 doubles. */
static uint32_t ps_tp_select(const uint32_t *keys, const float *w, const int64_t V, const uint32_t lo,
                             double target, double *hist) {
    static const int bits[3] = {PS_TP_B1, PS_TP_B2, PS_TP_B3};
    uint32_t prefix = 0;
    int shift = 32, known = 0; /* bits of the answer found so far */
    for (int level = 0; level < 3; ++level) {
        const int b = bits[level];
        shift -= b;
        const int nb = 1 << b;
        /* PS_TP_COPIES histograms taken in turn, summed after: neighbouring tokens often land in one
         * bucket, and a single histogram then chains every add through memory */
        for (int j = 0; j < PS_TP_COPIES * nb; ++j) hist[j] = 0.0;
        int64_t i = 0; /* the tokens a vector loop below leaves are counted one by one after it */
#ifdef PS_AVX512
        if (known) { /* past the first level few tokens match the prefix: find them 16 at a time */
            const __m512i vlo = _mm512_set1_epi32((int32_t)lo), vpre = _mm512_set1_epi32((int32_t)prefix);
            for (; i < V; i += 16) {
                const __mmask16 in = ps_tp_tail(V, i);
                const __m512i kv = _mm512_maskz_loadu_epi32(in, keys + i);
                unsigned hit = _mm512_mask_cmp_epu32_mask(in, kv, vlo, _MM_CMPINT_NLT) &
                               _mm512_cmpeq_epi32_mask(_mm512_srli_epi32(kv, (unsigned)(32 - known)), vpre);
                for (; hit; hit &= hit - 1) ps_tp_count(hist, nb, shift, keys, w, i + __builtin_ctz(hit));
            }
        }
#elif defined(PS_AVX2)
        if (known) { /* as above, 8 at a time */
            const __m256i vlo = _mm256_set1_epi32((int32_t)lo), vpre = _mm256_set1_epi32((int32_t)prefix);
            const __m128i sh = _mm_cvtsi32_si128(32 - known);
            for (; i + 8 <= V; i += 8) {
                const __m256i kv = _mm256_loadu_si256((const __m256i *)(keys + i));
                const __m256i match = _mm256_and_si256(ps_tp_geu(kv, vlo), _mm256_cmpeq_epi32(_mm256_srl_epi32(kv, sh), vpre));
                for (unsigned hit = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(match)); hit; hit &= hit - 1)
                    ps_tp_count(hist, nb, shift, keys, w, i + __builtin_ctz(hit));
            }
        }
#endif
        for (; i < V; ++i)
            if (keys[i] >= lo && (!known || (keys[i] >> (32 - known)) == prefix)) ps_tp_count(hist, nb, shift, keys, w, i);
        for (int c = 1; c < PS_TP_COPIES; ++c)
            for (int j = 0; j < nb; ++j) hist[j] += hist[c * nb + j];
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

/* The portable row passes over [0, V): the keys and the max (any NaN flagged in *nan), the masses, and the
 * kept set (its size in *kept). The AVX2 passes end with them on their last V % 8 tokens. */
static inline float ps_tp_keys_part(const float *restrict x, const int64_t V, uint32_t *restrict keys, int *nan) {
    float m = -INFINITY;
    for (int64_t i = 0; i < V; ++i) {
        keys[i] = ps_tp_key(x[i]);
        *nan |= x[i] != x[i];
        m = x[i] > m ? x[i] : m;
    }
    return m;
}

static inline double ps_tp_masses_part(const float *restrict x, const int64_t V, const uint32_t *restrict keys,
                                       const uint32_t kth, const float m, float *restrict out) {
    double z = 0.0;
    for (int64_t i = 0; i < V; ++i) {
        const float e = (keys[i] >= kth && x[i] != -INFINITY) ? ps_exp(x[i] - m) : 0.0f;
        out[i] = e;
        z += e;
    }
    return z;
}

static inline double ps_tp_keep_part(const int64_t V, const uint32_t *restrict keys, const uint32_t cut,
                                     float *restrict out, int64_t *kept) {
    double mass = 0.0;
    int64_t n = 0;
    for (int64_t i = 0; i < V; ++i) {
        if (keys[i] >= cut && out[i] > 0.0f) {
            mass += out[i];
            ++n;
        } else {
            out[i] = 0.0f;
        }
    }
    *kept = n;
    return mass;
}

/* The row passes around the two selects: keys and the max (-1 for a NaN or no finite logit), the
 * exp masses of the tokens at or above the k-th (their sum z), and the tokens at or above the cut
 * (their sum). With AVX-512, 16 tokens at a time with the sums in double lanes (gcc leaves these
 * loops scalar: the exp, the double sums). With the selects' changes (copies of the histogram, the
 * later levels' tokens found 16 at a time), 8 rows of 49,152 logits, top-p 0.95, 2-core AMD EPYC
 * Zen 4: 1.44 -> 0.55 ms (2 threads), 1.31 -> 0.95 ms (1 thread); with top-k 50 too, 1.98 -> 1.19 (1).
 * After: 0.42 ms vs the torch sort reference's 16.8 (benchmarks/cpu_kernels.py, results/cpu_kernels_zen4.json). */
#ifdef PS_AVX512
static inline __m512d ps_tp_sum_pd(__m512d acc, __m512 v) { /* acc + the 16 floats of v, in double */
    acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
    return _mm512_add_pd(acc, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}

static float ps_tp_keys(const float *restrict x, const int64_t V, uint32_t *restrict keys) {
    __m512 vm = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int64_t i = 0; i < V; i += 16) {
        const __mmask16 in = ps_tp_tail(V, i);
        const __m512 xv = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), in, x + i);
        const __m512i u = _mm512_castps_si512(xv);
        const __m512i key = _mm512_mask_blend_epi32(_mm512_movepi32_mask(u), _mm512_or_si512(u, _mm512_set1_epi32((int32_t)0x80000000u)),
                                                    _mm512_xor_si512(u, _mm512_set1_epi32(-1)));
        _mm512_mask_storeu_epi32(keys + i, in, key);
        nan |= _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q);
        vm = _mm512_max_ps(vm, xv);
    }
    const float m = _mm512_reduce_max_ps(vm);
    return nan || m == -INFINITY ? NAN : m;
}

static double ps_tp_masses(const float *restrict x, const int64_t V, const uint32_t *restrict keys, const uint32_t kth,
                           const float m, float *restrict out) {
    __m512d z = _mm512_setzero_pd();
    const __m512i kv = _mm512_set1_epi32((int32_t)kth);
    const __m512 vm = _mm512_set1_ps(m), ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < V; i += 16) {
        const __mmask16 in = ps_tp_tail(V, i);
        const __m512 xv = _mm512_mask_loadu_ps(ninf, in, x + i);
        const __mmask16 keep = _mm512_cmp_epu32_mask(_mm512_maskz_loadu_epi32(in, keys + i), kv, _MM_CMPINT_NLT) &
                               _mm512_cmp_ps_mask(xv, ninf, _CMP_NEQ_OQ) & in;
        const __m512 e = _mm512_maskz_mov_ps(keep, ps_exp16(_mm512_sub_ps(xv, vm)));
        _mm512_mask_storeu_ps(out + i, in, e);
        z = ps_tp_sum_pd(z, e);
    }
    return _mm512_reduce_add_pd(z);
}

static double ps_tp_keep(const int64_t V, const uint32_t *restrict keys, const uint32_t cut, float *restrict out,
                         int64_t *kept) {
    __m512d mass = _mm512_setzero_pd();
    const __m512i cv = _mm512_set1_epi32((int32_t)cut);
    int64_t n = 0;
    for (int64_t i = 0; i < V; i += 16) {
        const __mmask16 in = ps_tp_tail(V, i);
        const __m512 e = _mm512_maskz_loadu_ps(in, out + i);
        const __mmask16 keep = _mm512_cmp_epu32_mask(_mm512_maskz_loadu_epi32(in, keys + i), cv, _MM_CMPINT_NLT) &
                               _mm512_cmp_ps_mask(e, _mm512_setzero_ps(), _CMP_GT_OQ) & in;
        const __m512 k = _mm512_maskz_mov_ps(keep, e);
        _mm512_mask_storeu_ps(out + i, in, k);
        mass = ps_tp_sum_pd(mass, k);
        n += __builtin_popcount((unsigned)keep);
    }
    *kept = n;
    return _mm512_reduce_add_pd(mass);
}
#elif defined(PS_AVX2)
static float ps_tp_keys(const float *restrict x, const int64_t V, uint32_t *restrict keys) {
    __m256 vm = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    const int64_t V8 = V / 8 * 8;
    for (int64_t i = 0; i < V8; i += 8) {
        const __m256 xv = _mm256_loadu_ps(x + i);
        const __m256i u = _mm256_castps_si256(xv); /* negative: ~u; else u with the top bit set */
        const __m256i flip = _mm256_or_si256(_mm256_srai_epi32(u, 31), _mm256_set1_epi32((int32_t)0x80000000u));
        _mm256_storeu_si256((__m256i *)(keys + i), _mm256_xor_si256(u, flip));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q));
        vm = _mm256_max_ps(vm, xv);
    }
    int any_nan = _mm256_movemask_ps(nan) != 0;
    const float m = ps_tp_keys_part(x + V8, V - V8, keys + V8, &any_nan), mv = ps_hmax8(vm);
    const float mx = m > mv ? m : mv;
    return any_nan || mx == -INFINITY ? NAN : mx;
}

static double ps_tp_masses(const float *restrict x, const int64_t V, const uint32_t *restrict keys, const uint32_t kth,
                           const float m, float *restrict out) {
    __m256d z = _mm256_setzero_pd();
    const __m256i kv = _mm256_set1_epi32((int32_t)kth);
    const __m256 vm = _mm256_set1_ps(m), ninf = _mm256_set1_ps(-INFINITY);
    const int64_t V8 = V / 8 * 8;
    for (int64_t i = 0; i < V8; i += 8) {
        const __m256 xv = _mm256_loadu_ps(x + i);
        const __m256 keep = _mm256_and_ps(_mm256_castsi256_ps(ps_tp_geu(_mm256_loadu_si256((const __m256i *)(keys + i)), kv)),
                                          _mm256_cmp_ps(xv, ninf, _CMP_NEQ_OQ));
        const __m256 e = _mm256_and_ps(keep, ps_exp8(_mm256_sub_ps(xv, vm)));
        _mm256_storeu_ps(out + i, e);
        z = ps_tp_sum4_pd(z, e);
    }
    return ps_tp_hadd_pd(z) + ps_tp_masses_part(x + V8, V - V8, keys + V8, kth, m, out + V8);
}

static double ps_tp_keep(const int64_t V, const uint32_t *restrict keys, const uint32_t cut, float *restrict out,
                         int64_t *kept) {
    __m256d mass = _mm256_setzero_pd();
    const __m256i cv = _mm256_set1_epi32((int32_t)cut);
    int64_t n = 0;
    const int64_t V8 = V / 8 * 8;
    for (int64_t i = 0; i < V8; i += 8) {
        const __m256 e = _mm256_loadu_ps(out + i);
        const __m256 keep = _mm256_and_ps(_mm256_castsi256_ps(ps_tp_geu(_mm256_loadu_si256((const __m256i *)(keys + i)), cv)),
                                          _mm256_cmp_ps(e, _mm256_setzero_ps(), _CMP_GT_OQ));
        const __m256 k = _mm256_and_ps(keep, e);
        _mm256_storeu_ps(out + i, k);
        mass = ps_tp_sum4_pd(mass, k);
        n += __builtin_popcount((unsigned)_mm256_movemask_ps(keep));
    }
    int64_t tail = 0;
    const double rest = ps_tp_keep_part(V - V8, keys + V8, cut, out + V8, &tail);
    *kept = n + tail;
    return ps_tp_hadd_pd(mass) + rest;
}
#else
static float ps_tp_keys(const float *restrict x, const int64_t V, uint32_t *restrict keys) {
    int any_nan = 0;
    const float m = ps_tp_keys_part(x, V, keys, &any_nan);
    return any_nan || m == -INFINITY ? NAN : m;
}

static double ps_tp_masses(const float *restrict x, const int64_t V, const uint32_t *restrict keys, const uint32_t kth,
                           const float m, float *restrict out) {
    return ps_tp_masses_part(x, V, keys, kth, m, out);
}

static double ps_tp_keep(const int64_t V, const uint32_t *restrict keys, const uint32_t cut, float *restrict out,
                         int64_t *kept) {
    return ps_tp_keep_part(V, keys, cut, out, kept);
}
#endif

/* One row: keys into `keys`, exp(x - max) of the kept tokens into `out`, then the final scale. */
static int64_t ps_tp_row(const float *restrict x, const int64_t V, const int64_t k, const float p,
                         float *restrict out, uint32_t *restrict keys, double *hist) {
    const float m = ps_tp_keys(x, V, keys);
    if (m != m) return -1; /* a NaN or no finite logit: the caller keeps the reference for such a row */
    const uint32_t kth = k < V ? ps_tp_select(keys, NULL, V, 0u, (double)(V - k), hist) : 0u;
    const double z = ps_tp_masses(x, V, keys, kth, m, out);
    const uint32_t cut = p < 1.0f ? ps_tp_select(keys, out, V, kth, (1.0 - (double)p) * z, hist) : kth;
    int64_t kept;
    const float inv = (float)(1.0 / ps_tp_keep(V, keys, cut, out, &kept));
    for (int64_t i = 0; i < V; ++i) out[i] *= inv;
    return kept;
}

/* logits [S, V] (row stride ld), ks [S] (k >= V: no top-k), ps [S] in (0, 1] -> out [S, V]
 * (contiguous), kept [S] (-1 for a row with a NaN or no finite logit: out undefined there).
 * Returns 0, or 2 when scratch memory could not be had. */
int64_t ps_top_k_top_p(const float *logits, const int64_t S, const int64_t V, const int64_t ld, const int64_t *ks,
                       const float *ps, float *out, int64_t *kept, const int nthreads) {
    const int nt = nthreads < 1 ? 1 : nthreads;
    const size_t per_thread = ((size_t)V * sizeof(uint32_t) + ((size_t)PS_TP_COPIES << PS_TP_B1) * sizeof(double) + 63) / 64 * 64;
    char *scratch = malloc((size_t)nt * per_thread);
    if (!scratch) return 2;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t s = 0; s < S; ++s) {
        char *mine = scratch + (size_t)omp_get_thread_num() * per_thread;
        double *hist = (double *)mine; /* 8-byte aligned first, then the keys */
        uint32_t *keys = (uint32_t *)(mine + ((size_t)PS_TP_COPIES << PS_TP_B1) * sizeof(double));
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
 * n=8; this is one vectorised pass (8 rows: 0.16 ms, results/cpu_kernels_zen4.json). u has 23 bits, so E >= 6e-8: a token can gain at most ~1e-7
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
 * |t| < 0.172, by its series to t^9 (relative error < 1e-7). The scalar path's; ps_neglog16 below is the
 * same arithmetic 16 lanes at a time. */
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
#elif defined(PS_AVX2)
/* The same, 8 tokens at a time. */
static inline __m256i ps_hash32x8(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int32_t)0x846ca68bu));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

static inline __m256 ps_neglog8(__m256 u) {
    const __m256i b = _mm256_castps_si256(u), mant = _mm256_and_si256(b, _mm256_set1_epi32(0x7fffff));
    const __m256i big = _mm256_cmpgt_epi32(mant, _mm256_set1_epi32(0x3504f3)); /* all ones: use m / 2 */
    const __m256i e = _mm256_sub_epi32(_mm256_sub_epi32(_mm256_srli_epi32(b, 23), _mm256_set1_epi32(127)), big);
    const __m256 m = _mm256_castsi256_ps(_mm256_or_si256(
        mant, _mm256_blendv_epi8(_mm256_set1_epi32(0x3f800000), _mm256_set1_epi32(0x3f000000), big)));
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(m, one), _mm256_add_ps(m, one)), t2 = _mm256_mul_ps(t, t);
    __m256 series = _mm256_fmadd_ps(t2, _mm256_set1_ps(1.0f / 9.0f), _mm256_set1_ps(1.0f / 7.0f));
    series = _mm256_fmadd_ps(t2, series, _mm256_set1_ps(1.0f / 5.0f));
    series = _mm256_fmadd_ps(t2, series, _mm256_set1_ps(1.0f / 3.0f));
    series = _mm256_fmadd_ps(t2, series, one);
    const __m256 lg = _mm256_fmadd_ps(_mm256_cvtepi32_ps(e), _mm256_set1_ps(0.69314718055994531f),
                                      _mm256_mul_ps(_mm256_add_ps(t, t), series));
    return _mm256_sub_ps(_mm256_setzero_ps(), lg);
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
        const __mmask16 in = ps_tp_tail(V, i);
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
#elif defined(PS_AVX2)
    /* as the AVX-512 loop, 8 lanes over V rounded down to 8 */
    __m256 vbest = _mm256_setzero_ps();
    __m256i vidx = _mm256_set1_epi32(-1), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 half = _mm256_set1_ps(0.5f), scale = _mm256_set1_ps(0x1p-23f);
    for (; i + 8 <= V; i += 8, idx = _mm256_add_epi32(idx, _mm256_set1_epi32(8))) {
        const __m256i h = ps_hash32x8(_mm256_add_epi32(
            ps_hash32x8(_mm256_xor_si256(idx, _mm256_set1_epi32((int32_t)s0))), _mm256_set1_epi32((int32_t)s1)));
        /* h >> 9 < 2^23: the signed conversion is exact */
        const __m256 u = _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 9)), half), scale);
        const __m256 pv = _mm256_loadu_ps(p + i);
        const __m256 r = _mm256_div_ps(pv, ps_neglog8(u));
        const __m256 better = _mm256_and_ps(_mm256_cmp_ps(pv, _mm256_setzero_ps(), _CMP_GT_OQ),
                                            _mm256_cmp_ps(r, vbest, _CMP_GT_OQ));
        vbest = _mm256_blendv_ps(vbest, r, better);
        vidx = _mm256_blendv_epi8(vidx, idx, _mm256_castps_si256(better));
    }
    float lb[8];
    int32_t li[8];
    _mm256_storeu_ps(lb, vbest);
    _mm256_storeu_si256((__m256i *)li, vidx);
    for (int l = 0; l < 8; ++l) /* the first token of the best ratio: lanes hold ascending ids */
        if (lb[l] > best || (lb[l] == best && lb[l] > 0.0f && li[l] < winner)) {
            best = lb[l];
            winner = li[l];
        }
#endif
    for (; i < V; ++i) { /* every token without AVX-512 / AVX2, the last V % 8 with AVX2 */
        const float pi = p[i];
        if (!(pi > 0.0f)) continue;
        const float r = pi / ps_neglog(ps_race_uniform((uint32_t)i, s0, s1));
        if (r > best) {
            best = r;
            winner = i;
        }
    }
    return winner;
}

/* probs [S, V] (row stride ld), seeds [S] -> tokens [S] (-1 where a row has no p > 0). */
void ps_race(const float *probs, const int64_t S, const int64_t V, const int64_t ld, const int64_t *seeds,
             int64_t *tokens, const int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads < 1 ? 1 : nthreads) if (S > 1)
    for (int64_t s = 0; s < S; ++s) tokens[s] = ps_race_row(probs + s * ld, V, (uint64_t)seeds[s]);
}
