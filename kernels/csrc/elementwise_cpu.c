/* Fused elementwise ops of the decoder layer on CPU: RMSNorm (with the residual add before it),
 * SiLU-and-multiply, and rotary embedding, in float32 and bfloat16.
 *
 * Why: in torch each of these is 4-9 separate ops (RMSNorm alone: cast, pow, mean, add, rsqrt,
 * mul, cast, mul), each a full pass over the activations plus ~5-10 us of dispatch. Measured on
 * SmolLM2 they were a third of a bfloat16 prefill step's time and ~1,000 dispatches per decode step.
 * Here each is one pass, rows split over the OpenMP threads.
 *
 * Rounding follows the torch references in kernels/elementwise.py (which follow HF transformers)
 * step by step: every intermediate the reference materialises in the model dtype is rounded to it
 * here too (R below), so bfloat16 results match the reference bit for bit where the math is exact
 * (residual add, rotary, the final products); RMSNorm's sum of squares is added in another order
 * (float32 rounding apart, the same), and SiLU's exp is ps_exp (~2 ulp).
 */
#include "ps_cpu.h"

#define PS_PAR_MIN 16384 /* elements below which one thread does the whole op (fork/join costs ~us) */

#define PS_F32_IN(p) (p)
#define PS_F32_OUT(x) (x)
#define PS_F32_R(x) (x)
#define PS_BF16_IN(p) ps_bf16_to_f32(p)
#define PS_BF16_OUT(x) ps_f32_to_bf16(x)
#define PS_BF16_R(x) ps_bf16_to_f32(ps_f32_to_bf16(x))

/* out[r] = w * R(y * rsqrt(mean(y^2) + eps)),  y = R(x[r] + h[r]) stored to res[r]  (or y = x[r], no h)
 *
 *     rows r = 0 .. rows-1, each H wide; x, h, res and out rows at their own strides; y: H floats
 *     of scratch. One row per call of the row function; bfloat16 rows go 16 lanes at a time with
 *     AVX-512 (gcc leaves the scalar bf16 conversions unvectorized), float32 rows auto-vectorize. */
#define PS_DEFINE_ADD_RMS_NORM_ROW(NAME, T, IN, OUT, R)                                                \
    static inline void NAME(const T *xr, const T *hr, const T *w, T *rr, T *orow, int64_t H, float eps, \
                            float *restrict y) {                                                       \
        if (hr) {                                                                                      \
            for (int64_t i = 0; i < H; ++i) {                                                          \
                y[i] = R(IN(xr[i]) + IN(hr[i]));                                                       \
                rr[i] = OUT(y[i]);                                                                     \
            }                                                                                          \
        } else {                                                                                       \
            for (int64_t i = 0; i < H; ++i) y[i] = IN(xr[i]);                                          \
        }                                                                                              \
        float ss = 0.0f;                                                                               \
        _Pragma("omp simd reduction(+:ss)")                                                            \
        for (int64_t i = 0; i < H; ++i) ss += y[i] * y[i];                                             \
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);                                           \
        for (int64_t i = 0; i < H; ++i) orow[i] = OUT(IN(w[i]) * R(y[i] * inv));                       \
    }

PS_DEFINE_ADD_RMS_NORM_ROW(ps_add_rms_norm_row_f32, float, PS_F32_IN, PS_F32_OUT, PS_F32_R)
#ifdef PS_AVX512
static inline void ps_add_rms_norm_row_bf16(const uint16_t *xr, const uint16_t *hr, const uint16_t *w,
                                            uint16_t *rr, uint16_t *orow, int64_t H, float eps, float *restrict y) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < H; i += 16) {
        const __mmask16 m = H - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (H - i)) - 1u);
        __m512 a = ps_load16_bf16(xr + i, m);
        if (hr) {
            a = ps_round16_bf16(_mm512_add_ps(a, ps_load16_bf16(hr + i, m)));
            ps_store16_bf16(rr + i, a, m);
        }
        _mm512_mask_storeu_ps(y + i, m, a);
        ss = _mm512_fmadd_ps(a, a, ss); /* masked lanes are 0 */
    }
    const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)H + eps));
    for (int64_t i = 0; i < H; i += 16) {
        const __mmask16 m = H - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (H - i)) - 1u);
        const __m512 n = ps_round16_bf16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, y + i), inv));
        ps_store16_bf16(orow + i, _mm512_mul_ps(ps_load16_bf16(w + i, m), n), m);
    }
}
#else
PS_DEFINE_ADD_RMS_NORM_ROW(ps_add_rms_norm_row_bf16, uint16_t, PS_BF16_IN, PS_BF16_OUT, PS_BF16_R)
#endif

#define PS_DEFINE_ADD_RMS_NORM(NAME, ROW, T)                                                           \
    void NAME(const T *x, const T *h, const T *w, T *res, T *out, int64_t rows, int64_t H,            \
              int64_t x_s, int64_t h_s, int64_t r_s, int64_t o_s, float eps, int nthreads) {          \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (rows * H >= PS_PAR_MIN)") \
        for (int64_t r = 0; r < rows; ++r) {                                                           \
            float y[H > 0 ? H : 1];                                                                    \
            ROW(x + r * x_s, h ? h + r * h_s : 0, w, res + r * r_s, out + r * o_s, H, eps, y);         \
        }                                                                                              \
    }

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

PS_DEFINE_ADD_RMS_NORM(ps_add_rms_norm_f32, ps_add_rms_norm_row_f32, float)
PS_DEFINE_ADD_RMS_NORM(ps_add_rms_norm_bf16, ps_add_rms_norm_row_bf16, uint16_t)
PS_DEFINE_SILU_MUL(ps_silu_mul_f32, ps_silu_mul_row_f32, float)
PS_DEFINE_SILU_MUL(ps_silu_mul_bf16, ps_silu_mul_row_bf16, uint16_t)
PS_DEFINE_ROPE(ps_rope_f32, ps_rope_row_f32, float)
PS_DEFINE_ROPE(ps_rope_bf16, ps_rope_row_bf16, uint16_t)
