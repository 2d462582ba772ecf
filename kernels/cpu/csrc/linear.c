#include "ps_cpu.h"
#include <stdlib.h>

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
 *
 * ps_linear_bf16 is the same for bfloat16 (where the CPU has AVX512-BF16): vdpbf16ps multiplies
 * 32 bf16 pairs and adds them into 16 float32 lanes; the sums round to bfloat16 once at the end.
 */
#define PS_LIN_MB 8
#define PS_LIN_TILE 64
/* AVX2 path: software prefetch of the next pair of weight rows (2 rows ahead): the hardware
 * prefetcher alone left the weight stream at ~17 GB/s, with it ~22 GB/s (SmolLM2's 30 layers at 4
 * rows). The AVX-512 paths read one row at a time and need none (see ps_lin_cols). */
#define PS_LIN_PF 2

#if defined(__AVX512F__)
#include <immintrin.h>
/* One weight row per pass, read front to back: a row is one sequential stream, which the hardware
 * prefetcher follows at the core's full read rate. Two rows per pass (two streams K apart, as this
 * kernel had) measured half that on a 2-core AMD EPYC Zen 4 (one core: 10-11 vs 20.6 GB/s, the rate
 * of a plain streaming read; 30 layers of 3072 x 576 bf16, /tmp harness), and software prefetch did
 * not help either. Few inputs get two accumulator sets (alternate 16-float blocks of k) so the FMA
 * chains overlap; K's tail goes through masked loads. */
static inline __attribute__((always_inline)) void ps_lin_cols(const float *restrict x, const int64_t ldx,
                                                              const float *restrict w, const int64_t K,
                                                              float *restrict out, const int64_t ldo,
                                                              const int64_t n0, const int64_t n1, const int MB) {
    const __mmask16 tail = (__mmask16)((1u << (K % 16)) - 1u);
    for (int64_t n = n0; n < n1; ++n) {
        const float *w0 = w + n * K;
        __m512 a0[PS_LIN_MB], a1[PS_LIN_MB];
        for (int m = 0; m < MB; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
        int64_t k = 0;
        if (MB <= 4)
            for (; k + 32 <= K; k += 32) {
                const __m512 v0 = _mm512_loadu_ps(w0 + k), v1 = _mm512_loadu_ps(w0 + k + 16);
                for (int m = 0; m < MB; ++m) {
                    a0[m] = _mm512_fmadd_ps(v0, _mm512_loadu_ps(x + m * ldx + k), a0[m]);
                    a1[m] = _mm512_fmadd_ps(v1, _mm512_loadu_ps(x + m * ldx + k + 16), a1[m]);
                }
            }
        for (; k + 16 <= K; k += 16) {
            const __m512 v0 = _mm512_loadu_ps(w0 + k);
            for (int m = 0; m < MB; ++m) a0[m] = _mm512_fmadd_ps(v0, _mm512_loadu_ps(x + m * ldx + k), a0[m]);
        }
        if (tail) {
            const __m512 v0 = _mm512_maskz_loadu_ps(tail, w0 + k);
            for (int m = 0; m < MB; ++m)
                a0[m] = _mm512_fmadd_ps(v0, _mm512_maskz_loadu_ps(tail, x + m * ldx + k), a0[m]);
        }
        for (int m = 0; m < MB; ++m)
            out[m * ldo + n] = _mm512_reduce_add_ps(MB <= 4 ? _mm512_add_ps(a0[m], a1[m]) : a0[m]);
    }
}
#elif defined(PS_AVX2)
/* AVX2 (16 ymm registers): NR weight rows per pass against MB inputs, NR x MB accumulators, NR weight
 * vectors and one input vector in registers: two rows against up to 4 inputs, or one row against 5-8
 * (each weight row then read once). K's tail goes through masked loads. */
static inline __attribute__((always_inline)) void ps_lin_cols_avx2(const float *restrict x, const int64_t ldx,
                                                                   const float *restrict w, const int64_t K,
                                                                   float *restrict out, const int64_t ldo,
                                                                   const int64_t n0, const int64_t n1, const int MB,
                                                                   const int NR) {
    const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(K % 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const int64_t pf = (NR == 2 ? PS_LIN_PF : 2 * PS_LIN_PF) * K; /* the rows 2 (NR = 2) or 4 (NR = 1) ahead */
    for (int64_t n = n0; n < n1; n += NR) {
        const int nr = n1 - n < NR ? (int)(n1 - n) : NR; /* the last pass may have one row */
        const float *wr[2] = {w + n * K, w + (n + nr - 1) * K};
        __m256 a[2][8], v[2];
        for (int r = 0; r < NR; ++r)
            for (int m = 0; m < MB; ++m) a[r][m] = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            for (int r = 0; r < NR; ++r) {
                _mm_prefetch((const char *)(wr[r] + pf + k), _MM_HINT_T0);
                v[r] = _mm256_loadu_ps(wr[r] + k);
            }
            for (int m = 0; m < MB; ++m) {
                const __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
                for (int r = 0; r < NR; ++r) a[r][m] = _mm256_fmadd_ps(v[r], xv, a[r][m]);
            }
        }
        if (K % 8) {
            for (int r = 0; r < NR; ++r) v[r] = _mm256_maskload_ps(wr[r] + k, tail);
            for (int m = 0; m < MB; ++m) {
                const __m256 xv = _mm256_maskload_ps(x + m * ldx + k, tail);
                for (int r = 0; r < NR; ++r) a[r][m] = _mm256_fmadd_ps(v[r], xv, a[r][m]);
            }
        }
        for (int m = 0; m < MB; ++m)
            for (int r = 0; r < nr; ++r) out[m * ldo + n + r] = ps_hadd8(a[r][m]);
    }
}

static inline __attribute__((always_inline)) void ps_lin_cols(const float *restrict x, const int64_t ldx,
                                                              const float *restrict w, const int64_t K,
                                                              float *restrict out, const int64_t ldo,
                                                              const int64_t n0, const int64_t n1, const int MB) {
    if (MB <= 4) ps_lin_cols_avx2(x, ldx, w, K, out, ldo, n0, n1, MB, 2);
    else ps_lin_cols_avx2(x, ldx, w, K, out, ldo, n0, n1, MB, 1);
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
#define PS_LIN_CALL(MB) ps_lin_cols(xm, ldx, w, K, om, ldo, n0, n1, MB)
            PS_CONST_ROWS_8(M - m0, PS_LIN_CALL)
#undef PS_LIN_CALL
        }
        if (bias)
            for (int64_t m = 0; m < M; ++m)
                for (int64_t n = n0; n < n1; ++n) out[m * ldo + n] += bias[n];
    }
}

int64_t ps_linear_max_rows(void) { return 16; }

#if defined(__AVX512BF16__) && defined(PS_AVX512)
static inline __attribute__((always_inline)) void ps_lin_cols_bf16(const uint16_t *restrict x, const int64_t ldx,
                                                                   const uint16_t *restrict w, const int64_t K,
                                                                   float *restrict acc_out, const int64_t n0,
                                                                   const int64_t n1, const int MB) {
    /* acc_out[m * (n1 - n0) + (n - n0)]: float sums, rounded by the caller. One weight row per pass
     * (one sequential stream; see ps_lin_cols), two accumulator sets for few inputs. */
    const __mmask32 tail = (__mmask32)((K % 32) ? ((1ull << (K % 32)) - 1ull) : 0u);
    const int64_t W = n1 - n0;
    for (int64_t n = n0; n < n1; ++n) {
        const uint16_t *w0 = w + n * K;
        __m512 a0[PS_LIN_MB], a1[PS_LIN_MB];
        for (int m = 0; m < MB; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
        int64_t k = 0;
        if (MB <= 4)
            for (; k + 64 <= K; k += 64) {
                const __m512bh v0 = (__m512bh)_mm512_loadu_si512(w0 + k);
                const __m512bh v1 = (__m512bh)_mm512_loadu_si512(w0 + k + 32);
                for (int m = 0; m < MB; ++m) {
                    a0[m] = _mm512_dpbf16_ps(a0[m], v0, (__m512bh)_mm512_loadu_si512(x + m * ldx + k));
                    a1[m] = _mm512_dpbf16_ps(a1[m], v1, (__m512bh)_mm512_loadu_si512(x + m * ldx + k + 32));
                }
            }
        for (; k + 32 <= K; k += 32) {
            const __m512bh v0 = (__m512bh)_mm512_loadu_si512(w0 + k);
            for (int m = 0; m < MB; ++m)
                a0[m] = _mm512_dpbf16_ps(a0[m], v0, (__m512bh)_mm512_loadu_si512(x + m * ldx + k));
        }
        if (tail) {
            const __m512bh v0 = (__m512bh)_mm512_maskz_loadu_epi16(tail, w0 + k);
            for (int m = 0; m < MB; ++m)
                a0[m] = _mm512_dpbf16_ps(a0[m], v0, (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * ldx + k));
        }
        for (int m = 0; m < MB; ++m)
            acc_out[m * W + (n - n0)] = _mm512_reduce_add_ps(MB <= 4 ? _mm512_add_ps(a0[m], a1[m]) : a0[m]);
    }
}

void ps_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *out, int64_t M,
                    int64_t N, int64_t K, int64_t ldx, int64_t ldo, int nthreads) {
    const int64_t ntiles = (N + PS_LIN_TILE - 1) / PS_LIN_TILE;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < ntiles; ++t) {
        const int64_t n0 = t * PS_LIN_TILE, n1 = n0 + PS_LIN_TILE < N ? n0 + PS_LIN_TILE : N, W = n1 - n0;
        float acc[PS_LIN_MB * PS_LIN_TILE];
        for (int64_t m0 = 0; m0 < M; m0 += PS_LIN_MB) {
            const uint16_t *xm = x + m0 * ldx;
            const int mb = M - m0 < PS_LIN_MB ? (int)(M - m0) : PS_LIN_MB;
#define PS_LIN_CALL(MB) ps_lin_cols_bf16(xm, ldx, w, K, acc, n0, n1, MB)
            PS_CONST_ROWS_8(mb, PS_LIN_CALL)
#undef PS_LIN_CALL
            for (int m = 0; m < mb; ++m)
                for (int64_t n = n0; n < n1; ++n) {
                    float v = acc[m * W + (n - n0)];
                    if (bias) v += ps_bf16_to_f32(bias[n]);
                    out[(m0 + m) * ldo + n] = ps_f32_to_bf16(v);
                }
        }
    }
}

int64_t ps_linear_bf16_available(void) { return 1; }
#elif defined(PS_AVX2)
/* AVX2 without bfloat16 instructions (AMD Zen 3): bfloat16 weights widened to float32 in registers (a
 * shift of each 16-bit value) and multiplied with float32 FMAs, so decode reads the bfloat16 bytes,
 * half of float32's. Why: there torch's bfloat16 matmul is emulated (SmolLM2's 30 layers at 1 row:
 * ~40 ms against ~9 ms of weight read, 2-core AMD EPYC Zen 3). The inputs are widened once per call
 * into float32 rows; the sums are float32, rounded to bfloat16 once at the end. */
static inline __attribute__((always_inline)) void ps_lin_cols_avx2_bf16(const float *restrict x, const int64_t ldx,
                                                                        const uint16_t *restrict w, const int64_t K,
                                                                        float *restrict acc, const int64_t W,
                                                                        const int64_t n0, const int64_t n1,
                                                                        const int MB, const int NR) {
    const int64_t pf = (NR == 2 ? PS_LIN_PF : 2 * PS_LIN_PF) * K;
    for (int64_t n = n0; n < n1; n += NR) {
        const int nr = n1 - n < NR ? (int)(n1 - n) : NR;
        const uint16_t *wr[2] = {w + n * K, w + (n + nr - 1) * K};
        __m256 a[2][8], v[2];
        for (int r = 0; r < NR; ++r)
            for (int m = 0; m < MB; ++m) a[r][m] = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            for (int r = 0; r < NR; ++r) {
                _mm_prefetch((const char *)(wr[r] + pf + k), _MM_HINT_T0);
                v[r] = ps_load8_bf16(wr[r] + k);
            }
            for (int m = 0; m < MB; ++m) {
                const __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
                for (int r = 0; r < NR; ++r) a[r][m] = _mm256_fmadd_ps(v[r], xv, a[r][m]);
            }
        }
        for (int m = 0; m < MB; ++m)
            for (int r = 0; r < nr; ++r) {
                float s = ps_hadd8(a[r][m]);
                for (int64_t kk = k; kk < K; ++kk) s += ps_bf16_to_f32(wr[r][kk]) * x[m * ldx + kk];
                acc[m * W + (n + r - n0)] = s;
            }
    }
}

void ps_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *out, int64_t M,
                    int64_t N, int64_t K, int64_t ldx, int64_t ldo, int nthreads) {
    float *xf = (float *)malloc((size_t)(M * K) * sizeof(float)); /* the inputs widened: [M, K] */
    if (!xf) return;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) xf[m * K + k] = ps_bf16_to_f32(x[m * ldx + k]);
    const int64_t ntiles = (N + PS_LIN_TILE - 1) / PS_LIN_TILE;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < ntiles; ++t) {
        const int64_t n0 = t * PS_LIN_TILE, n1 = n0 + PS_LIN_TILE < N ? n0 + PS_LIN_TILE : N, W = n1 - n0;
        float acc[PS_LIN_MB * PS_LIN_TILE];
        for (int64_t m0 = 0; m0 < M; m0 += PS_LIN_MB) {
            const float *xm = xf + m0 * K;
            const int mb = M - m0 < PS_LIN_MB ? (int)(M - m0) : PS_LIN_MB;
#define PS_LIN_CALL(MB) ps_lin_cols_avx2_bf16(xm, K, w, K, acc, W, n0, n1, MB, (MB) <= 4 ? 2 : 1)
            PS_CONST_ROWS_8(mb, PS_LIN_CALL)
#undef PS_LIN_CALL
            for (int m = 0; m < mb; ++m)
                for (int64_t n = n0; n < n1; ++n) {
                    float v = acc[m * W + (n - n0)];
                    if (bias) v += ps_bf16_to_f32(bias[n]);
                    out[(m0 + m) * ldo + n] = ps_f32_to_bf16(v);
                }
        }
    }
    free(xf);
}

int64_t ps_linear_bf16_available(void) { return 1; }
#else
void ps_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *out, int64_t M,
                    int64_t N, int64_t K, int64_t ldx, int64_t ldo, int nthreads) {
    (void)x; (void)w; (void)bias; (void)out; (void)M; (void)N; (void)K; (void)ldx; (void)ldo; (void)nthreads;
}
int64_t ps_linear_bf16_available(void) { return 0; } /* no AVX512-BF16: the launcher keeps F.linear */
#endif
