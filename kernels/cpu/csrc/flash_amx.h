/* The bfloat16 flash-attention item on AMX tiles (Intel Xeon 4th gen on): flash_item.h's item with both
 * products as tile multiplies, the softmax in AVX-512 between them. Included by flash_item.h.
 *
 * Why: on the 2-core Intel Xeon with AMX this project measures on, vdpbf16ps issues every second cycle
 * (1.3 G/s against 5.0 G/s for 512-bit FMAs: 20 independent accumulators on one core), so ps_prefill_item_dp ran no faster
 * than the float32 item, while one tile multiply (16 x 16 outputs over 32 bfloat16 products) does 8,192
 * multiply-adds.
 *
 * One item: rows r0 .. r0+31 (2 blocks of 16 lanes, as ps_prefill_item_dp), keys in steps of 32:
 *
 *     S^T[t][r]  = sum_d K[k0 + t][d] Q[r][d]         A = K rows (16 keys x 32 d), B = Q as d pairs
 *                                                      (16 pairs x 16 rows): C = 16 keys x 16 rows
 *     softmax on S^T as lanes = rows (flash_item.h), P^T as key pairs (lane r: p[r][2u], p[r][2u+1])
 *     O^T[d][r] += sum_t V^T[d][k0 + t] P[r][t]         A = V^T (16 d x 32 keys), B = P^T pairs
 *                                                      (16 pairs x 16 rows): C = 16 d x 16 rows
 *
 * so the float32 running output ot[d] keeps flash_item.h's layout (lane = row) and is rescaled there:
 * ot = alpha ot + C. Tiles: 0-3 accumulate (S^T of 2 key halves x 2 row blocks, then O^T of 4 d
 * blocks), 4-5 hold A, 6-7 B. The gathered keys are K position rows as ps_prefill_item_dp's, V
 * transposed (ps_gather_vt): lp, the positions gathered per head, is a multiple of 32 and pads with
 * zeros, so every tile load stays inside its head. Masked scores are -inf before the exp, so padding
 * keys weigh 2^-125 of a zero V row. The probabilities round to bfloat16 before P.V, as in ps_prefill_item_dp. */
#ifndef PS_FLASH_AMX_H
#define PS_FLASH_AMX_H
#include "amx_tiles.h"

/* Whether the AMX item takes a call with head_dim D (4 d blocks of 16 per O^T pass, pairs of 32 d per
 * S^T multiply). */
static inline int ps_amx_takes(int64_t D) { return D % 64 == 0 && D <= PS_PF_MAX_D; }

/* dst[c * ld + r] = row r's element c, for a 16 x 16 block of 16-bit elements (rows[r]: 16 elements
 * each): unpacks of 16-, 32- and 64-bit units within 128-bit lanes, then the lanes' halves swapped. */
static inline void ps_transpose16_epi16(const uint16_t *const rows[16], uint16_t *dst, int64_t ld) {
    __m256i a[16], b[16];
    for (int r = 0; r < 16; ++r) a[r] = _mm256_loadu_si256((const __m256i *)rows[r]);
    for (int r = 0; r < 16; r += 2) { /* (r, r+1) pairs of columns 0-3 | 8-11, 4-7 | 12-15 */
        b[r] = _mm256_unpacklo_epi16(a[r], a[r + 1]);
        b[r + 1] = _mm256_unpackhi_epi16(a[r], a[r + 1]);
    }
    for (int r = 0; r < 16; r += 4) /* rows r .. r+3 of columns {0,1 | 8,9}, {2,3 | 10,11}, {4,5 | ..}, {6,7 | ..} */
        for (int h = 0; h < 2; ++h) {
            a[r + 2 * h] = _mm256_unpacklo_epi32(b[r + h], b[r + 2 + h]);
            a[r + 2 * h + 1] = _mm256_unpackhi_epi32(b[r + h], b[r + 2 + h]);
        }
    /* a[4g + i]: rows 4g .. 4g+3, columns {2i, 2i+1 | 2i+8, 2i+9} (i = 0..3) */
    for (int g = 0; g < 4; g += 2) /* rows 8 (g/2) .. +7: column c | c+8 in b[8 (g/2) + c] */
        for (int i = 0; i < 4; ++i) {
            b[4 * g + 2 * i] = _mm256_unpacklo_epi64(a[4 * g + i], a[4 * g + 4 + i]);
            b[4 * g + 2 * i + 1] = _mm256_unpackhi_epi64(a[4 * g + i], a[4 * g + 4 + i]);
        }
    for (int c = 0; c < 8; ++c) {
        _mm256_storeu_si256((__m256i *)(dst + c * ld), _mm256_permute2x128_si256(b[c], b[8 + c], 0x20));
        _mm256_storeu_si256((__m256i *)(dst + (c + 8) * ld), _mm256_permute2x128_si256(b[c], b[8 + c], 0x31));
    }
}

/* Positions [p0, p1) of KV head h of a bfloat16 cache transposed into dst (D rows of lp positions;
 * p0 a multiple of 16, D of 16), positions p1 .. p0 + 15 zero. */
static void ps_gather_vt(const uint16_t *cache, const int32_t *bt_row, int64_t p0, int64_t p1, int64_t BS,
                         int64_t c_sb, int64_t c_ss, int64_t c_sh, int64_t h, int64_t D, int64_t lp, uint16_t *dst) {
    static const uint16_t zeros[PS_PF_MAX_D];
    const uint16_t *rows[16];
    for (int64_t p = p0; p < p0 + 16; ++p)
        rows[p - p0] = p < p1 ? cache + (int64_t)bt_row[p / BS] * c_sb + (p % BS) * c_ss + h * c_sh : zeros;
    for (int64_t d = 0; d < D; d += 16) {
        const uint16_t *block[16];
        for (int t = 0; t < 16; ++t) block[t] = rows[t] + d;
        ps_transpose16_epi16(block, dst + d * lp + p0, lp);
    }
}

/* Where the AMX items read K: key p's row at base + p ss (gathered rows, bt NULL), or at base + bt[p / bs] sb
 * + (p % bs) ss, the paged cache itself, whose blocks of a multiple of 16 positions keep a tile's 16 keys
 * in one block at one stride. Reading K in place leaves the gather only V to transpose: per layer, decode
 * over 4 x 16 sequences sharing 1,024 tokens spent ~40% of its time copying their K (2-core Xeon). */
typedef struct {
    const uint16_t *base;
    const int32_t *bt;
    int64_t sb, ss, bs;
} ps_krows;

static inline const uint16_t *ps_krow(const ps_krows k, const int64_t p) {
    return k.bt ? k.base + (int64_t)k.bt[p / k.bs] * k.sb + (p % k.bs) * k.ss : k.base + p * k.ss;
}

/* Whether the items read K in place (the head_dim 64 item; blocks of a multiple of 16 positions). */
static inline int ps_amx_k_in_place(int64_t D, int64_t BS) { return D == 64 && BS % 16 == 0; }

/* KV head h's keys for the items: in place in the cache (bt_row: the sequence's block table), or the gathered
 * rows at Kb. */
static inline ps_krows ps_amx_krows(const uint16_t *kc, const int32_t *bt_row, int64_t k_sb, int64_t k_ss,
                                    int64_t k_sh, int64_t h, int64_t BS, int64_t D, const uint16_t *Kb) {
    if (ps_amx_k_in_place(D, BS)) return (ps_krows){kc + h * k_sh, bt_row, k_sb, k_ss, BS};
    return (ps_krows){Kb, NULL, 0, D, 1};
}

/* Positions [p0, min(p1, p0 + 16)) of KV head h into the AMX item's layout at base (lp positions of Hkv
 * heads, zero past p1): K head h at (uint16_t *)base + h lp D as position rows, V^T head h at
 * (uint16_t *)(base + Hkv lp D) + h lp D. The bytes ps_gather_chunk's layouts take. */
static inline void ps_gather_chunk_amx(const uint16_t *kc, const uint16_t *vc, const int32_t *bt_row, int64_t p0,
                                       int64_t p1, int64_t BS, int64_t k_sb, int64_t k_ss, int64_t k_sh, int64_t v_sb,
                                       int64_t v_ss, int64_t v_sh, int64_t h, int64_t Hkv, int64_t D, int64_t lp,
                                       float *base) {
    if (ps_amx_k_in_place(D, BS)) kc = NULL; /* the items read K where it is */
    uint16_t *Kb = (uint16_t *)base + h * lp * D, *VT = (uint16_t *)(base + Hkv * lp * D) + h * lp * D;
    p1 = p1 < p0 ? p0 : p1;
    if (kc) {
        for (int64_t p = p0; p < p1; ++p)
            memcpy(Kb + p * D, kc + (int64_t)bt_row[p / BS] * k_sb + (p % BS) * k_ss + h * k_sh,
                   (size_t)D * sizeof(uint16_t));
        memset(Kb + p1 * D, 0, (size_t)((p0 + 16 - p1) * D) * sizeof(uint16_t));
    }
    ps_gather_vt(vc, bt_row, p0, p1, BS, v_sb, v_ss, v_sh, h, D, lp, VT);
}

/* Tiles 0-3 += V^T blocks d0 .. d0+63 (rows of lp positions at vt, the step's keys) times the P^T pairs
 * in tile 7; tiles 4-6 take three A blocks at once (a multiply waits for the load of its A tile, and a
 * load into a tile for the multiply reading it). */
static inline void ps_amx_pv64(const uint16_t *vt, const int64_t lp) {
    _tile_loadd(4, vt, 2 * lp);
    _tile_loadd(5, vt + 16 * lp, 2 * lp);
    _tile_loadd(6, vt + 32 * lp, 2 * lp);
    _tile_dpbf16ps(0, 4, 7);
    _tile_dpbf16ps(1, 5, 7);
    _tile_dpbf16ps(2, 6, 7);
    _tile_loadd(4, vt + 48 * lp, 2 * lp);
    _tile_dpbf16ps(3, 4, 7);
}

/* Tiles 0-3 to / from 64 rows of 16 floats (tile i: rows 16 i .. 16 i + 15). */
static inline void ps_amx_store4(float ob[][16]) {
    _tile_stored(0, ob[0], 64);
    _tile_stored(1, ob[16], 64);
    _tile_stored(2, ob[32], 64);
    _tile_stored(3, ob[48], 64);
}

static inline void ps_amx_load4(float ob[][16]) {
    _tile_loadd(0, ob[0], 64);
    _tile_loadd(1, ob[16], 64);
    _tile_loadd(2, ob[32], 64);
    _tile_loadd(3, ob[48], 64);
}

/* A step's scores s[t] (lane = row) from S^T as stored, with masked set: keys past a lane's position, and
 * keys from kend on, at -inf. */
static inline __attribute__((always_inline)) void ps_amx_scores(const float sb[][16], __m512 *s, const int64_t k0,
                                                                const int64_t kend, const __m512 pos, const int masked) {
    for (int t = 0; t < PS_AMX_KEYS; ++t) s[t] = _mm512_load_ps(sb[t]);
    if (masked)
        for (int t = 0; t < PS_AMX_KEYS; ++t) {
            const __mmask16 keep =
                k0 + t < kend ? _mm512_cmp_ps_mask(_mm512_set1_ps((float)(k0 + t)), pos, _CMP_LE_OQ) : 0;
            s[t] = _mm512_mask_blend_ps(keep, _mm512_set1_ps(-INFINITY), s[t]);
        }
}

/* The max (add = 0) or sum (add = 1) of a step's 32 vectors, as a tree: a chain of 31 dependent ops was
 * ~130 cycles of latency. */
static inline __attribute__((always_inline)) __m512 ps_amx_reduce(const __m512 *s, const int add) {
    __m512 tr[PS_AMX_KEYS / 2];
    for (int i = 0; i < PS_AMX_KEYS / 2; ++i)
        tr[i] = add ? _mm512_add_ps(s[i], s[i + PS_AMX_KEYS / 2]) : _mm512_max_ps(s[i], s[i + PS_AMX_KEYS / 2]);
    for (int w = PS_AMX_KEYS / 4; w; w /= 2)
        for (int i = 0; i < w; ++i) tr[i] = add ? _mm512_add_ps(tr[i], tr[i + w]) : _mm512_max_ps(tr[i], tr[i + w]);
    return tr[0];
}

/* The step's probabilities 2^(s vscale - m) as P^T pairs into pb (the B of O^T); returns their sum. */
static inline __attribute__((always_inline)) __m512 ps_amx_probs(__m512 *s, const __m512 vscale, const __m512 m,
                                                                 const __m512i interleave, uint32_t pb[][16]) {
    for (int t = 0; t < PS_AMX_KEYS; ++t) s[t] = ps_exp2_bf16(_mm512_fmsub_ps(s[t], vscale, m));
    for (int u = 0; u < PS_AMX_KEYS / 2; ++u)
        _mm512_store_si512(pb[u], _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(s[2 * u + 1], s[2 * u])));
    return ps_amx_reduce(s, 1);
}

/* The item (see above). q / out as ps_prefill_item_dp; K: lp x D bfloat16 position rows, VT: D x lp;
 * nv: the 16-row blocks with real rows (1 or 2), a constant in each copy. */
static inline __attribute__((always_inline)) void ps_prefill_item_amx(
    const uint16_t *restrict q, const int64_t q_st, const int64_t q_sh, uint16_t *restrict out, const int64_t o_st,
    const int64_t o_sh, const uint16_t *restrict K, const uint16_t *restrict VT, const int64_t lp, const int64_t offset,
    const int64_t r0, const int64_t nrows, const int64_t G, const int64_t h, const int64_t D, const float scale,
    const int64_t kmax, float *restrict state, const int nv) {
    uint32_t qp[PS_PF_NV][PS_PF_MAX_D / 2][16] __attribute__((aligned(64))); /* B of S^T: lane r = q[r][2i], q[r][2i+1] */
    float sb[PS_PF_NV][PS_AMX_KEYS][16] __attribute__((aligned(64)));       /* S^T of a step */
    uint32_t pb[PS_PF_NV][PS_AMX_KEYS / 2][16] __attribute__((aligned(64))); /* B of O^T: lane r = p[r][2u], p[r][2u+1] */
    float ob[64][16] __attribute__((aligned(64)));                          /* O^T of a step, 4 d blocks */
    __m512 ot[PS_PF_MAX_D][PS_PF_NV], pos[PS_PF_NV], m[PS_PF_NV], lsum[PS_PF_NV];
    int64_t row_o[PS_PF_ROWS];
    const __m512 vscale = _mm512_set1_ps(scale * 1.44269504088896341f); /* m and the exps in base 2 */
    const __m512i interleave = ps_pair_interleave();
    for (int j = 0; j < nv; ++j) {
        pos[j] = ps_pf_rows16(q, q_st, q_sh, o_st, o_sh, offset, r0 + 16 * j, nrows, G, h, D, (__m512 *)qp[j], 1,
                              row_o + 16 * j);
        m[j] = _mm512_set1_ps(-INFINITY);
        lsum[j] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; ++d) ot[d][j] = _mm512_setzero_ps();
    }
    ps_amx_configure();
    const int64_t last = r0 + 16 * nv - 1 < nrows ? r0 + 16 * nv - 1 : nrows - 1;
    const int64_t first_pos = offset + r0 / G, kseen = offset + last / G + 1, kend = kseen < kmax ? kseen : kmax;
    for (int64_t k0 = 0; k0 < kend; k0 += PS_AMX_KEYS) {
        /* S^T: tile 2 kh + j for key half kh, row block j */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t dc = 0; dc < D; dc += 32) {
            _tile_loadd(4, K + k0 * D + dc, 2 * D);
            _tile_loadd(5, K + (k0 + 16) * D + dc, 2 * D);
            _tile_loadd(6, qp[0][dc / 2], 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            if (nv > 1) {
                _tile_loadd(7, qp[1][dc / 2], 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, sb[0][0], 64);
        _tile_stored(2, sb[0][16], 64);
        if (nv > 1) {
            _tile_stored(1, sb[1][0], 64);
            _tile_stored(3, sb[1][16], 64);
        }
        __m512 alpha[PS_PF_NV];
        const int masked = k0 + PS_AMX_KEYS - 1 > first_pos || k0 + PS_AMX_KEYS > kend;
        for (int j = 0; j < nv; ++j) {
            __m512 s[PS_AMX_KEYS];
            ps_amx_scores(sb[j], s, k0, kend, pos[j], masked);
            const __m512 mnew = _mm512_max_ps(m[j], _mm512_mul_ps(ps_amx_reduce(s, 0), vscale)); /* finite: key 0 is in every first step */
            alpha[j] = ps_exp2_bf16(_mm512_sub_ps(m[j], mnew));
            lsum[j] = _mm512_fmadd_ps(lsum[j], alpha[j], ps_amx_probs(s, vscale, mnew, interleave, pb[j]));
            m[j] = mnew;
        }
        /* O^T, 4 d blocks of 16 at a time per row block */
        for (int j = 0; j < nv; ++j) {
            _tile_loadd(7, pb[j], 64);
            for (int64_t d0 = 0; d0 < D; d0 += 64) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                ps_amx_pv64(VT + d0 * lp + k0, lp);
                ps_amx_store4(ob);
                for (int d = 0; d < 64; ++d)
                    ot[d0 + d][j] = _mm512_fmadd_ps(ot[d0 + d][j], alpha[j], _mm512_load_ps(ob[d]));
            }
        }
    }
    _tile_release();
    for (int j = 0; j < nv; ++j) /* m in natural units for the state */
        ps_pf_finish16(ot, j, _mm512_mul_ps(m[j], _mm512_set1_ps(0.693147180559945309f)), lsum[j], row_o, r0 + 16 * j,
                       nrows, D, state, out);
}

/* head_dim 64: an item of 16 rows whose output O^T stays in tiles 0-3 for all its keys. The running
 * max a row's exps subtract moves only when a step's max passes it by more than PS_PF_SLACK (in
 * base 2): the probabilities then stay below 2^PS_PF_SLACK, and the tiles are rescaled (stored,
 * multiplied, loaded) only on those steps, the first few. ps_prefill_item_amx instead adds each
 * step's O^T into float32 vectors (alpha ot + C), 64 loads and FMAs a row block per step. Tiles: 0-3
 * O^T, 4-5 S^T of the step's key halves, 6 A (K or V^T), 7 B (Q or P^T pairs). */
static inline __attribute__((always_inline)) void ps_prefill_item_amx64(
    const uint16_t *restrict q, const int64_t q_st, const int64_t q_sh, uint16_t *restrict out, const int64_t o_st,
    const int64_t o_sh, const ps_krows K, const int64_t kreal, const uint16_t *restrict VT, const int64_t lp,
    const int64_t offset,
    const int64_t r0, const int64_t nrows, const int64_t G, const int64_t h, const float scale, const int64_t kmax,
    float *restrict state) {
    enum { D = 64 };
    uint32_t qp[D / 2][16] __attribute__((aligned(64)));
    float sb[PS_AMX_KEYS][16] __attribute__((aligned(64)));
    uint32_t pb[PS_AMX_KEYS / 2][16] __attribute__((aligned(64)));
    float ob[D][16] __attribute__((aligned(64))); /* O^T: row d, lane = query row */
    int64_t row_o[16];
    const __m512 vscale = _mm512_set1_ps(scale * 1.44269504088896341f);
    const __m512i interleave = ps_pair_interleave();
    const __m512 pos = ps_pf_rows16(q, q_st, q_sh, o_st, o_sh, offset, r0, nrows, G, h, D, (__m512 *)qp, 1, row_o);
    __m512 m = _mm512_set1_ps(-INFINITY), lsum = _mm512_setzero_ps();
    ps_amx_configure();
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int64_t last = r0 + 15 < nrows ? r0 + 15 : nrows - 1;
    const int64_t first_pos = offset + r0 / G, kseen = offset + last / G + 1, kend = kseen < kmax ? kseen : kmax;
    for (int64_t k0 = 0; k0 < kend; k0 += PS_AMX_KEYS) {
        _tile_zero(4);
        _tile_zero(5);
        /* keys from kreal on have no rows to read (in place: maybe no block); their scores are masked */
        const uint16_t *k_lo = ps_krow(K, k0), *k_hi = k0 + 16 < kreal ? ps_krow(K, k0 + 16) : NULL;
        _tile_loadd(7, qp[0], 64);
        _tile_loadd(6, k_lo, 2 * K.ss);
        _tile_dpbf16ps(4, 6, 7);
        if (k_hi) {
            _tile_loadd(6, k_hi, 2 * K.ss);
            _tile_dpbf16ps(5, 6, 7);
        }
        _tile_loadd(7, qp[16], 64);
        _tile_loadd(6, k_lo + 32, 2 * K.ss);
        _tile_dpbf16ps(4, 6, 7);
        if (k_hi) {
            _tile_loadd(6, k_hi + 32, 2 * K.ss);
            _tile_dpbf16ps(5, 6, 7);
        }
        _tile_stored(4, sb[0], 64);
        _tile_stored(5, sb[16], 64);
        __m512 s[PS_AMX_KEYS];
        ps_amx_scores(sb, s, k0, kend, pos, k0 + PS_AMX_KEYS - 1 > first_pos || k0 + PS_AMX_KEYS > kend);
        const __m512 mt = _mm512_mul_ps(ps_amx_reduce(s, 0), vscale);
        if (_mm512_cmp_ps_mask(mt, _mm512_add_ps(m, _mm512_set1_ps(PS_PF_SLACK)), _CMP_GT_OQ)) {
            const __m512 mnew = _mm512_max_ps(m, mt); /* finite: key 0 is in every first step */
            const __m512 alpha = ps_exp2_bf16(_mm512_sub_ps(m, mnew));
            if (k0) { /* the tiles hold the earlier steps' O^T: rescale them */
                ps_amx_store4(ob);
                for (int d = 0; d < D; ++d) _mm512_store_ps(ob[d], _mm512_mul_ps(_mm512_load_ps(ob[d]), alpha));
                ps_amx_load4(ob);
            }
            lsum = _mm512_mul_ps(lsum, alpha);
            m = mnew;
        }
        lsum = _mm512_add_ps(lsum, ps_amx_probs(s, vscale, m, interleave, pb));
        _tile_loadd(7, pb[0], 64); /* S^T is stored: tiles 4-6 are free for V^T */
        ps_amx_pv64(VT + k0, lp);
    }
    ps_amx_store4(ob);
    _tile_release();
    float mj[16], lj[16];
    _mm512_storeu_ps(mj, _mm512_mul_ps(m, _mm512_set1_ps(0.693147180559945309f))); /* natural units */
    _mm512_storeu_ps(lj, lsum);
    const int n = nrows - r0 < 16 ? (int)(nrows - r0) : 16;
    for (int l = 0; l < n; ++l) {
        if (state) { /* the softmax state, as in ps_prefill_item */
            float *st = state + row_o[l];
            st[0] = mj[l];
            st[1] = lj[l];
            for (int d = 0; d < D; ++d) st[2 + d] = ob[d][l];
        } else {
            const float inv = 1.0f / lj[l];
            for (int d = 0; d < D; ++d) out[row_o[l] + d] = ps_f32_to_bf16(ob[d][l] * inv);
        }
    }
}

/* The item for rows r0 .. of nrows, its copies for 1 or 2 row blocks and head_dim 64 (SmolLM2, Llama,
 * Qwen2) or any D ps_amx_takes. K: ps_amx_krows's (gathered for D other than 64); keys from kreal on
 * are not read. */
static inline __attribute__((always_inline)) void ps_prefill_amx(
    const uint16_t *restrict q, const int64_t q_st, const int64_t q_sh, uint16_t *restrict out, const int64_t o_st,
    const int64_t o_sh, const ps_krows K, const int64_t kreal, const uint16_t *restrict VT, const int64_t lp,
    const int64_t offset,
    const int64_t r0, const int64_t nrows, const int64_t G, const int64_t h, const int64_t D, const float scale,
    const int64_t kmax, float *restrict state) {
#define PS_AMX_CALL(D_, NV) \
    ps_prefill_item_amx(q, q_st, q_sh, out, o_st, o_sh, K.base, VT, lp, offset, r0, nrows, G, h, D_, scale, kmax, state, NV)
    const int two = nrows - r0 > 16;
    if (D == 64) {
        ps_prefill_item_amx64(q, q_st, q_sh, out, o_st, o_sh, K, kreal, VT, lp, offset, r0, nrows, G, h, scale, kmax,
                              state);
        if (two)
            ps_prefill_item_amx64(q, q_st, q_sh, out, o_st, o_sh, K, kreal, VT, lp, offset, r0 + 16, nrows, G, h, scale,
                                  kmax, state);
    } else {
        if (two) PS_AMX_CALL(D, 2);
        else PS_AMX_CALL(D, 1);
    }
#undef PS_AMX_CALL
}
#endif
