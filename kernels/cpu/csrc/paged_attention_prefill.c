/* Paged prefill attention on CPU: causal attention of each sequence's new tokens over its paged KV.
 *
 * The contract of kernels/paged_attention_prefill.py (see its module docstring): sequence s owns
 * query rows qsl[s] .. qsl[s+1]-1, its LAST q_len positions (offset = lens[s] - q_len); the query
 * at position p sees keys 0 .. p. Query head k uses KV head k / G (G = Hq / Hkv).
 *
 * Why C: the torch path gathers each sequence's K/V into a dense copy and runs one SDPA call per
 * sequence, which reached ~80-110 GFLOP/s on this project's 2-core machine. Here:
 *
 *   1. gather: K and V of every (sequence, KV head) are copied once into float32 rows of D, in
 *      position order, padded with zero rows to a multiple of 16 (ws below);
 *   2. attend: work items of 16 "rows" (a row is one (query, query head) pair of one KV head),
 *      each a flash-attention pass over 16-key tiles with every vector lane-wise over its 16 rows:
 *
 *          qt[d]      = scale * q[row][d]                   (16 lanes: the item's rows)
 *          s[t]       = sum_d qt[d] * K[k0 + t][d]           (16 vectors; K broadcast from the tile)
 *          causal mask: lane r keeps key k0 + t only if k0 + t <= pos(r)
 *          m' = max(m, max_t s[t]);  a = exp(m - m');  p[t] = exp(s[t] - m');  l = a l + sum_t p[t]
 *          ot[d]      = a * ot[d] + sum_t p[t] * V[k0 + t][d]
 *          out[row]   = ot[.][row] / l[row]
 *
 *      The softmax needs no horizontal reductions (a row's running max and sum live in its lane),
 *      and both products are FMAs with one operand broadcast from L1, ~16 FMAs per vector load.
 *
 *     ws, per sequence s (Lp = lens[s] rounded up to 16):
 *        [ K head 0: Lp x D | K head 1 | ... | K head Hkv-1 | V head 0 | ... | V head Hkv-1 ]
 *
 * Written with GCC vector types, so the same source builds with AVX-512 (one vector = one zmm, exp
 * through ps_exp16) or without it (gcc splits the vectors). bfloat16 q / caches / out take the same
 * float32 math: the gather widens K and V once, q is widened as it is loaded and out rounded once
 * (round to nearest even) as it is stored. torch's SDPA does the same in bfloat16 and, on this
 * project's AVX-512 machine without AMX, measured no faster than in float32 (2.6-3x slower than this).
 * Where the CPU has AVX512-BF16, bfloat16 takes ps_prefill_item_dp instead: the same item with both
 * products on bf16 pairs (K and V gathered as bfloat16, not widened).
 */
#include <stdlib.h>

#include "ps_cpu.h"

#define PS_PF_MAX_D 256
#define PS_PF_NV 2 /* row vectors per work item */
#define PS_PF_ROWS (16 * PS_PF_NV)
#define PS_PF_KH 8 /* keys per Q.K pass: NV x 8 accumulators, NV query vectors and a broadcast in registers */
#define PS_PF_DB 8 /* head_dim columns per P.V pass: NV x 8 independent FMA chains hide the FMA latency */

typedef float ps_v16 __attribute__((vector_size(64)));
typedef int32_t ps_m16 __attribute__((vector_size(64)));

static inline ps_v16 ps_v16_set1(float x) { return (ps_v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

static inline ps_v16 ps_v16_select(ps_m16 keep, ps_v16 a, ps_v16 b) { /* keep ? a : b, lane-wise */
    return (ps_v16)(((ps_m16)a & keep) | ((ps_m16)b & ~keep));
}

static inline ps_v16 ps_v16_max(ps_v16 a, ps_v16 b) { return ps_v16_select(a > b, a, b); }

static inline ps_v16 ps_v16_exp(ps_v16 x) {
#ifdef PS_AVX512
    return (ps_v16)ps_exp16((__m512)x);
#else
    ps_v16 r;
    for (int l = 0; l < 16; ++l) r[l] = ps_exp(x[l]); /* ps_exp(-inf) ~ 1e-38, not 0: harmless here */
    return r;
#endif
}

/* Element i of a float32 (bf16 = 0) or bfloat16 (bf16 = 1) array, as float32; and the store back. */
static inline __attribute__((always_inline)) float ps_pf_load(const void *p, int64_t i, const int bf16) {
    return bf16 ? ps_bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline __attribute__((always_inline)) void ps_pf_store(void *p, int64_t i, float x, const int bf16) {
    if (bf16) ((uint16_t *)p)[i] = ps_f32_to_bf16(x);
    else ((float *)p)[i] = x;
}

/* One item: rows r0 .. r0+31 (those < nrows are real; the rest repeat the last real row and are not
 * stored) of KV head h of one sequence; q and out point at the sequence's first token, K and V at the
 * head's gathered rows. Two row vectors per item, so each K or V element broadcast from L1 feeds two
 * FMAs: with one, the broadcasts alone kept both load ports busy (~70% of FMA peak measured).
 * always_inline: the dispatch below makes copies for constant D and element type (q and out are
 * float32 or bfloat16 as bf16 says; K and V are the float32 gathered rows either way). */
static inline __attribute__((always_inline)) void ps_prefill_item(
    const void *restrict q, const int64_t q_st, const int64_t q_sh, void *restrict out, const int64_t o_st,
    const int64_t o_sh, const float *restrict K, const float *restrict V, const int64_t offset, const int64_t r0,
    const int64_t nrows, const int64_t G, const int64_t h, const int64_t D, const float scale, const int bf16) {
    ps_v16 qt[PS_PF_MAX_D][PS_PF_NV], ot[PS_PF_MAX_D][PS_PF_NV], pos[PS_PF_NV], m[PS_PF_NV], lsum[PS_PF_NV];
    int64_t row_o[PS_PF_ROWS]; /* element offset of each lane's output row */
    for (int j = 0; j < PS_PF_NV; ++j) {
        for (int l = 0; l < 16; ++l) {
            const int64_t r0l = r0 + 16 * j + l, r = r0l < nrows ? r0l : nrows - 1, qi = r / G, k = h * G + r % G;
            pos[j][l] = (float)(offset + qi);
            row_o[16 * j + l] = qi * o_st + k * o_sh;
            for (int64_t d = 0; d < D; ++d) qt[d][j][l] = ps_pf_load(q, qi * q_st + k * q_sh + d, bf16) * scale;
        }
        m[j] = ps_v16_set1(-INFINITY);
        lsum[j] = ps_v16_set1(0.0f);
        for (int64_t d = 0; d < D; ++d) ot[d][j] = ps_v16_set1(0.0f);
    }
    const int64_t last = r0 + PS_PF_ROWS - 1 < nrows ? r0 + PS_PF_ROWS - 1 : nrows - 1;
    const int64_t first_pos = offset + r0 / G, kend = offset + last / G + 1; /* keys 0 .. kend-1 are seen */
    for (int64_t k0 = 0; k0 < kend; k0 += 16) {
        const float *kt = K + k0 * D, *vt = V + k0 * D;
        ps_v16 s[PS_PF_NV][16];
        for (int t0 = 0; t0 < 16; t0 += PS_PF_KH) { /* scores, 8 keys at a time: 16 accumulators */
            ps_v16 acc[PS_PF_NV][PS_PF_KH];
            for (int j = 0; j < PS_PF_NV; ++j)
                for (int t = 0; t < PS_PF_KH; ++t) acc[j][t] = ps_v16_set1(0.0f);
            const float *kd = kt + t0 * D; /* one pointer walking d: the 8 keys are constant offsets */
            for (int64_t d = 0; d < D; ++d, ++kd)
                for (int t = 0; t < PS_PF_KH; ++t) {
                    const float kb = kd[t * D];
                    for (int j = 0; j < PS_PF_NV; ++j) acc[j][t] += qt[d][j] * kb;
                }
            for (int j = 0; j < PS_PF_NV; ++j)
                for (int t = 0; t < PS_PF_KH; ++t) s[j][t0 + t] = acc[j][t];
        }
        ps_v16 alpha[PS_PF_NV];
        for (int j = 0; j < PS_PF_NV; ++j) {
            if (k0 + 15 > first_pos) /* the tile reaches past some lane's position: causal mask */
                for (int t = 0; t < 16; ++t)
                    s[j][t] = ps_v16_select(ps_v16_set1((float)(k0 + t)) <= pos[j], s[j][t], ps_v16_set1(-INFINITY));
            ps_v16 mt = s[j][0];
            for (int t = 1; t < 16; ++t) mt = ps_v16_max(mt, s[j][t]);
            const ps_v16 mnew = ps_v16_max(m[j], mt); /* finite: key 0 is in every lane's first tile */
            alpha[j] = ps_v16_exp(m[j] - mnew);
            lsum[j] *= alpha[j];
            for (int t = 0; t < 16; ++t) {
                s[j][t] = ps_v16_exp(s[j][t] - mnew); /* s now holds the tile's probabilities p */
                lsum[j] += s[j][t];
            }
            m[j] = mnew;
        }
        for (int64_t d0 = 0; d0 < D; d0 += PS_PF_DB) { /* ot = alpha ot + p V, 8 columns at a time */
            ps_v16 o[PS_PF_NV][PS_PF_DB];
            for (int j = 0; j < PS_PF_NV; ++j)
                for (int i = 0; i < PS_PF_DB; ++i) o[j][i] = ot[d0 + i][j] * alpha[j];
            for (int t = 0; t < 16; ++t)
                for (int i = 0; i < PS_PF_DB; ++i) {
                    const float vb = vt[t * D + d0 + i];
                    for (int j = 0; j < PS_PF_NV; ++j) o[j][i] += s[j][t] * vb;
                }
            for (int j = 0; j < PS_PF_NV; ++j)
                for (int i = 0; i < PS_PF_DB; ++i) ot[d0 + i][j] = o[j][i];
        }
    }
    for (int j = 0; j < PS_PF_NV; ++j) {
        const ps_v16 inv = 1.0f / lsum[j];
        for (int l = 0; l < 16 && r0 + 16 * j + l < nrows; ++l)
            for (int64_t d = 0; d < D; ++d) ps_pf_store(out, row_o[16 * j + l] + d, ot[d][j][l] * inv[l], bf16);
    }
}

#if defined(__AVX512BF16__) && defined(PS_AVX512)
#define PS_PF_DP 1
/* bfloat16 with AVX512-BF16: the item above with both products on vdpbf16ps, which multiplies 16
 * lanes of bf16 pairs and adds each pair's two products into a float32 lane, so one instruction does
 * the work of two FMAs. Gathered K stays bfloat16 in position rows (a pair of d is one 32-bit word);
 * gathered V holds position pairs (ps_gather_vpairs: v[t][d] and v[t+1][d] in one word). Scores,
 * the softmax and the output sums stay float32; the probabilities round to bfloat16 before P.V (as
 * FlashAttention does on GPUs), so a result may differ from the float32 math by up to 2^-9 of the
 * largest |V| (tests/kernels/test_paged_attention_cpu.py). The scale is folded into the exp. */
static inline __attribute__((always_inline)) void ps_prefill_item_dp(
    const uint16_t *restrict q, const int64_t q_st, const int64_t q_sh, uint16_t *restrict out, const int64_t o_st,
    const int64_t o_sh, const uint16_t *restrict K, const uint32_t *restrict V, const int64_t offset, const int64_t r0,
    const int64_t nrows, const int64_t G, const int64_t h, const int64_t D, const float scale) {
    __m512bh qt[PS_PF_MAX_D / 2][PS_PF_NV]; /* lane r: q[row r][2i], q[row r][2i+1] */
    __m512 ot[PS_PF_MAX_D][PS_PF_NV], pos[PS_PF_NV], m[PS_PF_NV], lsum[PS_PF_NV];
    int64_t row_o[PS_PF_ROWS];
    const __m512 vscale = _mm512_set1_ps(scale);
    /* bf16 element 2l of a pair vector from lane l of the first operand of cvtne2ps (its low half),
     * 2l + 1 from lane l of the second (its high half) */
    __m512i interleave;
    {
        uint16_t idx[32];
        for (int i = 0; i < 32; ++i) idx[i] = (uint16_t)(i % 2 ? 16 + i / 2 : i / 2);
        interleave = _mm512_loadu_si512(idx);
    }
    for (int j = 0; j < PS_PF_NV; ++j) {
        uint32_t qw[PS_PF_MAX_D / 2][16];
        float pj[16];
        for (int l = 0; l < 16; ++l) {
            const int64_t r0l = r0 + 16 * j + l, r = r0l < nrows ? r0l : nrows - 1, qi = r / G, k = h * G + r % G;
            pj[l] = (float)(offset + qi);
            row_o[16 * j + l] = qi * o_st + k * o_sh;
            const uint16_t *qr = q + qi * q_st + k * q_sh;
            for (int64_t i = 0; i < D / 2; ++i) qw[i][l] = (uint32_t)qr[2 * i] | (uint32_t)qr[2 * i + 1] << 16;
        }
        for (int64_t i = 0; i < D / 2; ++i) qt[i][j] = (__m512bh)_mm512_loadu_si512(qw[i]);
        pos[j] = _mm512_loadu_ps(pj);
        m[j] = _mm512_set1_ps(-INFINITY);
        lsum[j] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; ++d) ot[d][j] = _mm512_setzero_ps();
    }
    const int64_t last = r0 + PS_PF_ROWS - 1 < nrows ? r0 + PS_PF_ROWS - 1 : nrows - 1;
    const int64_t first_pos = offset + r0 / G, kend = offset + last / G + 1;
    for (int64_t k0 = 0; k0 < kend; k0 += 16) {
        const uint16_t *kt = K + k0 * D;
        const uint32_t *vt = V + k0 / 2 * D; /* 8 position pairs of D words */
        __m512 s[PS_PF_NV][16];
        for (int t0 = 0; t0 < 16; t0 += PS_PF_KH) {
            __m512 acc[PS_PF_NV][PS_PF_KH];
            for (int j = 0; j < PS_PF_NV; ++j)
                for (int t = 0; t < PS_PF_KH; ++t) acc[j][t] = _mm512_setzero_ps();
            const uint16_t *kd = kt + t0 * D;
            for (int64_t i = 0; i < D / 2; ++i, kd += 2)
                for (int t = 0; t < PS_PF_KH; ++t) {
                    const __m512bh kb = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(kd + t * D));
                    for (int j = 0; j < PS_PF_NV; ++j) acc[j][t] = _mm512_dpbf16_ps(acc[j][t], qt[i][j], kb);
                }
            for (int j = 0; j < PS_PF_NV; ++j)
                for (int t = 0; t < PS_PF_KH; ++t) s[j][t0 + t] = acc[j][t];
        }
        __m512 alpha[PS_PF_NV];
        __m512bh p2[PS_PF_NV][8]; /* lane r: p[r][2u], p[r][2u + 1] in bfloat16 */
        for (int j = 0; j < PS_PF_NV; ++j) {
            if (k0 + 15 > first_pos)
                for (int t = 0; t < 16; ++t)
                    s[j][t] = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(_mm512_set1_ps((float)(k0 + t)), pos[j], _CMP_LE_OQ),
                                                   _mm512_set1_ps(-INFINITY), s[j][t]);
            __m512 mt = s[j][0];
            for (int t = 1; t < 16; ++t) mt = _mm512_max_ps(mt, s[j][t]);
            const __m512 mnew = _mm512_max_ps(m[j], _mm512_mul_ps(mt, vscale)); /* m: scaled scores */
            alpha[j] = ps_exp16(_mm512_sub_ps(m[j], mnew));
            lsum[j] = _mm512_mul_ps(lsum[j], alpha[j]);
            for (int t = 0; t < 16; ++t) {
                s[j][t] = ps_exp16(_mm512_fmsub_ps(s[j][t], vscale, mnew));
                lsum[j] = _mm512_add_ps(lsum[j], s[j][t]);
            }
            for (int u = 0; u < 8; ++u)
                p2[j][u] = (__m512bh)_mm512_permutexvar_epi16(
                    interleave, (__m512i)_mm512_cvtne2ps_pbh(s[j][2 * u + 1], s[j][2 * u]));
            m[j] = mnew;
        }
        for (int64_t d0 = 0; d0 < D; d0 += PS_PF_DB) {
            __m512 o[PS_PF_NV][PS_PF_DB];
            for (int j = 0; j < PS_PF_NV; ++j)
                for (int i = 0; i < PS_PF_DB; ++i) o[j][i] = _mm512_mul_ps(ot[d0 + i][j], alpha[j]);
            for (int u = 0; u < 8; ++u)
                for (int i = 0; i < PS_PF_DB; ++i) {
                    const __m512bh vb = (__m512bh)_mm512_set1_epi32((int32_t)vt[u * D + d0 + i]);
                    for (int j = 0; j < PS_PF_NV; ++j) o[j][i] = _mm512_dpbf16_ps(o[j][i], p2[j][u], vb);
                }
            for (int j = 0; j < PS_PF_NV; ++j)
                for (int i = 0; i < PS_PF_DB; ++i) ot[d0 + i][j] = o[j][i];
        }
    }
    for (int j = 0; j < PS_PF_NV; ++j) {
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), lsum[j]);
        float ov[16];
        for (int64_t d = 0; d < D; ++d) {
            _mm512_storeu_ps(ov, _mm512_mul_ps(ot[d][j], inv));
            for (int l = 0; l < 16 && r0 + 16 * j + l < nrows; ++l) out[row_o[16 * j + l] + d] = ps_f32_to_bf16(ov[l]);
        }
    }
}

/* Positions [p0, p1) of KV head h of a bfloat16 cache as position pairs: word (p / 2) * D + d of dst
 * holds v[p][d] in its low half and v[p + 1][d] in its high half (p even; p0 even, the pair past
 * p1 is zero). */
static void ps_gather_vpairs(const uint16_t *cache, const int32_t *bt_row, int64_t p0, int64_t p1, int64_t BS,
                             int64_t c_sb, int64_t c_ss, int64_t c_sh, int64_t h, int64_t D, uint32_t *dst) {
    for (int64_t p = p0; p < p1; p += 2) {
        const uint16_t *a = cache + (int64_t)bt_row[p / BS] * c_sb + (p % BS) * c_ss + h * c_sh;
        const uint16_t *b = p + 1 < p1 ? cache + (int64_t)bt_row[(p + 1) / BS] * c_sb + ((p + 1) % BS) * c_ss + h * c_sh
                                       : NULL;
        for (int64_t d = 0; d < D; d += 16) {
            const __mmask16 mk = D - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - d)) - 1u);
            const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, a + d));
            const __m512i hi = b ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, b + d)) : _mm512_setzero_si512();
            _mm512_mask_storeu_epi32(dst + p / 2 * D + d, mk, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}
#endif

/* Positions [p0, p1) of KV head h into the gathered float32 rows dst, one row of D per position
 * (from a float32 or, bf16 = 1, a bfloat16 cache; strides in elements). */
static inline __attribute__((always_inline)) void ps_gather(const void *cache, const int32_t *bt_row, int64_t p0,
                                                            int64_t p1, int64_t BS, int64_t c_sb, int64_t c_ss,
                                                            int64_t c_sh, int64_t h, int64_t D, float *dst,
                                                            const int bf16) {
    for (int64_t p = p0; p < p1; ++p) {
        const int64_t at = (int64_t)bt_row[p / BS] * c_sb + (p % BS) * c_ss + h * c_sh;
        if (bf16) ps_load_bf16((const uint16_t *)cache + at, dst + p * D, D);
        else memcpy(dst + p * D, (const float *)cache + at, (size_t)D * sizeof(float));
    }
}

/* The first index i with starts[i + 1] > w (starts: n + 1 non-decreasing offsets, starts[0] = 0). */
static int64_t ps_owner(const int64_t *starts, int64_t n, int64_t w) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (starts[mid + 1] > w) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

#define PS_PF_ITEM_ARGS(D_, BF16_) \
    qs, q_st, q_sh, os, o_st, o_sh, Kh, Vh, len[s] - ql, r0, ql * G, G, h, D_, scale, BF16_
#define PS_PF_DP_ARGS(D_) \
    (const uint16_t *)qs, q_st, q_sh, (uint16_t *)os, o_st, o_sh, Kb, Vp, len[s] - ql, r0, ql * G, G, h, D_, scale
#define PS_PF_ITEM_FOR_D(BF16_)                                               \
    do {                                                                      \
        if (D == 64) ps_prefill_item(PS_PF_ITEM_ARGS(64, BF16_));             \
        else if (D == 128) ps_prefill_item(PS_PF_ITEM_ARGS(128, BF16_));      \
        else ps_prefill_item(PS_PF_ITEM_ARGS(D, BF16_));                      \
    } while (0)

/* The entry points (float32 and bfloat16 q / caches / out; the same float32 math). Returns 1
 * (computing nothing) when a block id covering [0, lens[s]) of a sequence with queries is outside
 * [0, NB), 2 when the workspace is too small (or no memory), 3 when a sequence has more queries
 * than positions. Sequences without queries are not read at all. ws must
 * hold sum_s roundup(lens[s], 16) * 2 * Hkv * D floats over the sequences with queries. */
static int64_t ps_paged_prefill(const void *q, const void *kc, const void *vc, const int32_t *bt,
                                const int32_t *lens, const int32_t *qsl, void *out, float *ws, int64_t ws_floats,
                                int64_t S, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS, int64_t bt_stride,
                                int64_t NB, int64_t q_st, int64_t q_sh, int64_t k_sb, int64_t k_ss, int64_t k_sh,
                                int64_t v_sb, int64_t v_ss, int64_t v_sh, int64_t o_st, int64_t o_sh, float scale,
                                int nthreads, const int bf16) {
    const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
    const int64_t G = Hq / Hkv;
    int64_t *len = malloc(4 * (S + 1) * sizeof(int64_t)); /* positions read (0: no queries) */
    if (!len) return 2;
    /* prefix sums: ws offset of each sequence, gather chunks (16 positions of one head), items */
    int64_t *kv_at = len + S + 1, *chunk_at = kv_at + S + 1, *item_at = chunk_at + S + 1;
    kv_at[0] = chunk_at[0] = item_at[0] = 0;
    int64_t err = 0;
    for (int64_t s = 0; s < S && !err; ++s) {
        const int64_t ql = qsl[s + 1] - qsl[s];
        len[s] = ql > 0 ? lens[s] : 0;
        if (ql > lens[s]) err = 3;
        else if (ql > 0 && ps_bad_block_ids(bt + s * bt_stride, lens + s, 1, BS, bt_stride, NB)) err = 1;
        const int64_t lp = (len[s] + 15) / 16 * 16;
        kv_at[s + 1] = kv_at[s] + lp * 2 * Hkv * D;
        chunk_at[s + 1] = chunk_at[s] + Hkv * (lp / 16);
        item_at[s + 1] = item_at[s] + Hkv * ((ql * G + PS_PF_ROWS - 1) / PS_PF_ROWS);
    }
    if (!err && kv_at[S] > ws_floats) err = 2;
    if (err) {
        free(len);
        return err;
    }
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t w = 0; w < chunk_at[S]; ++w) {
            const int64_t s = ps_owner(chunk_at, S, w), c = w - chunk_at[s], lp = (len[s] + 15) / 16 * 16;
            const int64_t h = c / (lp / 16), p0 = c % (lp / 16) * 16;
            const int64_t p1 = p0 + 16 < len[s] ? p0 + 16 : len[s];
            float *Kh = ws + kv_at[s] + h * lp * D, *Vh = Kh + Hkv * lp * D;
#ifdef PS_PF_DP
            if (bf16) { /* bfloat16 rows of K and position pairs of V (ps_prefill_item_dp) */
                uint16_t *Kb = (uint16_t *)(ws + kv_at[s]) + h * lp * D;
                uint32_t *Vp = (uint32_t *)(ws + kv_at[s] + Hkv * lp * D) + h * (lp / 2) * D;
                const int32_t *bt_row = bt + s * bt_stride;
                for (int64_t p = p0; p < p1; ++p)
                    memcpy(Kb + p * D, (const uint16_t *)kc + (int64_t)bt_row[p / BS] * k_sb + (p % BS) * k_ss + h * k_sh,
                           (size_t)D * sizeof(uint16_t));
                memset(Kb + p1 * D, 0, (size_t)((p0 + 16 - p1) * D) * sizeof(uint16_t));
                ps_gather_vpairs(vc, bt_row, p0, p1, BS, v_sb, v_ss, v_sh, h, D, Vp);
                const int64_t done = (p1 + 1) / 2; /* pairs written, the last maybe half zero */
                memset(Vp + done * D, 0, (size_t)((p0 + 16) / 2 - done) * D * sizeof(uint32_t));
                continue;
            }
#endif
            if (bf16) { /* literal element types: each call is specialised (see ps_prefill_item) */
                ps_gather(kc, bt + s * bt_stride, p0, p1, BS, k_sb, k_ss, k_sh, h, D, Kh, 1);
                ps_gather(vc, bt + s * bt_stride, p0, p1, BS, v_sb, v_ss, v_sh, h, D, Vh, 1);
            } else {
                ps_gather(kc, bt + s * bt_stride, p0, p1, BS, k_sb, k_ss, k_sh, h, D, Kh, 0);
                ps_gather(vc, bt + s * bt_stride, p0, p1, BS, v_sb, v_ss, v_sh, h, D, Vh, 0);
            }
            /* zero padding rows: a masked key's score is -inf, but 0 * NaN would still be NaN */
            memset(Kh + p1 * D, 0, (size_t)((p0 + 16 - p1) * D) * sizeof(float));
            memset(Vh + p1 * D, 0, (size_t)((p0 + 16 - p1) * D) * sizeof(float));
        }
        /* heaviest first: within a sequence, later rows see more keys */
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < item_at[S]; ++w) {
            const int64_t s = ps_owner(item_at, S, w), ql = qsl[s + 1] - qsl[s];
            const int64_t groups = (ql * G + PS_PF_ROWS - 1) / PS_PF_ROWS, c = w - item_at[s];
            const int64_t h = c / groups, r0 = (groups - 1 - c % groups) * PS_PF_ROWS;
            const int64_t lp = (len[s] + 15) / 16 * 16;
            const float *Kh = ws + kv_at[s] + h * lp * D, *Vh = Kh + Hkv * lp * D;
            const void *qs = (const char *)q + (int64_t)qsl[s] * q_st * elem;
            void *os = (char *)out + (int64_t)qsl[s] * o_st * elem;
#ifdef PS_PF_DP
            if (bf16) {
                const uint16_t *Kb = (const uint16_t *)(ws + kv_at[s]) + h * lp * D;
                const uint32_t *Vp = (const uint32_t *)(ws + kv_at[s] + Hkv * lp * D) + h * (lp / 2) * D;
                if (D == 64) ps_prefill_item_dp(PS_PF_DP_ARGS(64));
                else ps_prefill_item_dp(PS_PF_DP_ARGS(D));
                continue;
            }
#endif
            if (bf16) PS_PF_ITEM_FOR_D(1);
            else PS_PF_ITEM_FOR_D(0);
        }
    }
    free(len);
    return 0;
}

/* The arguments after out, shared by both entry points. */
#define PS_PF_TAIL_ARGS                                                                                         \
    float *ws, int64_t ws_floats, int64_t S, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS, int64_t bt_stride,   \
        int64_t NB, int64_t q_st, int64_t q_sh, int64_t k_sb, int64_t k_ss, int64_t k_sh, int64_t v_sb, int64_t v_ss, \
        int64_t v_sh, int64_t o_st, int64_t o_sh, float scale, int nthreads
#define PS_PF_PASS                                                                                             \
    bt, lens, qsl, out, ws, ws_floats, S, Hq, Hkv, D, BS, bt_stride, NB, q_st, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, \
        v_sh, o_st, o_sh, scale, nthreads

int64_t ps_paged_prefill_f32(const float *q, const float *kc, const float *vc, const int32_t *bt,
                             const int32_t *lens, const int32_t *qsl, float *out, PS_PF_TAIL_ARGS) {
    return ps_paged_prefill(q, kc, vc, PS_PF_PASS, 0);
}

int64_t ps_paged_prefill_bf16(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int32_t *bt,
                              const int32_t *lens, const int32_t *qsl, uint16_t *out, PS_PF_TAIL_ARGS) {
    return ps_paged_prefill(q, kc, vc, PS_PF_PASS, 1);
}

/* The launcher's limits: head_dim a multiple of PS_PF_DB, at most PS_PF_MAX_D. */
int64_t ps_prefill_max_d(void) { return PS_PF_MAX_D; }
int64_t ps_prefill_d_multiple(void) { return PS_PF_DB; }
