"""Compile every Triton kernel ahead of time for an H100 (sm_90) without a GPU.

Run as a script in a process WITHOUT TRITON_INTERPRET (the interpreter replaces triton's
stdlib). Catches what the interpreter cannot: type errors in loop-carried values, constexpr
specialization (e.g. an int argument equal to 1), unsupported ops, shared-memory overflow.
Prints one line per kernel and exits non-zero on any failure.

    python kernels_aot_check.py            # bf16: every kernel/variant; fp32: the IEEE-dot kernels
    python kernels_aot_check.py --full     # every kernel/variant for bf16, fp16 and fp32 (~2 min cold)
"""

import os
import sys
import traceback

assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run without TRITON_INTERPRET"

import triton  # noqa: E402
import triton.language  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from kernels import copy_blocks, paged_attention_decode, paged_attention_prefill, store_kv  # noqa: E402
from kernels.online_softmax_triton import bind_into  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
H100_SMEM = 227 * 1024
failures = 0


def check(name, fn, types, consts):
    global failures
    fn.__globals__["tl"] = triton.language  # what kernels._common.lazy_jit does at first launch
    bind_into(fn)  # and the shared online-softmax tile the attention kernels call
    jf = JITFunction(fn)
    signature = {n: ("constexpr" if n in consts else types(n)) for n in jf.arg_names}
    try:
        k = triton.compile(ASTSource(jf, signature, consts), target=TARGET)
        smem = k.metadata.shared
        if smem > H100_SMEM:
            raise RuntimeError(f"needs {smem} bytes of shared memory")
        print(f"OK   {name} (shared {smem} B)")
    except Exception:
        failures += 1
        print(f"FAIL {name}")
        traceback.print_exc()


def typer(dt, index_ptrs=(), i64_ptrs=(), f32_ptrs=(), floats=()):
    def types(n):
        if n in i64_ptrs:
            return "*i64"
        if n in index_ptrs:
            return "*i32"
        if n in f32_ptrs:
            return "*fp32"
        if n.endswith("_ptr"):
            return f"*{dt}"
        return "fp32" if n in floats else "i32"

    return types


FULL = "--full" in sys.argv
FLOATS = ("qk_scale", "softcap_log2")
PLAIN = {"WINDOWED": False, "SOFTCAP": False}
MASKED = {"WINDOWED": True, "SOFTCAP": True}  # sliding window and soft cap (kernels/masked_attention.py)
for dt in ["bf16", "fp16", "fp32"] if FULL else ["bf16", "fp32"]:
    ieee = dt == "fp32"
    if dt == "fp32" and not FULL:  # only what differs from bf16: the IEEE fp32 dots
        dec_types = typer(dt, index_ptrs=("bt_ptr", "seq_lens_ptr"),
                          f32_ptrs=("part_m_ptr", "part_l_ptr", "part_acc_ptr"), floats=FLOATS)
        check(f"decode {dt}", paged_attention_decode._decode_kernel, dec_types,
              {"BLOCK_G": 16, "BLOCK_D": 64, "BLOCK_N": 64, "NUM_SPLITS": 1, "IEEE": True, "UPCAST": False, **PLAIN})
        check(f"prefill {dt} G=4", paged_attention_prefill._prefill_kernel,
              typer(dt, index_ptrs=("bt_ptr", "seq_lens_ptr", "qsl_ptr"), floats=FLOATS),
              {"BLOCK_Q": 16, "BLOCK_G": 4, "BLOCK_M": 64, "BLOCK_D": 128, "BLOCK_N": 64, "IEEE": True,
               "UPCAST": False, **PLAIN})
        continue
    check(f"store_kv {dt}", store_kv._store_kv_kernel, typer(dt, i64_ptrs=("slot_ptr",)),
          {"BLOCK_H": 8, "BLOCK_D": 128})
    dec_types = typer(dt, index_ptrs=("bt_ptr", "seq_lens_ptr"),
                      f32_ptrs=("part_m_ptr", "part_l_ptr", "part_acc_ptr"), floats=FLOATS)
    for splits in (1, 4):
        for masks in (PLAIN, MASKED):
            check(f"decode {dt} splits={splits} {masks}", paged_attention_decode._decode_kernel, dec_types,
                  {"BLOCK_G": 16, "BLOCK_D": 128, "BLOCK_N": 64, "NUM_SPLITS": splits, "IEEE": ieee, "UPCAST": False,
                   **masks})
    check(f"decode-reduce {dt}", paged_attention_decode._decode_reduce_kernel, dec_types,
          {"BLOCK_G": 16, "BLOCK_D": 128, "NUM_SPLITS": 4})
    pre_types = typer(dt, index_ptrs=("bt_ptr", "seq_lens_ptr", "qsl_ptr"), floats=FLOATS)
    for g in (1, 4, 8):
        for masks in (PLAIN, MASKED):
            check(f"prefill {dt} G={g} {masks}", paged_attention_prefill._prefill_kernel, pre_types,
                  {"BLOCK_Q": 64 // g, "BLOCK_G": g, "BLOCK_M": 64, "BLOCK_D": 128, "BLOCK_N": 64, "IEEE": ieee,
                   "UPCAST": False, **masks})
    # triton specializes int arguments equal to 1 into constexprs
    check(f"prefill {dt} num_seqs=1", paged_attention_prefill._prefill_kernel, pre_types,
          {"num_seqs": 1, "queries_per_kv": 1, "BLOCK_Q": 64, "BLOCK_G": 1, "BLOCK_M": 64, "BLOCK_D": 64,
           "BLOCK_N": 64, "IEEE": ieee, "UPCAST": False, **PLAIN})
    check(f"copy_blocks {dt}", copy_blocks._copy_blocks_kernel, typer(dt, i64_ptrs=("mapping_ptr",)),
          {"BLOCK": 4096})

# The elementwise ops of the CUDA op set (kernels/elementwise_triton.py)
from kernels import elementwise_triton  # noqa: E402

for dt in ["bf16", "fp16", "fp32"] if FULL else ["bf16", "fp32"]:
    for residual in (False, True):
        check(f"add_rms_norm {dt} residual={residual}", elementwise_triton._add_rms_norm_kernel,
              typer(dt, floats=("eps",)), {"HAS_RESIDUAL": residual, "BLOCK": 4096})
    check(f"silu_mul {dt}", elementwise_triton._silu_mul_kernel, typer(dt), {"BLOCK": 1024})
    check(f"rope {dt}", elementwise_triton._rope_kernel, typer(dt), {"BLOCK_H": 64, "BLOCK_D": 64})

sys.exit(1 if failures else 0)
