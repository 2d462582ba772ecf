/* Paged decode attention on CPU: one new query token per sequence against its paged KV.
 *
 * The same contract as kernels/paged_attention_decode.py (see its module docstring): sequence b
 * attends to positions 0 .. lens[b]-1; position p lives in block bt[b, p / BS] at offset p % BS.
 * Query head h uses KV head h / G (G = Hq / Hkv).
 *
 * Why C: the torch path must gather every sequence's K/V into a dense copy before SDPA, and
 * pays ~100 us of dispatch per small SDPA call; this reads each K/V row once, straight from the
 * block it lives in, so a decode step is bound by memory bandwidth rather than by copies and
 * dispatch. Built at first use by kernels/_native.py (gcc -O3 -march=native -fopenmp); the
 * OpenMP runtime is torch's own (same soname, already loaded), so both share one thread pool.
 *
 * One work item = (sequence, KV head): its G query heads go through the blocks together with an
 * online softmax (running max m, running sum l, unnormalised accumulator acc), in float32.
 *
 *     block j of sequence b:  rows t = 0 .. n-1 (n = BS, or what is left of lens[b])
 *         s[g][t] = scale * q[g] . k[t]                    (scores of the block)
 *         m' = max(m, max_t s[g][t]);  a = exp(m - m')     (rescale what came before)
 *         acc[g] = a * acc[g] + sum_t exp(s[g][t] - m') v[t];   l = a * l + sum_t exp(...)
 *     out[g] = acc[g] / l[g]
 */
#include "ps_cpu.h"

#define PS_MAX_G 16
#define PS_MAX_D 256
#define PS_MAX_BS 128

/* Prefetch a block's BS rows of K and V (row_bytes each; rows k_ss / v_ss bytes apart). */
static inline void ps_prefetch_block(const void *k, const void *v, int64_t BS, int64_t k_ss, int64_t v_ss,
                                     int64_t row_bytes) {
    for (int64_t t = 0; t < BS; ++t)
        for (int64_t c = 0; c < row_bytes; c += 64) {
            __builtin_prefetch((const char *)k + t * k_ss + c);
            __builtin_prefetch((const char *)v + t * v_ss + c);
        }
}

/* One work item, (sequence b, KV head h): q, kc, vc and out already point at head h's G query rows,
 * KV column and output rows; bt_row is sequence b's block table. always_inline, so the callers
 * below get copies specialised for the common head_dim / block_size (the loops then unroll). */
#define PS_DEFINE_ITEM(NAME, T, LOAD, STORE)                                                          \
    static inline __attribute__((always_inline)) void NAME(                                          \
        const T *restrict q, const T *restrict kc, const T *restrict vc, const int32_t *restrict bt_row, \
        const int64_t len, const int64_t start, T *restrict out, const int64_t G, const int64_t D,  \
        const int64_t BS, const int64_t q_sh, const int64_t k_sb, const int64_t k_ss, const int64_t v_sb, \
        const int64_t v_ss, const int64_t o_sh, const float scale) {                                 \
        float qs[PS_MAX_G * PS_MAX_D], acc[PS_MAX_G * PS_MAX_D], row[PS_MAX_D];                      \
        float s[PS_MAX_G * PS_MAX_BS], m[PS_MAX_G], l[PS_MAX_G];                                     \
        for (int64_t g = 0; g < G; ++g) {                                                            \
            LOAD(q + g * q_sh, qs + g * D, D);                                                       \
            for (int64_t d = 0; d < D; ++d) qs[g * D + d] *= scale;                                  \
            for (int64_t d = 0; d < D; ++d) acc[g * D + d] = 0.0f;                                   \
            m[g] = -INFINITY;                                                                        \
            l[g] = 0.0f;                                                                             \
        }                                                                                            \
        const int64_t nblk = len > 0 ? (len + BS - 1) / BS : 0;                                      \
        for (int64_t j = start / BS; j < nblk; ++j) {                                                \
            const int64_t blk = bt_row[j];                                                           \
            const int64_t n = len - j * BS < BS ? len - j * BS : BS;                                 \
            const int64_t t_lo = start > j * BS ? start - j * BS : 0; /* a window starts inside */   \
            const T *kb = kc + blk * k_sb;                                                           \
            const T *vb = vc + blk * v_sb;                                                           \
            if (j + 1 < nblk) /* the next block is elsewhere in the pool: fetch it while we work */ \
                ps_prefetch_block(kc + (int64_t)bt_row[j + 1] * k_sb, vc + (int64_t)bt_row[j + 1] * v_sb, \
                                  BS, k_ss * (int64_t)sizeof(T), v_ss * (int64_t)sizeof(T), D * (int64_t)sizeof(T)); \
            for (int64_t t = t_lo; t < n; ++t) {                                                     \
                LOAD(kb + t * k_ss, row, D);                                                         \
                for (int64_t g = 0; g < G; ++g) {                                                    \
                    const float *qg = qs + g * D;                                                    \
                    float dot = 0.0f;                                                                \
                    _Pragma("omp simd reduction(+:dot)")                                             \
                    for (int64_t d = 0; d < D; ++d) dot += qg[d] * row[d];                           \
                    s[g * PS_MAX_BS + t] = dot;                                                      \
                }                                                                                    \
            }                                                                                        \
            for (int64_t g = 0; g < G; ++g) {                                                        \
                float *sg = s + g * PS_MAX_BS;                                                       \
                float mx = m[g];                                                                     \
                for (int64_t t = t_lo; t < n; ++t) mx = sg[t] > mx ? sg[t] : mx;                     \
                const float alpha = ps_exp(m[g] - mx); /* m = -inf at first: exp -> 0 */             \
                float sum = 0.0f;                                                                    \
                _Pragma("omp simd reduction(+:sum)")                                                 \
                for (int64_t t = t_lo; t < n; ++t) {                                                 \
                    sg[t] = ps_exp(sg[t] - mx);                                                      \
                    sum += sg[t];                                                                    \
                }                                                                                    \
                l[g] = l[g] * alpha + sum;                                                           \
                m[g] = mx;                                                                           \
                float *ag = acc + g * D;                                                             \
                for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;                                      \
            }                                                                                        \
            for (int64_t t = t_lo; t < n; ++t) {                                                     \
                LOAD(vb + t * v_ss, row, D);                                                         \
                for (int64_t g = 0; g < G; ++g) {                                                    \
                    const float p = s[g * PS_MAX_BS + t];                                            \
                    float *ag = acc + g * D;                                                         \
                    _Pragma("omp simd")                                                              \
                    for (int64_t d = 0; d < D; ++d) ag[d] += p * row[d];                             \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        for (int64_t g = 0; g < G; ++g) {                                                            \
            const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f; /* len 0: a zero row */             \
            for (int64_t d = 0; d < D; ++d) STORE(out + g * o_sh + d, acc[g * D + d] * inv);         \
        }                                                                                            \
    }

#ifdef PS_AVX512
/* The same work item with AVX-512 for head_dim a multiple of 16, in tiles of up to 16 tokens.
 *
 * Scores: each token's G dot products are left as 16-lane partial sums, and the 16 tokens of a
 * tile are reduced together by ps_hsum16 (a transpose-and-add tree, ~3 ops per token) instead of a
 * horizontal reduction per score (~8). The tree leaves lane l holding the sum of input PS_PERM[l];
 * PS_PERM is its own inverse, so token t's partial goes in slot PS_PERM[t] and lane t comes out t.
 *
 *     tile: tokens t0 .. t0+nt-1 of one block (nt <= 16)
 *         part[g][PS_PERM[t]] = sum_v q[g][v] * k[t][v]     (16-lane vectors, v over D/16)
 *         s[g] = ps_hsum16(part[g])                          (lane t = score of token t; lanes >= nt: -inf)
 *         online softmax on the 16 lanes, then acc[g][v] += p[g][t] * V[t][v] for each token
 */
static const int PS_PERM[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

static inline __m512 ps_hsum16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i) /* 256-bit halves */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[i], a[i + 8], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; ++i) /* 128-bit quarters */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[i], b[i + 4], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; ++i) /* pairs within 128-bit lanes */
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[i], c[i + 2], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(c[i], c[i + 2], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

#define PS_LOADV_F32(p) _mm512_loadu_ps(p)
#define PS_LOADV_BF16(p) ps_load16_bf16((p), (__mmask16)0xffff)
#define PS_STOREV_F32(p, v) _mm512_storeu_ps((p), (v))
#define PS_STOREV_BF16(p, v) ps_store16_bf16((p), (v), (__mmask16)0xffff)

#define PS_DEFINE_ITEM_AVX(NAME, T, LOADV, STOREV)                                                    \
    static inline __attribute__((always_inline)) void NAME(                                          \
        const T *restrict q, const T *restrict kc, const T *restrict vc, const int32_t *restrict bt_row, \
        const int64_t len, const int64_t start, T *restrict out, const int64_t G, const int64_t D,  \
        const int64_t BS, const int64_t q_sh, const int64_t k_sb, const int64_t k_ss, const int64_t v_sb, \
        const int64_t v_ss, const int64_t o_sh, const float scale) {                                 \
        const int64_t DV = D / 16;                                                                   \
        __m512 qs[PS_MAX_G * PS_MAX_D / 16], acc[PS_MAX_G * PS_MAX_D / 16], kv[PS_MAX_D / 16];      \
        __m512 part[PS_MAX_G][16];                                                                   \
        float p[PS_MAX_G][16] __attribute__((aligned(64))), m[PS_MAX_G], l[PS_MAX_G];               \
        for (int64_t g = 0; g < G; ++g) {                                                            \
            for (int64_t v = 0; v < DV; ++v) {                                                       \
                qs[g * DV + v] = _mm512_mul_ps(LOADV(q + g * q_sh + 16 * v), _mm512_set1_ps(scale)); \
                acc[g * DV + v] = _mm512_setzero_ps();                                               \
            }                                                                                        \
            m[g] = -INFINITY;                                                                        \
            l[g] = 0.0f;                                                                             \
        }                                                                                            \
        const int64_t nblk = len > 0 ? (len + BS - 1) / BS : 0;                                      \
        for (int64_t j = start / BS; j < nblk; ++j) {                                                \
            const T *kb = kc + (int64_t)bt_row[j] * k_sb, *vb = vc + (int64_t)bt_row[j] * v_sb;      \
            const int64_t n = len - j * BS < BS ? len - j * BS : BS;                                 \
            if (j + 1 < nblk) /* the next block is elsewhere in the pool: fetch it while we work */ \
                ps_prefetch_block(kc + (int64_t)bt_row[j + 1] * k_sb, vc + (int64_t)bt_row[j + 1] * v_sb, \
                                  BS, k_ss * (int64_t)sizeof(T), v_ss * (int64_t)sizeof(T), D * (int64_t)sizeof(T)); \
            for (int64_t t0 = 0; t0 < n; t0 += 16) {                                                 \
                const int64_t nt = n - t0 < 16 ? n - t0 : 16;                                        \
                const int64_t skip = start - j * BS - t0; /* tokens before a window start: masked */  \
                const __mmask16 valid = (__mmask16)((nt == 16 ? 0xffffu : (1u << nt) - 1u)            \
                                                    & (skip <= 0 ? 0xffffu : skip >= 16 ? 0u : ~((1u << skip) - 1u))); \
                if (!valid) continue; /* wholly before the window: no score, no NaN from exp(-inf + inf) */ \
                for (int64_t t = 0; t < 16; ++t) {                                                   \
                    if (t < nt) {                                                                    \
                        const T *kr = kb + (t0 + t) * k_ss;                                          \
                        for (int64_t v = 0; v < DV; ++v) kv[v] = LOADV(kr + 16 * v);                 \
                    } else {                                                                         \
                        for (int64_t v = 0; v < DV; ++v) kv[v] = _mm512_setzero_ps();                \
                    }                                                                                \
                    for (int64_t g = 0; g < G; ++g) {                                                \
                        __m512 dot = _mm512_mul_ps(qs[g * DV], kv[0]);                               \
                        for (int64_t v = 1; v < DV; ++v) dot = _mm512_fmadd_ps(qs[g * DV + v], kv[v], dot); \
                        part[g][PS_PERM[t]] = dot;                                                   \
                    }                                                                                \
                }                                                                                    \
                for (int64_t g = 0; g < G; ++g) {                                                    \
                    const __m512 sc = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), ps_hsum16(part[g])); \
                    const float mx = fmaxf(m[g], _mm512_reduce_max_ps(sc));                          \
                    const float alpha = ps_exp(m[g] - mx); /* m = -inf at first: exp -> 0 */         \
                    const __m512 e = _mm512_maskz_mov_ps(valid, ps_exp16(_mm512_sub_ps(sc, _mm512_set1_ps(mx)))); \
                    l[g] = l[g] * alpha + _mm512_reduce_add_ps(e);                                   \
                    m[g] = mx;                                                                       \
                    _mm512_store_ps(p[g], e);                                                        \
                    for (int64_t v = 0; v < DV; ++v)                                                 \
                        acc[g * DV + v] = _mm512_mul_ps(acc[g * DV + v], _mm512_set1_ps(alpha));     \
                }                                                                                    \
                for (int64_t t = 0; t < nt; ++t) {                                                   \
                    const T *vr = vb + (t0 + t) * v_ss;                                              \
                    for (int64_t v = 0; v < DV; ++v) kv[v] = LOADV(vr + 16 * v);                     \
                    for (int64_t g = 0; g < G; ++g) {                                                \
                        const __m512 pg = _mm512_set1_ps(p[g][t]);                                   \
                        for (int64_t v = 0; v < DV; ++v)                                             \
                            acc[g * DV + v] = _mm512_fmadd_ps(pg, kv[v], acc[g * DV + v]);           \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        for (int64_t g = 0; g < G; ++g) {                                                            \
            const __m512 inv = _mm512_set1_ps(l[g] > 0.0f ? 1.0f / l[g] : 0.0f); /* len 0: zeros */ \
            for (int64_t v = 0; v < DV; ++v) STOREV(out + g * o_sh + 16 * v, _mm512_mul_ps(acc[g * DV + v], inv)); \
        }                                                                                            \
    }

PS_DEFINE_ITEM_AVX(ps_item_avx_f32, float, PS_LOADV_F32, PS_STOREV_F32)
PS_DEFINE_ITEM_AVX(ps_item_avx_bf16, uint16_t, PS_LOADV_BF16, PS_STOREV_BF16)
#endif

#ifdef PS_AVX2
/* The AVX-512 item's plan in 8-lane AVX2 for head_dim a multiple of 8: tiles of up to 8 tokens, each
 * token's G dot products left as 8-lane partial sums and the tile's 8 reduced together by ps_hsum8
 * (lane t = token t, no permutation), the online softmax on those 8 lanes. */
#define PS_LOAD8_F32(p) _mm256_loadu_ps(p)
#define PS_LOAD8_BF16(p) ps_load8_bf16(p)

#define PS_DEFINE_ITEM_AVX2(NAME, T, LOADV, STORE)                                                    \
    static inline __attribute__((always_inline)) void NAME(                                          \
        const T *restrict q, const T *restrict kc, const T *restrict vc, const int32_t *restrict bt_row, \
        const int64_t len, const int64_t start, T *restrict out, const int64_t G, const int64_t D,  \
        const int64_t BS, const int64_t q_sh, const int64_t k_sb, const int64_t k_ss, const int64_t v_sb, \
        const int64_t v_ss, const int64_t o_sh, const float scale) {                                 \
        const int64_t DV = D / 8;                                                                    \
        __m256 qs[PS_MAX_G * PS_MAX_D / 8], acc[PS_MAX_G * PS_MAX_D / 8], kv[PS_MAX_D / 8];         \
        __m256 part[PS_MAX_G][8];                                                                    \
        float p[PS_MAX_G][8] __attribute__((aligned(32))), m[PS_MAX_G], l[PS_MAX_G];                \
        const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);                              \
        for (int64_t g = 0; g < G; ++g) {                                                            \
            for (int64_t v = 0; v < DV; ++v) {                                                       \
                qs[g * DV + v] = _mm256_mul_ps(LOADV(q + g * q_sh + 8 * v), _mm256_set1_ps(scale));  \
                acc[g * DV + v] = _mm256_setzero_ps();                                               \
            }                                                                                        \
            m[g] = -INFINITY;                                                                        \
            l[g] = 0.0f;                                                                             \
        }                                                                                            \
        const int64_t nblk = len > 0 ? (len + BS - 1) / BS : 0;                                      \
        for (int64_t j = start / BS; j < nblk; ++j) {                                                \
            const T *kb = kc + (int64_t)bt_row[j] * k_sb, *vb = vc + (int64_t)bt_row[j] * v_sb;      \
            const int64_t n = len - j * BS < BS ? len - j * BS : BS;                                 \
            if (j + 1 < nblk) /* the next block is elsewhere in the pool: fetch it while we work */ \
                ps_prefetch_block(kc + (int64_t)bt_row[j + 1] * k_sb, vc + (int64_t)bt_row[j + 1] * v_sb, \
                                  BS, k_ss * (int64_t)sizeof(T), v_ss * (int64_t)sizeof(T), D * (int64_t)sizeof(T)); \
            for (int64_t t0 = 0; t0 < n; t0 += 8) {                                                  \
                const int64_t nt = n - t0 < 8 ? n - t0 : 8;                                          \
                const int64_t skip = start - j * BS - t0; /* tokens before a window start: masked */  \
                if (skip >= nt) continue; /* wholly before the window: no score, no NaN from exp(-inf + inf) */ \
                /* lane t is a real, in-window token: skip <= t < nt */                               \
                const __m256 valid = _mm256_castsi256_ps(_mm256_and_si256(                            \
                    _mm256_cmpgt_epi32(_mm256_set1_epi32((int)nt), iota),                            \
                    _mm256_cmpgt_epi32(iota, _mm256_set1_epi32((int)(skip > 0 ? skip : 0) - 1))));    \
                for (int64_t t = 0; t < 8; ++t) {                                                    \
                    if (t < nt) {                                                                    \
                        const T *kr = kb + (t0 + t) * k_ss;                                          \
                        for (int64_t v = 0; v < DV; ++v) kv[v] = LOADV(kr + 8 * v);                  \
                    } else {                                                                         \
                        for (int64_t v = 0; v < DV; ++v) kv[v] = _mm256_setzero_ps();                \
                    }                                                                                \
                    for (int64_t g = 0; g < G; ++g) {                                                \
                        __m256 d0 = _mm256_mul_ps(qs[g * DV], kv[0]), d1 = _mm256_setzero_ps();      \
                        for (int64_t v = 1; v + 1 < DV; v += 2) { /* two chains: FMA latency */      \
                            d1 = _mm256_fmadd_ps(qs[g * DV + v], kv[v], d1);                         \
                            d0 = _mm256_fmadd_ps(qs[g * DV + v + 1], kv[v + 1], d0);                 \
                        }                                                                            \
                        if (DV % 2 == 0) d1 = _mm256_fmadd_ps(qs[g * DV + DV - 1], kv[DV - 1], d1);  \
                        part[g][t] = _mm256_add_ps(d0, d1);                                          \
                    }                                                                                \
                }                                                                                    \
                for (int64_t g = 0; g < G; ++g) {                                                    \
                    const __m256 sc = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), ps_hsum8(part[g]), valid); \
                    const float mx = fmaxf(m[g], ps_hmax8(sc));                                      \
                    const float alpha = ps_exp(m[g] - mx); /* m = -inf at first: exp -> 0 */         \
                    const __m256 e = _mm256_and_ps(valid, ps_exp8(_mm256_sub_ps(sc, _mm256_set1_ps(mx)))); \
                    l[g] = l[g] * alpha + ps_hadd8(e);                                               \
                    m[g] = mx;                                                                       \
                    _mm256_store_ps(p[g], e);                                                        \
                    for (int64_t v = 0; v < DV; ++v)                                                 \
                        acc[g * DV + v] = _mm256_mul_ps(acc[g * DV + v], _mm256_set1_ps(alpha));     \
                }                                                                                    \
                for (int64_t t = 0; t < nt; ++t) {                                                   \
                    const T *vr = vb + (t0 + t) * v_ss;                                              \
                    for (int64_t v = 0; v < DV; ++v) kv[v] = LOADV(vr + 8 * v);                      \
                    for (int64_t g = 0; g < G; ++g) {                                                \
                        const __m256 pg = _mm256_set1_ps(p[g][t]);                                   \
                        for (int64_t v = 0; v < DV; ++v)                                             \
                            acc[g * DV + v] = _mm256_fmadd_ps(pg, kv[v], acc[g * DV + v]);           \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        for (int64_t g = 0; g < G; ++g) {                                                            \
            const __m256 inv = _mm256_set1_ps(l[g] > 0.0f ? 1.0f / l[g] : 0.0f); /* len 0: zeros */ \
            float o[8] __attribute__((aligned(32)));                                                 \
            for (int64_t v = 0; v < DV; ++v) {                                                       \
                _mm256_store_ps(o, _mm256_mul_ps(acc[g * DV + v], inv));                             \
                for (int i = 0; i < 8; ++i) STORE(out + g * o_sh + 8 * v + i, o[i]);                 \
            }                                                                                        \
        }                                                                                            \
    }

PS_DEFINE_ITEM_AVX2(ps_item_avx_f32, float, PS_LOAD8_F32, ps_store_f32)
PS_DEFINE_ITEM_AVX2(ps_item_avx_bf16, uint16_t, PS_LOAD8_BF16, ps_store_bf16)
#endif

/* One work item through the best copy: with AVX-512 and head_dim a multiple of 16, the vector item
 * (specialised for head_dim 64 / block_size 16 with 1-4 query heads per KV head: SmolLM2 has 3,
 * Llama-3 and Qwen2 4 or more); otherwise the portable item (specialised for 64 / 128 with BS 16). */
#define PS_ITEM_ARGS(G_, D_, BS_) qw, kw, vw, btw, lens[b], start, ow, G_, D_, BS_, q_sh, k_sb, k_ss, v_sb, v_ss, o_sh, scale
#ifdef PS_AVX512
#define PS_DISPATCH_ITEM(ITEM, AVX_ITEM)                                                              \
    if (D == 64 && BS == 16 && G == 3) AVX_ITEM(PS_ITEM_ARGS(3, 64, 16));                          \
    else if (D == 64 && BS == 16 && G == 4) AVX_ITEM(PS_ITEM_ARGS(4, 64, 16));                     \
    else if (D == 64 && BS == 16 && G == 1) AVX_ITEM(PS_ITEM_ARGS(1, 64, 16));                     \
    else if (D == 64 && BS == 16 && G == 2) AVX_ITEM(PS_ITEM_ARGS(2, 64, 16));                     \
    else if (D == 128 && BS == 16) AVX_ITEM(PS_ITEM_ARGS(G, 128, 16));                             \
    else if (D % 16 == 0) AVX_ITEM(PS_ITEM_ARGS(G, D, BS));                                        \
    else ITEM(PS_ITEM_ARGS(G, D, BS));
#elif defined(PS_AVX2)
#define PS_DISPATCH_ITEM(ITEM, AVX_ITEM)                                                              \
    if (D == 64 && BS == 16 && G == 3) AVX_ITEM(PS_ITEM_ARGS(3, 64, 16));                          \
    else if (D == 64 && BS == 16 && G == 4) AVX_ITEM(PS_ITEM_ARGS(4, 64, 16));                     \
    else if (D == 64 && BS == 16 && G == 1) AVX_ITEM(PS_ITEM_ARGS(1, 64, 16));                     \
    else if (D == 64 && BS == 16 && G == 2) AVX_ITEM(PS_ITEM_ARGS(2, 64, 16));                     \
    else if (D == 128 && BS == 16) AVX_ITEM(PS_ITEM_ARGS(G, 128, 16));                             \
    else if (D % 8 == 0) AVX_ITEM(PS_ITEM_ARGS(G, D, BS));                                         \
    else ITEM(PS_ITEM_ARGS(G, D, BS));
#else
#define PS_DISPATCH_ITEM(ITEM, AVX_ITEM)                                                              \
    if (D == 64 && BS == 16) ITEM(PS_ITEM_ARGS(G, 64, 16));                                        \
    else if (D == 128 && BS == 16) ITEM(PS_ITEM_ARGS(G, 128, 16));                                 \
    else ITEM(PS_ITEM_ARGS(G, D, BS));
#endif

/* The entry point (returns 1, computing nothing, when a block id is outside the pool): all (sequence, KV head) items over the OpenMP pool, dispatched to copies of
 * the item specialised for head_dim 64 / 128 with block_size 16 (SmolLM2, Llama, Qwen2 defaults). */
#define PS_DEFINE_DECODE(NAME, ITEM, AVX_ITEM, T)                                                               \
    int64_t NAME(const T *q, const T *kc, const T *vc, const int32_t *bt, const int32_t *lens, T *out, \
                 int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS, int64_t bt_stride,      \
                 int64_t NB, int64_t q_sb, int64_t q_sh, int64_t k_sb, int64_t k_ss, int64_t k_sh,  \
                 int64_t v_sb, int64_t v_ss, int64_t v_sh, int64_t o_sb, int64_t o_sh, float scale, \
                 int64_t window, int nthreads) {                                                     \
        if (ps_bad_block_ids(bt, lens, B, BS, bt_stride, NB)) return 1; /* nothing computed */     \
        const int64_t G = Hq / Hkv;                                                                  \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads)")                       \
        for (int64_t w = 0; w < B * Hkv; ++w) {                                                      \
            const int64_t b = w / Hkv, h = w % Hkv;                                                  \
            const T *qw = q + b * q_sb + h * G * q_sh;                                               \
            const T *kw = kc + h * k_sh, *vw = vc + h * v_sh;                                        \
            const int32_t *btw = bt + b * bt_stride;                                                 \
            T *ow = out + b * o_sb + h * G * o_sh;                                                   \
            /* a sliding window (window > 0): only the last `window` positions are read */           \
            const int64_t start = window > 0 && lens[b] > window ? lens[b] - window : 0;             \
            PS_DISPATCH_ITEM(ITEM, AVX_ITEM)                                                         \
        }                                                                                            \
        return 0;                                                                                    \
    }

PS_DEFINE_ITEM(ps_item_f32, float, ps_load_f32, ps_store_f32)
PS_DEFINE_ITEM(ps_item_bf16, uint16_t, ps_load_bf16, ps_store_bf16)
#if !defined(PS_AVX512) && !defined(PS_AVX2)
#define ps_item_avx_f32 ps_item_f32
#define ps_item_avx_bf16 ps_item_bf16
#endif
PS_DEFINE_DECODE(ps_paged_decode_f32, ps_item_f32, ps_item_avx_f32, float)
PS_DEFINE_DECODE(ps_paged_decode_bf16, ps_item_bf16, ps_item_avx_bf16, uint16_t)

/* Limits the launcher checks before calling (beyond them it uses the torch path). */
int64_t ps_max_g(void) { return PS_MAX_G; }
int64_t ps_max_d(void) { return PS_MAX_D; }
int64_t ps_max_bs(void) { return PS_MAX_BS; }
