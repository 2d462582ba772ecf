#include "elementwise.h"

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

PS_DEFINE_ADD_RMS_NORM(ps_add_rms_norm_f32, ps_add_rms_norm_row_f32, float)
PS_DEFINE_ADD_RMS_NORM(ps_add_rms_norm_bf16, ps_add_rms_norm_row_bf16, uint16_t)
