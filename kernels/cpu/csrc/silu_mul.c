#include "elementwise.h"

/* out[r, i] = R(R(silu(g)) * u),  g = gu[r, i], u = gu[r, I + i]   (gate and up side by side)
 *
 * silu(g) = g / (1 + exp(-g)), as torch computes it. gcc leaves the scalar exp unvectorized, so
 * with AVX-512 the row goes 16 lanes at a time (the tail masked); the scalar loop is the fallback. */
#ifdef PS_AVX512
static inline __m512 ps_silu16(__m512 a) {
    return _mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.0f), ps_exp16(_mm512_sub_ps(_mm512_setzero_ps(), a))));
}
static inline void ps_silu_mul_row_f32(const float *g, const float *u, float *o, int64_t I) {
    for (int64_t i = 0; i < I; i += 16) {
        const __mmask16 m = I - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (I - i)) - 1u);
        const __m512 a = _mm512_maskz_loadu_ps(m, g + i), b = _mm512_maskz_loadu_ps(m, u + i);
        _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(ps_silu16(a), b));
    }
}
static inline void ps_silu_mul_row_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o, int64_t I) {
    for (int64_t i = 0; i < I; i += 16) {
        const __mmask16 m = I - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (I - i)) - 1u);
        const __m512 a = ps_load16_bf16(g + i, m), b = ps_load16_bf16(u + i, m);
        ps_store16_bf16(o + i, _mm512_mul_ps(ps_round16_bf16(ps_silu16(a)), b), m);
    }
}
#else
#define PS_DEFINE_SILU_MUL_ROW(NAME, T, IN, OUT, R)                                                    \
    static inline void NAME(const T *g, const T *u, T *o, int64_t I) {                                 \
        for (int64_t i = 0; i < I; ++i) {                                                              \
            const float a = IN(g[i]);                                                                  \
            const float e = -a > 88.0f ? INFINITY : ps_exp(-a); /* ps_exp tops out at 2^127 */        \
            o[i] = OUT(R(a / (1.0f + e)) * IN(u[i]));                                                  \
        }                                                                                              \
    }
PS_DEFINE_SILU_MUL_ROW(ps_silu_mul_row_f32, float, PS_F32_IN, PS_F32_OUT, PS_F32_R)
PS_DEFINE_SILU_MUL_ROW(ps_silu_mul_row_bf16, uint16_t, PS_BF16_IN, PS_BF16_OUT, PS_BF16_R)
#endif

#define PS_DEFINE_SILU_MUL(NAME, ROW, T)                                                               \
    void NAME(const T *gu, T *out, int64_t rows, int64_t I, int64_t gu_s, int64_t o_s, int nthreads) { \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (rows * I >= PS_PAR_MIN)") \
        for (int64_t r = 0; r < rows; ++r) ROW(gu + r * gu_s, gu + r * gu_s + I, out + r * o_s, I);   \
    }

PS_DEFINE_SILU_MUL(ps_silu_mul_f32, ps_silu_mul_row_f32, float)
PS_DEFINE_SILU_MUL(ps_silu_mul_bf16, ps_silu_mul_row_bf16, uint16_t)
