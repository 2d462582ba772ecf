/* The fp8 KV cache on CPU (kernels/kv_quant.py): store_kv quantizing K and V to float8 e4m3, and decode
 * attention reading them. The query, the new K / V and the output stay in the model dtype (float32 or
 * bfloat16); the math is float32.
 *
 *     store:   byte = e4m3(clamp(x / scale, -448, 448))            (torch's rounding, bit for bit)
 *     decode:  k = e4m3_value(byte) * k_scale, v likewise; then paged_attention_decode.c's online softmax
 *
 * Why C: the decode is bound by reading the pool, and fp8 reads a quarter of float32's bytes; widening a
 * block to float32 in torch first would read it, write it 4x larger and read it again. The items are
 * paged_attention_decode.c's per-(sequence, KV head) items with the K / V loads replaced: 16 (AVX-512) or 8
 * (AVX2 + F16C) bytes become float16 bits (sign to bit 15, the 7 exponent-and-mantissa bits to bits 13..7:
 * value * 2^-8 for normals and subnormals alike) and vcvtph2ps widens them; 2^8 and the scales fold into
 * the query's scale and the output's. Shared prefixes are not attended once per group here (the model-dtype
 * decode's flash items): each sequence reads its blocks itself, a quarter of float32's bytes.
 */
#include "decode_tile.h"
#include "ps_cpu.h"

/* float32 -> e4m3 bits of clamp(x, -448, 448), round to nearest even: torch's conversion (c10's
 * fp8e4m3fn_from_fp32_value), so the pool holds the bytes the torch reference writes. Below 2^-6 (e4m3's
 * smallest normal) adding 2^14 lets the float add round the subnormal's 3 bits in place. */
static inline uint8_t ps_e4m3_bits(float x) {
    x = x < -448.0f ? -448.0f : (x > 448.0f ? 448.0f : x);
    uint32_t u, ua;
    memcpy(&u, &x, 4);
    const float a = fabsf(x) + 16384.0f;
    memcpy(&ua, &a, 4);
    const uint32_t sign = (u >> 24) & 0x80u, mag = u & 0x7fffffffu;
    const uint32_t sub = (ua - (141u << 23)) & 0xffu;
    const uint32_t norm = ((mag - (120u << 23) + 0x7ffffu + ((mag >> 20) & 1u)) >> 20) & 0xffu;
    const uint32_t bits = mag > 0x7f800000u ? 0x7fu : (mag < (121u << 23) ? sub : norm); /* NaN: 0x7f as torch */
    return (uint8_t)(bits | sign);
}

/* e4m3 bits -> value * 2^-8, exactly (NaN bits read as 480 * 2^-8, as the vector loads below read them). */
static inline float ps_e4m3_scaled(uint8_t b) {
    const uint32_t e = (b >> 3) & 15u, m = b & 7u;
    union { uint32_t u; float f; } v;
    if (e) v.u = ((e + 112u) << 23) | (m << 20); /* 2^(e - 7 - 8) (1 + m / 8) */
    else v.f = (float)m * (1.0f / 131072.0f);     /* m 2^-9 2^-8 */
    v.u |= (uint32_t)(b & 0x80u) << 24;
    return v.f;
}

/* ---------------------------------------------------------------------------------------------
 * store_kv: each new token's K and V row (n = Hkv * D elements, contiguous) quantized into its slot
 * (slot < 0: padding, skipped). Every slot is checked first: one outside [-inf, nslots) writes nothing and
 * returns 1. Strides: k_st / v_st in elements of the inputs, kc_ss / vc_ss in bytes of the cache. */
#define PS_DEFINE_STORE_FP8(NAME, T, TO_F32)                                                          \
    int64_t NAME(const T *k, const T *v, uint8_t *kc, uint8_t *vc, const int64_t *slots, int64_t T_, int64_t n, \
                 int64_t k_st, int64_t v_st, int64_t kc_ss, int64_t vc_ss, int64_t nslots, float k_scale,       \
                 float v_scale) {                                                                     \
        for (int64_t t = 0; t < T_; ++t)                                                              \
            if (slots[t] >= nslots) return 1;                                                         \
        for (int64_t t = 0; t < T_; ++t) {                                                            \
            const int64_t s = slots[t];                                                               \
            if (s < 0) continue;                                                                      \
            const T *kr = k + t * k_st, *vr = v + t * v_st;                                           \
            uint8_t *kd = kc + s * kc_ss, *vd = vc + s * vc_ss;                                       \
            for (int64_t i = 0; i < n; ++i) kd[i] = ps_e4m3_bits(TO_F32(kr[i]) / k_scale);            \
            for (int64_t i = 0; i < n; ++i) vd[i] = ps_e4m3_bits(TO_F32(vr[i]) / v_scale);            \
        }                                                                                             \
        return 0;                                                                                     \
    }

static inline float ps_f32_id(float x) { return x; }
PS_DEFINE_STORE_FP8(ps_store_kv_fp8_f32, float, ps_f32_id)
PS_DEFINE_STORE_FP8(ps_store_kv_fp8_bf16, uint16_t, ps_bf16_to_f32)

/* ---------------------------------------------------------------------------------------------
 * Decode items: one (sequence, KV head), its G query heads together, as in paged_attention_decode.c.
 * qk = softmax scale * k_scale * 2^8 multiplies the query; vm = v_scale * 2^8 the output. */
#define PS_FP8_ITEM_PARAMS(T)                                                                         \
    const T *restrict q, const uint8_t *restrict kc, const uint8_t *restrict vc, const int32_t *restrict bt_row, \
        const int64_t len, const int64_t start, T *restrict out, const int64_t G, const int64_t D,   \
        const int64_t BS, const int64_t q_sh, const int64_t k_sb, const int64_t k_ss, const int64_t v_sb, \
        const int64_t v_ss, const int64_t o_sh, const float qk, const float vm

/* The next block's K and V rows (D bytes each) into L2 while this one is worked on. */
static inline __attribute__((always_inline)) void ps_fp8_prefetch(const uint8_t *k, const uint8_t *v, int64_t BS,
                                                                   int64_t k_ss, int64_t v_ss, int64_t D) {
    for (int64_t t = 0; t < BS; ++t)
        for (int64_t c = 0; c < D; c += 64) {
            __builtin_prefetch(k + t * k_ss + c, 0, 2);
            __builtin_prefetch(v + t * v_ss + c, 0, 2);
        }
}

/* Portable (any head_dim): rows widened one value at a time. */
#define PS_DEFINE_FP8_ITEM(NAME, T, LOAD, STORE)                                                      \
    static inline __attribute__((always_inline)) void NAME(PS_FP8_ITEM_PARAMS(T)) {                  \
        float qs[PS_MAX_G * PS_MAX_D], acc[PS_MAX_G * PS_MAX_D], row[PS_MAX_D];                      \
        float s[PS_MAX_G * PS_MAX_BS], m[PS_MAX_G], l[PS_MAX_G];                                     \
        for (int64_t g = 0; g < G; ++g) {                                                            \
            LOAD(q + g * q_sh, qs + g * D, D);                                                       \
            for (int64_t d = 0; d < D; ++d) qs[g * D + d] *= qk;                                     \
            for (int64_t d = 0; d < D; ++d) acc[g * D + d] = 0.0f;                                   \
            m[g] = -INFINITY;                                                                        \
            l[g] = 0.0f;                                                                             \
        }                                                                                            \
        const int64_t nblk = len > 0 ? (len + BS - 1) / BS : 0;                                      \
        for (int64_t j = start / BS; j < nblk; ++j) {                                                \
            const uint8_t *kb = kc + (int64_t)bt_row[j] * k_sb, *vb = vc + (int64_t)bt_row[j] * v_sb; \
            const int64_t n = len - j * BS < BS ? len - j * BS : BS;                                 \
            const int64_t t_lo = start > j * BS ? start - j * BS : 0; /* a window starts inside */   \
            for (int64_t t = t_lo; t < n; ++t) {                                                     \
                for (int64_t d = 0; d < D; ++d) row[d] = ps_e4m3_scaled(kb[t * k_ss + d]);           \
                for (int64_t g = 0; g < G; ++g) {                                                    \
                    float dot = 0.0f;                                                                \
                    for (int64_t d = 0; d < D; ++d) dot += qs[g * D + d] * row[d];                   \
                    s[g * PS_MAX_BS + t] = dot;                                                      \
                }                                                                                    \
            }                                                                                        \
            for (int64_t g = 0; g < G; ++g) {                                                        \
                float *sg = s + g * PS_MAX_BS, mx = m[g], sum = 0.0f;                                \
                for (int64_t t = t_lo; t < n; ++t) mx = sg[t] > mx ? sg[t] : mx;                     \
                const float alpha = ps_exp(m[g] - mx);                                               \
                for (int64_t t = t_lo; t < n; ++t) {                                                 \
                    sg[t] = ps_exp(sg[t] - mx);                                                      \
                    sum += sg[t];                                                                    \
                }                                                                                    \
                l[g] = l[g] * alpha + sum;                                                           \
                m[g] = mx;                                                                           \
                for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= alpha;                             \
            }                                                                                        \
            for (int64_t t = t_lo; t < n; ++t) {                                                     \
                for (int64_t d = 0; d < D; ++d) row[d] = ps_e4m3_scaled(vb[t * v_ss + d]);           \
                for (int64_t g = 0; g < G; ++g) {                                                    \
                    const float p = s[g * PS_MAX_BS + t];                                            \
                    for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p * row[d];                    \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        for (int64_t g = 0; g < G; ++g) {                                                            \
            const float inv = l[g] > 0.0f ? vm / l[g] : 0.0f; /* len 0: a zero row */               \
            for (int64_t d = 0; d < D; ++d) STORE(out + g * o_sh + d, acc[g * D + d] * inv);         \
        }                                                                                            \
    }

PS_DEFINE_FP8_ITEM(ps_fp8_item_f32, float, ps_load_f32, ps_store_f32)
PS_DEFINE_FP8_ITEM(ps_fp8_item_bf16, uint16_t, ps_load_bf16, ps_store_bf16)

#ifdef PS_AVX512
/* 16 e4m3 bytes -> 16 floats, value * 2^-8 each (see the file comment). */
static inline __m512 ps_load16_e4m3(const uint8_t *p) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi16(b, 8), _mm256_set1_epi16((short)0x8000));
    const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7);
    return _mm512_cvtph_ps(_mm256_or_si256(sign, rest));
}

#define PS_FP8_LOADQ_F32(p) _mm512_loadu_ps(p)
#define PS_FP8_LOADQ_BF16(p) ps_load16_bf16((p), (__mmask16)0xffff)
#define PS_FP8_STOREV_F32(p, v) _mm512_storeu_ps((p), (v))
#define PS_FP8_STOREV_BF16(p, v) ps_store16_bf16((p), (v), (__mmask16)0xffff)

/* head_dim a multiple of 16: tiles of up to 16 tokens, a tile's partial dots reduced by ps_hsum16
 * (paged_attention_decode.c's AVX-512 item, its K and V rows read from e4m3 bytes). */
#define PS_DEFINE_FP8_ITEM_AVX(NAME, T, LOADQ, STOREV)                                                \
    static inline __attribute__((always_inline)) void NAME(PS_FP8_ITEM_PARAMS(T)) {                  \
        const int64_t DV = D / 16;                                                                   \
        __m512 qs[PS_MAX_G * PS_MAX_D / 16], acc[PS_MAX_G * PS_MAX_D / 16], kv[PS_MAX_D / 16];      \
        __m512 part[PS_MAX_G][16];                                                                   \
        float p[PS_MAX_G][16] __attribute__((aligned(64))), m[PS_MAX_G], l[PS_MAX_G];               \
        for (int64_t g = 0; g < G; ++g) {                                                            \
            for (int64_t v = 0; v < DV; ++v) {                                                       \
                qs[g * DV + v] = _mm512_mul_ps(LOADQ(q + g * q_sh + 16 * v), _mm512_set1_ps(qk));    \
                acc[g * DV + v] = _mm512_setzero_ps();                                               \
            }                                                                                        \
            m[g] = -INFINITY;                                                                        \
            l[g] = 0.0f;                                                                             \
        }                                                                                            \
        const int64_t nblk = len > 0 ? (len + BS - 1) / BS : 0;                                      \
        for (int64_t j = start / BS; j < nblk; ++j) {                                                \
            const uint8_t *kb = kc + (int64_t)bt_row[j] * k_sb, *vb = vc + (int64_t)bt_row[j] * v_sb; \
            const int64_t n = len - j * BS < BS ? len - j * BS : BS;                                 \
            if (j + 1 < nblk)                                                                        \
                ps_fp8_prefetch(kc + (int64_t)bt_row[j + 1] * k_sb, vc + (int64_t)bt_row[j + 1] * v_sb, BS, k_ss, \
                                v_ss, D);                                                            \
            for (int64_t t0 = 0; t0 < n; t0 += 16) {                                                 \
                const int64_t nt = n - t0 < 16 ? n - t0 : 16;                                        \
                const __mmask16 valid = ps_tile_valid(nt, start - j * BS - t0);                      \
                if (!valid) continue; /* wholly before the window */                                 \
                for (int64_t t = 0; t < 16; ++t) {                                                   \
                    for (int64_t v = 0; v < DV; ++v)                                                 \
                        kv[v] = t < nt ? ps_load16_e4m3(kb + (t0 + t) * k_ss + 16 * v) : _mm512_setzero_ps(); \
                    for (int64_t g = 0; g < G; ++g) {                                                \
                        __m512 dot = _mm512_mul_ps(qs[g * DV], kv[0]);                               \
                        for (int64_t v = 1; v < DV; ++v) dot = _mm512_fmadd_ps(qs[g * DV + v], kv[v], dot); \
                        part[g][PS_PERM[t]] = dot;                                                   \
                    }                                                                                \
                }                                                                                    \
                for (int64_t g = 0; g < G; ++g) {                                                    \
                    const __m512 sc = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), ps_hsum16(part[g])); \
                    const float mx = fmaxf(m[g], _mm512_reduce_max_ps(sc));                          \
                    const float alpha = ps_exp(m[g] - mx); /* m = -inf at first: exp -> 0 */         \
                    const __m512 e = _mm512_maskz_mov_ps(valid, ps_exp16(_mm512_sub_ps(sc, _mm512_set1_ps(mx)))); \
                    l[g] = l[g] * alpha + _mm512_reduce_add_ps(e);                                   \
                    m[g] = mx;                                                                       \
                    _mm512_store_ps(p[g], e);                                                        \
                    for (int64_t v = 0; v < DV; ++v)                                                 \
                        acc[g * DV + v] = _mm512_mul_ps(acc[g * DV + v], _mm512_set1_ps(alpha));     \
                }                                                                                    \
                for (int64_t t = 0; t < nt; ++t) {                                                   \
                    for (int64_t v = 0; v < DV; ++v) kv[v] = ps_load16_e4m3(vb + (t0 + t) * v_ss + 16 * v); \
                    for (int64_t g = 0; g < G; ++g) {                                                \
                        const __m512 pg = _mm512_set1_ps(p[g][t]);                                   \
                        for (int64_t v = 0; v < DV; ++v)                                             \
                            acc[g * DV + v] = _mm512_fmadd_ps(pg, kv[v], acc[g * DV + v]);           \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        for (int64_t g = 0; g < G; ++g) {                                                            \
            const __m512 inv = _mm512_set1_ps(l[g] > 0.0f ? vm / l[g] : 0.0f); /* len 0: zeros */   \
            for (int64_t v = 0; v < DV; ++v) STOREV(out + g * o_sh + 16 * v, _mm512_mul_ps(acc[g * DV + v], inv)); \
        }                                                                                            \
    }

PS_DEFINE_FP8_ITEM_AVX(ps_fp8_item_avx_f32, float, PS_FP8_LOADQ_F32, PS_FP8_STOREV_F32)
PS_DEFINE_FP8_ITEM_AVX(ps_fp8_item_avx_bf16, uint16_t, PS_FP8_LOADQ_BF16, PS_FP8_STOREV_BF16)
#define PS_FP8_LANES 16
#elif defined(PS_AVX2) && defined(__F16C__)
/* 8 e4m3 bytes -> 8 floats, value * 2^-8 each. */
static inline __m256 ps_load8_e4m3(const uint8_t *p) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i sign = _mm_and_si128(_mm_slli_epi16(b, 8), _mm_set1_epi16((short)0x8000));
    const __m128i rest = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7);
    return _mm256_cvtph_ps(_mm_or_si128(sign, rest));
}

#define PS_FP8_LOADQ8_F32(p) _mm256_loadu_ps(p)
#define PS_FP8_LOADQ8_BF16(p) ps_load8_bf16(p)

/* head_dim a multiple of 8: paged_attention_decode.c's AVX2 item (tiles of 8 tokens, ps_hsum8), its K and V
 * rows read from e4m3 bytes. */
#define PS_DEFINE_FP8_ITEM_AVX2(NAME, T, LOADQ, STORE)                                                \
    static inline __attribute__((always_inline)) void NAME(PS_FP8_ITEM_PARAMS(T)) {                  \
        const int64_t DV = D / 8;                                                                    \
        __m256 qs[PS_MAX_G * PS_MAX_D / 8], acc[PS_MAX_G * PS_MAX_D / 8], kv[PS_MAX_D / 8];         \
        __m256 part[PS_MAX_G][8];                                                                    \
        float p[PS_MAX_G][8] __attribute__((aligned(32))), m[PS_MAX_G], l[PS_MAX_G];                \
        const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);                              \
        for (int64_t g = 0; g < G; ++g) {                                                            \
            for (int64_t v = 0; v < DV; ++v) {                                                       \
                qs[g * DV + v] = _mm256_mul_ps(LOADQ(q + g * q_sh + 8 * v), _mm256_set1_ps(qk));     \
                acc[g * DV + v] = _mm256_setzero_ps();                                               \
            }                                                                                        \
            m[g] = -INFINITY;                                                                        \
            l[g] = 0.0f;                                                                             \
        }                                                                                            \
        const int64_t nblk = len > 0 ? (len + BS - 1) / BS : 0;                                      \
        for (int64_t j = start / BS; j < nblk; ++j) {                                                \
            const uint8_t *kb = kc + (int64_t)bt_row[j] * k_sb, *vb = vc + (int64_t)bt_row[j] * v_sb; \
            const int64_t n = len - j * BS < BS ? len - j * BS : BS;                                 \
            if (j + 1 < nblk)                                                                        \
                ps_fp8_prefetch(kc + (int64_t)bt_row[j + 1] * k_sb, vc + (int64_t)bt_row[j + 1] * v_sb, BS, k_ss, \
                                v_ss, D);                                                            \
            for (int64_t t0 = 0; t0 < n; t0 += 8) {                                                  \
                const int64_t nt = n - t0 < 8 ? n - t0 : 8;                                          \
                const int64_t skip = start - j * BS - t0;                                            \
                if (skip >= nt) continue; /* wholly before the window */                             \
                const __m256 valid = _mm256_castsi256_ps(_mm256_and_si256(                            \
                    _mm256_cmpgt_epi32(_mm256_set1_epi32((int)nt), iota),                            \
                    _mm256_cmpgt_epi32(iota, _mm256_set1_epi32((int)(skip > 0 ? skip : 0) - 1))));    \
                for (int64_t t = 0; t < 8; ++t) {                                                    \
                    for (int64_t v = 0; v < DV; ++v)                                                 \
                        kv[v] = t < nt ? ps_load8_e4m3(kb + (t0 + t) * k_ss + 8 * v) : _mm256_setzero_ps(); \
                    for (int64_t g = 0; g < G; ++g) {                                                \
                        __m256 dot = _mm256_mul_ps(qs[g * DV], kv[0]);                               \
                        for (int64_t v = 1; v < DV; ++v) dot = _mm256_fmadd_ps(qs[g * DV + v], kv[v], dot); \
                        part[g][t] = dot;                                                            \
                    }                                                                                \
                }                                                                                    \
                for (int64_t g = 0; g < G; ++g) {                                                    \
                    const __m256 sc = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), ps_hsum8(part[g]), valid); \
                    const float mx = fmaxf(m[g], ps_hmax8(sc));                                      \
                    const float alpha = ps_exp(m[g] - mx);                                           \
                    const __m256 e = _mm256_and_ps(valid, ps_exp8(_mm256_sub_ps(sc, _mm256_set1_ps(mx)))); \
                    l[g] = l[g] * alpha + ps_hadd8(e);                                               \
                    m[g] = mx;                                                                       \
                    _mm256_store_ps(p[g], e);                                                        \
                    for (int64_t v = 0; v < DV; ++v)                                                 \
                        acc[g * DV + v] = _mm256_mul_ps(acc[g * DV + v], _mm256_set1_ps(alpha));     \
                }                                                                                    \
                for (int64_t t = 0; t < nt; ++t) {                                                   \
                    for (int64_t v = 0; v < DV; ++v) kv[v] = ps_load8_e4m3(vb + (t0 + t) * v_ss + 8 * v); \
                    for (int64_t g = 0; g < G; ++g) {                                                \
                        const __m256 pg = _mm256_set1_ps(p[g][t]);                                   \
                        for (int64_t v = 0; v < DV; ++v)                                             \
                            acc[g * DV + v] = _mm256_fmadd_ps(pg, kv[v], acc[g * DV + v]);           \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        for (int64_t g = 0; g < G; ++g) {                                                            \
            const __m256 inv = _mm256_set1_ps(l[g] > 0.0f ? vm / l[g] : 0.0f);                       \
            float o[8] __attribute__((aligned(32)));                                                 \
            for (int64_t v = 0; v < DV; ++v) {                                                       \
                _mm256_store_ps(o, _mm256_mul_ps(acc[g * DV + v], inv));                             \
                for (int i = 0; i < 8; ++i) STORE(out + g * o_sh + 8 * v + i, o[i]);                 \
            }                                                                                        \
        }                                                                                            \
    }

PS_DEFINE_FP8_ITEM_AVX2(ps_fp8_item_avx_f32, float, PS_FP8_LOADQ8_F32, ps_store_f32)
PS_DEFINE_FP8_ITEM_AVX2(ps_fp8_item_avx_bf16, uint16_t, PS_FP8_LOADQ8_BF16, ps_store_bf16)
#define PS_FP8_LANES 8
#endif

/* One item through the best copy: the vector item (specialised for SmolLM2's head_dim 64 / block 16 with
 * 1-4 query heads per KV head, and for head_dim 128) where head_dim is a multiple of its lanes. */
#define PS_FP8_ARGS(G_, D_, BS_) \
    qw, kw, vw, btw, lens[b], start, ow, G_, D_, BS_, q_sh, k_sb, k_ss, v_sb, v_ss, o_sh, qk, vm
#ifdef PS_FP8_LANES
#define PS_FP8_DISPATCH(ITEM, AVX_ITEM)                                                              \
    if (D == 64 && BS == 16 && G == 3) AVX_ITEM(PS_FP8_ARGS(3, 64, 16));                          \
    else if (D == 64 && BS == 16 && G == 4) AVX_ITEM(PS_FP8_ARGS(4, 64, 16));                     \
    else if (D == 64 && BS == 16 && G == 1) AVX_ITEM(PS_FP8_ARGS(1, 64, 16));                     \
    else if (D == 64 && BS == 16 && G == 2) AVX_ITEM(PS_FP8_ARGS(2, 64, 16));                     \
    else if (D == 128 && BS == 16) AVX_ITEM(PS_FP8_ARGS(G, 128, 16));                             \
    else if (D % PS_FP8_LANES == 0) AVX_ITEM(PS_FP8_ARGS(G, D, BS));                              \
    else ITEM(PS_FP8_ARGS(G, D, BS));
#else
#define PS_FP8_DISPATCH(ITEM, AVX_ITEM)                                                              \
    if (D == 64 && BS == 16) ITEM(PS_FP8_ARGS(G, 64, 16));                                        \
    else ITEM(PS_FP8_ARGS(G, D, BS));
#define ps_fp8_item_avx_f32 ps_fp8_item_f32
#define ps_fp8_item_avx_bf16 ps_fp8_item_bf16
#endif

/* The entry point: the arguments of ps_paged_decode_* (strides of the cache in bytes = elements) less the
 * scratch, plus k_scale and v_scale. Returns 1, computing nothing, when a block id is outside the pool. */
#define PS_DEFINE_DECODE_FP8(NAME, ITEM, AVX_ITEM, T)                                                 \
    int64_t NAME(const T *q, const uint8_t *kc, const uint8_t *vc, const int32_t *bt, const int32_t *lens, T *out, \
                 int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS, int64_t bt_stride, int64_t NB,      \
                 int64_t q_sb, int64_t q_sh, int64_t k_sb, int64_t k_ss, int64_t k_sh, int64_t v_sb, int64_t v_ss, \
                 int64_t v_sh, int64_t o_sb, int64_t o_sh, float scale, float k_scale, float v_scale,          \
                 int64_t window, int nthreads) {                                                      \
        if (ps_bad_block_ids(bt, lens, B, BS, bt_stride, NB)) return 1;                              \
        const int64_t G = Hq / Hkv;                                                                  \
        const float qk = scale * k_scale * 256.0f, vm = v_scale * 256.0f;                            \
        _Pragma("omp parallel for num_threads(nthreads) schedule(dynamic, 1)")                       \
        for (int64_t w = 0; w < B * Hkv; ++w) {                                                      \
            const int64_t b = w / Hkv, h = w % Hkv;                                                  \
            const T *qw = q + b * q_sb + h * G * q_sh;                                               \
            const uint8_t *kw = kc + h * k_sh, *vw = vc + h * v_sh;                                  \
            const int32_t *btw = bt + b * bt_stride;                                                 \
            T *ow = out + b * o_sb + h * G * o_sh;                                                   \
            const int64_t start = window > 0 && lens[b] > window ? lens[b] - window : 0;             \
            PS_FP8_DISPATCH(ITEM, AVX_ITEM)                                                          \
        }                                                                                            \
        return 0;                                                                                    \
    }

PS_DEFINE_DECODE_FP8(ps_paged_decode_fp8_f32, ps_fp8_item_f32, ps_fp8_item_avx_f32, float)
PS_DEFINE_DECODE_FP8(ps_paged_decode_fp8_bf16, ps_fp8_item_bf16, ps_fp8_item_avx_bf16, uint16_t)
