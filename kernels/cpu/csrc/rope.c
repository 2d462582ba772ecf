#include "elementwise.h"

/* Rotary embedding in place on the first NH heads of each row (q heads, then k heads):
 *
 *     x = [x1 | x2] (two halves of D/2);  x1' = R(R(x1 c) - R(x2 s)),  x2' = R(R(x2 c) + R(x1 s))
 *
 * c, s: [rows, D/2] rows at cs_s. fp-contract off: the reference rounds each product before the
 * add, and so must the float32 path here (an FMA would round once). bfloat16 rows go 16 lanes at a
 * time with AVX-512 (products of two bf16 are exact in float32, so only the roundings matter). */
#define PS_DEFINE_ROPE_ROW(NAME, T, IN, OUT, R)                                                        \
    __attribute__((optimize("fp-contract=off"))) static void NAME(T *row, const T *c, const T *s,     \
                                                                  int64_t NH, int64_t D) {             \
        const int64_t half = D / 2;                                                                    \
        for (int64_t hd = 0; hd < NH; ++hd) {                                                          \
            T *x1 = row + hd * D, *x2 = x1 + half;                                                     \
            _Pragma("omp simd")                                                                        \
            for (int64_t i = 0; i < half; ++i) {                                                       \
                const float a = IN(x1[i]), b = IN(x2[i]), ci = IN(c[i]), si = IN(s[i]);                \
                x1[i] = OUT(R(a * ci) - R(b * si));                                                    \
                x2[i] = OUT(R(b * ci) + R(a * si));                                                    \
            }                                                                                          \
        }                                                                                              \
    }

PS_DEFINE_ROPE_ROW(ps_rope_row_f32, float, PS_F32_IN, PS_F32_OUT, PS_F32_R)
#ifdef PS_AVX512
static void ps_rope_row_bf16(uint16_t *row, const uint16_t *c, const uint16_t *s, int64_t NH, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 m = half - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (half - i)) - 1u);
        const __m512 ci = ps_load16_bf16(c + i, m), si = ps_load16_bf16(s + i, m);
        for (int64_t hd = 0; hd < NH; ++hd) {
            uint16_t *x1 = row + hd * D + i, *x2 = x1 + half;
            const __m512 a = ps_load16_bf16(x1, m), b = ps_load16_bf16(x2, m);
            const __m512 ac = ps_round16_bf16(_mm512_mul_ps(a, ci)), bs = ps_round16_bf16(_mm512_mul_ps(b, si));
            const __m512 bc = ps_round16_bf16(_mm512_mul_ps(b, ci)), as = ps_round16_bf16(_mm512_mul_ps(a, si));
            ps_store16_bf16(x1, _mm512_sub_ps(ac, bs), m);
            ps_store16_bf16(x2, _mm512_add_ps(bc, as), m);
        }
    }
}
#else
PS_DEFINE_ROPE_ROW(ps_rope_row_bf16, uint16_t, PS_BF16_IN, PS_BF16_OUT, PS_BF16_R)
#endif

#define PS_DEFINE_ROPE(NAME, ROW, T)                                                                   \
    void NAME(T *qk, const T *cos, const T *sin, int64_t rows, int64_t NH, int64_t D, int64_t qk_s,    \
              int64_t cs_s, int nthreads) {                                                            \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (rows * NH * D >= PS_PAR_MIN)") \
        for (int64_t r = 0; r < rows; ++r) ROW(qk + r * qk_s, cos + r * cs_s, sin + r * cs_s, NH, D);  \
    }

PS_DEFINE_ROPE(ps_rope_f32, ps_rope_row_f32, float)
PS_DEFINE_ROPE(ps_rope_bf16, ps_rope_row_bf16, uint16_t)
