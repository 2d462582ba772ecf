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
#include "flash_item.h"

static inline int64_t ps_round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

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

/* Keys 0 .. whole[s]-1 of each sequence with queries that another sequence with queries also reads (the same
 * leading block ids: a cached system prompt under several questions), whole blocks only; 0 elsewhere.
 * lead[s]: the sequence s was compared with, the first one sharing its first block (s itself for that one).
 * Those keys are read once for all their sharers: float32 items read them in place (flash_item.h's
 * ps_kv_rows), and bfloat16 ones from lead[s]'s gathered rows; the gather skips them either way.
 * Per layer, 2-core AMD EPYC Zen 5, interleaved medians, float32: 16 prompts of 64 tokens after the same
 * 1,024 cached 10.2-10.5 -> 7.2-7.5 ms, 4 such groups 38.4-39.1 -> 31.9; with the caches flushed before
 * each call, 8.5-8.9 -> 7.8-8.0 and 34.9-37.4 -> 31.2-31.4. Keys a sequence reads alone stay gathered:
 * every item of the sequence reads them again, and from the compact gathered rows that measured faster
 * than in place (16 x 64 after 1,024 of their own: 9.0 -> 10.2-11.9 ms; 1 x 2,048 13.7 -> 14.4-14.7).
 * The caller starts whole at 0 and lead[s] at s. */
static void ps_shared_keys(const int32_t *bt, const int64_t *len, int64_t S, int64_t BS, int64_t bt_stride,
                           int64_t *whole, int64_t *lead) {
    for (int64_t s = 0; s < S; ++s) {
        if (len[s] < BS || whole[s]) continue;
        const int32_t *first = bt + s * bt_stride;
        for (int64_t o = s + 1; o < S; ++o) {
            const int32_t *row = bt + o * bt_stride;
            if (len[o] < BS || row[0] != first[0]) continue;
            const int64_t limit = (len[s] < len[o] ? len[s] : len[o]) / BS; /* whole blocks of both */
            int64_t c = 0;
            while (c < limit && row[c] == first[c]) ++c;
            if (c * BS > whole[o]) whole[o] = c * BS, lead[o] = s;
            if (c * BS > whole[s]) whole[s] = c * BS;
        }
    }
}

#define PS_PF_ITEM_ARGS(D_, BF16_) \
    qs, q_st, q_sh, os, o_st, o_sh, Kh, Vh, src, len[s] - ql, r0, ql * G, G, h, D_, scale, INT64_MAX, NULL, BF16_
#define PS_PF_DP_ARGS(D_) \
    (const uint16_t *)qs, q_st, q_sh, (uint16_t *)os, o_st, o_sh, Kb, Vp, shared, len[s] - ql, r0, ql * G, G, h, D_, scale, \
        INT64_MAX, NULL
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
 * hold sum_s roundup(lens[s], 16) * 2 * Hkv * D floats over the sequences with queries (roundup to 32
 * where bfloat16 runs on AMX tiles: ps_prefill_on_amx). */
static int64_t ps_paged_prefill(const void *q, const void *kc, const void *vc, const int32_t *bt,
                                const int32_t *lens, const int32_t *qsl, void *out, float *ws, int64_t ws_floats,
                                int64_t S, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS, int64_t bt_stride,
                                int64_t NB, int64_t q_st, int64_t q_sh, int64_t k_sb, int64_t k_ss, int64_t k_sh,
                                int64_t v_sb, int64_t v_ss, int64_t v_sh, int64_t o_st, int64_t o_sh, float scale,
                                int nthreads, const int bf16) {
    const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
    const int64_t G = Hq / Hkv;
#ifdef PS_PF_AMX
    const int amx = bf16 && ps_amx_takes(D) && ps_amx_permitted();
#else
    const int amx = 0;
#endif
    const int64_t align = amx ? 32 : 16; /* gathered positions per head: a multiple of this */
    int64_t *len = malloc(6 * (S + 1) * sizeof(int64_t)); /* positions read (0: no queries) */
    if (!len) return 2;
    /* prefix sums: ws offset of each sequence, gather chunks (16 positions, every head), items */
    int64_t *kv_at = len + S + 1, *chunk_at = kv_at + S + 1, *item_at = chunk_at + S + 1;
    int64_t *whole = item_at + S + 1, *lead = whole + S + 1; /* keys read once for their sharers (ps_shared_keys) */
    kv_at[0] = chunk_at[0] = item_at[0] = 0;
    int64_t err = 0;
    for (int64_t s = 0; s < S && !err; ++s) {
        const int64_t ql = qsl[s + 1] - qsl[s];
        len[s] = ql > 0 ? lens[s] : 0;
        if (ql > lens[s]) err = 3;
        else if (ql > 0 && ps_bad_block_ids(bt + s * bt_stride, lens + s, 1, BS, bt_stride, NB)) err = 1;
        const int64_t lp = ps_round_up(len[s], align);
        kv_at[s + 1] = kv_at[s] + lp * 2 * Hkv * D;
        chunk_at[s + 1] = chunk_at[s] + lp / 16;
        item_at[s + 1] = item_at[s] + Hkv * ((ql * G + PS_PF_ROWS - 1) / PS_PF_ROWS);
    }
    if (!err && kv_at[S] > ws_floats) err = 2;
    if (err) {
        free(len);
        return err;
    }
    /* float32 items read whole tiles from the cache (BS a multiple of 16); AMX items gather all their keys */
    const int in_place = !bf16 && BS % 16 == 0;
    for (int64_t s = 0; s < S; ++s) whole[s] = 0, lead[s] = s;
    if (in_place || (bf16 && !amx)) ps_shared_keys(bt, len, S, BS, bt_stride, whole, lead);
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t w = 0; w < chunk_at[S]; ++w) {
            const int64_t s = ps_owner(chunk_at, S, w), lp = ps_round_up(len[s], align);
            const int64_t p0 = (w - chunk_at[s]) * 16, p1 = p0 + 16 < len[s] ? p0 + 16 : len[s];
            if (p0 + 16 <= whole[s] && (in_place || lead[s] != s)) continue; /* shared: read in place or in lead[s]'s rows */
            for (int64_t h = 0; h < Hkv; ++h) { /* every head of the block's rows at once: one pass over them */
#ifdef PS_PF_AMX
                if (amx) {
                    ps_gather_chunk_amx(kc, vc, bt + s * bt_stride, p0, p1, BS, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, h,
                                        Hkv, D, lp, ws + kv_at[s]);
                    continue;
                }
#endif
                ps_gather_chunk(kc, vc, bt + s * bt_stride, p0, p1, BS, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, h, Hkv, D,
                                lp, ws + kv_at[s], bf16);
            }
        }
        /* heaviest first: within a sequence, later rows see more keys */
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < item_at[S]; ++w) {
            const int64_t s = ps_owner(item_at, S, w), ql = qsl[s + 1] - qsl[s];
            const int64_t groups = (ql * G + PS_PF_ROWS - 1) / PS_PF_ROWS, c = w - item_at[s];
            const int64_t h = c / groups, r0 = (groups - 1 - c % groups) * PS_PF_ROWS;
            const int64_t lp = ps_round_up(len[s], align);
            const float *Kh = ws + kv_at[s] + h * lp * D, *Vh = Kh + Hkv * lp * D;
            const void *qs = (const char *)q + (int64_t)qsl[s] * q_st * elem;
            void *os = (char *)out + (int64_t)qsl[s] * o_st * elem;
#ifdef PS_PF_AMX
            if (amx) {
                const uint16_t *Kb = (const uint16_t *)(ws + kv_at[s]) + h * lp * D;
                const uint16_t *VT = (const uint16_t *)(ws + kv_at[s] + Hkv * lp * D) + h * lp * D;
                const ps_krows K = ps_amx_krows(kc, bt + s * bt_stride, k_sb, k_ss, k_sh, h, BS, D, Kb);
                ps_prefill_amx((const uint16_t *)qs, q_st, q_sh, (uint16_t *)os, o_st, o_sh, K, len[s], VT, lp,
                               len[s] - ql, r0, ql * G, G, h, D, scale, INT64_MAX, NULL);
                continue;
            }
#endif
#ifdef PS_PF_DP
            if (bf16) {
                const uint16_t *Kb = (const uint16_t *)(ws + kv_at[s]) + h * lp * D;
                const uint32_t *Vp = (const uint32_t *)(ws + kv_at[s] + Hkv * lp * D) + h * (lp / 2) * D;
                const int64_t ls = lead[s], llp = ps_round_up(len[ls], align);
                const ps_kv_pairs shared = {(const uint16_t *)(ws + kv_at[ls]) + h * llp * D,
                                            (const uint32_t *)(ws + kv_at[ls] + Hkv * llp * D) + h * (llp / 2) * D,
                                            ls == s ? 0 : whole[s], NULL, NULL, NULL, 0, 0, 0, 0, 0};
                if (D == 64) ps_prefill_item_dp(PS_PF_DP_ARGS(64));
                else ps_prefill_item_dp(PS_PF_DP_ARGS(D));
                continue;
            }
#endif
            ps_kv_rows src = PS_KV_GATHERED;
            if (in_place && whole[s])
                src = ps_kv_paged(kc, vc, bt + s * bt_stride, h, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, BS, whole[s]);
            else if (lead[s] != s) { /* bfloat16 widened: lead[s]'s gathered float32 rows */
                const int64_t ls = lead[s], llp = ps_round_up(len[ls], align);
                const float *Kl = ws + kv_at[ls] + h * llp * D;
                src = (ps_kv_rows){Kl, Kl + Hkv * llp * D, NULL, 0, 0, 0, 0, 0, whole[s]};
            }
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
/* 1 when bfloat16 prefill runs on AMX tiles here (head_dim a multiple of 64; the process may use them). */
int64_t ps_prefill_on_amx(void) {
#ifdef PS_PF_AMX
    return ps_amx_permitted();
#else
    return 0;
#endif
}
