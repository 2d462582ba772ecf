/* Shared by the fused elementwise ops of the decoder layer on CPU: RMSNorm (with the residual add before it),
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
#ifndef PS_ELEMENTWISE_H
#define PS_ELEMENTWISE_H
#include "ps_cpu.h"

#define PS_PAR_MIN 16384 /* elements below which one thread does the whole op (fork/join costs ~us) */

#define PS_F32_IN(p) (p)
#define PS_F32_OUT(x) (x)
#define PS_F32_R(x) (x)
#define PS_BF16_IN(p) ps_bf16_to_f32(p)
#define PS_BF16_OUT(x) ps_f32_to_bf16(x)
#define PS_BF16_R(x) ps_bf16_to_f32(ps_f32_to_bf16(x))

#ifdef PS_AVX512
/* silu(a) = a / (1 + exp(-a)), as torch computes it, 16 lanes (silu_mul.c; lanes_linear.c's fused gate_up). */
static inline __m512 ps_silu16(__m512 a) {
    return _mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.0f), ps_exp16(_mm512_sub_ps(_mm512_setzero_ps(), a))));
}
#endif

#endif
