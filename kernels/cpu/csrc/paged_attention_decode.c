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
 * online softmax (running max m, running sum l, unnormalised accumulator acc), in float32 (bfloat16
 * with AVX512-BF16: both products on bf16 pairs, ps_item_dp_bf16).
 *
 *     block j of sequence b:  rows t = 0 .. n-1 (n = BS, or what is left of lens[b])
 *         s[g][t] = scale * q[g] . k[t]                    (scores of the block)
 *         m' = max(m, max_t s[g][t]);  a = exp(m - m')     (rescale what came before)
 *         acc[g] = a * acc[g] + sum_t exp(s[g][t] - m') v[t];   l = a * l + sum_t exp(...)
 *     out[g] = acc[g] / l[g]
 *
 * A prefix shared by many sequences goes through flash items first and the item above starts from
 * their state (m, l, acc) at the first key after it: see "Shared prefixes" below.
 */
#include "decode_tile.h"
#include "flash_item.h"
#include "ps_cpu.h"

/* PS_MAX_G, PS_MAX_D and PS_MAX_BS (the items' limits) are in decode_tile.h. */

/* One work item, (sequence b, KV head h): q, kc, vc and out already point at head h's G query rows,
 * KV column and output rows; bt_row is sequence b's block table. always_inline, so the callers
 * below get copies specialised for the common head_dim / block_size (the loops then unroll). */
#define PS_DEFINE_ITEM(NAME, T, LOAD, STORE)                                                          \
    static inline __attribute__((always_inline)) void NAME(                                          \
        const T *restrict q, const T *restrict kc, const T *restrict vc, const int32_t *restrict bt_row, \
        const int64_t len, const int64_t start, T *restrict out, const int64_t G, const int64_t D,  \
        const int64_t BS, const int64_t q_sh, const int64_t k_sb, const int64_t k_ss, const int64_t v_sb, \
        const int64_t v_ss, const int64_t o_sh, const float scale, const float *restrict init) {     \
        float qs[PS_MAX_G * PS_MAX_D], acc[PS_MAX_G * PS_MAX_D], row[PS_MAX_D];                      \
        float s[PS_MAX_G * PS_MAX_BS], m[PS_MAX_G], l[PS_MAX_G];                                     \
        for (int64_t g = 0; g < G; ++g) {                                                            \
            LOAD(q + g * q_sh, qs + g * D, D);                                                       \
            for (int64_t d = 0; d < D; ++d) qs[g * D + d] *= scale;                                  \
            for (int64_t d = 0; d < D; ++d) acc[g * D + d] = init ? init[g * (D + 2) + 2 + d] : 0.0f;  \
            m[g] = init ? init[g * (D + 2)] : -INFINITY;                                             \
            l[g] = init ? init[g * (D + 2) + 1] : 0.0f;                                              \
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
/* PS_PERM, ps_tile_valid and ps_hsum16 live in decode_tile.h (the fp8 decode items, kv_fp8.c, use them too). */

#define PS_LOADV_F32(p) _mm512_loadu_ps(p)
#define PS_LOADV_BF16(p) ps_load16_bf16((p), (__mmask16)0xffff)
#define PS_STOREV_F32(p, v) _mm512_storeu_ps((p), (v))
#define PS_STOREV_BF16(p, v) ps_store16_bf16((p), (v), (__mmask16)0xffff)

#define PS_DEFINE_ITEM_AVX(NAME, T, LOADV, STOREV)                                                    \
    static inline __attribute__((always_inline)) void NAME(                                          \
        const T *restrict q, const T *restrict kc, const T *restrict vc, const int32_t *restrict bt_row, \
        const int64_t len, const int64_t start, T *restrict out, const int64_t G, const int64_t D,  \
        const int64_t BS, const int64_t q_sh, const int64_t k_sb, const int64_t k_ss, const int64_t v_sb, \
        const int64_t v_ss, const int64_t o_sh, const float scale, const float *restrict init) {     \
        const int64_t DV = D / 16;                                                                   \
        __m512 qs[PS_MAX_G * PS_MAX_D / 16], acc[PS_MAX_G * PS_MAX_D / 16], kv[PS_MAX_D / 16];      \
        __m512 part[PS_MAX_G][16];                                                                   \
        float p[PS_MAX_G][16] __attribute__((aligned(64))), m[PS_MAX_G], l[PS_MAX_G];               \
        for (int64_t g = 0; g < G; ++g) {                                                            \
            for (int64_t v = 0; v < DV; ++v) {                                                       \
                qs[g * DV + v] = _mm512_mul_ps(LOADV(q + g * q_sh + 16 * v), _mm512_set1_ps(scale)); \
                acc[g * DV + v] = init ? _mm512_loadu_ps(init + g * (D + 2) + 2 + 16 * v) : _mm512_setzero_ps(); \
            }                                                                                        \
            m[g] = init ? init[g * (D + 2)] : -INFINITY;                                             \
            l[g] = init ? init[g * (D + 2) + 1] : 0.0f;                                              \
        }                                                                                            \
        const int64_t nblk = len > 0 ? (len + BS - 1) / BS : 0;                                      \
        for (int64_t j = start / BS; j < nblk; ++j) {                                                \
            const T *kb = kc + (int64_t)bt_row[j] * k_sb, *vb = vc + (int64_t)bt_row[j] * v_sb;      \
            const int64_t n = len - j * BS < BS ? len - j * BS : BS;                                 \
            const char *kpf, *vpf; /* the pool ahead, a row of K and V a token (flash_item.h) */       \
            ps_decode_ahead((const char *)kc, (const char *)vc, bt_row, j, start / BS, nblk, BS,     \
                            k_sb * (int64_t)sizeof(T), v_sb * (int64_t)sizeof(T), k_ss * (int64_t)sizeof(T), \
                            v_ss * (int64_t)sizeof(T), D * (int64_t)sizeof(T), &kpf, &vpf);         \
            for (int64_t t0 = 0; t0 < n; t0 += 16) {                                                 \
                const int64_t nt = n - t0 < 16 ? n - t0 : 16;                                        \
                const int64_t skip = start - j * BS - t0; /* tokens before a window start: masked */  \
                const __mmask16 valid = ps_tile_valid(nt, skip);                                     \
                if (!valid) continue; /* wholly before the window: no score, no NaN from exp(-inf + inf) */ \
                for (int64_t t = 0; t < 16; ++t) {                                                   \
                    if (kpf && t0 + t < BS)                                                          \
                        ps_prefetch_row(kpf + (t0 + t) * k_ss * (int64_t)sizeof(T),                  \
                                        vpf + (t0 + t) * v_ss * (int64_t)sizeof(T), D * (int64_t)sizeof(T)); \
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

#if defined(PS_AVX512) && defined(__AVX512BF16__)
/* bfloat16 with AVX512-BF16, head_dim a multiple of 32: the item above with both products on vdpbf16ps
 * (16 lanes of bf16 pairs, each pair's two products added into a float32 lane), as the prefill item
 * does (flash_item.h ps_prefill_item_dp). The item above widens every K and V element to float32 (two
 * integer ops a vector) and spends one FMA per element and query head; here K rows are read as d pairs
 * as they lie in the cache, and each two V rows are interleaved into position pairs (one unpack a
 * vector), so each instruction does two FMAs' work and nothing is widened.
 *
 *     scores: part[g][PS_PERM[t]] = sum over k's D/32 vectors of dp(q[g] pairs, k[t] pairs); ps_hsum16; * scale
 *     P.V:    acc[g][.] += dp((v[t][d], v[t+1][d]) pairs, (p[g][t], p[g][t+1]) broadcast)
 *
 * The unpacks leave acc's lanes in another order than d: within 32 columns, the low unpack holds d =
 * 8L + j and the high one 8L + 4 + j in lane 4L + j (L the 128-bit lane, j < 4). The order is undone
 * once, when the item loads its starting state and stores its rows (ps_dp_from_d / ps_dp_to_d).
 * Probabilities round to bfloat16 before P.V, and q is not pre-scaled (the scale multiplies the
 * scores): results stay within 2^-9 of the largest |V| of the float32 math, as for prefill.
 * Per layer, 2-core AMD EPYC Zen 4, SmolLM2's 9 query / 3 KV heads, medians, interleaved runs: 64
 * sequences x 350 tokens 0.88-0.89 -> 0.59-0.63 ms warm, 1.58-1.65 -> 1.09-1.19 ms with the caches flushed
 * before each call; 4 x 530 0.10 -> 0.07 / 0.32-0.34 -> 0.23 ms. The unique-prompt workload's decode
 * attention (benchmarks/profile_gsp.py --workload unique_prompts) 1.98 -> 1.77 s: in the engine the
 * pool's reads bound it more than the flushed microbenchmark. */
static inline __attribute__((always_inline)) void ps_dp_from_d(const __m512 n0, const __m512 n1, __m512 *lo, __m512 *hi) {
    const __m512i il = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i ih = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    *lo = _mm512_permutex2var_ps(n0, il, n1);
    *hi = _mm512_permutex2var_ps(n0, ih, n1);
}
static inline __attribute__((always_inline)) void ps_dp_to_d(const __m512 lo, const __m512 hi, __m512 *n0, __m512 *n1) {
    const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    *n0 = _mm512_permutex2var_ps(lo, i0, hi);
    *n1 = _mm512_permutex2var_ps(lo, i1, hi);
}

static inline __attribute__((always_inline)) void ps_item_dp_bf16(
    const uint16_t *restrict q, const uint16_t *restrict kc, const uint16_t *restrict vc, const int32_t *restrict bt_row,
    const int64_t len, const int64_t start, uint16_t *restrict out, const int64_t G, const int64_t D, const int64_t BS,
    const int64_t q_sh, const int64_t k_sb, const int64_t k_ss, const int64_t v_sb, const int64_t v_ss, const int64_t o_sh,
    const float scale, const float *restrict init) {
    if (D % 32) { /* constant in every specialised copy: folds away */
        ps_item_avx_bf16(q, kc, vc, bt_row, len, start, out, G, D, BS, q_sh, k_sb, k_ss, v_sb, v_ss, o_sh, scale, init);
        return;
    }
    const int64_t DW = D / 32, DV = D / 16; /* 32-column words of a row; acc vectors per query head */
    __m512bh qp[PS_MAX_G][PS_MAX_D / 32];
    __m512 acc[PS_MAX_G][PS_MAX_D / 16], part[PS_MAX_G][16];
    uint16_t pb[PS_MAX_G][16] __attribute__((aligned(64))); /* a tile's probabilities in bfloat16 */
    float m[PS_MAX_G], l[PS_MAX_G];
    for (int64_t g = 0; g < G; ++g) {
        for (int64_t w = 0; w < DW; ++w) {
            qp[g][w] = (__m512bh)_mm512_loadu_si512(q + g * q_sh + 32 * w);
            const __m512 n0 = init ? _mm512_loadu_ps(init + g * (D + 2) + 2 + 32 * w) : _mm512_setzero_ps();
            const __m512 n1 = init ? _mm512_loadu_ps(init + g * (D + 2) + 18 + 32 * w) : _mm512_setzero_ps();
            ps_dp_from_d(n0, n1, &acc[g][2 * w], &acc[g][2 * w + 1]);
        }
        m[g] = init ? init[g * (D + 2)] : -INFINITY;
        l[g] = init ? init[g * (D + 2) + 1] : 0.0f;
    }
    const int64_t nblk = len > 0 ? (len + BS - 1) / BS : 0;
    for (int64_t j = start / BS; j < nblk; ++j) {
        const uint16_t *kb = kc + (int64_t)bt_row[j] * k_sb, *vb = vc + (int64_t)bt_row[j] * v_sb;
        const int64_t n = len - j * BS < BS ? len - j * BS : BS;
        const int64_t rb = D * (int64_t)sizeof(uint16_t), kb_ss = k_ss * (int64_t)sizeof(uint16_t),
                      vb_ss = v_ss * (int64_t)sizeof(uint16_t);
        const char *kpf, *vpf; /* the pool ahead, a row of K and V a token (flash_item.h) */
        ps_decode_ahead((const char *)kc, (const char *)vc, bt_row, j, start / BS, nblk, BS, k_sb * (int64_t)sizeof(uint16_t),
                        v_sb * (int64_t)sizeof(uint16_t), kb_ss, vb_ss, rb, &kpf, &vpf);
        for (int64_t t0 = 0; t0 < n; t0 += 16) {
            const int64_t nt = n - t0 < 16 ? n - t0 : 16;
            const int64_t skip = start - j * BS - t0;
            const __mmask16 valid = ps_tile_valid(nt, skip);
            if (!valid) continue;
            for (int64_t t = 0; t < 16; ++t) {
                if (kpf && t0 + t < BS) ps_prefetch_row(kpf + (t0 + t) * kb_ss, vpf + (t0 + t) * vb_ss, rb);
                if (t < nt) {
                    const uint16_t *kr = kb + (t0 + t) * k_ss;
                    __m512bh kw[PS_MAX_D / 32];
                    for (int64_t w = 0; w < DW; ++w) kw[w] = (__m512bh)_mm512_loadu_si512(kr + 32 * w);
                    for (int64_t g = 0; g < G; ++g) {
                        __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), qp[g][0], kw[0]);
                        for (int64_t w = 1; w < DW; ++w) dot = _mm512_dpbf16_ps(dot, qp[g][w], kw[w]);
                        part[g][PS_PERM[t]] = dot;
                    }
                } else {
                    for (int64_t g = 0; g < G; ++g) part[g][PS_PERM[t]] = _mm512_setzero_ps();
                }
            }
            for (int64_t g = 0; g < G; ++g) {
                const __m512 sc = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY),
                                                       _mm512_mul_ps(ps_hsum16(part[g]), _mm512_set1_ps(scale)));
                const float mx = fmaxf(m[g], _mm512_reduce_max_ps(sc));
                const float alpha = ps_exp(m[g] - mx);
                const __m512 e = _mm512_maskz_mov_ps(valid, ps_exp16(_mm512_sub_ps(sc, _mm512_set1_ps(mx))));
                l[g] = l[g] * alpha + _mm512_reduce_add_ps(e);
                m[g] = mx;
                _mm256_store_si256((__m256i *)pb[g], (__m256i)_mm512_cvtneps_pbh(e));
                for (int64_t v = 0; v < DV; ++v) acc[g][v] = _mm512_mul_ps(acc[g][v], _mm512_set1_ps(alpha));
            }
            for (int64_t t = 0; t < nt; t += 2) { /* positions t, t + 1 as pairs (past nt: a zero row) */
                const uint16_t *va = vb + (t0 + t) * v_ss, *vn = t + 1 < nt ? va + v_ss : PS_ZERO_ROW;
                for (int64_t w = 0; w < DW; ++w) {
                    const __m512i a = _mm512_loadu_si512(va + 32 * w), b = _mm512_loadu_si512(vn + 32 * w);
                    const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
                    for (int64_t g = 0; g < G; ++g) {
                        int32_t pw; /* p[g][t] | p[g][t + 1] << 16 */
                        memcpy(&pw, pb[g] + t, sizeof pw);
                        const __m512bh pp = (__m512bh)_mm512_set1_epi32(pw);
                        acc[g][2 * w] = _mm512_dpbf16_ps(acc[g][2 * w], lo, pp);
                        acc[g][2 * w + 1] = _mm512_dpbf16_ps(acc[g][2 * w + 1], hi, pp);
                    }
                }
            }
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        const __m512 inv = _mm512_set1_ps(l[g] > 0.0f ? 1.0f / l[g] : 0.0f); /* len 0: zeros */
        for (int64_t w = 0; w < DW; ++w) {
            __m512 n0, n1;
            ps_dp_to_d(acc[g][2 * w], acc[g][2 * w + 1], &n0, &n1);
            PS_STOREV_BF16(out + g * o_sh + 32 * w, _mm512_mul_ps(n0, inv));
            PS_STOREV_BF16(out + g * o_sh + 32 * w + 16, _mm512_mul_ps(n1, inv));
        }
    }
}
#define ps_item_avx_bf16_best ps_item_dp_bf16
#else
#define ps_item_avx_bf16_best ps_item_avx_bf16
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
        const int64_t v_ss, const int64_t o_sh, const float scale, const float *restrict init) {     \
        const int64_t DV = D / 8;                                                                    \
        __m256 qs[PS_MAX_G * PS_MAX_D / 8], acc[PS_MAX_G * PS_MAX_D / 8], kv[PS_MAX_D / 8];         \
        __m256 part[PS_MAX_G][8];                                                                    \
        float p[PS_MAX_G][8] __attribute__((aligned(32))), m[PS_MAX_G], l[PS_MAX_G];                \
        const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);                              \
        for (int64_t g = 0; g < G; ++g) {                                                            \
            for (int64_t v = 0; v < DV; ++v) {                                                       \
                qs[g * DV + v] = _mm256_mul_ps(LOADV(q + g * q_sh + 8 * v), _mm256_set1_ps(scale));  \
                acc[g * DV + v] = init ? _mm256_loadu_ps(init + g * (D + 2) + 2 + 8 * v) : _mm256_setzero_ps(); \
            }                                                                                        \
            m[g] = init ? init[g * (D + 2)] : -INFINITY;                                             \
            l[g] = init ? init[g * (D + 2) + 1] : 0.0f;                                              \
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
#define PS_ITEM_ARGS(G_, D_, BS_) \
    qw, kw, vw, btw, lens[b], start, ow, G_, D_, BS_, q_sh, k_sb, k_ss, v_sb, v_ss, o_sh, scale, init
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

/* ---------------------------------------------------------------------------------------------
 * Shared prefixes (GSP questions over one system prompt, n > 1 samples, beams): sequences whose first
 * blocks are the same block ids read the same keys. Per sequence, the item above reads them once per
 * sequence and keeps only G rows (one sequence's query heads) busy per key, well under the FMA rate
 * (~120 GFLOP/s for 64 sequences over 1,100 tokens on a 2-core Zen 5). Where at least
 * PS_SHARED_MIN_ROWS query rows share at least PS_SHARED_MIN_KEYS keys, the shared part runs as flash
 * items of 32 rows (flash_item.h, as prefill: 250-330 GFLOP/s there, bfloat16 pairs ~550), which leave
 * each row's softmax state (m, l, unnormalised acc); each sequence's own item then starts from that
 * state at the first key past the shared part. Only with AVX-512 or AVX2 (the portable flash item is slow)
 * and without a sliding window.
 *
 *     group: members b_0 .. b_n-1 (bt[b_i][0 .. c) equal), nkeys = c BS rounded down to 16 (32 on AMX)
 *         phase 1: gather keys 0 .. nkeys-1 once per KV head (the first member's block table)
 *         phase 2: items of 32 (member, query head) rows over them, no mask -> state[i][head] (m, l, acc[D])
 *         phase 3: every sequence's item from `start` = its group's nkeys (0 outside groups), init = state
 */
/* Query rows a group needs (members x G): one part-filled flash item already beats reading the prefix once
 * per sequence, in both dtypes. Measured per layer, per-sequence -> shared, scratch reused, medians of 60
 * (9 query / 3 KV heads, 1,024 shared tokens + 16-80 own unless said):
 *   2-core AMD EPYC Zen 5, bfloat16 pairs: 8 samples (24 rows) 0.19 -> 0.10-0.16 ms; 4 x 16 sequences
 *     1.33-1.54 -> 0.55-0.92; 64: 1.28-1.31 -> 0.38-0.54.
 *   The same CPU, float32, once the flash items had their register transposes (the threshold had been 96 rows, set when
 *     48 measured slower): 8 samples 0.183-0.187 -> 0.135-0.138 ms; 2 x 8 over 512 0.180-0.187 -> 0.123;
 *     4 x 16 1.52-1.63 -> 1.00-1.07; 64 0.59 both. Under 16 rows the items lose: 4 beams over 512 (12
 *     rows) 0.06 -> 0.08, 2 samples (6 rows) 0.063 -> 0.13.
 *   2-core Intel Xeon with AMX, float32, 4 x 16: ~9% faster shared.
 *   AVX2 (flash_item.h's 8-lane item), 2-core AMD EPYC Zen 3, cold pool: 4 x 16 over 1,024 + 40 own,
 *     48 rows: 4.1-4.8 -> 3.2-4.1 ms; 64 over 1,024 + 20: 3.3-4.4 -> 2.0-2.7 ms; 8 samples (24 rows):
 *     0.77-0.90 -> 0.72-0.96 ms. */
#if defined(PS_AVX512) || defined(PS_AVX2)
#define PS_SHARED_FLASH 1 /* flash_item.h's items are vectorised for this CPU: shared prefixes use them */
#endif
#define PS_SHARED_MIN_ROWS 16
#define PS_SHARED_MIN_KEYS 64

typedef struct {
    int64_t first, n, nkeys; /* members order[first .. first + n), keys shared */
    int64_t ws_at, q_at, state_at; /* offsets of its gathered K/V, its queries, its state */
    int64_t chunk_at, item_at; /* its first phase-1 chunk and phase-2 item */
} ps_group;

/* Groups of sequences whose first blocks are equal ids, each with its members (in `order`), their
 * number and the keys they share (whole blocks before every member's last position, rounded down to
 * 16); group_of[b] is b's group or -1, local[b] its index there. Returns the number of groups. */
static int64_t ps_plan_shared(const int32_t *bt, const int32_t *lens, int64_t B, int64_t BS, int64_t bt_stride,
                              int64_t G, int64_t min_rows, int64_t key_multiple, int64_t *group_of, int64_t *local,
                              int64_t *order, ps_group *groups) {
    int64_t ng = 0, placed = 0;
    for (int64_t b = 0; b < B; ++b) group_of[b] = -1;
    for (int64_t b = 0; b < B; ++b) {
        if (group_of[b] != -1 || lens[b] - 1 < PS_SHARED_MIN_KEYS) continue;
        int64_t n = 0, limit = (lens[b] - 1) / BS; /* the last position's block is never shared */
        for (int64_t o = b; o < B; ++o)
            if (group_of[o] == -1 && lens[o] - 1 >= PS_SHARED_MIN_KEYS && bt[o * bt_stride] == bt[b * bt_stride]) {
                order[placed + n++] = o;
                group_of[o] = -2; /* considered: not a group's first again */
                if ((lens[o] - 1) / BS < limit) limit = (lens[o] - 1) / BS;
            }
        int64_t c = 0;
        for (int same = 1; same && c < limit; c += same)
            for (int64_t i = 1; i < n && same; ++i) same = bt[order[placed + i] * bt_stride + c] == bt[b * bt_stride + c];
        const int64_t nkeys = c * BS / key_multiple * key_multiple;
        if (n * G < min_rows || nkeys < PS_SHARED_MIN_KEYS) continue;
        groups[ng] = (ps_group){placed, n, nkeys, 0, 0, 0, 0, 0};
        for (int64_t i = 0; i < n; ++i) {
            group_of[order[placed + i]] = ng;
            local[order[placed + i]] = i;
        }
        placed += n;
        ++ng;
    }
    for (int64_t b = 0; b < B; ++b)
        if (group_of[b] == -2) group_of[b] = -1;
    return ng;
}

/* Whether a call's shared prefixes run on AMX tiles (bfloat16; flash_amx.h), their keys then a multiple of
 * PS_AMX_KEYS. */
static inline int ps_shared_amx(int bf16, int64_t D) {
#ifdef PS_PF_AMX
    return bf16 && ps_amx_takes(D) && ps_amx_permitted();
#else
    (void)bf16, (void)D;
    return 0;
#endif
}

/* Whether a decode call of this shape looks for shared prefixes at all. */
static inline int ps_shared_applies(int64_t B, int64_t D, int64_t window) {
#ifdef PS_SHARED_FLASH
    return window <= 0 && D % PS_PF_DB == 0 && D <= PS_PF_MAX_D && B >= 2;
#else
    (void)B, (void)D, (void)window;
    return 0;
#endif
}

/* The number of groups a decode call with these arguments attends through the flash items (tests). */
int64_t ps_decode_shared_groups(const int32_t *bt, const int32_t *lens, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                                int64_t BS, int64_t bt_stride, int64_t window, int64_t bf16) {
#ifdef PS_SHARED_FLASH
    if (!ps_shared_applies(B, D, window)) return 0;
    int64_t *ids = malloc(3 * B * sizeof(int64_t));
    ps_group *groups = malloc(B * sizeof(ps_group));
    int64_t ng = ids && groups ? ps_plan_shared(bt, lens, B, BS, bt_stride, Hq / Hkv, PS_SHARED_MIN_ROWS,
                                                ps_shared_amx((int)bf16, D) ? PS_AMX_KEYS : 16, ids, ids + B, ids + 2 * B,
                                                groups)
                                    : 0;
    free(ids);
    free(groups);
    return ng;
#else
    (void)bt, (void)lens, (void)B, (void)Hq, (void)Hkv, (void)D, (void)BS, (void)bt_stride, (void)window, (void)bf16;
    return 0;
#endif
}

/* One decode call's shared-prefix work: its groups and where their buffers lie in the caller's scratch
 * (all NULL / 0 without groups). The caller's scratch, not malloc: a fresh multi-MiB buffer per layer
 * was faulted in page by page in some processes (glibc's heap did not keep it), 2.5k faults a call. */
typedef struct {
    int64_t ng, Hq, chunks, items;
    int amx; /* the groups run on AMX tiles (flash_amx.h's layout and item) */
    ps_group *groups;
    int64_t *group_of, *local, *order; /* one allocation of 3 B */
    float *ws;    /* every group's gathered keys 0 .. nkeys-1 (flash_item.h's layout, lp = nkeys) */
    char *qbuf;   /* every group's member queries, [n, Hq, D] in the model dtype */
    float *state; /* every group's [n, Hq, D + 2]: m, l, acc[D] per (member, query head) */
} ps_shared;

static void ps_shared_free(ps_shared *sh) {
    free(sh->groups);
    free(sh->group_of);
}

/* Plans the groups and lays their buffers out in scratch (scratch_floats long), filling their queries.
 * Returns 2 (nothing held) without memory, 3 (nothing held, *need set) when scratch is too short,
 * else 0. */
static int ps_shared_prepare(ps_shared *sh, const void *q, size_t elem, const int32_t *bt, const int32_t *lens, int64_t B,
                             int64_t Hq, int64_t Hkv, int64_t D, int64_t BS, int64_t bt_stride, int64_t q_sb,
                             int64_t q_sh, int64_t window, float *scratch, int64_t scratch_floats, int64_t *need) {
    if (!ps_shared_applies(B, D, window)) return 0;
    const int64_t G = Hq / Hkv;
    sh->Hq = Hq;
    sh->group_of = malloc(3 * B * sizeof(int64_t));
    sh->groups = malloc(B * sizeof(ps_group));
    if (!sh->group_of || !sh->groups) goto oom;
    sh->local = sh->group_of + B;
    sh->order = sh->group_of + 2 * B;
    sh->amx = ps_shared_amx(elem == sizeof(uint16_t), D);
    sh->ng = ps_plan_shared(bt, lens, B, BS, bt_stride, G, PS_SHARED_MIN_ROWS,
                            sh->amx ? PS_AMX_KEYS : 16, sh->group_of,
                            sh->local, sh->order, sh->groups);
    if (!sh->ng) {
        ps_shared_free(sh);
        *sh = (ps_shared){0};
        return 0;
    }
    int64_t ws = 0, qn = 0, st = 0;
    for (int64_t g = 0; g < sh->ng; ++g) {
        ps_group *gr = sh->groups + g;
        gr->ws_at = ws, gr->q_at = qn, gr->state_at = st, gr->chunk_at = sh->chunks, gr->item_at = sh->items;
        ws += gr->nkeys * 2 * Hkv * D;
        qn += gr->n * Hq * D;
        st += gr->n * Hq * (D + 2);
        sh->chunks += Hkv * (gr->nkeys / 16);
        sh->items += Hkv * ((gr->n * G + PS_PF_ROWS - 1) / PS_PF_ROWS);
    }
    const int64_t q_floats = (qn * (int64_t)elem + sizeof(float) - 1) / sizeof(float);
    if (ws + st + q_floats > scratch_floats) {
        *need = ws + st + q_floats;
        ps_shared_free(sh);
        return 3;
    }
    sh->ws = scratch;
    sh->state = scratch + ws;
    sh->qbuf = (char *)(scratch + ws + st);
    for (int64_t g = 0; g < sh->ng; ++g)
        for (int64_t i = 0; i < sh->groups[g].n; ++i)
            for (int64_t k = 0; k < Hq; ++k)
                memcpy(sh->qbuf + (sh->groups[g].q_at + (i * Hq + k) * D) * elem,
                       (const char *)q + (sh->order[sh->groups[g].first + i] * q_sb + k * q_sh) * elem, D * elem);
    return 0;
oom:
    ps_shared_free(sh);
    return 2;
}

/* The group that owns work unit w of a phase (at: the group's first unit in that phase). */
static inline int64_t ps_group_of_unit(const ps_shared *sh, int64_t w, int chunks) {
    int64_t g = 0;
    while (g + 1 < sh->ng && (chunks ? sh->groups[g + 1].chunk_at : sh->groups[g + 1].item_at) <= w) ++g;
    return g;
}

/* Phases 1 and 2, by every thread of the calling parallel region (each loop ends in its barrier). */
static inline __attribute__((always_inline)) void ps_shared_run(
    const ps_shared *sh, const void *kc, const void *vc, const int32_t *bt, int64_t Hkv, int64_t D, int64_t BS,
    int64_t bt_stride, int64_t k_sb, int64_t k_ss, int64_t k_sh, int64_t v_sb, int64_t v_ss, int64_t v_sh, float scale,
    const int bf16) {
#ifdef PS_SHARED_FLASH
    if (!sh->ng) return;
    const int64_t Hq = sh->Hq, G = Hq / Hkv;
    const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
#ifdef PS_PF_DP
    const int pairs_item = 1; /* bfloat16 runs ps_prefill_item_dp, which can read its tiles in place */
#else
    const int pairs_item = 0;
#endif
    /* the items read the shared keys in place (ps_kv_rows / ps_kv_pairs), whole tiles only: nkeys is a
     * multiple of 16; AMX items and the widened bfloat16 item read gathered keys */
    const int in_place = BS % 16 == 0 && !sh->amx && (!bf16 || pairs_item);
#pragma omp for schedule(static)
    for (int64_t w = 0; w < sh->chunks; ++w) {
        const ps_group *gr = sh->groups + ps_group_of_unit(sh, w, 1);
        const int64_t c = w - gr->chunk_at, per_head = gr->nkeys / 16, h = c / per_head, p0 = c % per_head * 16;
#ifdef PS_PF_AMX
        if (sh->amx) {
            ps_gather_chunk_amx(kc, vc, bt + sh->order[gr->first] * bt_stride, p0, p0 + 16, BS, k_sb, k_ss, k_sh, v_sb,
                                v_ss, v_sh, h, Hkv, D, gr->nkeys, sh->ws + gr->ws_at);
            continue;
        }
#endif
        if (in_place) continue; /* the items read the shared keys where they are */
        ps_gather_chunk(kc, vc, bt + sh->order[gr->first] * bt_stride, p0, p0 + 16, BS, k_sb, k_ss, k_sh, v_sb, v_ss,
                        v_sh, h, Hkv, D, gr->nkeys, sh->ws + gr->ws_at, bf16);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < sh->items; ++w) {
        const ps_group *gr = sh->groups + ps_group_of_unit(sh, w, 0);
        const int64_t per_head = (gr->n * G + PS_PF_ROWS - 1) / PS_PF_ROWS, c = w - gr->item_at;
        const int64_t h = c / per_head, r0 = c % per_head * PS_PF_ROWS, lp = gr->nkeys;
        const float *base = sh->ws + gr->ws_at;
        const char *qg = sh->qbuf + gr->q_at * elem;
        float *st = sh->state + gr->state_at;
#ifdef PS_PF_AMX
        if (sh->amx) {
            const uint16_t *Kb = (const uint16_t *)base + h * lp * D;
            const uint16_t *VT = (const uint16_t *)(base + Hkv * lp * D) + h * lp * D;
            const ps_krows K = ps_amx_krows(kc, bt + sh->order[gr->first] * bt_stride, k_sb, k_ss, k_sh, h, BS, D, Kb);
            ps_prefill_amx((const uint16_t *)qg, Hq * D, D, NULL, Hq * (D + 2), D + 2, K, lp, VT, lp, lp, r0, gr->n * G,
                           G, h, D, scale, lp, st);
            continue;
        }
#endif
#ifdef PS_PF_DP
        if (bf16) {
            const uint16_t *Kb = (const uint16_t *)base + h * lp * D;
            const uint32_t *Vp = (const uint32_t *)(base + Hkv * lp * D) + h * (lp / 2) * D;
            const ps_kv_pairs shared = {NULL, NULL, in_place ? lp : 0, (const uint16_t *)kc + h * k_sh,
                                        (const uint16_t *)vc + h * v_sh, bt + sh->order[gr->first] * bt_stride,
                                        k_sb, k_ss, v_sb, v_ss, BS};
            if (D == 64)
                ps_prefill_item_dp((const uint16_t *)qg, Hq * D, D, NULL, Hq * (D + 2), D + 2, Kb, Vp, shared, lp, r0, gr->n * G, G,
                                   h, 64, scale, lp, st);
            else
                ps_prefill_item_dp((const uint16_t *)qg, Hq * D, D, NULL, Hq * (D + 2), D + 2, Kb, Vp, shared, lp, r0, gr->n * G, G,
                                   h, D, scale, lp, st);
            continue;
        }
#endif
        const float *Kh = base + h * lp * D, *Vh = Kh + Hkv * lp * D;
        const ps_kv_rows src = in_place ? ps_kv_paged(kc, vc, bt + sh->order[gr->first] * bt_stride, h, k_sb, k_ss, k_sh,
                                                      v_sb, v_ss, v_sh, BS, lp)
                                        : PS_KV_GATHERED;
        if (D == 64)
            ps_prefill_item(qg, Hq * D, D, NULL, Hq * (D + 2), D + 2, Kh, Vh, src, lp, r0, gr->n * G, G, h, 64, scale, lp,
                            st, bf16);
        else
            ps_prefill_item(qg, Hq * D, D, NULL, Hq * (D + 2), D + 2, Kh, Vh, src, lp, r0, gr->n * G, G, h, D, scale, lp,
                            st, bf16);
    }
#else
    (void)sh, (void)kc, (void)vc, (void)bt, (void)Hkv, (void)D, (void)BS, (void)bt_stride, (void)k_sb, (void)k_ss;
    (void)k_sh, (void)v_sb, (void)v_ss, (void)v_sh, (void)scale, (void)bf16;
#endif
}

/* Sequence b's state for its query heads from head0 on, with *start moved past the shared keys; NULL
 * (start kept) outside groups. */
static inline const float *ps_shared_state(const ps_shared *sh, int64_t b, int64_t head0, int64_t D, int64_t *start) {
    if (!sh->ng || sh->group_of[b] < 0) return NULL;
    const ps_group *gr = sh->groups + sh->group_of[b];
    *start = gr->nkeys;
    return sh->state + gr->state_at + (sh->local[b] * sh->Hq + head0) * (D + 2);
}

/* The entry point (returns 1, computing nothing, when a block id is outside the pool; 2 without
 * memory; 3 when scratch is shorter than the *need floats the shared prefixes take): phases 1-2 for the groups above, then all (sequence, KV head) items over the OpenMP
 * pool, dispatched to copies of the item specialised for head_dim 64 / 128 with block_size 16
 * (SmolLM2, Llama, Qwen2 defaults). */
#define PS_DEFINE_DECODE(NAME, ITEM, AVX_ITEM, T, BF16)                                                         \
    int64_t NAME(const T *q, const T *kc, const T *vc, const int32_t *bt, const int32_t *lens, T *out, \
                 int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS, int64_t bt_stride,      \
                 int64_t NB, int64_t q_sb, int64_t q_sh, int64_t k_sb, int64_t k_ss, int64_t k_sh,  \
                 int64_t v_sb, int64_t v_ss, int64_t v_sh, int64_t o_sb, int64_t o_sh, float scale, \
                 int64_t window, int nthreads, float *scratch, int64_t scratch_floats, int64_t *need) {  \
        if (ps_bad_block_ids(bt, lens, B, BS, bt_stride, NB)) return 1; /* nothing computed */     \
        const int64_t G = Hq / Hkv;                                                                  \
        ps_shared shared = {0};                                                                      \
        const int refused = ps_shared_prepare(&shared, q, sizeof(T), bt, lens, B, Hq, Hkv, D, BS, bt_stride, q_sb, \
                                              q_sh, window, scratch, scratch_floats, need);          \
        if (refused) return refused;                                                                 \
        _Pragma("omp parallel num_threads(nthreads)")                                                \
        {                                                                                            \
            ps_shared_run(&shared, kc, vc, bt, Hkv, D, BS, bt_stride, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, scale, \
                          BF16);                                                                     \
            _Pragma("omp for schedule(dynamic, 1)")                                                  \
            for (int64_t w = 0; w < B * Hkv; ++w) {                                                  \
                const int64_t b = w / Hkv, h = w % Hkv;                                              \
                const T *qw = q + b * q_sb + h * G * q_sh;                                           \
                const T *kw = kc + h * k_sh, *vw = vc + h * v_sh;                                    \
                const int32_t *btw = bt + b * bt_stride;                                             \
                T *ow = out + b * o_sb + h * G * o_sh;                                               \
                /* a sliding window (window > 0): only the last `window` positions are read; a shared \
                 * prefix: the keys after it, from its state */                                      \
                int64_t start = window > 0 && lens[b] > window ? lens[b] - window : 0;               \
                const float *init = ps_shared_state(&shared, b, h * G, D, &start);                  \
                PS_DISPATCH_ITEM(ITEM, AVX_ITEM)                                                     \
            }                                                                                        \
        }                                                                                            \
        ps_shared_free(&shared);                                                                     \
        return 0;                                                                                    \
    }

PS_DEFINE_ITEM(ps_item_f32, float, ps_load_f32, ps_store_f32)
PS_DEFINE_ITEM(ps_item_bf16, uint16_t, ps_load_bf16, ps_store_bf16)
#if !defined(PS_AVX512) && !defined(PS_AVX2)
#define ps_item_avx_f32 ps_item_f32
#define ps_item_avx_bf16 ps_item_bf16
#endif
PS_DEFINE_DECODE(ps_paged_decode_f32, ps_item_f32, ps_item_avx_f32, float, 0)
PS_DEFINE_DECODE(ps_paged_decode_bf16, ps_item_bf16, ps_item_avx_bf16_best, uint16_t, 1)

/* Limits the launcher checks before calling (beyond them it uses the torch path). */
int64_t ps_max_g(void) { return PS_MAX_G; }
int64_t ps_max_d(void) { return PS_MAX_D; }
int64_t ps_max_bs(void) { return PS_MAX_BS; }
