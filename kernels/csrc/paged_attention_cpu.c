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
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PS_MAX_G 16
#define PS_MAX_D 256
#define PS_MAX_BS 128

/* exp(x) for x <= 0 in float32, vectorizable (libm's expf is a call per element). Cody-Waite
 * reduction x = n ln2 + r, |r| <= ln2/2, then a degree-6 Taylor/minimax polynomial: relative error
 * ~2 ulp, far below the rounding of the scores themselves. Inputs below -87 flush to 0. */
static inline float ps_exp(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187045e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } scale = { .i = ((int32_t)n + 127) << 23 }; /* 2^n */
    return p * scale.f;
}

static inline void ps_load_f32(const float *restrict src, float *restrict dst, int64_t d) {
    for (int64_t i = 0; i < d; ++i) dst[i] = src[i];
}

static inline void ps_load_bf16(const uint16_t *src, float *dst, int64_t d) {
    for (int64_t i = 0; i < d; ++i) {
        uint32_t u = (uint32_t)src[i] << 16;
        memcpy(&dst[i], &u, 4);
    }
}

static inline void ps_store_f32(float *dst, float x) { *dst = x; }

static inline void ps_store_bf16(uint16_t *dst, float x) { /* round to nearest even, NaN kept */
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        *dst = (uint16_t)((u >> 16) | 0x40u);
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    *dst = (uint16_t)(u >> 16);
}

/* One work item, (sequence b, KV head h): q, kc, vc and out already point at head h's G query rows,
 * KV column and output rows; bt_row is sequence b's block table. always_inline, so the callers
 * below get copies specialised for the common head_dim / block_size (the loops then unroll). */
#define PS_DEFINE_ITEM(NAME, T, LOAD, STORE)                                                          \
    static inline __attribute__((always_inline)) void NAME(                                          \
        const T *restrict q, const T *restrict kc, const T *restrict vc, const int32_t *restrict bt_row, \
        const int64_t len, T *restrict out, const int64_t G, const int64_t D, const int64_t BS,      \
        const int64_t q_sh, const int64_t k_sb, const int64_t k_ss, const int64_t v_sb,             \
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
        for (int64_t j = 0; j < nblk; ++j) {                                                         \
            const int64_t blk = bt_row[j];                                                           \
            const int64_t n = len - j * BS < BS ? len - j * BS : BS;                                 \
            const T *kb = kc + blk * k_sb;                                                           \
            const T *vb = vc + blk * v_sb;                                                           \
            if (j + 1 < nblk) { /* the next block is elsewhere in the pool: fetch it while we work */ \
                const T *kn = kc + (int64_t)bt_row[j + 1] * k_sb, *vn = vc + (int64_t)bt_row[j + 1] * v_sb; \
                for (int64_t t = 0; t < BS; ++t)                                                     \
                    for (int64_t c = 0; c < D * (int64_t)sizeof(T); c += 64) {                       \
                        __builtin_prefetch((const char *)(kn + t * k_ss) + c);                      \
                        __builtin_prefetch((const char *)(vn + t * v_ss) + c);                      \
                    }                                                                                \
            }                                                                                        \
            for (int64_t t = 0; t < n; ++t) {                                                        \
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
                for (int64_t t = 0; t < n; ++t) mx = sg[t] > mx ? sg[t] : mx;                        \
                const float alpha = ps_exp(m[g] - mx); /* m = -inf at first: exp -> 0 */             \
                float sum = 0.0f;                                                                    \
                _Pragma("omp simd reduction(+:sum)")                                                 \
                for (int64_t t = 0; t < n; ++t) {                                                    \
                    sg[t] = ps_exp(sg[t] - mx);                                                      \
                    sum += sg[t];                                                                    \
                }                                                                                    \
                l[g] = l[g] * alpha + sum;                                                           \
                m[g] = mx;                                                                           \
                float *ag = acc + g * D;                                                             \
                for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;                                      \
            }                                                                                        \
            for (int64_t t = 0; t < n; ++t) {                                                        \
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

/* The kernel trusts every block id it reads: check those (and only those, the ones covering
 * [0, lens[b])) are in the pool [0, NB) before any is read. One serial pass over B x blocks ids. */
static int ps_bad_block_ids(const int32_t *bt, const int32_t *lens, int64_t B, int64_t BS, int64_t bt_stride,
                            int64_t NB) {
    for (int64_t b = 0; b < B; ++b) {
        const int64_t nblk = lens[b] > 0 ? (lens[b] + BS - 1) / BS : 0;
        for (int64_t j = 0; j < nblk; ++j)
            if (bt[b * bt_stride + j] < 0 || bt[b * bt_stride + j] >= NB) return 1;
    }
    return 0;
}

/* The entry point (returns 1, computing nothing, when a block id is outside the pool): all (sequence, KV head) items over the OpenMP pool, dispatched to copies of
 * the item specialised for head_dim 64 / 128 with block_size 16 (SmolLM2, Llama, Qwen2 defaults). */
#define PS_DEFINE_DECODE(NAME, ITEM, T)                                                               \
    int64_t NAME(const T *q, const T *kc, const T *vc, const int32_t *bt, const int32_t *lens, T *out, \
                 int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS, int64_t bt_stride,      \
                 int64_t NB, int64_t q_sb, int64_t q_sh, int64_t k_sb, int64_t k_ss, int64_t k_sh,  \
                 int64_t v_sb, int64_t v_ss, int64_t v_sh, int64_t o_sb, int64_t o_sh, float scale, \
                 int nthreads) {                                                                     \
        if (ps_bad_block_ids(bt, lens, B, BS, bt_stride, NB)) return 1; /* nothing computed */     \
        const int64_t G = Hq / Hkv;                                                                  \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads)")                       \
        for (int64_t w = 0; w < B * Hkv; ++w) {                                                      \
            const int64_t b = w / Hkv, h = w % Hkv;                                                  \
            const T *qw = q + b * q_sb + h * G * q_sh;                                               \
            const T *kw = kc + h * k_sh, *vw = vc + h * v_sh;                                        \
            const int32_t *btw = bt + b * bt_stride;                                                 \
            T *ow = out + b * o_sb + h * G * o_sh;                                                   \
            if (D == 64 && BS == 16)                                                                 \
                ITEM(qw, kw, vw, btw, lens[b], ow, G, 64, 16, q_sh, k_sb, k_ss, v_sb, v_ss, o_sh, scale); \
            else if (D == 128 && BS == 16)                                                           \
                ITEM(qw, kw, vw, btw, lens[b], ow, G, 128, 16, q_sh, k_sb, k_ss, v_sb, v_ss, o_sh, scale); \
            else                                                                                     \
                ITEM(qw, kw, vw, btw, lens[b], ow, G, D, BS, q_sh, k_sb, k_ss, v_sb, v_ss, o_sh, scale); \
        }                                                                                            \
        return 0;                                                                                    \
    }

PS_DEFINE_ITEM(ps_item_f32, float, ps_load_f32, ps_store_f32)
PS_DEFINE_ITEM(ps_item_bf16, uint16_t, ps_load_bf16, ps_store_bf16)
PS_DEFINE_DECODE(ps_paged_decode_f32, ps_item_f32, float)
PS_DEFINE_DECODE(ps_paged_decode_bf16, ps_item_bf16, uint16_t)

/* Limits the launcher checks before calling (beyond them it uses the torch path). */
int64_t ps_max_g(void) { return PS_MAX_G; }
int64_t ps_max_d(void) { return PS_MAX_D; }
int64_t ps_max_bs(void) { return PS_MAX_BS; }

/* ---------------------------------------------------------------------------------------------
 * Small-batch float32 linear: out[M, N] = x[M, K] @ w[N, K]^T (+ bias), for M <= 16 rows.
 *
 * Why: decoding a handful of sequences (beams, n>1 samples, a small batch) is bound by reading
 * the weights once per step, but the CPU BLAS behind F.linear is erratic at these shapes (measured
 * 2-6x above the weight-read time for 2-16 rows on this project's machine). Here every weight row
 * is read once from memory and dotted with all M inputs while it is in L1; inputs of up to 8 rows
 * share one pass (8 x 16-float accumulators stay in registers), a second pass re-reads the row from
 * L1/L2. Output columns are split over the threads.
 *
 *     out columns:   [ tile 0: n 0..63 | tile 1: n 64..127 | ... ]   one tile per work item
 *     per column n:  acc[m][0..15] += w[n, k..k+15] * x[m, k..k+15]   k in steps of 16, then the tail
 */
#define PS_LIN_MB 8
#define PS_LIN_TILE 64

#if defined(__AVX512F__)
#include <immintrin.h>
/* Two weight rows per pass (2 x MB accumulators + 2 weight vectors stay in the 32 zmm registers):
 * each input vector loaded once feeds two FMAs. K's tail goes through masked loads. */
static inline __attribute__((always_inline)) void ps_lin_cols(const float *restrict x, const int64_t ldx,
                                                              const float *restrict w, const int64_t K,
                                                              float *restrict out, const int64_t ldo,
                                                              const int64_t n0, const int64_t n1, const int MB) {
    const __mmask16 tail = (__mmask16)((1u << (K % 16)) - 1u);
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) {
        const float *w0 = w + n * K, *w1 = w0 + K;
        __m512 a0[PS_LIN_MB], a1[PS_LIN_MB];
        for (int m = 0; m < MB; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) {
            const __m512 v0 = _mm512_loadu_ps(w0 + k), v1 = _mm512_loadu_ps(w1 + k);
            for (int m = 0; m < MB; ++m) {
                const __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
                a0[m] = _mm512_fmadd_ps(v0, xv, a0[m]);
                a1[m] = _mm512_fmadd_ps(v1, xv, a1[m]);
            }
        }
        if (tail) {
            const __m512 v0 = _mm512_maskz_loadu_ps(tail, w0 + k), v1 = _mm512_maskz_loadu_ps(tail, w1 + k);
            for (int m = 0; m < MB; ++m) {
                const __m512 xv = _mm512_maskz_loadu_ps(tail, x + m * ldx + k);
                a0[m] = _mm512_fmadd_ps(v0, xv, a0[m]);
                a1[m] = _mm512_fmadd_ps(v1, xv, a1[m]);
            }
        }
        for (int m = 0; m < MB; ++m) {
            out[m * ldo + n] = _mm512_reduce_add_ps(a0[m]);
            out[m * ldo + n + 1] = _mm512_reduce_add_ps(a1[m]);
        }
    }
    for (; n < n1; ++n) { /* an odd last column */
        const float *w0 = w + n * K;
        __m512 a0[PS_LIN_MB];
        for (int m = 0; m < MB; ++m) a0[m] = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) {
            const __m512 v0 = _mm512_loadu_ps(w0 + k);
            for (int m = 0; m < MB; ++m) a0[m] = _mm512_fmadd_ps(v0, _mm512_loadu_ps(x + m * ldx + k), a0[m]);
        }
        if (tail) {
            const __m512 v0 = _mm512_maskz_loadu_ps(tail, w0 + k);
            for (int m = 0; m < MB; ++m)
                a0[m] = _mm512_fmadd_ps(v0, _mm512_maskz_loadu_ps(tail, x + m * ldx + k), a0[m]);
        }
        for (int m = 0; m < MB; ++m) out[m * ldo + n] = _mm512_reduce_add_ps(a0[m]);
    }
}
#else
static inline __attribute__((always_inline)) void ps_lin_cols(const float *restrict x, const int64_t ldx,
                                                              const float *restrict w, const int64_t K,
                                                              float *restrict out, const int64_t ldo,
                                                              const int64_t n0, const int64_t n1, const int MB) {
    for (int64_t n = n0; n < n1; ++n) {
        const float *wr = w + n * K;
        float acc[PS_LIN_MB][16];
        for (int m = 0; m < MB; ++m)
            for (int l = 0; l < 16; ++l) acc[m][l] = 0.0f;
        int64_t k = 0;
        for (; k + 16 <= K; k += 16)
            for (int m = 0; m < MB; ++m)
                for (int l = 0; l < 16; ++l) acc[m][l] += wr[k + l] * x[m * ldx + k + l];
        for (int m = 0; m < MB; ++m) {
            float s = 0.0f;
            for (int l = 0; l < 16; ++l) s += acc[m][l];
            for (int64_t kk = k; kk < K; ++kk) s += wr[kk] * x[m * ldx + kk];
            out[m * ldo + n] = s;
        }
    }
}
#endif

void ps_linear_f32(const float *x, const float *w, const float *bias, float *out, int64_t M, int64_t N,
                   int64_t K, int64_t ldx, int64_t ldo, int nthreads) {
    const int64_t ntiles = (N + PS_LIN_TILE - 1) / PS_LIN_TILE;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < ntiles; ++t) {
        const int64_t n0 = t * PS_LIN_TILE, n1 = n0 + PS_LIN_TILE < N ? n0 + PS_LIN_TILE : N;
        for (int64_t m0 = 0; m0 < M; m0 += PS_LIN_MB) {
            const float *xm = x + m0 * ldx;
            float *om = out + m0 * ldo;
            switch (M - m0 < PS_LIN_MB ? M - m0 : PS_LIN_MB) { /* constant MB: accumulators in registers */
            case 1: ps_lin_cols(xm, ldx, w, K, om, ldo, n0, n1, 1); break;
            case 2: ps_lin_cols(xm, ldx, w, K, om, ldo, n0, n1, 2); break;
            case 3: ps_lin_cols(xm, ldx, w, K, om, ldo, n0, n1, 3); break;
            case 4: ps_lin_cols(xm, ldx, w, K, om, ldo, n0, n1, 4); break;
            case 5: ps_lin_cols(xm, ldx, w, K, om, ldo, n0, n1, 5); break;
            case 6: ps_lin_cols(xm, ldx, w, K, om, ldo, n0, n1, 6); break;
            case 7: ps_lin_cols(xm, ldx, w, K, om, ldo, n0, n1, 7); break;
            default: ps_lin_cols(xm, ldx, w, K, om, ldo, n0, n1, 8); break;
            }
        }
        if (bias)
            for (int64_t m = 0; m < M; ++m)
                for (int64_t n = n0; n < n1; ++n) out[m * ldo + n] += bias[n];
    }
}

int64_t ps_linear_max_rows(void) { return 16; }
