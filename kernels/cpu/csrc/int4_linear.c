#include "ps_cpu.h"

/* ---------------------------------------------------------------------------------------------
 * Weight-only int4 linear with int8 activations on AVX512-VNNI:
 *     out[M, N] = x[M, K] @ w[N, K]^T,   w = q * d + m per group of G inputs, q in [0, 15]
 *
 * Why: torch's _weight_int4pack_mm_for_cpu decodes every weight to float once per input row, so at
 * 8 rows it costs about 8 times one row (measured on SmolLM2's 3072x576: ~22.5 us per row) and
 * decode of a batch spends most of its time there. Here each 4-bit weight is unpacked once (two
 * AND/shift ops per 128 weights) and multiplied against all rows as bytes by vpdpbusd (64
 * multiply-adds per instruction), as llama.cpp runs its Q4 formats. Each row is first quantized per
 * block of 32 inputs into two int8 digits, x = ad (hi + lo / 254) with ad = max|x| / 127 (round to
 * nearest even): about 16 bits per block where one int8 (llama.cpp's Q8 rows) gave 8, which flipped
 * SmolLM2's answer to the README's question and cost 0.5% perplexity. Then
 *
 *     out[r, n] = sum_b  ad[r, b] / 254 * d[n, g] * sum_{k in b} q[n, k] (254 hi[r, k] + lo[r, k])
 *                      + m[n, g] * asum[r, b],          asum[r, b] = ad[r, b] * sum_{k in b} (hi + lo / 254)
 *
 * with the sum over k in int32 (|.| < 2^24: exact in float32) and the rest in float32.
 *
 * Packed layout (kernels/quant_linear.py packs it), per tile of 16 output columns:
 *     weights [N/16][K/8][16 columns][4 bytes]: byte i of column c at k-octet o holds
 *             q[c, 8o + i] in its low nibble and q[c, 8o + 4 + i] in its high nibble, so one
 *             64-byte load is the 16 columns x 8 inputs vpdpbusd wants (low nibbles: inputs
 *             8o..8o+3 in each lane; high: 8o+4..8o+7)
 *     scales  [N/16][K/G][2][16] float16: d of the 16 columns, then m; or, symmetric (GGUF's Q4_0, w = (q - 8) d),
 *             [N/16][K/G][1][16]: d alone, m = -8 d (a tenth fewer bytes a decode step reads: 288 per 32 x 16
 *             block against 320)
 * Output columns are split over the threads in tiles of 16; rows go through in passes of up to 8
 * (8 float accumulators and the 8 unpacked weight vectors of a 32-input block stay in registers).
 */
#define PS_Q4_MB 8
#define PS_Q4_AB 32 /* inputs per activation block (one int8 scale) */
/* Software prefetch distance in bytes, weights and scales (see the measurement in quant_linear.py). */
#ifndef PS_Q4_PF
#define PS_Q4_PF 1024
#endif
#define PS_Q4_PF_SCALES 256

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#include <immintrin.h>
#include <stdlib.h>

static inline __m512 ps_q4_load16(const void *x, int64_t i, int bf16) {
    return bf16 ? ps_load16_bf16((const uint16_t *)x + i, 0xffff) : _mm512_loadu_ps((const float *)x + i);
}

static inline __m512i ps_q4_times254(__m512i v) { return _mm512_sub_epi32(_mm512_slli_epi32(v, 8), _mm512_slli_epi32(v, 1)); }

/* Row r of x -> two int8 rows hi, lo [K], ad[K/32] scales, asum[K/32]: per block of 32,
 * x = ad * (hi + lo / 254) to within ad / 508 (about 16 bits against the block's largest |x|;
 * 254, not 256, so that lo = round(254 (x / ad - hi)) never leaves [-127, 127]). */
static void ps_q4_quantize_row(const void *x, int bf16, int64_t K, int8_t *hi, int8_t *lo, float *ad, float *asum,
                               const int two) {
    for (int64_t b = 0; b < K / PS_Q4_AB; ++b) {
        const __m512 v0 = ps_q4_load16(x, b * PS_Q4_AB, bf16), v1 = ps_q4_load16(x, b * PS_Q4_AB + 16, bf16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m512i qs = _mm512_setzero_si512();
        for (int h = 0; h < 2; ++h) {
            const __m512 xs = _mm512_mul_ps(h ? v1 : v0, inv); /* |xs| <= 127 */
            const __m512i qh = _mm512_cvtps_epi32(xs);   /* round to nearest even */
            _mm_storeu_si128((__m128i *)(hi + b * PS_Q4_AB + 16 * h), _mm512_cvtsepi32_epi8(qh));
            if (!two) {
                qs = _mm512_add_epi32(qs, qh);
                continue;
            }
            const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(xs, _mm512_cvtepi32_ps(qh)),
                                                                _mm512_set1_ps(254.0f))); /* |ql| <= 127 */
            _mm_storeu_si128((__m128i *)(lo + b * PS_Q4_AB + 16 * h), _mm512_cvtsepi32_epi8(ql));
            qs = _mm512_add_epi32(qs, _mm512_add_epi32(ps_q4_times254(qh), ql));
        }
        ad[b] = amax / 127.0f;
        asum[b] = (two ? ad[b] / 254.0f : ad[b]) * (float)_mm512_reduce_add_epi32(qs);
    }
}

/* One tile of 16 columns for MB rows (a constant at each call site: the accumulators stay in registers). */
static inline __attribute__((always_inline)) void ps_q4_tile(const int8_t *restrict hi, const int8_t *restrict lo,
                                                             const float *restrict ad,
                                                             const float *restrict asum, const int64_t K,
                                                             const uint8_t *restrict wt, const uint16_t *restrict st,
                                                             const int64_t G, float *restrict acc, const int MB,
                                                             const int W8, const int SYM, const int TWO) {
    const int64_t nb = K / PS_Q4_AB;
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 f[PS_Q4_MB];
    for (int r = 0; r < MB; ++r) f[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint16_t *sg = st + (b * PS_Q4_AB / G) * (SYM ? 16 : 32);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sg));
        const __m512 m = SYM ? _mm512_mul_ps(d, _mm512_set1_ps(-8.0f))
                             : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sg + 16)));
        __m512i w[8];
        _mm_prefetch((const char *)(sg + PS_Q4_PF_SCALES), _MM_HINT_T0);
        if (W8) { /* bytes: vector j holds inputs 4j..4j+3 of the block, as the nibbles unpack below */
            for (int j = 0; j < 8; ++j) {
                _mm_prefetch((const char *)(wt + (b * 8 + j) * 64 + 2 * PS_Q4_PF), _MM_HINT_T0);
                w[j] = _mm512_loadu_si512(wt + (b * 8 + j) * 64);
            }
        } else {
            for (int o = 0; o < 4; ++o) {
                _mm_prefetch((const char *)(wt + (b * 4 + o) * 64 + PS_Q4_PF), _MM_HINT_T0);
                const __m512i raw = _mm512_loadu_si512(wt + (b * 4 + o) * 64);
                w[2 * o] = _mm512_and_si512(raw, low);
                w[2 * o + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            }
        }
        for (int r = 0; r < MB; ++r) {
            const int32_t *ah = (const int32_t *)(hi + r * K + b * PS_Q4_AB);
            const int32_t *al = (const int32_t *)(lo + r * K + b * PS_Q4_AB);
            /* four short chains, not one of 16: vpdpbusd's latency bounds a single row */
            __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
            for (int j = 0; j < 8; j += 2) {
                if (TWO) {
                    h0 = _mm512_dpbusd_epi32(h0, w[j], _mm512_set1_epi32(ah[j]));
                    h1 = _mm512_dpbusd_epi32(h1, w[j + 1], _mm512_set1_epi32(ah[j + 1]));
                    l0 = _mm512_dpbusd_epi32(l0, w[j], _mm512_set1_epi32(al[j]));
                    l1 = _mm512_dpbusd_epi32(l1, w[j + 1], _mm512_set1_epi32(al[j + 1]));
                } else { /* one digit: the four chains over the block's eight vectors */
                    if (j & 2) {
                        l0 = _mm512_dpbusd_epi32(l0, w[j], _mm512_set1_epi32(ah[j]));
                        l1 = _mm512_dpbusd_epi32(l1, w[j + 1], _mm512_set1_epi32(ah[j + 1]));
                    } else {
                        h0 = _mm512_dpbusd_epi32(h0, w[j], _mm512_set1_epi32(ah[j]));
                        h1 = _mm512_dpbusd_epi32(h1, w[j + 1], _mm512_set1_epi32(ah[j + 1]));
                    }
                }
            }
            /* two digits: 254 sum(q hi) + sum(q lo): |s| < 2^24 for nibbles, exact in float32 (bytes: < 2^29, rounded
             * to 24 bits); one digit: sum(q hi) */
            const __m512i s = TWO ? _mm512_add_epi32(ps_q4_times254(_mm512_add_epi32(h0, h1)), _mm512_add_epi32(l0, l1))
                                  : _mm512_add_epi32(_mm512_add_epi32(h0, h1), _mm512_add_epi32(l0, l1));
            f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s),
                                   _mm512_mul_ps(d, _mm512_set1_ps(ad[r * nb + b] * (TWO ? 1.0f / 254 : 1.0f))), f[r]);
            f[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(asum[r * nb + b]), f[r]);
        }
    }
    for (int r = 0; r < MB; ++r) _mm512_storeu_ps(acc + r * 16, f[r]);
}

/* x [M, K] (float32, or bfloat16 when bf16) with row stride ldx; out [M, N] in x's dtype, row stride
 * ldo; sym: scales hold d alone (m = -8 d). Needs N % 16 == 0, G % 32 == 0, K % G == 0 (the launcher checks).
 * Returns 1 when the workspace cannot be allocated. */
static int64_t ps_q_linear(const void *x, const uint8_t *w, const uint16_t *scales, void *out, int64_t M, int64_t N,
                           int64_t K, int64_t G, int64_t ldx, int64_t ldo, int bf16, int nthreads, const int W8,
                           const int sym, const int two) {
    const int64_t nb = K / PS_Q4_AB, ntiles = N / 16;
    int8_t *aq = malloc((size_t)(2 * M * K) + (size_t)(2 * M * nb) * sizeof(float));
    if (!aq) return 1;
    int8_t *hi = aq, *lo = aq + M * K;
    float *ad = (float *)(aq + 2 * M * K), *asum = ad + M * nb;
    const size_t xsize = bf16 ? 2 : 4;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; ++r)
            ps_q4_quantize_row((const char *)x + r * ldx * xsize, bf16, K, hi + r * K, lo + r * K, ad + r * nb,
                               asum + r * nb, two);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < ntiles; ++t) {
            const uint8_t *wt = w + t * (W8 ? 16 : 8) * K;
            const uint16_t *st = scales + t * (K / G) * (sym ? 16 : 32);
            float acc[PS_Q4_MB * 16];
            for (int64_t m0 = 0; m0 < M; m0 += PS_Q4_MB) {
                const int mb = M - m0 < PS_Q4_MB ? (int)(M - m0) : PS_Q4_MB;
                const int8_t *a = hi + m0 * K, *l = lo + m0 * K;
                const float *sd = ad + m0 * nb, *ss = asum + m0 * nb;
/* constant MB, SYM and TWO: accumulators in registers, no branch in the loop */
#define PS_Q4_TILE2(MB_, SYM_) (two ? ps_q4_tile(a, l, sd, ss, K, wt, st, G, acc, MB_, W8, SYM_, 1) \
                                    : ps_q4_tile(a, l, sd, ss, K, wt, st, G, acc, MB_, W8, SYM_, 0))
#define PS_Q4_TILE(MB_) (sym ? PS_Q4_TILE2(MB_, 1) : PS_Q4_TILE2(MB_, 0))
                switch (mb) {
                case 1: PS_Q4_TILE(1); break;
                case 2: PS_Q4_TILE(2); break;
                case 3: PS_Q4_TILE(3); break;
                case 4: PS_Q4_TILE(4); break;
                case 5: PS_Q4_TILE(5); break;
                case 6: PS_Q4_TILE(6); break;
                case 7: PS_Q4_TILE(7); break;
                default: PS_Q4_TILE(8); break;
                }
#undef PS_Q4_TILE
#undef PS_Q4_TILE2
                for (int r = 0; r < mb; ++r) {
                    const __m512 v = _mm512_loadu_ps(acc + r * 16);
                    if (bf16)
                        ps_store16_bf16((uint16_t *)out + (m0 + r) * ldo + t * 16, v, 0xffff);
                    else
                        _mm512_storeu_ps((float *)out + (m0 + r) * ldo + t * 16, v);
                }
            }
        }
    }
    free(aq);
    return 0;
}

#define PS_Q_LINEAR 1
#elif defined(PS_AVX2) && defined(__F16C__)
/* AVX2 without VNNI (AMD Zen 3): the same layout, activation digits and sums, with vpdpbusd's 4-byte dot
 * products as vpmaddubsw (u8 x s8 -> s16 pairs: |15 * 127 * 2| < 2^15, never saturating) then vpmaddwd
 * against ones (-> s32), as llama.cpp does on AVX2. A 16-column tile goes as two halves of 8 columns, up to 4
 * rows a pass (16 ymm registers). Why: torch's int4 kernel ran SmolLM2's 30 layers at 9.5 ms a decode step
 * on a 2-core AMD EPYC Zen 3 (53 MB of int4 weights: 5.6 GB/s) and the served model decoded 40 tokens/s
 * against llama.cpp's 69-74 on the same GGUF. */
#define PS_Q4_MB2 4
#include <immintrin.h>
#include <stdlib.h>

static inline float ps_q4_x(const void *x, int64_t i, int bf16) {
    return bf16 ? ps_bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* ps_q4_quantize_row of the AVX-512 path, one value at a time (rintf: round to nearest even). */
static void ps_q4_quantize_row(const void *x, int bf16, int64_t K, int8_t *hi, int8_t *lo, float *ad, float *asum,
                               const int two) {
    for (int64_t b = 0; b < K / PS_Q4_AB; ++b) {
        float amax = 0.0f;
        for (int i = 0; i < PS_Q4_AB; ++i) amax = fmaxf(amax, fabsf(ps_q4_x(x, b * PS_Q4_AB + i, bf16)));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t qs = 0;
        for (int i = 0; i < PS_Q4_AB; ++i) {
            const float xs = ps_q4_x(x, b * PS_Q4_AB + i, bf16) * inv;
            const float qh = rintf(xs), ql = two ? rintf((xs - qh) * 254.0f) : 0.0f;
            hi[b * PS_Q4_AB + i] = (int8_t)qh;
            if (two) lo[b * PS_Q4_AB + i] = (int8_t)ql;
            qs += two ? 254 * (int32_t)qh + (int32_t)ql : (int32_t)qh;
        }
        ad[b] = amax / 127.0f;
        asum[b] = (two ? ad[b] / 254.0f : ad[b]) * (float)qs;
    }
}

/* 8 columns (half ``h`` of a 16-column tile) for MB rows. */
static inline __attribute__((always_inline)) void ps_q4_half(const int8_t *restrict hi, const int8_t *restrict lo,
                                                             const float *restrict ad, const float *restrict asum,
                                                             const int64_t K, const uint8_t *restrict wt,
                                                             const uint16_t *restrict st, const int64_t G,
                                                             float *restrict acc, const int h, const int MB,
                                                             const int W8, const int SYM, const int TWO) {
    const int64_t nb = K / PS_Q4_AB;
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    __m256 f[PS_Q4_MB2];
    for (int r = 0; r < MB; ++r) f[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint16_t *sg = st + (b * PS_Q4_AB / G) * (SYM ? 16 : 32) + 8 * h;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sg));
        const __m256 m = SYM ? _mm256_mul_ps(d, _mm256_set1_ps(-8.0f))
                             : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sg + 16)));
        __m256i ih[PS_Q4_MB2], il[PS_Q4_MB2];
        for (int r = 0; r < MB; ++r) ih[r] = il[r] = _mm256_setzero_si256();
        if (W8) { /* bytes q + 128: as s8 (q in [-127, 127]), |q| against the activation given q's sign */
            for (int o = 0; o < 8; ++o) {
                const uint8_t *src = wt + (b * 8 + o) * 64 + 32 * h;
                _mm_prefetch((const char *)(src + 2 * PS_Q4_PF), _MM_HINT_T0);
                const __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)src), flip);
                const __m256i qa = _mm256_abs_epi8(q);
                for (int r = 0; r < MB; ++r) {
                    const int32_t *ah = (const int32_t *)(hi + r * K + b * PS_Q4_AB);
                    const int32_t *al = (const int32_t *)(lo + r * K + b * PS_Q4_AB);
                    ih[r] = _mm256_add_epi32(ih[r], _mm256_madd_epi16(
                        _mm256_maddubs_epi16(qa, _mm256_sign_epi8(_mm256_set1_epi32(ah[o]), q)), ones));
                    if (!TWO) continue;
                    il[r] = _mm256_add_epi32(il[r], _mm256_madd_epi16(
                        _mm256_maddubs_epi16(qa, _mm256_sign_epi8(_mm256_set1_epi32(al[o]), q)), ones));
                }
            }
        } else for (int o = 0; o < 4; ++o) {
            const uint8_t *src = wt + (b * 4 + o) * 64 + 32 * h;
            _mm_prefetch((const char *)(src + PS_Q4_PF), _MM_HINT_T0);
            const __m256i raw = _mm256_loadu_si256((const __m256i *)src);
            const __m256i w0 = _mm256_and_si256(raw, low), w1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            for (int r = 0; r < MB; ++r) {
                const int32_t *ah = (const int32_t *)(hi + r * K + b * PS_Q4_AB);
                const int32_t *al = (const int32_t *)(lo + r * K + b * PS_Q4_AB);
                ih[r] = _mm256_add_epi32(ih[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w0, _mm256_set1_epi32(ah[2 * o])), ones));
                ih[r] = _mm256_add_epi32(ih[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w1, _mm256_set1_epi32(ah[2 * o + 1])), ones));
                if (!TWO) continue;
                il[r] = _mm256_add_epi32(il[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w0, _mm256_set1_epi32(al[2 * o])), ones));
                il[r] = _mm256_add_epi32(il[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w1, _mm256_set1_epi32(al[2 * o + 1])), ones));
            }
        }
        for (int r = 0; r < MB; ++r) {
            const __m256i s = TWO ? _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(ih[r], 8), _mm256_slli_epi32(ih[r], 1)),
                                                     il[r])
                                  : ih[r];
            f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s),
                                   _mm256_mul_ps(d, _mm256_set1_ps(ad[r * nb + b] * (TWO ? 1.0f / 254 : 1.0f))), f[r]);
            if (!W8) f[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(asum[r * nb + b]), f[r]); /* W8: q - 128 took m = -128 d */
        }
    }
    for (int r = 0; r < MB; ++r) _mm256_storeu_ps(acc + r * 16 + 8 * h, f[r]);
}

static int64_t ps_q_linear(const void *x, const uint8_t *w, const uint16_t *scales, void *out, int64_t M, int64_t N,
                           int64_t K, int64_t G, int64_t ldx, int64_t ldo, int bf16, int nthreads, const int W8,
                           const int sym, const int two) {
    const int64_t nb = K / PS_Q4_AB, ntiles = N / 16;
    int8_t *aq = malloc((size_t)(2 * M * K) + (size_t)(2 * M * nb) * sizeof(float));
    if (!aq) return 1;
    int8_t *hi = aq, *lo = aq + M * K;
    float *ad = (float *)(aq + 2 * M * K), *asum = ad + M * nb;
    const size_t xsize = bf16 ? 2 : 4;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; ++r)
            ps_q4_quantize_row((const char *)x + r * ldx * xsize, bf16, K, hi + r * K, lo + r * K, ad + r * nb,
                               asum + r * nb, two);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < ntiles; ++t) {
            const uint8_t *wt = w + t * (W8 ? 16 : 8) * K;
            const uint16_t *st = scales + t * (K / G) * (sym ? 16 : 32);
            float acc[PS_Q4_MB2 * 16];
            for (int64_t m0 = 0; m0 < M; m0 += PS_Q4_MB2) {
                const int mb = M - m0 < PS_Q4_MB2 ? (int)(M - m0) : PS_Q4_MB2;
                const int8_t *a = hi + m0 * K, *l = lo + m0 * K;
                const float *sd = ad + m0 * nb, *ss = asum + m0 * nb;
/* constant MB and SYM: accumulators in registers */
#define PS_Q4_HALF2(MB_, SYM_) (two ? ps_q4_half(a, l, sd, ss, K, wt, st, G, acc, h, MB_, W8, SYM_, 1) \
                                    : ps_q4_half(a, l, sd, ss, K, wt, st, G, acc, h, MB_, W8, SYM_, 0))
#define PS_Q4_HALF(MB_) (sym ? PS_Q4_HALF2(MB_, 1) : PS_Q4_HALF2(MB_, 0))
                for (int h = 0; h < 2; ++h) {
                    switch (mb) {
                    case 1: PS_Q4_HALF(1); break;
                    case 2: PS_Q4_HALF(2); break;
                    case 3: PS_Q4_HALF(3); break;
                    default: PS_Q4_HALF(4); break;
                    }
                }
#undef PS_Q4_HALF
#undef PS_Q4_HALF2
                for (int r = 0; r < mb; ++r)
                    for (int c = 0; c < 16; ++c) {
                        const float v = acc[r * 16 + c];
                        if (bf16)
                            ((uint16_t *)out)[(m0 + r) * ldo + t * 16 + c] = ps_f32_to_bf16(v);
                        else
                            ((float *)out)[(m0 + r) * ldo + t * 16 + c] = v;
                    }
            }
        }
    }
    free(aq);
    return 0;
}

#define PS_Q_LINEAR 1
#endif

#ifdef PS_Q_LINEAR
int64_t ps_int4_linear(const void *x, const uint8_t *w, const uint16_t *scales, void *out, int64_t M, int64_t N,
                       int64_t K, int64_t G, int64_t ldx, int64_t ldo, int bf16, int nthreads, int sym, int two) {
    return ps_q_linear(x, w, scales, out, M, N, K, G, ldx, ldo, bf16, nthreads, 0, sym, two);
}

/* The same with 8-bit weights q in [0, 255] (w = q * d + m: an int8 table as q + 128, m = -128 d), laid out
 * [N/16][K/4][16 columns][4 bytes] (byte i of column c at k-quad o: q[c, 4o + i]). Why: the int8 LM head of
 * the shipped SmolLM2 (49,152 x 576) took 2.4 ms a decode step through torch's _weight_int8pack_mm or the
 * bfloat16 table on a 2-core AMD EPYC Zen 4, where its 28 MB read at 34 GB/s takes 0.8.
 *
 * On AVX2, vpmaddubsw wants one unsigned operand and its pairs of products within
 * int16, so the weight goes in as |q| and the activation takes q's sign (llama.cpp's Q8 dot):
 * 2 * 127 * 127 < 2^15. Why: on a 2-core AMD EPYC Zen 3 SmolLM2's head (49,152 x 576) took 4.8 ms a decode
 * step as the bfloat16 table (56 MB) and 10.5 through torch's int8 kernel. */
int64_t ps_int8_linear(const void *x, const uint8_t *w, const uint16_t *scales, void *out, int64_t M, int64_t N,
                       int64_t K, int64_t G, int64_t ldx, int64_t ldo, int bf16, int nthreads, int two) {
    return ps_q_linear(x, w, scales, out, M, N, K, G, ldx, ldo, bf16, nthreads, 1, 0, two);
}

int64_t ps_int4_linear_available(void) { return 1; }
int64_t ps_int8_linear_available(void) { return 1; }
#else /* neither AVX512-VNNI nor AVX2: the launchers keep torch's int4 / int8 kernels */
int64_t ps_int4_linear(const void *x, const uint8_t *w, const uint16_t *scales, void *out, int64_t M, int64_t N,
                       int64_t K, int64_t G, int64_t ldx, int64_t ldo, int bf16, int nthreads, int sym, int two) {
    (void)x; (void)w; (void)scales; (void)out; (void)M; (void)N; (void)K; (void)G; (void)ldx; (void)ldo;
    (void)bf16; (void)nthreads; (void)sym; (void)two;
    return 2;
}
int64_t ps_int8_linear(const void *x, const uint8_t *w, const uint16_t *scales, void *out, int64_t M, int64_t N,
                       int64_t K, int64_t G, int64_t ldx, int64_t ldo, int bf16, int nthreads, int two) {
    (void)x; (void)w; (void)scales; (void)out; (void)M; (void)N; (void)K; (void)G; (void)ldx; (void)ldo;
    (void)bf16; (void)nthreads; (void)two;
    return 2;
}
int64_t ps_int4_linear_available(void) { return 0; }
int64_t ps_int8_linear_available(void) { return 0; }
#endif

/* ---------------------------------------------------------------------------------------------
 * The packed int4 weight (layout above) back to float32, or bfloat16 (bf16: rounded to nearest even),
 * out[N, K] = q * d + m, for a prefill's rows multiplied by a GEMM instead of the int4 kernel
 * (kernels/quant_linear.py: where measured faster: on CPUs whose int8 products go through AVX2's vpmaddubsw,
 * and for bfloat16 activations where oneDNN multiplies bfloat16 on AMX tiles). Tiles of 16 columns over the
 * threads; returns 0. Portable C, and an AVX-512 path: SmolLM2's 3072 x 576 to bfloat16 0.17 ms, where the
 * portable loop then torch's conversion took 0.98 (a third of the 2,048-row bfloat16 GEMM it feeds; 2-core Intel
 * Xeon with AMX, family 6 model 167).
 */
static inline float ps_f16_to_f32(uint16_t h) {
    const uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
    float v;
    if (e == 0) {
        v = ldexpf((float)m, -24); /* zero or subnormal */
    } else if (e == 31) {
        v = m ? NAN : INFINITY;
    } else {
        const uint32_t bits = ((e + 112) << 23) | (m << 13);
        memcpy(&v, &bits, sizeof v);
    }
    return (h & 0x8000) ? -v : v;
}

static void ps_dequantize_tile(const uint8_t *wt, const uint16_t *st, void *out, int64_t t, int64_t K, int64_t G,
                               int sym, int bf16) {
    const int64_t ng = K / G, per = sym ? 16 : 32;
    for (int64_t c = 0; c < 16; ++c) {
        const int64_t r = (t * 16 + c) * K;
        for (int64_t g = 0; g < ng; ++g) {
            const float d = ps_f16_to_f32(st[g * per + c]);
            const float m = sym ? -8.0f * d : ps_f16_to_f32(st[g * per + 16 + c]);
            for (int64_t o = g * G / 8; o < (g + 1) * G / 8; ++o) {
                const uint8_t *b = wt + (o * 16 + c) * 4;
                for (int i = 0; i < 8; ++i) {
                    const float v = (float)(i < 4 ? b[i] & 0x0f : b[i - 4] >> 4) * d + m;
                    if (bf16)
                        ((uint16_t *)out)[r + 8 * o + i] = ps_f32_to_bf16(v);
                    else
                        ((float *)out)[r + 8 * o + i] = v;
                }
            }
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__F16C__)
/* One 64-byte load is an octet of k for the tile's 16 columns (4 bytes each): its 16-byte quarter J widens to 16
 * floats whose 128-bit lane q is column 4J + q's k 8o..8o+3 (low nibbles) or 8o+4..8o+7 (high), so each column's
 * eight values leave as two 128-bit (float32) or one 128-bit (bfloat16) store. */
#define PS_DQ_QUARTER(J)                                                                                          \
    do {                                                                                                          \
        const __m512 vl = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(lo, J))), \
                                          dj[J], mj[J]);                                                          \
        const __m512 vh = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(hi, J))), \
                                          dj[J], mj[J]);                                                          \
        const int64_t r0 = (t * 16 + 4 * J) * K + 8 * o;                                                          \
        if (bf16) {                                                                                               \
            const __m256i bl = _mm512_cvtepi32_epi16(ps_bf16_bits16(vl));                                         \
            const __m256i bh = _mm512_cvtepi32_epi16(ps_bf16_bits16(vh));                                         \
            const __m256i u0 = _mm256_unpacklo_epi64(bl, bh), u1 = _mm256_unpackhi_epi64(bl, bh);                 \
            uint16_t *ob = (uint16_t *)out + r0;                                                                  \
            _mm_storeu_si128((__m128i *)ob, _mm256_castsi256_si128(u0));                                         \
            _mm_storeu_si128((__m128i *)(ob + K), _mm256_castsi256_si128(u1));                                   \
            _mm_storeu_si128((__m128i *)(ob + 2 * K), _mm256_extracti128_si256(u0, 1));                          \
            _mm_storeu_si128((__m128i *)(ob + 3 * K), _mm256_extracti128_si256(u1, 1));                          \
        } else {                                                                                                  \
            float *of = (float *)out + r0;                                                                        \
            _mm_storeu_ps(of, _mm512_castps512_ps128(vl));                                                        \
            _mm_storeu_ps(of + 4, _mm512_castps512_ps128(vh));                                                    \
            _mm_storeu_ps(of + K, _mm512_extractf32x4_ps(vl, 1));                                                 \
            _mm_storeu_ps(of + K + 4, _mm512_extractf32x4_ps(vh, 1));                                             \
            _mm_storeu_ps(of + 2 * K, _mm512_extractf32x4_ps(vl, 2));                                             \
            _mm_storeu_ps(of + 2 * K + 4, _mm512_extractf32x4_ps(vh, 2));                                         \
            _mm_storeu_ps(of + 3 * K, _mm512_extractf32x4_ps(vl, 3));                                             \
            _mm_storeu_ps(of + 3 * K + 4, _mm512_extractf32x4_ps(vh, 3));                                         \
        }                                                                                                         \
    } while (0)

static void ps_dequantize_tile16(const uint8_t *wt, const uint16_t *st, void *out, int64_t t, int64_t K, int64_t G,
                                 int sym, int bf16) {
    const int64_t ng = K / G, per = sym ? 16 : 32;
    const __m512i low = _mm512_set1_epi8(0x0f);
    const __m512i quad = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2);
    for (int64_t g = 0; g < ng; ++g) {
        const __m512 d16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + g * per)));
        const __m512 m16 = sym ? _mm512_mul_ps(d16, _mm512_set1_ps(-8.0f))
                               : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + g * per + 16)));
        __m512 dj[4], mj[4]; /* element e of quarter J: column 4J + e / 4 */
        for (int j = 0; j < 4; ++j) {
            const __m512i idx = _mm512_add_epi32(quad, _mm512_set1_epi32(4 * j));
            dj[j] = _mm512_permutexvar_ps(idx, d16);
            mj[j] = _mm512_permutexvar_ps(idx, m16);
        }
        for (int64_t o = g * G / 8; o < (g + 1) * G / 8; ++o) {
            const __m512i raw = _mm512_loadu_si512(wt + o * 64);
            const __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            PS_DQ_QUARTER(0);
            PS_DQ_QUARTER(1);
            PS_DQ_QUARTER(2);
            PS_DQ_QUARTER(3);
        }
    }
}
#undef PS_DQ_QUARTER
#define PS_DQ_TILE ps_dequantize_tile16
#else
#define PS_DQ_TILE ps_dequantize_tile
#endif

int64_t ps_int4_dequantize(const uint8_t *w, const uint16_t *scales, void *out, int64_t N, int64_t K, int64_t G,
                           int sym, int bf16, int nthreads) {
    const int64_t ng = K / G, per = sym ? 16 : 32;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < N / 16; ++t) PS_DQ_TILE(w + t * 8 * K, scales + t * ng * per, out, t, K, G, sym, bf16);
    return 0;
}
