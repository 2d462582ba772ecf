#include "elementwise.h"

/* out[r, i] = R(R(silu(g)) * u),  g = gu[r, i], u = gu[r, I + i]   (gate and up side by side)
 *
 * silu(g) = g / (1 + exp(-g)), as torch computes it. gcc leaves the scalar exp unvectorized, so
 * with AVX-512 the row goes 16 lanes at a time (the tail masked); the scalar loop is the fallback. */
#ifdef PS_AVX512
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
#ifdef PS_AVX2
/* AVX2: 8 lanes at a time, the scalar row for the tail (measured on a 2-core AMD EPYC Zen 3, where
 * the scalar exp made SiLU-and-multiply ~4% of a float32 GSP run). */
PS_DEFINE_SILU_MUL_ROW(ps_silu_mul_tail_f32, float, PS_F32_IN, PS_F32_OUT, PS_F32_R)
PS_DEFINE_SILU_MUL_ROW(ps_silu_mul_tail_bf16, uint16_t, PS_BF16_IN, PS_BF16_OUT, PS_BF16_R)
static inline __m256 ps_silu8(__m256 a) {
    const __m256 na = _mm256_sub_ps(_mm256_setzero_ps(), a);
    /* ps_exp8 stops at 2^127: past 88 the +inf the scalar row uses is put back (silu -> -0) */
    const __m256 e = _mm256_blendv_ps(ps_exp8(na), _mm256_set1_ps(INFINITY),
                                      _mm256_cmp_ps(na, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
    return _mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}
static inline void ps_silu_mul_row_f32(const float *g, const float *u, float *o, int64_t I) {
    int64_t i = 0;
    for (; i + 8 <= I; i += 8)
        _mm256_storeu_ps(o + i, _mm256_mul_ps(ps_silu8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
    ps_silu_mul_tail_f32(g + i, u + i, o + i, I - i);
}
static inline void ps_silu_mul_row_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o, int64_t I) {
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
        float s[8] __attribute__((aligned(32)));
        _mm256_store_ps(s, ps_silu8(ps_load8_bf16(g + i)));
        for (int l = 0; l < 8; ++l) o[i + l] = PS_BF16_OUT(PS_BF16_R(s[l]) * PS_BF16_IN(u[i + l]));
    }
    ps_silu_mul_tail_bf16(g + i, u + i, o + i, I - i);
}
#else
PS_DEFINE_SILU_MUL_ROW(ps_silu_mul_row_f32, float, PS_F32_IN, PS_F32_OUT, PS_F32_R)
PS_DEFINE_SILU_MUL_ROW(ps_silu_mul_row_bf16, uint16_t, PS_BF16_IN, PS_BF16_OUT, PS_BF16_R)
#endif
#endif

#define PS_DEFINE_SILU_MUL(NAME, ROW, T)                                                               \
    void NAME(const T *gu, T *out, int64_t rows, int64_t I, int64_t gu_s, int64_t o_s, int nthreads) { \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (rows * I >= PS_PAR_MIN)") \
        for (int64_t r = 0; r < rows; ++r) ROW(gu + r * gu_s, gu + r * gu_s + I, out + r * o_s, I);   \
    }

PS_DEFINE_SILU_MUL(ps_silu_mul_f32, ps_silu_mul_row_f32, float)
PS_DEFINE_SILU_MUL(ps_silu_mul_bf16, ps_silu_mul_row_bf16, uint16_t)
