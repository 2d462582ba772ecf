/* The decode items' 16-token tiles with AVX-512 (paged_attention_decode.c, kv_fp8.c): which lanes of a tile
 * are read, and the transpose-and-add tree that reduces a tile's 16 partial dot products at once (see
 * paged_attention_decode.c's AVX-512 item for the plan: token t's partial goes in slot PS_PERM[t]). */
#ifndef PS_DECODE_TILE_H
#define PS_DECODE_TILE_H

#include "ps_cpu.h"

/* The items' limits (the launchers check them: native.max_group, max_head_dim, max_block_size). */
#define PS_MAX_G 16
#define PS_MAX_D 256
#define PS_MAX_BS 128

#ifdef PS_AVX512
static const int PS_PERM[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

/* The lanes of a tile of nt tokens (nt <= 16) that are read: those < nt, less the first skip (tokens before
 * a sliding window's start; skip <= 0: none). */
static inline __mmask16 ps_tile_valid(const int64_t nt, const int64_t skip) {
    return (__mmask16)((nt == 16 ? 0xffffu : (1u << nt) - 1u) & (skip <= 0 ? 0xffffu : skip >= 16 ? 0u : ~((1u << skip) - 1u)));
}

static inline __m512 ps_hsum16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i) /* 256-bit halves */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[i], a[i + 8], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; ++i) /* 128-bit quarters */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[i], b[i + 4], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; ++i) /* pairs within 128-bit lanes */
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[i], c[i + 2], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(c[i], c[i + 2], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

#endif
