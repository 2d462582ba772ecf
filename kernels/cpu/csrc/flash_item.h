/* The flash-attention work item shared by prefill (paged_attention_prefill.c) and the shared-prefix
 * part of decode (paged_attention_decode.c), with the gathers that lay out its K and V. See
 * paged_attention_prefill.c for the item's plan. */
#ifndef PS_FLASH_ITEM_H
#define PS_FLASH_ITEM_H
#include <stdlib.h>
#include <string.h>

#include "ps_cpu.h"

#define PS_PF_MAX_D 256
#define PS_PF_NV 2 /* row vectors per work item */
#define PS_PF_ROWS (16 * PS_PF_NV)
#define PS_PF_KH 8 /* keys per Q.K pass: NV x 8 accumulators, NV query vectors and a broadcast in registers */
#define PS_PF_DB 8 /* head_dim columns per P.V pass: NV x 8 independent FMA chains hide the FMA latency */
/* Every item's running max moves only when a tile's max passes it by more than this (in base 2; 8 ln 2 in the
 * float32 items' natural units), so its probabilities stay below 2^PS_PF_SLACK and the rescale of its output is
 * skipped on the tiles that do not move it: after the first few, nearly all. */
#define PS_PF_SLACK 8.0f
#define PS_PF_SLACK_E (PS_PF_SLACK * 0.693147180559945309f)

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

#ifdef PS_AVX512
/* A 16 x 16 block of float32 (or 32-bit words) turned over: lane j of r[i] <-> lane i of r[j]. */
static inline __attribute__((always_inline)) void ps_transpose16(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), e = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
    }
    for (int i = 0; i < 4; ++i) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

/* An item's 16-row block leaves its lanes: col[d * stride] holds column d of the 16 rows (lane l: row
 * l), D columns; row l < n goes, times mul's lane l, to dst + ro[l] .. + D-1 as float32 (bf16 = 0) or
 * bfloat16 rounded to nearest even. In 16 x 16 blocks turned over in registers: a row's columns then
 * store as one vector, where the per-lane scalar stores took 5-10% of a bfloat16 prefill call (one
 * 1,088-token prompt, Zen 4). */
static inline __attribute__((always_inline)) void ps_rows16_store(const __m512 *col, const int64_t stride, const __m512 mul,
                                                                  const int64_t D, const int64_t *ro, const int n,
                                                                  void *dst, const int bf16) {
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
        const int64_t w = D - d0 < 16 ? D - d0 : 16;
        const __mmask16 mk = (__mmask16)(w == 16 ? 0xffffu : (1u << w) - 1u);
        __m512 r[16];
        for (int i = 0; i < 16; ++i) r[i] = i < w ? _mm512_mul_ps(col[(d0 + i) * stride], mul) : _mm512_setzero_ps();
        ps_transpose16(r);
        for (int l = 0; l < n; ++l) {
            if (bf16) ps_store16_bf16((uint16_t *)dst + ro[l] + d0, r[l], mk);
            else _mm512_mask_storeu_ps((float *)dst + ro[l] + d0, mk, r[l]);
        }
    }
}

/* The other way: 16 rows of W 32-bit words (row l at byte at[l] of src, float32 or bf16 pairs; bytes,
 * so a bfloat16 row may start at an odd element) into lanes, col[i * stride] lane l = word i of row l,
 * each word times mul (float32 rows) or as it is (mul_f32 = 0). */
static inline __attribute__((always_inline)) void ps_rows16_load(const char *src, const int64_t *at, const int64_t W,
                                                                 const __m512 mul, const int mul_f32, __m512 *col,
                                                                 const int64_t stride) {
    for (int64_t w0 = 0; w0 < W; w0 += 16) {
        const int64_t w = W - w0 < 16 ? W - w0 : 16;
        const __mmask16 mk = (__mmask16)(w == 16 ? 0xffffu : (1u << w) - 1u);
        __m512 r[16];
        for (int l = 0; l < 16; ++l) r[l] = _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(mk, src + at[l] + 4 * w0));
        ps_transpose16(r);
        for (int64_t i = 0; i < w; ++i) col[(w0 + i) * stride] = mul_f32 ? _mm512_mul_ps(r[i], mul) : r[i];
    }
}
#endif

/* Prefetch BS rows of K and V (a block, or a 16-key tile; row_bytes each, rows k_ss / v_ss bytes apart) into L2
 * (prefetcht1), not L1: a float32 block of SmolLM2's is 128 lines, more misses than L1 tracks at once,
 * and into L1 the burst stalled the item until most of them had arrived. Measured, decode over a pool
 * read cold (64 sequences x 350 / 540 tokens, 9 query / 3 KV heads, 2-core AMD EPYC Zen 4): float32
 * 2.1-2.3 -> 1.5-1.7 ms and 3.3-3.4 -> 2.4-2.5 ms; bfloat16 (64 lines a block) unchanged, 1.2 / 1.8 ms.
 * benchmarks/cpu_kernels.py's 64 x 350 case, float32: 2.26 ms before, 1.32 ms after (results/cpu_kernels_zen4.json). */
static inline __attribute__((always_inline)) void ps_prefetch_block(const void *k, const void *v, int64_t BS, int64_t k_ss, int64_t v_ss,
                                     int64_t row_bytes) {
    for (int64_t t = 0; t < BS; ++t)
        for (int64_t c = 0; c < row_bytes; c += 64) {
            __builtin_prefetch((const char *)k + t * k_ss + c, 0, 2);
            __builtin_prefetch((const char *)v + t * v_ss + c, 0, 2);
        }
}

/* The decode items' prefetch (paged_attention_decode.c), spread over the work: the first PS_DECODE_AHEAD blocks of
 * an item at once, then, as token t of block j is scored, row t of K and V of block j + PS_DECODE_AHEAD. Why: a
 * whole block's 128 lines (float32, SmolLM2's) prefetched at once as the block before starts, as ps_prefetch_block
 * does, came in bursts the memory system served at ~15 GB/s of this VM's 36; spread, the pool streams steadily.
 * Per layer, 2-core AMD EPYC Zen 4, SmolLM2's 9 query / 3 KV heads, float32, 30 pools on 2 MiB pages read cold,
 * two interleaved rounds: 8 sequences x 160 tokens 129-139 -> 108-119 us, 64 x 350 1.99-2.22 -> 1.75-2.00 ms,
 * 8 x 1,000 0.71-0.82 -> 0.67-0.70 ms, 1 x 1,000 105-125 -> 103-117 us (ahead 1, 3 and 4 blocks measured no
 * better than 2, and whole items at once worse); bfloat16 (the AVX512-BF16 item) 65-69 -> 58-59 us,
 * 0.96-1.02 -> 0.71-0.72 ms, 320-336 -> 237-243 us, 49-53 -> 50-51 us. The AVX2 and fp8 items still prefetch a
 * block at a time (not measured). */
#define PS_DECODE_AHEAD 2
static inline __attribute__((always_inline)) void ps_prefetch_row(const char *k, const char *v, int64_t row_bytes) {
    for (int64_t c = 0; c < row_bytes; c += 64) {
        __builtin_prefetch(k + c, 0, 2);
        __builtin_prefetch(v + c, 0, 2);
    }
}

/* Where block j's tokens prefetch their rows ahead: K and V of block j + PS_DECODE_AHEAD (*kpf NULL past the
 * item's nblk blocks); at the item's first block (j0), its first PS_DECODE_AHEAD blocks are fetched at once.
 * Strides and sizes in bytes: sb a block, ss a row; row_bytes the row's D elements. */
static inline __attribute__((always_inline)) void ps_decode_ahead(const char *kc, const char *vc, const int32_t *bt_row,
                                                                  int64_t j, int64_t j0, int64_t nblk, int64_t BS,
                                                                  int64_t k_sb, int64_t v_sb, int64_t k_ss, int64_t v_ss,
                                                                  int64_t row_bytes, const char **kpf, const char **vpf) {
    const int64_t ja = j + PS_DECODE_AHEAD;
    *kpf = ja < nblk ? kc + (int64_t)bt_row[ja] * k_sb : NULL;
    *vpf = ja < nblk ? vc + (int64_t)bt_row[ja] * v_sb : NULL;
    if (j == j0)
        for (int64_t jj = j; jj < nblk && jj < ja; ++jj)
            ps_prefetch_block(kc + (int64_t)bt_row[jj] * k_sb, vc + (int64_t)bt_row[jj] * v_sb, BS, k_ss, v_ss, row_bytes);
}

/* Where a float32 item reads its K and V rows: gathered at K / V (position rows D apart, zero past the
 * sequence's length), or, for each whole 16-key tile, in place in the paged cache, whose blocks (BS a
 * multiple of 16) hold a tile's rows k_ss / v_ss apart, the next tile's rows prefetched into L2 (the
 * gather's copy had done that for the items). Decode's shared prefixes read in place, and prefill the keys
 * several of its sequences share (paged_attention_prefill.c, ps_shared_keys); keys one sequence reads alone
 * stay gathered. Per layer, 2-core AMD EPYC Zen 5, medians, interleaved, caches flushed before each call
 * as the weights' streaming does in a forward: the decode of GSP's 64 sequences (4 x 16 over 1,024 shared
 * keys; their real block tables) 1.45-1.47 -> 1.30-1.33 ms (gathered -> in place; 1.73 in place without the
 * prefetch); warm 0.93-0.96 -> 0.71-0.74. kc == NULL: everything gathered (bfloat16 caches, widened by the
 * gather). */
typedef struct {
    const float *kc, *vc; /* KV head h's column of the caches, or another sequence's gathered rows (bt NULL) */
    const int32_t *bt;    /* the sequence's block table */
    int64_t k_sb, k_ss, v_sb, v_ss, bs;
    int64_t whole; /* keys 0 .. whole-1 (a multiple of 16) are read in place */
} ps_kv_rows;

static const ps_kv_rows PS_KV_GATHERED = {0};

/* KV head h of a sequence (block table bt_row) in place, keys 0 .. whole-1 (float32 caches). */
static inline ps_kv_rows ps_kv_paged(const void *kc, const void *vc, const int32_t *bt_row, int64_t h, int64_t k_sb,
                                     int64_t k_ss, int64_t k_sh, int64_t v_sb, int64_t v_ss, int64_t v_sh, int64_t BS,
                                     int64_t whole) {
    return (ps_kv_rows){(const float *)kc + h * k_sh, (const float *)vc + h * v_sh, bt_row, k_sb, k_ss, v_sb, v_ss,
                        BS, whole};
}

/* Tile k0's first K and V rows and their strides. */
static inline __attribute__((always_inline)) void ps_kv_tile(const ps_kv_rows src, const float *K, const float *V,
                                                             const int64_t k0, const int64_t D, const float **kt,
                                                             const float **vt, int64_t *ks, int64_t *vs) {
    if (src.kc && !src.bt && k0 + 16 <= src.whole) { /* another sequence's gathered rows */
        *kt = src.kc + k0 * D;
        *vt = src.vc + k0 * D;
        *ks = *vs = D;
    } else if (src.kc && k0 + 16 <= src.whole) {
        const int64_t blk = src.bt[k0 / src.bs], t = k0 % src.bs;
        *kt = src.kc + blk * src.k_sb + t * src.k_ss;
        *vt = src.vc + blk * src.v_sb + t * src.v_ss;
        *ks = src.k_ss;
        *vs = src.v_ss;
        if (k0 + 32 <= src.whole) { /* the next tile's rows into L2 while this one is computed */
            const int64_t nblk = src.bt[(k0 + 16) / src.bs], nt = (k0 + 16) % src.bs;
            ps_prefetch_block(src.kc + nblk * src.k_sb + nt * src.k_ss, src.vc + nblk * src.v_sb + nt * src.v_ss, 16,
                              src.k_ss * (int64_t)sizeof(float), src.v_ss * (int64_t)sizeof(float),
                              D * (int64_t)sizeof(float));
        }
    } else {
        *kt = K + k0 * D;
        *vt = V + k0 * D;
        *ks = *vs = D;
    }
}

#ifdef PS_AVX2
/* AVX2 (16 ymm registers): the item below in 8-lane vectors, PS_PF_V8 of them for its 32 rows, 2 keys per
 * Q.K pass and 2 head_dim columns per P.V pass: 8 accumulators, 4 query (or probability) vectors and the
 * broadcasts fit the registers. The generic item's 16-lane vectors split into register pairs on AVX2,
 * its 2 x 8 accumulators spilled and its exp ran per lane: ~10x slower than torch's SDPA, measured on a
 * 2-core AMD EPYC (Zen 3). Same arguments, same results to float32 rounding. */
#define PS_PF_V8 (PS_PF_ROWS / 8)
#define PS_PF_KH2 2
#define PS_PF_DB2 2

static inline __attribute__((always_inline)) void ps_prefill_item_v8(
    const void *restrict q, const int64_t q_st, const int64_t q_sh, void *restrict out, const int64_t o_st,
    const int64_t o_sh, const float *restrict K, const float *restrict V, const ps_kv_rows src, const int64_t offset,
    const int64_t r0,
    const int64_t nrows, const int64_t G, const int64_t h, const int64_t D, const float scale, const int64_t kmax,
    float *restrict state, const int bf16, const int nv) {
    __m256 qt[PS_PF_MAX_D][PS_PF_V8], ot[PS_PF_MAX_D][PS_PF_V8], pos[PS_PF_V8], m[PS_PF_V8], lsum[PS_PF_V8];
    int64_t row_o[PS_PF_ROWS]; /* element offset of each lane's output row */
    for (int j = 0; j < nv; ++j) {
        float qw[PS_PF_MAX_D][8], pj[8];
        for (int l = 0; l < 8; ++l) {
            const int64_t r0l = r0 + 8 * j + l, r = r0l < nrows ? r0l : nrows - 1, qi = r / G, k = h * G + r % G;
            pj[l] = (float)(offset + qi);
            row_o[8 * j + l] = qi * o_st + k * o_sh;
            for (int64_t d = 0; d < D; ++d) qw[d][l] = ps_pf_load(q, qi * q_st + k * q_sh + d, bf16) * scale;
        }
        for (int64_t d = 0; d < D; ++d) {
            qt[d][j] = _mm256_loadu_ps(qw[d]);
            ot[d][j] = _mm256_setzero_ps();
        }
        pos[j] = _mm256_loadu_ps(pj);
        m[j] = _mm256_set1_ps(-INFINITY);
        lsum[j] = _mm256_setzero_ps();
    }
    const int64_t last = r0 + PS_PF_ROWS - 1 < nrows ? r0 + PS_PF_ROWS - 1 : nrows - 1;
    const int64_t first_pos = offset + r0 / G, kseen = offset + last / G + 1; /* keys 0 .. kend-1 are seen */
    const int64_t kend = kseen < kmax ? kseen : kmax;
    for (int64_t k0 = 0; k0 < kend; k0 += 16) {
        const float *kt, *vt;
        int64_t ks, vs;
        ps_kv_tile(src, K, V, k0, D, &kt, &vt, &ks, &vs);
        __m256 s[PS_PF_V8][16];
        for (int t0 = 0; t0 < 16; t0 += PS_PF_KH2) {
            __m256 acc[PS_PF_V8][PS_PF_KH2];
            for (int j = 0; j < nv; ++j)
                for (int t = 0; t < PS_PF_KH2; ++t) acc[j][t] = _mm256_setzero_ps();
            const float *kd = kt + t0 * ks;
            for (int64_t d = 0; d < D; ++d, ++kd)
                for (int t = 0; t < PS_PF_KH2; ++t) {
                    const __m256 kb = _mm256_broadcast_ss(kd + t * ks);
                    for (int j = 0; j < nv; ++j) acc[j][t] = _mm256_fmadd_ps(qt[d][j], kb, acc[j][t]);
                }
            for (int j = 0; j < nv; ++j)
                for (int t = 0; t < PS_PF_KH2; ++t) s[j][t0 + t] = acc[j][t];
        }
        __m256 alpha[PS_PF_V8];
        for (int j = 0; j < nv; ++j) {
            if (k0 + 15 > first_pos) /* the tile reaches past some lane's position: causal mask */
                for (int t = 0; t < 16; ++t)
                    s[j][t] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s[j][t],
                                               _mm256_cmp_ps(_mm256_set1_ps((float)(k0 + t)), pos[j], _CMP_LE_OQ));
            __m256 mt = s[j][0];
            for (int t = 1; t < 16; ++t) mt = _mm256_max_ps(mt, s[j][t]);
            const __m256 mnew = _mm256_max_ps(m[j], mt); /* finite: key 0 is in every lane's first tile */
            alpha[j] = ps_exp8(_mm256_sub_ps(m[j], mnew)); /* ps_exp8(-inf) ~ 1e-38, not 0: harmless here */
            lsum[j] = _mm256_mul_ps(lsum[j], alpha[j]);
            for (int t = 0; t < 16; ++t) {
                s[j][t] = ps_exp8(_mm256_sub_ps(s[j][t], mnew)); /* s now holds the tile's probabilities p */
                lsum[j] = _mm256_add_ps(lsum[j], s[j][t]);
            }
            m[j] = mnew;
        }
        for (int64_t d0 = 0; d0 < D; d0 += PS_PF_DB2) { /* ot = alpha ot + p V, 2 columns at a time */
            __m256 o[PS_PF_V8][PS_PF_DB2];
            for (int j = 0; j < nv; ++j)
                for (int i = 0; i < PS_PF_DB2; ++i) o[j][i] = _mm256_mul_ps(ot[d0 + i][j], alpha[j]);
            for (int t = 0; t < 16; ++t)
                for (int i = 0; i < PS_PF_DB2; ++i) {
                    const __m256 vb = _mm256_broadcast_ss(vt + t * vs + d0 + i);
                    for (int j = 0; j < nv; ++j) o[j][i] = _mm256_fmadd_ps(s[j][t], vb, o[j][i]);
                }
            for (int j = 0; j < nv; ++j)
                for (int i = 0; i < PS_PF_DB2; ++i) ot[d0 + i][j] = o[j][i];
        }
    }
    for (int j = 0; j < nv; ++j) {
        float mj[8], lj[8], ov[8];
        _mm256_storeu_ps(mj, m[j]);
        _mm256_storeu_ps(lj, lsum[j]);
        for (int64_t d = 0; d < D; ++d) {
            _mm256_storeu_ps(ov, ot[d][j]);
            for (int l = 0; l < 8 && r0 + 8 * j + l < nrows; ++l) {
                if (state) state[row_o[8 * j + l] + 2 + d] = ov[l]; /* the softmax state, as below */
                else ps_pf_store(out, row_o[8 * j + l] + d, ov[l] / lj[l], bf16);
            }
        }
        if (state)
            for (int l = 0; l < 8 && r0 + 8 * j + l < nrows; ++l) {
                state[row_o[8 * j + l]] = mj[l];
                state[row_o[8 * j + l] + 1] = lj[l];
            }
    }
}

/* Only the 8-row vectors that hold real rows where that is one or two: a shared-prefix group of 16 members
 * (48 rows: an item of 32 and one of 16) otherwise computes 4 for its second. nv is a constant in each
 * copy, so the loops unroll. Decode over 4 x 16 sequences sharing 1,024 keys, per layer (Zen 3, cold
 * pool, interleaved): 2.97 -> 2.65 ms. A copy for 3 (n = 8 samples: 24 rows) measured 0.85x, so 3 takes 4. */
static inline __attribute__((always_inline)) void ps_prefill_item(
    const void *restrict q, const int64_t q_st, const int64_t q_sh, void *restrict out, const int64_t o_st,
    const int64_t o_sh, const float *restrict K, const float *restrict V, const ps_kv_rows src, const int64_t offset,
    const int64_t r0,
    const int64_t nrows, const int64_t G, const int64_t h, const int64_t D, const float scale, const int64_t kmax,
    float *restrict state, const int bf16) {
#define PS_ITEM_V8(NV) ps_prefill_item_v8(q, q_st, q_sh, out, o_st, o_sh, K, V, src, offset, r0, nrows, G, h, D, scale, kmax, \
                                          state, bf16, NV)
    switch ((nrows - r0 + 7) / 8) {
    case 1: PS_ITEM_V8(1); break;
    case 2: PS_ITEM_V8(2); break;
    default: PS_ITEM_V8(PS_PF_V8); break;
    }
#undef PS_ITEM_V8
}
#else
/* A tile's P.V into a float32 item's output: ot[d][j] = alpha[j] ot[d][j] + sum_t p[j][t] V[t][d] (RESCALE 0:
 * alpha is 1 for every row, the multiply skipped), PS_PF_DB columns at a time. */
static inline __attribute__((always_inline)) void ps_pv_tile(ps_v16 ot[][PS_PF_NV], const ps_v16 *alpha,
                                                             ps_v16 p[][16], const float *restrict vt, const int64_t vs,
                                                             const int64_t D, const int nv, const int RESCALE) {
    for (int64_t d0 = 0; d0 < D; d0 += PS_PF_DB) {
        ps_v16 o[PS_PF_NV][PS_PF_DB];
        for (int j = 0; j < nv; ++j)
            for (int i = 0; i < PS_PF_DB; ++i) o[j][i] = RESCALE ? ot[d0 + i][j] * alpha[j] : ot[d0 + i][j];
        for (int t = 0; t < 16; ++t)
            for (int i = 0; i < PS_PF_DB; ++i) {
                const float vb = vt[t * vs + d0 + i];
                for (int j = 0; j < nv; ++j) o[j][i] += p[j][t] * vb;
            }
        for (int j = 0; j < nv; ++j)
            for (int i = 0; i < PS_PF_DB; ++i) ot[d0 + i][j] = o[j][i];
    }
}

/* One item: rows r0 .. r0+31 (those < nrows are real; the rest repeat the last real row and are not
 * stored) of KV head h of one sequence; q and out point at the sequence's first token, K and V at the
 * head's gathered rows. Two row vectors per item, so each K or V element broadcast from L1 feeds two
 * FMAs: with one, the broadcasts alone kept both load ports busy (~70% of FMA peak measured).
 * always_inline: the dispatch below makes copies for constant D and element type (q and out are
 * float32 or bfloat16 as bf16 says; K and V are the float32 gathered rows either way). */
static inline __attribute__((always_inline)) void ps_prefill_item16(
    const void *restrict q, const int64_t q_st, const int64_t q_sh, void *restrict out, const int64_t o_st,
    const int64_t o_sh, const float *restrict K, const float *restrict V, const ps_kv_rows src, const int64_t offset,
    const int64_t r0,
    const int64_t nrows, const int64_t G, const int64_t h, const int64_t D, const float scale, const int64_t kmax,
    float *restrict state, const int bf16, const int nv) {
    ps_v16 qt[PS_PF_MAX_D][PS_PF_NV], ot[PS_PF_MAX_D][PS_PF_NV], pos[PS_PF_NV], m[PS_PF_NV], lsum[PS_PF_NV];
    int64_t row_o[PS_PF_ROWS]; /* element offset of each lane's output row */
    for (int j = 0; j < nv; ++j) {
        int64_t at[16]; /* each row's query, in elements from q */
        for (int l = 0; l < 16; ++l) {
            const int64_t r0l = r0 + 16 * j + l, r = r0l < nrows ? r0l : nrows - 1, qi = r / G, k = h * G + r % G;
            pos[j][l] = (float)(offset + qi);
            row_o[16 * j + l] = qi * o_st + k * o_sh;
            at[l] = qi * q_st + k * q_sh;
        }
#ifdef PS_AVX512
        if (!bf16) { /* float32 rows turned over in 16 x 16 blocks (ps_rows16_load, byte offsets) */
            for (int l = 0; l < 16; ++l) at[l] *= (int64_t)sizeof(float);
            ps_rows16_load((const char *)q, at, D, _mm512_set1_ps(scale), 1, (__m512 *)&qt[0][j], PS_PF_NV);
        } else
#endif
            for (int l = 0; l < 16; ++l)
                for (int64_t d = 0; d < D; ++d) qt[d][j][l] = ps_pf_load(q, at[l] + d, bf16) * scale;
        m[j] = ps_v16_set1(-INFINITY);
        lsum[j] = ps_v16_set1(0.0f);
        for (int64_t d = 0; d < D; ++d) ot[d][j] = ps_v16_set1(0.0f);
    }
    const int64_t last = r0 + 16 * nv - 1 < nrows ? r0 + 16 * nv - 1 : nrows - 1;
    const int64_t first_pos = offset + r0 / G, kseen = offset + last / G + 1; /* keys 0 .. kend-1 are seen */
    const int64_t kend = kseen < kmax ? kseen : kmax;
    for (int64_t k0 = 0; k0 < kend; k0 += 16) {
        const float *kt, *vt;
        int64_t ks, vs;
        ps_kv_tile(src, K, V, k0, D, &kt, &vt, &ks, &vs);
        ps_v16 s[PS_PF_NV][16];
        for (int t0 = 0; t0 < 16; t0 += PS_PF_KH) { /* scores, 8 keys at a time: 16 accumulators */
            ps_v16 acc[PS_PF_NV][PS_PF_KH];
            for (int j = 0; j < nv; ++j)
                for (int t = 0; t < PS_PF_KH; ++t) acc[j][t] = ps_v16_set1(0.0f);
            const float *kd = kt + t0 * ks; /* one pointer walking d: the 8 keys at fixed offsets */
            for (int64_t d = 0; d < D; ++d, ++kd)
                for (int t = 0; t < PS_PF_KH; ++t) {
                    const float kb = kd[t * ks];
                    for (int j = 0; j < nv; ++j) acc[j][t] += qt[d][j] * kb;
                }
            for (int j = 0; j < nv; ++j)
                for (int t = 0; t < PS_PF_KH; ++t) s[j][t0 + t] = acc[j][t];
        }
        ps_v16 alpha[PS_PF_NV];
        int rescale = 0;
        for (int j = 0; j < nv; ++j) {
            if (k0 + 15 > first_pos) /* the tile reaches past some lane's position: causal mask */
                for (int t = 0; t < 16; ++t)
                    s[j][t] = ps_v16_select(ps_v16_set1((float)(k0 + t)) <= pos[j], s[j][t], ps_v16_set1(-INFINITY));
            ps_v16 mt = s[j][0];
            for (int t = 1; t < 16; ++t) mt = ps_v16_max(mt, s[j][t]);
            /* PS_PF_SLACK's rule (the exps stay degree 6: float32's accuracy). Per layer, 2-core AMD EPYC Zen 5,
             * medians of 3 alternating rounds (results/amd-zen5-avx512bf16/ab_flash_f32_lazy_max.json): prefill
             * 1x2048 11.98 -> 11.14 ms, 64 after 1,024 cached 0.424 -> 0.403, 5 x 410 2.68 -> 2.55; decode over
             * shared prefixes unchanged. */
            const ps_m16 grows = mt > m[j] + PS_PF_SLACK_E;
            int any = 0;
            for (int l = 0; l < 16; ++l) any |= grows[l];
            alpha[j] = ps_v16_set1(1.0f);
            if (any) {
                const ps_v16 mnew = ps_v16_max(m[j], mt); /* finite: key 0 is in every lane's first tile */
                alpha[j] = ps_v16_exp(m[j] - mnew);
                lsum[j] *= alpha[j];
                m[j] = mnew;
                rescale = 1;
            }
            for (int t = 0; t < 16; ++t) {
                s[j][t] = ps_v16_exp(s[j][t] - m[j]); /* s now holds the tile's probabilities p */
                lsum[j] += s[j][t];
            }
        }
        if (rescale) ps_pv_tile(ot, alpha, s, vt, vs, D, nv, 1);
        else ps_pv_tile(ot, alpha, s, vt, vs, D, nv, 0);
    }
    for (int j = 0; j < nv; ++j) {
        const ps_v16 inv = 1.0f / lsum[j];
        const int n = nrows - r0 - 16 * j < 16 ? (int)(nrows - r0 - 16 * j) : 16;
        if (n <= 0) break; /* no real rows in this vector, nor in the next */
        if (state) /* the softmax state, not normalised: paged_attention_decode.c goes on from it */
            for (int l = 0; l < n; ++l) {
                state[row_o[16 * j + l]] = m[j][l];
                state[row_o[16 * j + l] + 1] = lsum[j][l];
            }
#ifdef PS_AVX512
        if (state) ps_rows16_store((const __m512 *)&ot[0][j], PS_PF_NV, _mm512_set1_ps(1.0f), D, row_o + 16 * j, n, state + 2, 0);
        else ps_rows16_store((const __m512 *)&ot[0][j], PS_PF_NV, (__m512)inv, D, row_o + 16 * j, n, out, bf16);
#else
        for (int l = 0; l < n; ++l) {
            if (state)
                for (int64_t d = 0; d < D; ++d) state[row_o[16 * j + l] + 2 + d] = ot[d][j][l];
            else
                for (int64_t d = 0; d < D; ++d) ps_pf_store(out, row_o[16 * j + l] + d, ot[d][j][l] * inv[l], bf16);
        }
#endif
    }
}

/* The item through a copy for its real row vectors: nv = 1 where its rows fit one (the last item of a
 * sequence or group, 16 rows or fewer), which then computes 16 rows, not 32 with 16 repeated. GSP's
 * decode groups (16 sequences x 3 query heads = 48 rows: an item of 32 and one of 16). */
static inline __attribute__((always_inline)) void ps_prefill_item(
    const void *restrict q, const int64_t q_st, const int64_t q_sh, void *restrict out, const int64_t o_st,
    const int64_t o_sh, const float *restrict K, const float *restrict V, const ps_kv_rows src, const int64_t offset,
    const int64_t r0,
    const int64_t nrows, const int64_t G, const int64_t h, const int64_t D, const float scale, const int64_t kmax,
    float *restrict state, const int bf16) {
#define PS_ITEM16(NV) ps_prefill_item16(q, q_st, q_sh, out, o_st, o_sh, K, V, src, offset, r0, nrows, G, h, D, scale, kmax, \
                                       state, bf16, NV)
    if (nrows - r0 > 16) PS_ITEM16(2);
    else PS_ITEM16(1);
#undef PS_ITEM16
}

#endif /* PS_AVX2 */

#if defined(__AVX512BF16__) && defined(PS_AVX512)
#define PS_PF_DP 1
/* 2^t in float32 to about 1e-4 relative (a degree-3 minimax polynomial on [-1/2, 1/2]): the bfloat16
 * items' probabilities round to bfloat16 (2^-9) before P.V, so ps_exp16's degree 6 bought nothing there. In
 * flash_amx.h's item the exp was the largest cost (per 32 keys x 32 rows on the 2-core Xeon: 2,736 cycles,
 * 1,788 without it). t = -inf (a masked key) gives 2^-125, no denormal (those take microcode assists). */
static inline __m512 ps_exp2_bf16(__m512 t) {
    t = _mm512_max_ps(t, _mm512_set1_ps(-125.0f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.05500893f), f, _mm512_set1_ps(0.24221098f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69328293f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Rows r0j .. r0j+15 of a bfloat16 item (past nrows: the last real row again): each row's query as d pairs,
 * col[i * stride] lane l = q[row l][2i] | q[row l][2i+1] << 16, its output offset row_o16[l] and its position. */
static inline __attribute__((always_inline)) __m512 ps_pf_rows16(const uint16_t *restrict q, const int64_t q_st,
                                                                 const int64_t q_sh, const int64_t o_st, const int64_t o_sh,
                                                                 const int64_t offset, const int64_t r0j,
                                                                 const int64_t nrows, const int64_t G, const int64_t h,
                                                                 const int64_t D, __m512 *col, const int64_t stride,
                                                                 int64_t *row_o16) {
    float pj[16];
    int64_t at[16]; /* each row's query, in bytes from q */
    for (int l = 0; l < 16; ++l) {
        const int64_t r0l = r0j + l, r = r0l < nrows ? r0l : nrows - 1, qi = r / G, k = h * G + r % G;
        pj[l] = (float)(offset + qi);
        row_o16[l] = qi * o_st + k * o_sh;
        at[l] = (qi * q_st + k * q_sh) * (int64_t)sizeof(uint16_t);
    }
    ps_rows16_load((const char *)q, at, D / 2, _mm512_setzero_ps(), 0, col, stride);
    return _mm512_loadu_ps(pj);
}

/* The permutation that makes cvtne2ps's output pairs: bf16 element 2l from lane l of its first operand
 * (the low half), 2l + 1 from lane l of its second (the high half). */
static inline __m512i ps_pair_interleave(void) {
    uint16_t idx[32];
    for (int i = 0; i < 32; ++i) idx[i] = (uint16_t)(i % 2 ? 16 + i / 2 : i / 2);
    return _mm512_loadu_si512(idx);
}

/* Row block j (rows r0j .. r0j+15, those < nrows real) of a 16-lane bfloat16 item: its softmax state
 * into state (m in natural units, l, the unnormalised ot; paged_attention_decode.c goes on from it)
 * or, without state, ot / l rounded into out. row_o: each row's element offset, for all the item's rows. */
static inline __attribute__((always_inline)) void ps_pf_finish16(__m512 ot[][PS_PF_NV], const int j, const __m512 m,
                                                                 const __m512 lsum, const int64_t *row_o,
                                                                 const int64_t r0j, const int64_t nrows, const int64_t D,
                                                                 float *restrict state, uint16_t *restrict out) {
    const int64_t *ro = row_o + 16 * j;
    const int n = nrows - r0j < 16 ? (int)(nrows - r0j) : 16;
    if (n <= 0) return;
    if (state) {
        float mj[16], lj[16];
        _mm512_storeu_ps(mj, m);
        _mm512_storeu_ps(lj, lsum);
        for (int l = 0; l < n; ++l) {
            state[ro[l]] = mj[l];
            state[ro[l] + 1] = lj[l];
        }
        ps_rows16_store(&ot[0][j], PS_PF_NV, _mm512_set1_ps(1.0f), D, ro, n, state + 2, 0);
        return;
    }
    ps_rows16_store(&ot[0][j], PS_PF_NV, _mm512_div_ps(_mm512_set1_ps(1.0f), lsum), D, ro, n, out, 1);
}

/* Keys 0 .. whole-1 of a bfloat16 item (whole = 0: none) read elsewhere than its own gathered rows: in
 * another sequence's gathered rows (K rows, V pairs; prefill's sharers, paged_attention_prefill.c
 * ps_shared_keys), or, with kc set, in place in the paged cache (decode's shared prefixes: blocks of a
 * multiple of 16 positions), each tile's V rows paired into the item's own buffer (ps_vpairs_tile) and the
 * next tile prefetched. In place, GSP's bfloat16 decode (64 sequences over 4 shared 1,024-token prompts,
 * their real block tables, caches flushed before each call) spent 0.35-0.45 of its 1.0-1.14 ms per layer
 * gathering the prefixes every step. */
typedef struct {
    const uint16_t *K;
    const uint32_t *V;
    int64_t whole;
    const uint16_t *kc, *vc; /* KV head h's column of the caches (NULL: K / V above) */
    const int32_t *bt;
    int64_t k_sb, k_ss, v_sb, v_ss, bs;
} ps_kv_pairs;

static const uint16_t PS_ZERO_ROW[PS_PF_MAX_D]; /* the missing second row of an odd length's last pair */

/* Two position rows of V as one row of pairs: dst[d] = a[d] | b[d] << 16. */
static inline __attribute__((always_inline)) void ps_vpair_row(const uint16_t *restrict a, const uint16_t *restrict b,
                                                               const int64_t D, uint32_t *restrict dst) {
    for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 mk = D - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - d)) - 1u);
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, a + d));
        const __m512i hi = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, b + d));
        _mm512_mask_storeu_epi32(dst + d, mk, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
}

/* 16 position rows of V (rows v_ss apart) as 8 position pairs, ps_gather_vpairs' layout for one tile. */
static inline __attribute__((always_inline)) void ps_vpairs_tile(const uint16_t *restrict v, const int64_t v_ss,
                                                                 const int64_t D, uint32_t *restrict dst) {
    for (int u = 0; u < 8; ++u) ps_vpair_row(v + 2 * u * v_ss, v + (2 * u + 1) * v_ss, D, dst + u * D);
}

/* A tile's P.V into a bfloat16 item's output: ot[d][j] = alpha[j] ot[d][j] + sum_u p2[j][u] . V pairs (RESCALE
 * 0: alpha is 1 for every row, the multiply skipped). PS_PF_DB columns at a time: NV x DB independent chains. */
static inline __attribute__((always_inline)) void ps_pv_tile_dp(__m512 ot[][PS_PF_NV], const __m512 *alpha,
                                                                __m512bh p2[][8], const uint32_t *restrict vt,
                                                                const int64_t D, const int nv, const int RESCALE) {
    for (int64_t d0 = 0; d0 < D; d0 += PS_PF_DB) {
        __m512 o[PS_PF_NV][PS_PF_DB];
        for (int j = 0; j < nv; ++j)
            for (int i = 0; i < PS_PF_DB; ++i) o[j][i] = RESCALE ? _mm512_mul_ps(ot[d0 + i][j], alpha[j]) : ot[d0 + i][j];
        for (int u = 0; u < 8; ++u)
            for (int i = 0; i < PS_PF_DB; ++i) {
                const __m512bh vb = (__m512bh)_mm512_set1_epi32((int32_t)vt[u * D + d0 + i]);
                for (int j = 0; j < nv; ++j) o[j][i] = _mm512_dpbf16_ps(o[j][i], p2[j][u], vb);
            }
        for (int j = 0; j < nv; ++j)
            for (int i = 0; i < PS_PF_DB; ++i) ot[d0 + i][j] = o[j][i];
    }
}

/* bfloat16 with AVX512-BF16: the item above with both products on vdpbf16ps, which multiplies 16
 * lanes of bf16 pairs and adds each pair's two products into a float32 lane, so one instruction does
 * the work of two FMAs. Gathered K stays bfloat16 in position rows (a pair of d is one 32-bit word);
 * gathered V holds position pairs (ps_gather_vpairs: v[t][d] and v[t+1][d] in one word). Scores,
 * the softmax and the output sums stay float32; the probabilities round to bfloat16 before P.V (as
 * FlashAttention does on GPUs), so a result may differ from the float32 math by up to 2^-9 of the
 * largest |V| (tests/kernels/test_paged_attention_cpu.py). The scale (and log2 e) is folded into the exp,
 * which runs in base 2 (ps_exp2_bf16); the running max moves by PS_PF_SLACK's rule. */
static inline __attribute__((always_inline)) void ps_prefill_item_dp16(
    const uint16_t *restrict q, const int64_t q_st, const int64_t q_sh, uint16_t *restrict out, const int64_t o_st,
    const int64_t o_sh, const uint16_t *restrict K, const uint32_t *restrict V, const ps_kv_pairs shared,
    const int64_t offset, const int64_t r0, const int64_t nrows, const int64_t G, const int64_t h, const int64_t D,
    const float scale, const int64_t kmax, float *restrict state, const int nv) {
    __m512bh qt[PS_PF_MAX_D / 2][PS_PF_NV]; /* lane r: q[row r][2i], q[row r][2i+1] */
    __m512 ot[PS_PF_MAX_D][PS_PF_NV], pos[PS_PF_NV], m[PS_PF_NV], lsum[PS_PF_NV];
    int64_t row_o[PS_PF_ROWS];
    const __m512 vscale = _mm512_set1_ps(scale * 1.44269504088896341f); /* m and the exps in base 2 */
    const __m512i interleave = ps_pair_interleave();
    for (int j = 0; j < nv; ++j) {
        pos[j] = ps_pf_rows16(q, q_st, q_sh, o_st, o_sh, offset, r0 + 16 * j, nrows, G, h, D, (__m512 *)&qt[0][j], PS_PF_NV,
                              row_o + 16 * j);
        m[j] = _mm512_set1_ps(-INFINITY);
        lsum[j] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; ++d) ot[d][j] = _mm512_setzero_ps();
    }
    const int64_t last = r0 + 16 * nv - 1 < nrows ? r0 + 16 * nv - 1 : nrows - 1;
    const int64_t first_pos = offset + r0 / G, kseen = offset + last / G + 1, kend = kseen < kmax ? kseen : kmax;
    uint32_t vbuf[8 * PS_PF_MAX_D] __attribute__((aligned(64))); /* a tile's V pairs, read in place */
    for (int64_t k0 = 0; k0 < kend; k0 += 16) {
        const uint16_t *kt = K + k0 * D;
        const uint32_t *vt = V + k0 / 2 * D; /* 8 position pairs of D words */
        int64_t ks = D;                      /* K's row stride */
        if (k0 + 16 <= shared.whole && shared.kc) {
            const int64_t blk = shared.bt[k0 / shared.bs], t = k0 % shared.bs;
            kt = shared.kc + blk * shared.k_sb + t * shared.k_ss;
            ks = shared.k_ss;
            ps_vpairs_tile(shared.vc + blk * shared.v_sb + t * shared.v_ss, shared.v_ss, D, vbuf);
            vt = vbuf;
            if (k0 + 32 <= shared.whole) { /* the next tile's rows into L2 while this one is computed */
                const int64_t nb = shared.bt[(k0 + 16) / shared.bs], nt = (k0 + 16) % shared.bs;
                ps_prefetch_block(shared.kc + nb * shared.k_sb + nt * shared.k_ss,
                                  shared.vc + nb * shared.v_sb + nt * shared.v_ss, 16,
                                  shared.k_ss * (int64_t)sizeof(uint16_t), shared.v_ss * (int64_t)sizeof(uint16_t),
                                  D * (int64_t)sizeof(uint16_t));
            }
        } else if (k0 + 16 <= shared.whole) {
            kt = shared.K + k0 * D;
            vt = shared.V + k0 / 2 * D;
        }
        __m512 s[PS_PF_NV][16];
        for (int t0 = 0; t0 < 16; t0 += PS_PF_KH) {
            __m512 acc[PS_PF_NV][PS_PF_KH];
            for (int j = 0; j < nv; ++j)
                for (int t = 0; t < PS_PF_KH; ++t) acc[j][t] = _mm512_setzero_ps();
            const uint16_t *kd = kt + t0 * ks;
            for (int64_t i = 0; i < D / 2; ++i, kd += 2)
                for (int t = 0; t < PS_PF_KH; ++t) {
                    const __m512bh kb = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(kd + t * ks));
                    for (int j = 0; j < nv; ++j) acc[j][t] = _mm512_dpbf16_ps(acc[j][t], qt[i][j], kb);
                }
            for (int j = 0; j < nv; ++j)
                for (int t = 0; t < PS_PF_KH; ++t) s[j][t0 + t] = acc[j][t];
        }
        __m512 alpha[PS_PF_NV];
        __m512bh p2[PS_PF_NV][8]; /* lane r: p[r][2u], p[r][2u + 1] in bfloat16 */
        int rescale = 0;
        for (int j = 0; j < nv; ++j) {
            if (k0 + 15 > first_pos)
                for (int t = 0; t < 16; ++t)
                    s[j][t] = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(_mm512_set1_ps((float)(k0 + t)), pos[j], _CMP_LE_OQ),
                                                   _mm512_set1_ps(-INFINITY), s[j][t]);
            __m512 mt = s[j][0];
            for (int t = 1; t < 16; ++t) mt = _mm512_max_ps(mt, s[j][t]);
            mt = _mm512_mul_ps(mt, vscale); /* m: scaled scores, base 2 */
            alpha[j] = _mm512_set1_ps(1.0f);
            /* PS_PF_SLACK's rule, the exps in base 2 by ps_exp2_bf16. Per layer on the 2-core AMD EPYC Zen 5
             * (results/amd-zen5-avx512bf16/ab_flash_dp_exp2.json, medians of 4 alternating rounds): prefill
             * 1x2048 7.17 -> 6.32 ms, 16 x 64 after a shared 1,024 3.86 -> 3.32, 5 x 410 1.84 -> 1.56; decode
             * over 4 shared prompts x 16 0.40 -> 0.37. */
            if (_mm512_cmp_ps_mask(mt, _mm512_add_ps(m[j], _mm512_set1_ps(PS_PF_SLACK)), _CMP_GT_OQ)) {
                const __m512 mnew = _mm512_max_ps(m[j], mt); /* finite: key 0 is in every first tile */
                alpha[j] = ps_exp2_bf16(_mm512_sub_ps(m[j], mnew));
                lsum[j] = _mm512_mul_ps(lsum[j], alpha[j]);
                m[j] = mnew;
                rescale = 1;
            }
            for (int t = 0; t < 16; ++t) {
                s[j][t] = ps_exp2_bf16(_mm512_fmsub_ps(s[j][t], vscale, m[j]));
                lsum[j] = _mm512_add_ps(lsum[j], s[j][t]);
            }
            for (int u = 0; u < 8; ++u)
                p2[j][u] = (__m512bh)_mm512_permutexvar_epi16(
                    interleave, (__m512i)_mm512_cvtne2ps_pbh(s[j][2 * u + 1], s[j][2 * u]));
        }
        if (rescale) ps_pv_tile_dp(ot, alpha, p2, vt, D, nv, 1);
        else ps_pv_tile_dp(ot, alpha, p2, vt, D, nv, 0);
    }
    for (int j = 0; j < nv; ++j) /* m in natural units for the state */
        ps_pf_finish16(ot, j, _mm512_mul_ps(m[j], _mm512_set1_ps(0.693147180559945309f)), lsum[j], row_o, r0 + 16 * j,
                       nrows, D, state, out);
}

/* As ps_prefill_item: a copy for one row vector where the item's rows fit it. */
static inline __attribute__((always_inline)) void ps_prefill_item_dp(
    const uint16_t *restrict q, const int64_t q_st, const int64_t q_sh, uint16_t *restrict out, const int64_t o_st,
    const int64_t o_sh, const uint16_t *restrict K, const uint32_t *restrict V, const ps_kv_pairs shared,
    const int64_t offset, const int64_t r0, const int64_t nrows, const int64_t G, const int64_t h, const int64_t D,
    const float scale, const int64_t kmax, float *restrict state) {
#define PS_ITEM_DP16(NV) \
    ps_prefill_item_dp16(q, q_st, q_sh, out, o_st, o_sh, K, V, shared, offset, r0, nrows, G, h, D, scale, kmax, state, NV)
    if (nrows - r0 > 16) PS_ITEM_DP16(2);
    else PS_ITEM_DP16(1);
#undef PS_ITEM_DP16
}

/* Positions [p0, p1) of KV head h of a bfloat16 cache as position pairs: word (p / 2) * D + d of dst
 * holds v[p][d] in its low half and v[p + 1][d] in its high half (p even; p0 even, the pair past
 * p1 is zero). */
static void ps_gather_vpairs(const uint16_t *cache, const int32_t *bt_row, int64_t p0, int64_t p1, int64_t BS,
                             int64_t c_sb, int64_t c_ss, int64_t c_sh, int64_t h, int64_t D, uint32_t *dst) {
    for (int64_t p = p0; p < p1; p += 2) {
        const uint16_t *a = cache + (int64_t)bt_row[p / BS] * c_sb + (p % BS) * c_ss + h * c_sh;
        const uint16_t *b = p + 1 < p1 ? cache + (int64_t)bt_row[(p + 1) / BS] * c_sb + ((p + 1) % BS) * c_ss + h * c_sh
                                       : PS_ZERO_ROW;
        ps_vpair_row(a, b, D, dst + p / 2 * D);
    }
}
#endif

#define PS_AMX_KEYS 32 /* the AMX item's keys per step, and the multiple its gathered positions pad to */
#if defined(PS_PF_DP) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PS_PF_AMX 1
#include "flash_amx.h"
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


/* Positions [p0, p1) of KV head h (p0 a multiple of 16, p1 <= p0 + 16) into a sequence's gathered K and
 * V at base, padded with zero rows to p0 + 16 (a masked key's score is -inf, but 0 * NaN would still
 * be NaN). base holds lp positions of Hkv heads: float32 rows [K head 0 | .. | V head 0 | ..]
 * (ps_prefill_item), or with PS_PF_DP and bf16 bfloat16 K rows and V position pairs in the same
 * places (ps_prefill_item_dp: K head h at (uint16_t *)base + h lp D, V at (uint32_t *)(base + Hkv lp D)
 * + h lp / 2 D). */
static inline void ps_gather_chunk(const void *kc, const void *vc, const int32_t *bt_row, int64_t p0, int64_t p1,
                                   int64_t BS, int64_t k_sb, int64_t k_ss, int64_t k_sh, int64_t v_sb, int64_t v_ss,
                                   int64_t v_sh, int64_t h, int64_t Hkv, int64_t D, int64_t lp, float *base, int bf16) {
#ifdef PS_PF_DP
    if (bf16) {
        uint16_t *Kb = (uint16_t *)base + h * lp * D;
        uint32_t *Vp = (uint32_t *)(base + Hkv * lp * D) + h * (lp / 2) * D;
        for (int64_t p = p0; p < p1; ++p)
            memcpy(Kb + p * D, (const uint16_t *)kc + (int64_t)bt_row[p / BS] * k_sb + (p % BS) * k_ss + h * k_sh,
                   (size_t)D * sizeof(uint16_t));
        memset(Kb + p1 * D, 0, (size_t)((p0 + 16 - p1) * D) * sizeof(uint16_t));
        ps_gather_vpairs(vc, bt_row, p0, p1, BS, v_sb, v_ss, v_sh, h, D, Vp);
        const int64_t done = (p1 + 1) / 2; /* pairs written, the last maybe half zero */
        memset(Vp + done * D, 0, (size_t)((p0 + 16) / 2 - done) * D * sizeof(uint32_t));
        return;
    }
#endif
    float *Kh = base + h * lp * D, *Vh = Kh + Hkv * lp * D;
    if (bf16) { /* literal element types: each call is specialised */
        ps_gather(kc, bt_row, p0, p1, BS, k_sb, k_ss, k_sh, h, D, Kh, 1);
        ps_gather(vc, bt_row, p0, p1, BS, v_sb, v_ss, v_sh, h, D, Vh, 1);
    } else {
        ps_gather(kc, bt_row, p0, p1, BS, k_sb, k_ss, k_sh, h, D, Kh, 0);
        ps_gather(vc, bt_row, p0, p1, BS, v_sb, v_ss, v_sh, h, D, Vh, 0);
    }
    memset(Kh + p1 * D, 0, (size_t)((p0 + 16 - p1) * D) * sizeof(float));
    memset(Vh + p1 * D, 0, (size_t)((p0 + 16 - p1) * D) * sizeof(float));
}
#endif
