#include <stdlib.h>

#include "elementwise.h"

/* ---------------------------------------------------------------------------------------------
 * bfloat16 linear on AMX tiles, reading the lanes layout of lanes_linear.c: out[M, N] = x[M, K] @ w[N, K]^T
 * (+ bias), and the gated form (gate_up + SiLU-and-multiply), for any M.
 *
 * Why: decoding 2-64 sequences reads every weight once per step, so a step costs the weight read if the
 * multiply keeps up with memory. On AMX CPUs vdpbf16ps (lanes_linear.c) does not: it issues every second
 * cycle on the 2-core Xeons measured here, so 8 rows took 2x the weight read and 64 rows 5x. oneDNN's AMX
 * GEMM does keep up in arithmetic but does not overlap it with the weight stream: at 64 rows it took 7.8 ms
 * a Llama-3.2-1B layer against 4.7 ms for reading the weights (2-core Xeon, family 6 model 167). One tile
 * multiply here is 16 rows x 16 columns x 32 products; per 32 k a block of 32 columns is 2 KiB of weights
 * and 2-4 multiplies, so the tiles outrun the memory at every row count and the kernel streams the weights.
 *
 * The lanes layout needs no copy of its own: a bfloat16 block of 32 columns stores, for each pair of k,
 * 32 columns x 2 values (128 bytes), which for 16 pairs and the block's first (second) 16 columns is
 * exactly an AMX B tile of 16 rows x 64 bytes at a stride of 128 bytes:
 *
 *     B0 = tile(wb + j0 * 64,      stride 128 B)   columns n0 .. n0+15, k pairs j0 .. j0+15
 *     B1 = tile(wb + j0 * 64 + 32, stride 128 B)   columns n0+16 .. n0+31
 *     A  = tile(x + m0 * ldx + k0, stride ldx * 2 B) 16 rows x 32 k of x, read where they lie
 *     C[r][h] += A_r B_h                             tiles 0-3: 2 row blocks x 2 column halves
 *
 * Rows go in passes of 32 (two A tiles; C tiles sized to the pass's rows, the tile configuration loaded
 * again only when a pass has fewer rows than the last); a block's later passes read its weights from L2
 * (K x 64 bytes: 512 KiB at K = 8,192). Blocks of 32 columns go to the threads in contiguous ranges, and
 * each thread prefetches its weights PS_AMX_PF bytes ahead of the tile loads; with several passes a block, the
 * next block's weights instead, to L2, a share each k-step of each pass (Llama-3.2-1B's 16 layers streamed from
 * memory, family 6 model 167: 256 / 512 / 2,048 rows 311 / 624 / 2,463 -> 282 / 577 / 2,312 ms, 64 rows a
 * tie). More rows than PS_AMX_CHUNK bytes of A tiles hold (256 at K = 2,048) go in chunks, each a sweep over
 * the blocks, so the A tiles stay in L2 (without: 2,048 rows on one 2,048 x 2,048 weight re-read 8 MiB of them
 * per block, 38 ms on one thread against 19 with the chunks). Past K = 2,048, more than one pass of rows goes in
 * slices of 2,048 k, each slice's sweep adding to the sums the last one kept (a chunk stays 256 rows:
 * Llama-3.2-1B's down projection at 2,048 rows 51-57 -> 46 ms, 512 rows 11.3-11.5 -> 8.7-8.9; oneDNN 38-40 and
 * 11.0; family 6 model 167). A K that is not a multiple of 32 (no whole A tiles) goes to lanes_linear.c on the same
 * layout.
 *
 * The A tiles are read from x where it lies (a tile load's stride is x's row stride). An earlier version first copied
 * x into tile order, into a buffer malloc'd per call (mmap'd and faulted in page by page above 128 KiB): the copy and
 * the faults were a third of a prefill call (SmolLM2's 576 x 576 at 512 / 2,048 rows 234 / 1,026 -> 162 / 688 us,
 * Llama-3.2-1B's 2,048 x 2,048 at 2,048 rows 9.3 -> 8.1 ms; decode rows unchanged), while tile loads from x, 16 rows
 * K x 2 bytes apart, ran as fast as from the copy (one thread, A in L2: 47.5 vs 45.4 ns a step at K = 576, 56.8 vs
 * 56.0 at K = 2,048; family 6 model 167).
 *
 * A pass's sums go out (bias, rounding, and the gated form's SiLU, an exp and a division a row) during the thread's
 * next pass, a few rows between its k-steps, so the vector units work while the tiles multiply; written straight
 * after their pass, they stalled the tiles: SmolLM2's gate_up + SiLU-and-multiply at 512 rows 1.39 -> 0.90 ms (the
 * SiLU alone had been a third of it), at 64 rows 186 -> 136 us, 576 x 576 at 512 rows 162 -> 144 us (family 6
 * model 167).
 *
 * Measured (2-core Intel Xeon, family 6 model 207, AMX; weights streamed from memory, bfloat16, time per
 * step against oneDNN's packed AMX GEMM; results/intel-f6m207-amx/packed_linear_amx*.json): SmolLM2's 30
 * layers 9.5 / 13.9 / 12.6 / 28.4 / 192 ms at 1 / 8 / 16 / 64 / 1,088 rows against 20.4 / 14.7 / 16.5 / 28.5 /
 * 352; Llama-3.2-1B's 16 layers 67 / 76 / 135 / 1,291 ms at 1 / 16 / 64 / 512 rows against 81 / 97 / 134 / 864
 * (interleaved reruns on 2-16 layers put 512 rows at 1.04-1.15x oneDNN's: this VM wanders). One row streams
 * at the memory's rate; from 32 rows the tile multiplies bound it, as they bound oneDNN (~700 GFLOP/s here
 * on weights that stream). Which form takes which rows is measured per shape at bind (kernels/cpu/choices.py).
 *
 * The sums run in float32 with the tiles' own rounding (bfloat16 products exact, float32 adds; AMX treats
 * bfloat16 denormals as 0), rounded once to bfloat16 at the end, so results differ from vdpbf16ps's by
 * float32 rounding only. The gated form's block holds 16 gate and the same 16 up columns
 * (linear.pack_lanes_gated): C[r][0] is the gate, C[r][1] the up, and the epilogue is lanes_linear.c's. */
#if defined(PS_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx_tiles.h"

#define PS_AMX_PASS 32      /* rows per pass: two A tiles */
#define PS_AMX_PF 4096      /* bytes of weights prefetched ahead (two steps of 32 k) */

#define PS_AMX_CHUNK (1 << 20) /* bytes of A tiles a chunk of rows holds */
#define PS_AMX_KSLICE 2048     /* k a sweep takes at most when rows need more than one pass: partial sums kept */

static inline int64_t ps_min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t ps_max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Tile rows for a pass of `rows` rows (1..32): C 0-1 and A 4 the first block's, C 2-3 and A 5 the
 * second's (16 when unused: any valid shape), B 6-7 16 pairs. */
static inline void ps_amx_configure_pass(int64_t rows) {
    const uint8_t r0 = (uint8_t)ps_min64(rows, 16), r1 = rows > 16 ? (uint8_t)(rows - 16) : 16;
    const uint8_t cfg[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
    ps_amx_configure_rows(cfg);
}

/* A finished pass's sums (ps_amx_keep's layout) and where they go: out's columns n0 .. n0 + ncols of its rows. */
typedef struct {
    float c[2][2][16][16]; /* [row block][column half][row][column] */
    int64_t rows, ncols;
    const uint16_t *bias; /* at column n0, or NULL */
    uint16_t *out;        /* row 0, column n0 */
} ps_amx_done;

/* Rows m_lo .. m_hi of a finished pass to out (row stride ldo), bias added and rounded once; gated: silu(gate) *
 * up as lanes_linear.c's epilogue (width 16, up bias `up` apart). */
static inline void ps_amx_finish(const ps_amx_done *d, int64_t m_lo, int64_t m_hi, int64_t ldo, int gated,
                                 int64_t up) {
    const uint16_t *bias = d->bias;
    const int64_t ncols = d->ncols;
    if (gated) {
        const __mmask16 lo = ncols >= 16 ? 0xffff : (__mmask16)((1u << ncols) - 1u);
        const __m512 bg = bias ? ps_load16_bf16(bias, lo) : _mm512_setzero_ps();
        const __m512 bu = bias ? ps_load16_bf16(bias + up, lo) : _mm512_setzero_ps();
        for (int64_t m = m_lo; m < m_hi; ++m) {
            const __m512 g = ps_round16_bf16(_mm512_add_ps(_mm512_load_ps(d->c[m / 16][0][m % 16]), bg));
            const __m512 u = ps_round16_bf16(_mm512_add_ps(_mm512_load_ps(d->c[m / 16][1][m % 16]), bu));
            ps_store16_bf16(d->out + m * ldo, _mm512_mul_ps(ps_round16_bf16(ps_silu16(g)), u), lo);
        }
        return;
    }
    const __mmask16 lo = ncols >= 16 ? 0xffff : (__mmask16)((1u << ncols) - 1u);
    const __mmask16 hi = ncols >= 32 ? 0xffff : ncols <= 16 ? 0 : (__mmask16)((1u << (ncols - 16)) - 1u);
    const __m512 b0 = bias ? ps_load16_bf16(bias, lo) : _mm512_setzero_ps();
    const __m512 b1 = bias ? ps_load16_bf16(bias + 16, hi) : _mm512_setzero_ps();
    for (int64_t m = m_lo; m < m_hi; ++m) {
        const __m512 v0 = _mm512_add_ps(_mm512_load_ps(d->c[m / 16][0][m % 16]), b0);
        const __m512 v1 = _mm512_add_ps(_mm512_load_ps(d->c[m / 16][1][m % 16]), b1);
        _mm256_mask_storeu_epi16(d->out + m * ldo, lo, (__m256i)_mm512_cvtneps_pbh(v0));
        _mm256_mask_storeu_epi16(d->out + m * ldo + 16, hi, (__m256i)_mm512_cvtneps_pbh(v1));
    }
}

/* C[r][h] for one block and one pass over k_lo .. k_hi: the pass's rows of x at xa (row stride lda), weights wb (the
 * block), pf: the thread's prefetch cursor (NULL on a later pass of the block: its weights are in L2 by then), pf_end
 * its range's end; part: the sums of the k before k_lo (ps_amx_keep's layout), NULL to start from zero; next: this
 * pass's part of the next block's weights, fetched to L2 `share` bytes a k-step (NULL: none); prev: the thread's
 * last finished pass, whose rows go to out a few between k-steps (the vector units round them, add biases and
 * apply SiLU while the tiles multiply), all of them by the end (NULL: none). */
static inline void ps_amx_block_pass(const uint16_t *xa, int64_t lda, int64_t rows, const uint16_t *wb, int64_t k_lo,
                                     int64_t k_hi, const char *pf, const char *pf_end, const float *part,
                                     const char *next, int64_t share, const ps_amx_done *prev, int64_t ldo, int gated,
                                     int64_t up) {
    const int64_t steps = (k_hi - k_lo) / 32, per_step = prev ? (prev->rows + steps - 1) / steps : 0;
    int64_t finished = 0; /* prev's rows written */
    if (part) {
        _tile_loadd(0, part, 64);
        _tile_loadd(1, part + 256, 64);
        _tile_loadd(2, part + 512, 64);
        _tile_loadd(3, part + 768, 64);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    const int two = rows > 16;
    for (int64_t k0 = k_lo; k0 < k_hi; k0 += 32) {
        const uint16_t *w = wb + k0 * 32; /* pair row k0 / 2, 64 elements each */
        if (pf) {
            const char *p = pf + k0 * 64;
            if (p + 2048 <= pf_end)
                for (int i = 0; i < 2048; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
        }
        if (next) {
            const char *p = next + (k0 - k_lo) / 32 * share;
            for (int64_t i = 0; i < share; i += 64) _mm_prefetch(p + i, _MM_HINT_T1);
        }
        _tile_loadd(6, w, 128);
        _tile_loadd(7, w + 32, 128);
        const uint16_t *a = xa + k0; /* step k0 / 32: rows 0-15, then 16-31, x 32 k */
        _tile_loadd(4, a, lda * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, a + 16 * lda, lda * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        if (finished < (prev ? prev->rows : 0)) {
            const int64_t m_hi = ps_min64(prev->rows, finished + per_step);
            ps_amx_finish(prev, finished, m_hi, ldo, gated, up);
            finished = m_hi;
        }
    }
    if (prev && finished < prev->rows) ps_amx_finish(prev, finished, prev->rows, ldo, gated, up);
}

/* The pass's partial sums to part: [row block][column half][16 rows][16 columns] float32, as ps_amx_done's c. */
static inline void ps_amx_keep(float *part) {
    _tile_stored(0, part, 64);
    _tile_stored(1, part + 256, 64);
    _tile_stored(2, part + 512, 64);
    _tile_stored(3, part + 768, 64);
}

void ps_lanes_linear_bf16(const uint16_t *x, const uint16_t *lanes, const uint16_t *bias, uint16_t *out, int64_t M,
                          int64_t N, int64_t K, int64_t ldx, int64_t ldo, int nthreads);
void ps_lanes_linear_bf16_gated(const uint16_t *x, const uint16_t *lanes, const uint16_t *bias, uint16_t *out,
                                int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldo, int nthreads);

static void ps_amx_linear(const uint16_t *x, const uint16_t *lanes, const uint16_t *bias, uint16_t *out, int64_t M,
                          int64_t N, int64_t K, int64_t ldx, int64_t ldo, int nthreads, int gated) {
    const int64_t width = gated ? 16 : 32; /* output columns a block gives */
    const int64_t nblocks = (N + width - 1) / width, block = K * 32; /* elements per block */
    const int64_t passes = (M + PS_AMX_PASS - 1) / PS_AMX_PASS;
    /* k a sweep takes, and the rows whose A tiles of that k stay in L2 while a thread sweeps its blocks (PS_AMX_CHUNK
     * bytes of them). Why slices: unsliced, a chunk at K = 8,192 was 64 rows, and every 64 rows streamed the whole
     * weight again (2,048 rows of Llama-3.2-1B's down projection: 32 reads of its 32 MiB, 56 ms against oneDNN's
     * 40 on a 2-core Intel Xeon, family 6 model 167); sliced at 2,048 a chunk is 256 rows, and each (pass, block)
     * keeps its sums between slices (4 KiB, ps_amx_keep). */
    const int64_t ks = M > PS_AMX_PASS ? ps_min64(K, PS_AMX_KSLICE) : K; /* one pass reuses nothing: unsliced */
    const int64_t chunk = ps_max64(PS_AMX_PASS, PS_AMX_CHUNK / (2 * ks) / PS_AMX_PASS * PS_AMX_PASS);
    const int64_t kept = ps_min64(chunk, passes * PS_AMX_PASS) / PS_AMX_PASS * nblocks; /* (pass, block) sums */
    float *parts = K > ks && K % 32 == 0 ? malloc((size_t)(kept * 1024) * sizeof(float)) : NULL;
    if (K % 32 || (K > ks && !parts)) { /* no whole A tiles, or no memory: the same layout through vdpbf16ps */
        (gated ? ps_lanes_linear_bf16_gated : ps_lanes_linear_bf16)(x, lanes, bias, out, M, N, K, ldx, ldo, nthreads);
        return;
    }
#pragma omp parallel num_threads(nthreads)
    {
        int64_t configured = -1; /* the rows the tiles are configured for */
        /* the last finished pass, written out during the next one (no rows before the first) */
        ps_amx_done done __attribute__((aligned(64))) = {.rows = 0};
        for (int64_t c0 = 0; c0 < M; c0 += chunk) {
            const int64_t c1 = ps_min64(M, c0 + chunk);
            for (int64_t k_lo = 0; k_lo < K; k_lo += ks) {
                const int64_t k_hi = ps_min64(K, k_lo + ks);
                /* the same blocks to each thread in every chunk and slice: no barrier needed between them */
#pragma omp for schedule(static) nowait
                for (int64_t b = 0; b < nblocks; ++b) {
                    const uint16_t *wb = lanes + b * block;
                    const int64_t n0 = b * width, ncols = ps_min64(N - n0, width);
                    const char *pf = (const char *)wb + PS_AMX_PF, *pf_end = (const char *)(lanes + nblocks * block);
                    /* Several passes: the next block's weights (this slice's) are fetched to L2 while these passes
                     * multiply, a share of them each k-step, so the stream and the tiles overlap */
                    const int64_t npass = (c1 - c0 + PS_AMX_PASS - 1) / PS_AMX_PASS;
                    const int64_t share = npass > 1 ? (2048 / npass + 63) / 64 * 64 : 0;
                    const char *next = share && b + 1 < nblocks ? (const char *)(wb + block + k_lo * 32) : NULL;
                    for (int64_t m0 = c0; m0 < c1; m0 += PS_AMX_PASS) {
                        const int64_t rows = ps_min64(c1 - m0, PS_AMX_PASS), p = (m0 - c0) / PS_AMX_PASS;
                        float *part = parts ? parts + (p * nblocks + b) * 1024 : NULL;
                        if (rows != configured) {
                            ps_amx_configure_pass(rows);
                            configured = rows;
                        }
                        const int last = k_hi == K; /* the pass's sums are complete */
                        ps_amx_block_pass(x + m0 * ldx, ldx, rows, wb, k_lo, k_hi, m0 == c0 && !next ? pf : NULL,
                                          pf_end, k_lo ? part : NULL,
                                          next ? next + p * (k_hi - k_lo) / 32 * share : NULL, share,
                                          last ? &done : NULL, ldo, gated, N);
                        if (!last) {
                            ps_amx_keep(part);
                            continue;
                        }
                        ps_amx_keep(&done.c[0][0][0][0]);
                        done.rows = rows, done.ncols = ncols, done.out = out + m0 * ldo + n0;
                        done.bias = bias ? bias + n0 : NULL;
                    }
                }
            }
        }
        ps_amx_finish(&done, 0, done.rows, ldo, gated, N);
        if (configured >= 0) _tile_release();
    }
    free(parts);
}

void ps_amx_linear_bf16(const uint16_t *x, const uint16_t *lanes, const uint16_t *bias, uint16_t *out, int64_t M,
                        int64_t N, int64_t K, int64_t ldx, int64_t ldo, int nthreads) {
    ps_amx_linear(x, lanes, bias, out, M, N, K, ldx, ldo, nthreads, 0);
}

void ps_amx_linear_bf16_gated(const uint16_t *x, const uint16_t *lanes, const uint16_t *bias, uint16_t *out,
                              int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldo, int nthreads) {
    ps_amx_linear(x, lanes, bias, out, M, N, K, ldx, ldo, nthreads, 1);
}

/* Built with AMX and granted by the OS. */
int64_t ps_amx_linear_available(void) { return ps_amx_permitted(); }
#else
void ps_amx_linear_bf16(const uint16_t *x, const uint16_t *lanes, const uint16_t *bias, uint16_t *out, int64_t M,
                        int64_t N, int64_t K, int64_t ldx, int64_t ldo, int nthreads) {
    (void)x; (void)lanes; (void)bias; (void)out; (void)M; (void)N; (void)K; (void)ldx; (void)ldo; (void)nthreads;
}
void ps_amx_linear_bf16_gated(const uint16_t *x, const uint16_t *lanes, const uint16_t *bias, uint16_t *out,
                              int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldo, int nthreads) {
    ps_amx_linear_bf16(x, lanes, bias, out, M, N, K, ldx, ldo, nthreads);
}
int64_t ps_amx_linear_available(void) { return 0; }
#endif
