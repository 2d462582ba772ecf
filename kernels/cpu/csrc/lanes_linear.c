#include "elementwise.h"

/* ---------------------------------------------------------------------------------------------
 * Small-batch linear on a weight in "lanes" layout: out[M, N] = x[M, K] @ w[N, K]^T (+ bias).
 *
 * Why: decoding 1-16 sequences reads every weight once per step and does little arithmetic, so the
 * step costs the weight read if the kernel keeps up with memory. The row kernel (linear.c) dots one
 * weight row with each input and reduces 16 lanes per output; at 8 inputs the reductions and input
 * loads bound it at about half the memory rate. Here the weight is laid out so that 32 output
 * columns sit in the lanes of two vectors, for each k:
 *
 *     float32:  lanes[N/32][K][32]                 acc[m][0..31] += w[n0.., k] * x[m, k]   (broadcast)
 *     bfloat16: lanes[N/32][K/2][32][2] (k pairs)  acc[m][0..31] += w[n0.., 2j:2j+2] . x[m, 2j:2j+2]
 *
 * (N padded to a multiple of 32 and, in bfloat16, K to even, with zeros.) Each block of 32 columns is
 * one sequential stream of K x 128 bytes; its 2 x MB accumulators stay in registers, no reductions,
 * and inputs of more than 8 rows re-read the block from L1/L2. Measured (2-core AMD EPYC Zen 4,
 * SmolLM2's 30 layers of linears in bfloat16, results/packed_linear_zen4.json): 6.0 / 5.9 / 6.8 ms at
 * 1 / 4 / 8 rows, about the time a plain read of the same 212 MB takes, against 6.1 / 10.4 / 13.7 ms
 * for the row kernel and 10.6 / 9.8 / 12.2 ms for oneDNN's packed copy.
 *
 * The sums run over k in order, in float32 (bfloat16: pairs by vdpbf16ps, rounded once at the end,
 * as oneDNN's). Output columns go to the threads in blocks of 32. AVX-512 only (AVX512-BF16 for
 * bfloat16); elsewhere the *_available functions say 0 and the launcher keeps the row kernel. */
#define PS_LANES 32
#define PS_LANES_MB 8
/* Blocks of more than one row prefetch their own stream 4 KiB ahead (32 k rows in float32, 32 k pairs in
 * bfloat16). One row keeps up with memory on the hardware prefetcher alone; at 4-16 rows the multiply-adds
 * between loads slowed the stream (to ~13 GB/s of 21 on the Xeon). SmolLM2's 30 layers, weights streamed,
 * benchmarks/packed_linear.py in interleaved processes: 2-core Intel Xeon f6m207 VM, float32, 4 rows
 * 28.6-33.3 -> 22.2-25.3 ms, 8 rows 36.3-41.1 -> 25.0-29.4, distances 16-128 alike within noise; 2-core
 * AMD Zen 5 VM (results/amd-zen5-avx512bf16/ab_lanes_prefetch.json; times moved 1.4x between processes,
 * so m rows' time / one row's in the same process, medians): float32 8 / 16 rows 1.30 / 1.39 -> 0.91 / 1.28;
 * bfloat16 (8 rounds) 4 / 8 / 16 rows 1.11 / 1.28 / 1.72 -> 1.01 / 1.05 / 1.33 (16 pairs ahead 1.06 / 1.17 /
 * 1.72, 64 like 32); the engine's bfloat16 n=8 0.756 -> 0.728 s, beam 4 0.447 -> 0.405 s (medians of 4
 * alternating rounds). One row takes none. (#ifndef: an A/B build may set a distance; 0 turns it off.) */
#ifndef PS_LANES_PF_F32
#define PS_LANES_PF_F32 32
#endif
#ifndef PS_LANES_PF_BF16
#define PS_LANES_PF_BF16 32
#endif

/* An entry point: x [M, K] (row stride ldx), the lanes layout, bias [N] or NULL, out [M, N] (row
 * stride ldo); blocks of 32 columns over the threads, inputs in chunks of 8 (KSTORED: the k rows a block
 * holds; CALL(MB): the block function on this chunk, which reads GATED and N).
 *
 * NAME_gated: the MLP's gate_up linear and SiLU-and-multiply in one pass (SwiGLU), N = I:
 *
 *     out[m, i] = R(R(silu(g)) * u),  g = R(x[m] . w[i] + b[i]),  u = R(x[m] . w[I + i] + b[I + i])
 *
 * (R: rounding to bfloat16; none in float32), the values the linear into [M, 2I] and silu_mul.c give bit
 * for bit, without writing the [M, 2I] intermediate and reading it back. Its weight is the lanes layout
 * of the gate_up rows reordered so that each block holds 16 gate columns and the same 16 up columns
 * (linear.py pack_lanes_gated): the block's two accumulators per row are a gate vector and its up vector,
 * so the loop is this kernel's own, and each block still one 32-lane stream that stays in L1. (Blocks of
 * 32 gate and 32 up columns, 4 accumulators a row, measured up to 1.5x slower in bfloat16: the pair of
 * blocks left L1.) */
#define PS_DEFINE_LANES(NAME, T, KSTORED, CALL)                                                          \
    static inline __attribute__((always_inline)) void NAME##_blocks(                                     \
        const T *x, const T *lanes, const T *bias, T *out, int64_t M, int64_t N, int64_t K, int64_t ldx, \
        int64_t ldo, int nthreads, const int GATED) {                                                    \
        const int64_t width = GATED ? PS_LANES / 2 : PS_LANES; /* output columns a block gives */       \
        const int64_t nblocks = (N + width - 1) / width;                                                 \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                               \
        for (int64_t b = 0; b < nblocks; ++b) {                                                          \
            const T *wb = lanes + b * (KSTORED) * PS_LANES;                                              \
            const int64_t n0 = b * width, ncols = N - n0 < width ? N - n0 : width;                       \
            const T *bb = bias ? bias + n0 : NULL;                                                       \
            for (int64_t m0 = 0; m0 < M; m0 += PS_LANES_MB) {                                            \
                const T *xm = x + m0 * ldx;                                                              \
                T *om = out + m0 * ldo + n0;                                                             \
                PS_CONST_ROWS_8(M - m0, CALL) /* constant MB: accumulators in registers */               \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
    void NAME(const T *x, const T *lanes, const T *bias, T *out, int64_t M, int64_t N, int64_t K, int64_t ldx, \
              int64_t ldo, int nthreads) {                                                               \
        NAME##_blocks(x, lanes, bias, out, M, N, K, ldx, ldo, nthreads, 0);                              \
    }                                                                                                    \
    void NAME##_gated(const T *x, const T *lanes, const T *bias, T *out, int64_t M, int64_t N, int64_t K,     \
                      int64_t ldx, int64_t ldo, int nthreads) {                                          \
        NAME##_blocks(x, lanes, bias, out, M, N, K, ldx, ldo, nthreads, 1);                              \
    }

#if defined(PS_AVX512)
static inline __attribute__((always_inline)) void ps_lanes_block_f32(const float *restrict x, const int64_t ldx,
                                                                     const float *restrict wb, const int64_t K,
                                                                     const float *restrict bias, float *restrict out,
                                                                     const int64_t ldo, const int64_t ncols,
                                                                     const int MB, const int gated, const int64_t up) {
    __m512 a0[PS_LANES_MB], a1[PS_LANES_MB];
    for (int m = 0; m < MB; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        if (MB > 1 && PS_LANES_PF_F32) {
            _mm_prefetch((const char *)(wb + (k + PS_LANES_PF_F32) * PS_LANES), _MM_HINT_T0);
            _mm_prefetch((const char *)(wb + (k + PS_LANES_PF_F32) * PS_LANES + 16), _MM_HINT_T0);
        }
        const __m512 v0 = _mm512_loadu_ps(wb + k * PS_LANES), v1 = _mm512_loadu_ps(wb + k * PS_LANES + 16);
        for (int m = 0; m < MB; ++m) {
            const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
            a0[m] = _mm512_fmadd_ps(v0, xb, a0[m]);
            a1[m] = _mm512_fmadd_ps(v1, xb, a1[m]);
        }
    }
    if (gated) { /* a0: gate columns, a1: the same up columns (bias: theirs, I apart) */
        const __mmask16 lo = ncols >= 16 ? 0xffff : (__mmask16)((1u << ncols) - 1u);
        const __m512 bg = bias ? _mm512_maskz_loadu_ps(lo, bias) : _mm512_setzero_ps();
        const __m512 bu = bias ? _mm512_maskz_loadu_ps(lo, bias + up) : _mm512_setzero_ps();
        for (int m = 0; m < MB; ++m)
            _mm512_mask_storeu_ps(out + m * ldo, lo, _mm512_mul_ps(ps_silu16(_mm512_add_ps(a0[m], bg)), _mm512_add_ps(a1[m], bu)));
        return;
    }
    const __mmask16 lo = ncols >= 16 ? 0xffff : (__mmask16)((1u << ncols) - 1u);
    const __mmask16 hi = ncols >= 32 ? 0xffff : ncols <= 16 ? 0 : (__mmask16)((1u << (ncols - 16)) - 1u);
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(lo, bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(hi, bias + 16) : _mm512_setzero_ps();
    for (int m = 0; m < MB; ++m) {
        _mm512_mask_storeu_ps(out + m * ldo, lo, _mm512_add_ps(a0[m], b0));
        _mm512_mask_storeu_ps(out + m * ldo + 16, hi, _mm512_add_ps(a1[m], b1));
    }
}

#define PS_LANES_CALL_F32(MB) ps_lanes_block_f32(xm, ldx, wb, K, bb, om, ldo, ncols, MB, GATED, N)
PS_DEFINE_LANES(ps_lanes_linear_f32, float, K, PS_LANES_CALL_F32)

int64_t ps_lanes_f32_available(void) { return 1; }
#else
void ps_lanes_linear_f32(const float *x, const float *lanes, const float *bias, float *out, int64_t M, int64_t N,
                         int64_t K, int64_t ldx, int64_t ldo, int nthreads) {
    (void)x; (void)lanes; (void)bias; (void)out; (void)M; (void)N; (void)K; (void)ldx; (void)ldo; (void)nthreads;
}
void ps_lanes_linear_f32_gated(const float *x, const float *lanes, const float *bias, float *out, int64_t M,
                               int64_t N, int64_t K, int64_t ldx, int64_t ldo, int nthreads) {
    ps_lanes_linear_f32(x, lanes, bias, out, M, N, K, ldx, ldo, nthreads);
}
int64_t ps_lanes_f32_available(void) { return 0; }
#endif

#if defined(PS_AVX512) && defined(__AVX512BF16__)
static inline __attribute__((always_inline)) void ps_lanes_block_bf16(const uint16_t *restrict x, const int64_t ldx,
                                                                      const uint16_t *restrict wb, const int64_t K,
                                                                      const uint16_t *restrict bias,
                                                                      uint16_t *restrict out, const int64_t ldo,
                                                                      const int64_t ncols, const int MB,
                                                                      const int gated, const int64_t up) {
    __m512 a0[PS_LANES_MB], a1[PS_LANES_MB];
    for (int m = 0; m < MB; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    const int64_t pairs = K / 2; /* whole pairs; an odd K's last one after the loop */
    for (int64_t j = 0; j < pairs; ++j) {
        if (MB > 1 && PS_LANES_PF_BF16) {
            _mm_prefetch((const char *)(wb + (j + PS_LANES_PF_BF16) * 2 * PS_LANES), _MM_HINT_T0);
            _mm_prefetch((const char *)(wb + (j + PS_LANES_PF_BF16) * 2 * PS_LANES + PS_LANES), _MM_HINT_T0);
        }
        const __m512bh v0 = (__m512bh)_mm512_loadu_si512(wb + j * 2 * PS_LANES);
        const __m512bh v1 = (__m512bh)_mm512_loadu_si512(wb + j * 2 * PS_LANES + PS_LANES);
        for (int m = 0; m < MB; ++m) {
            int32_t pair;
            memcpy(&pair, x + m * ldx + 2 * j, 4);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            a0[m] = _mm512_dpbf16_ps(a0[m], v0, xb);
            a1[m] = _mm512_dpbf16_ps(a1[m], v1, xb);
        }
    }
    if (K % 2) {
        const __m512bh v0 = (__m512bh)_mm512_loadu_si512(wb + pairs * 2 * PS_LANES);
        const __m512bh v1 = (__m512bh)_mm512_loadu_si512(wb + pairs * 2 * PS_LANES + PS_LANES);
        for (int m = 0; m < MB; ++m) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int32_t)x[m * ldx + 2 * pairs]); /* (x, 0) */
            a0[m] = _mm512_dpbf16_ps(a0[m], v0, xb);
            a1[m] = _mm512_dpbf16_ps(a1[m], v1, xb);
        }
    }
    if (gated) { /* gate and up rounded as the linear stores them, then silu_mul.c's steps */
        const __mmask16 lo = ncols >= 16 ? 0xffff : (__mmask16)((1u << ncols) - 1u);
        const __m512 bg = bias ? ps_load16_bf16(bias, lo) : _mm512_setzero_ps();
        const __m512 bu = bias ? ps_load16_bf16(bias + up, lo) : _mm512_setzero_ps();
        for (int m = 0; m < MB; ++m) {
            const __m512 g = ps_round16_bf16(_mm512_add_ps(a0[m], bg)), u = ps_round16_bf16(_mm512_add_ps(a1[m], bu));
            ps_store16_bf16(out + m * ldo, _mm512_mul_ps(ps_round16_bf16(ps_silu16(g)), u), lo);
        }
        return;
    }
    const __mmask16 lo = ncols >= 16 ? 0xffff : (__mmask16)((1u << ncols) - 1u);
    const __mmask16 hi = ncols >= 32 ? 0xffff : ncols <= 16 ? 0 : (__mmask16)((1u << (ncols - 16)) - 1u);
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias) { /* bfloat16 bias widened to float32, added before the one rounding */
        b0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lo, bias)), 16));
        b1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(hi, bias + 16)), 16));
    }
    for (int m = 0; m < MB; ++m) {
        _mm256_mask_storeu_epi16(out + m * ldo, lo, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a0[m], b0)));
        _mm256_mask_storeu_epi16(out + m * ldo + 16, hi, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a1[m], b1)));
    }
}

#define PS_LANES_CALL_BF16(MB) ps_lanes_block_bf16(xm, ldx, wb, K, bb, om, ldo, ncols, MB, GATED, N)
PS_DEFINE_LANES(ps_lanes_linear_bf16, uint16_t, K + (K % 2), PS_LANES_CALL_BF16)

int64_t ps_lanes_bf16_available(void) { return 1; }
#else
void ps_lanes_linear_bf16(const uint16_t *x, const uint16_t *lanes, const uint16_t *bias, uint16_t *out, int64_t M,
                          int64_t N, int64_t K, int64_t ldx, int64_t ldo, int nthreads) {
    (void)x; (void)lanes; (void)bias; (void)out; (void)M; (void)N; (void)K; (void)ldx; (void)ldo; (void)nthreads;
}
void ps_lanes_linear_bf16_gated(const uint16_t *x, const uint16_t *lanes, const uint16_t *bias, uint16_t *out,
                                int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldo, int nthreads) {
    ps_lanes_linear_bf16(x, lanes, bias, out, M, N, K, ldx, ldo, nthreads);
}
int64_t ps_lanes_bf16_available(void) { return 0; }
#endif

