/* Helpers shared by the CPU C kernels: a vectorizable exp and float32 <-> bfloat16 row moves. */
#ifndef PS_CPU_H
#define PS_CPU_H

#include <math.h>
#include <stdint.h>
#include <string.h>

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

/* CALL(MB) with MB a compile-time constant 1..8 equal to min(n, 8): the small-batch linears' row loops
 * then unroll with their accumulators in registers. */
#define PS_CONST_ROWS_8(n, CALL)                                                                        \
    switch ((n) < 8 ? (n) : 8) {                                                                       \
    case 1: CALL(1); break;                                                                            \
    case 2: CALL(2); break;                                                                            \
    case 3: CALL(3); break;                                                                            \
    case 4: CALL(4); break;                                                                            \
    case 5: CALL(5); break;                                                                            \
    case 6: CALL(6); break;                                                                            \
    case 7: CALL(7); break;                                                                            \
    default: CALL(8); break;                                                                           \
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

/* One value at a time (the elementwise kernels): bfloat16 bits <-> float32, round to nearest even. */
static inline float ps_bf16_to_f32(uint16_t b) {
    union { uint32_t u; float f; } v = { .u = (uint32_t)b << 16 };
    return v.f;
}

static inline uint16_t ps_f32_to_bf16(float x) {
    uint16_t b;
    ps_store_bf16(&b, x);
    return b;
}

/* The attention kernels trust every block id they read: check those (and only those, the ones covering
 * [0, lens[b])) are in the pool [0, NB) before any is read. One serial pass over B x blocks ids. */
static inline int ps_bad_block_ids(const int32_t *bt, const int32_t *lens, int64_t B, int64_t BS, int64_t bt_stride,
                            int64_t NB) {
    for (int64_t b = 0; b < B; ++b) {
        const int64_t nblk = lens[b] > 0 ? (lens[b] + BS - 1) / BS : 0;
        for (int64_t j = 0; j < nblk; ++j)
            if (bt[b * bt_stride + j] < 0 || bt[b * bt_stride + j] >= NB) return 1;
    }
    return 0;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PS_AVX512 1
#include <immintrin.h>

/* exp of 16 floats: the same reduction and polynomial as ps_exp, with 2^n applied by scalef, so
 * it overflows to inf (x >= 88.73) and underflows to 0 without bit tricks, which gcc does not
 * vectorize. The clamps only keep n finite; min/max return their second operand for NaN, so
 * NaN stays NaN. */
static inline __m512 ps_exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), _mm512_min_ps(_mm512_set1_ps(89.0f), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* 16 bfloat16 -> float32 (masked lanes read as 0). */
static inline __m512 ps_load16_bf16(const uint16_t *p, __mmask16 m) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* float32 -> bfloat16 bits in the low half of each lane: round to nearest even, NaN kept quiet
 * (ps_store_bf16, 16 at a time). */
static inline __m512i ps_bf16_bits16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, quiet);
}

static inline void ps_store16_bf16(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(ps_bf16_bits16(v)));
}

/* v rounded to bfloat16 and back (the reference's intermediate rounding). */
static inline __m512 ps_round16_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(ps_bf16_bits16(v), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
/* CPUs with AVX2 but not AVX-512 (AMD Zen 1-3, older Intel): 8-lane versions of what the kernels
 * need. Measured on a 2-core AMD EPYC (Zen 3) with AVX2 only, where gcc's own vectorization of the
 * portable loops left the decode kernel's per-score horizontal sums as the bottleneck. */
#define PS_AVX2 1
#include <immintrin.h>

/* exp of 8 floats for x <= ~88: ps_exp's reduction and polynomial, with 2^n built in the exponent
 * bits; n is clamped to [-126, 127] (x below -87.3 gives ~1e-38, as ps_exp does, not 0). */
static inline __m256 ps_exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), _mm256_min_ps(_mm256_set1_ps(88.0f), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* 8 bfloat16 -> float32. */
static inline __m256 ps_load8_bf16(const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Lane i of the result = the sum of a[i]'s 8 lanes (8 horizontal sums in 9 shuffles-and-adds). */
static inline __m256 ps_hsum8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* [a0..a3 | a0..a3] halves */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline float ps_hmax8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

static inline float ps_hadd8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
#endif

#endif
