"""Build and load the CPU C kernels (kernels/cpu/csrc/*.c) at first use, through ctypes.

The shared library is compiled once per source, compiler and CPU (``-march=native``) into
``$XDG_CACHE_HOME/prefixserve/kernels/<hash>/`` (``~/.cache`` by default) and reused after that;
compiling takes about a second. Nothing here is needed for correctness: when no C compiler is
found, the build fails, or ``PREFIXSERVE_NATIVE_KERNELS=0`` is set, :func:`native_kernels`
returns None and callers keep the torch path (a warning says why, once).

One source file per op under csrc/: paged_attention_decode.c, paged_attention_prefill.c, store_kv.c,
kv_fp8.c (store_kv and decode attention with an fp8 e4m3 KV cache, kernels/kv_quant.py),
linear.c (float32 / bfloat16 for a few rows: decode of beams, samples and small batches),
int4_linear.c (weight-only int4 and the int8 LM head's 8-bit tiles with int8 activations, AVX512-VNNI or AVX2), and the
decoder layer's fused elementwise ops add_rms_norm.c, silu_mul.c, rope.c (their shared rounding
macros in elementwise.h). All sources (and the shared header ps_cpu.h) build into one library.

Entry points are called through a small generated CPython extension where Python's headers are found
(fastcall.py: ctypes' per-argument conversion was ~0.27 us an argument), else through ctypes.

Links against OpenMP by soname (``libgomp.so.1``): torch's own copy is already loaded in the
process, so the dynamic linker binds to it and torch and these kernels share one thread pool.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .fastcall import fast_calls

import torch

logger = logging.getLogger(__name__)

# The dtypes the C kernels are built for, and their names' suffix.
DTYPE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(CSRC / f"{op}.c" for op in ("paged_attention_decode", "paged_attention_prefill", "store_kv", "linear",
                                             "add_rms_norm", "silu_mul", "rope", "int4_linear", "top_p", "lanes_linear",
                                             "kv_fp8", "amx_linear"))
HEADERS = (CSRC / "ps_cpu.h", CSRC / "elementwise.h", CSRC / "flash_item.h", CSRC / "flash_amx.h",
           CSRC / "decode_tile.h", CSRC / "amx_tiles.h")
FLAGS = ("-O3", "-march=native", "-std=gnu11", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno")
ENV_SWITCH = "PREFIXSERVE_NATIVE_KERNELS"

_P, _I64, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# q, k_cache, v_cache, block_tables, seq_lens, out; B, Hq, Hkv, D, BS, bt_stride, num_blocks;
# q_sb, q_sh; k_sb, k_ss, k_sh; v_sb, v_ss, v_sh; o_sb, o_sh; scale; window (0: none); nthreads;
# scratch, scratch floats, need (int64 out) -> 1 on a bad block id, 2 without memory, 3 when the
# shared-prefix work needs more scratch (*need floats; nothing computed)
DECODE_ARGTYPES = [_P] * 6 + [_I64] * 7 + [_I64] * 2 + [_I64] * 3 + [_I64] * 3 + [_I64] * 2 + [_F, _I64, _INT,
                                                                                             _P, _I64, _P]
# q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, workspace; workspace floats, S,
# Hq, Hkv, D, BS, bt_stride, num_blocks; q_st, q_sh; k_sb, k_ss, k_sh; v_sb, v_ss, v_sh; o_st, o_sh;
# scale; nthreads -> 1 on a bad block id, 2 on a short workspace, 3 on more queries than positions
PREFILL_ARGTYPES = [_P] * 8 + [_I64] * 8 + [_I64] * 2 + [_I64] * 3 + [_I64] * 3 + [_I64] * 2 + [_F, _INT]
# The fp8 decode (csrc/kv_fp8.c): DECODE_ARGTYPES up to the scale, then k_scale, v_scale, window, nthreads
# (no scratch: no shared-prefix phase) -> 1 on a bad block id
DECODE_FP8_ARGTYPES = DECODE_ARGTYPES[:23] + [_F, _F, _F, _I64, _INT]
# x, packed weight, scales, out; M, N, K, group, x row stride, out row stride; bf16; nthreads -> 1 on no memory
INT4_LINEAR_ARGTYPES = [_P] * 4 + [_I64] * 6 + [_INT] * 4  # ..., bf16, nthreads, symmetric (m = -8 d), two digits
INT8_LINEAR_ARGTYPES = INT4_LINEAR_ARGTYPES[:-2] + [_INT]  # no symmetric flag
# packed weight, scales, out float32 / bfloat16 [N, K]; N, K, group; symmetric, bfloat16, nthreads -> 0
INT4_DEQUANTIZE_ARGTYPES = [_P] * 3 + [_I64] * 3 + [_INT] * 3
# x, weight (or its lanes layout), bias (NULL for none), out; M, N, K, x row stride, out row stride; nthreads
LINEAR_ARGTYPES = [_P] * 4 + [_I64] * 5 + [_INT]
# key, value, k_cache, v_cache, slots (int64); T, row bytes, key/value token strides, cache slot
# strides (bytes), number of slots -> 1 on a slot outside the pool
STORE_KV_ARGTYPES = [_P] * 5 + [_I64] * 7
# key, value, k_cache, v_cache, slots (int64); T, row elements, key/value token strides (elements), cache slot
# strides (bytes), number of slots; k_scale, v_scale -> 1 on a slot outside the pool (csrc/kv_fp8.c)
STORE_KV_FP8_ARGTYPES = [_P] * 5 + [_I64] * 7 + [_F, _F]
# x, h (NULL: no residual add), w, res, out; rows, H, x/h/res/out row strides; eps; nthreads
RMS_NORM_ARGTYPES = [_P] * 5 + [_I64] * 6 + [_F, _INT]
# gate_up, out; rows, I, gate_up/out row strides; nthreads
SILU_MUL_ARGTYPES = [_P] * 2 + [_I64] * 4 + [_INT]
# qk (in place), cos, sin; rows, heads, head_dim, qk/cos row strides; nthreads
ROPE_ARGTYPES = [_P] * 3 + [_I64] * 5 + [_INT]
# logits; S, V, row stride; ks (int64), ps (float32), out, kept (int64); nthreads -> 2 without memory
TOP_P_ARGTYPES = [_P] + [_I64] * 3 + [_P] * 4 + [_INT]
# probs; S, V, row stride; seeds (int64), tokens (int64); nthreads
RACE_ARGTYPES = [_P] + [_I64] * 3 + [_P] * 2 + [_INT]


@dataclass(frozen=True)
class NativeKernels:
    """The loaded library's entry points and the limits it was built with."""

    decode_f32: ctypes._CFuncPtr
    decode_bf16: ctypes._CFuncPtr
    prefill_f32: ctypes._CFuncPtr
    prefill_bf16: ctypes._CFuncPtr  # float32 math on bfloat16 operands (see csrc/paged_attention_prefill.c)
    linear_f32: ctypes._CFuncPtr
    linear_bf16: ctypes._CFuncPtr | None  # None without AVX512-BF16 or AVX2 (F.linear then)
    store_kv: ctypes._CFuncPtr
    int4_linear: ctypes._CFuncPtr | None  # None without AVX512-VNNI or AVX2 (torch's int4 kernel then)
    elementwise: dict[str, ctypes._CFuncPtr]  # "add_rms_norm_f32", "silu_mul_bf16", "rope_f32", ...
    max_linear_rows: int
    max_group: int  # query heads per KV head
    max_head_dim: int
    max_block_size: int
    max_prefill_head_dim: int
    prefill_head_dim_multiple: int
    path: Path
    top_k_top_p: ctypes._CFuncPtr  # sampling's top-k / top-p filter (csrc/top_p.c)
    lanes_f32: ctypes._CFuncPtr | None  # linear on the lanes layout (csrc/lanes_linear.c); None without AVX-512
    lanes_bf16: ctypes._CFuncPtr | None  # ... and without AVX512-BF16
    race: ctypes._CFuncPtr  # sampling's exponential race (csrc/top_p.c)
    prefill_amx: bool  # bfloat16 prefill (head_dim a multiple of 64) on AMX tiles (csrc/flash_amx.h)
    lanes_gated_f32: ctypes._CFuncPtr | None = None  # gate_up linear + SiLU-and-multiply on the gated lanes layout
    lanes_gated_bf16: ctypes._CFuncPtr | None = None  # (csrc/lanes_linear.c); None where lanes_* is
    # An fp8 e4m3 KV cache with float32 / bfloat16 activations (csrc/kv_fp8.c), keyed by DTYPE_SUFFIX
    store_kv_fp8: dict | None = None
    decode_fp8: dict | None = None
    # 8-bit weights through the int4 kernel's tiles (csrc/int4_linear.c ps_int8_linear): the int8 LM head's
    # logits; None without AVX512-VNNI or AVX2
    int8_linear: ctypes._CFuncPtr | None = None
    # bfloat16 linear on AMX tiles over the lanes layout (csrc/amx_linear.c), plain and gated; None without AMX
    # (or where the OS withholds its tiles)
    amx_bf16: ctypes._CFuncPtr | None = None
    amx_gated_bf16: ctypes._CFuncPtr | None = None
    # the packed int4 weight back to float32 (csrc/int4_linear.c ps_int4_dequantize; portable C)
    int4_dequantize: ctypes._CFuncPtr | None = None

    # Entry points per model dtype (float32 / bfloat16), for the launchers and the engine's decode
    # stack alike. Callers check the dtype with has_dtype first.
    @staticmethod
    def has_dtype(dtype) -> bool:
        return dtype in DTYPE_SUFFIX

    def decode_for(self, dtype) -> ctypes._CFuncPtr:
        return self.decode_f32 if DTYPE_SUFFIX[dtype] == "f32" else self.decode_bf16

    def prefill_for(self, dtype) -> ctypes._CFuncPtr:
        return self.prefill_f32 if DTYPE_SUFFIX[dtype] == "f32" else self.prefill_bf16

    def linear_for(self, dtype) -> ctypes._CFuncPtr | None:
        return self.linear_f32 if DTYPE_SUFFIX[dtype] == "f32" else self.linear_bf16

    def lanes_for(self, dtype) -> ctypes._CFuncPtr | None:
        return self.lanes_f32 if DTYPE_SUFFIX[dtype] == "f32" else self.lanes_bf16

    def lanes_gated_for(self, dtype) -> ctypes._CFuncPtr | None:
        return self.lanes_gated_f32 if DTYPE_SUFFIX[dtype] == "f32" else self.lanes_gated_bf16

    def elementwise_for(self, op: str, dtype) -> ctypes._CFuncPtr:
        return self.elementwise[f"{op}_{DTYPE_SUFFIX[dtype]}"]

    def store_kv_fp8_for(self, dtype) -> ctypes._CFuncPtr:
        return self.store_kv_fp8[DTYPE_SUFFIX[dtype]]

    def decode_fp8_for(self, dtype) -> ctypes._CFuncPtr:
        return self.decode_fp8[DTYPE_SUFFIX[dtype]]


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "prefixserve" / "kernels"


def _cpu_flags() -> str:
    # -march=native code must never run on a different CPU: the flags are part of the cache key.
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


@functools.cache
def os_grants_amx() -> bool:
    """Linux lets this process use AMX tiles (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, as oneDNN and
    csrc/flash_amx.h ask): a CPU can list amx_bf16 under a kernel or VM that withholds the tile state."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    except (OSError, AttributeError):
        return False


@functools.cache
def cpu_has_amx() -> bool:
    """The CPU has AMX for bfloat16 (Intel Sapphire Rapids and later) and the OS grants its tiles: torch's
    oneDNN paths and the AMX attention items use it."""
    return "amx_bf16" in _cpu_flags().split() and os_grants_amx()


@functools.cache
def cpu_has_avx512() -> bool:
    """The C kernels were built with their AVX-512 paths (-march=native on a CPU with AVX512F/BW/VL)."""
    return {"avx512f", "avx512bw", "avx512vl"} <= set(_cpu_flags().split())


@functools.cache
def cpu_has_avx2() -> bool:
    """The C kernels were built with their AVX2 paths (-march=native on a CPU with AVX2 and FMA)."""
    return {"avx2", "fma"} <= set(_cpu_flags().split())


@functools.cache
def cpu_has_bf16_pairs() -> bool:
    """The C kernels were built with AVX512-BF16 (vdpbf16ps: bfloat16 pairs into float32 sums), which
    bfloat16 prefill attention and small bfloat16 linears use."""
    return cpu_has_avx512() and "avx512_bf16" in _cpu_flags().split()


@functools.cache
def cpu_has_int8_dot() -> bool:
    """The CPU multiplies int8 in 32-bit sums (AVX512-VNNI, AVX-VNNI or AMX-INT8). Without them oneDNN's
    int8 matmul falls back to AVX2's vpmaddubsw, whose 16-bit pair sums saturate: measured on a 2-core
    AMD EPYC with AVX2 only, logits off by 20% of the largest (tests/kernels/test_quant_linear.py)."""
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & set(_cpu_flags().split()))


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build_key(cc: str) -> str:
    sources = [f.read_bytes() for f in (*SOURCES, *HEADERS)]
    return hashlib.sha256(b"\0".join([*sources, cc.encode(), " ".join(FLAGS).encode(),
                                      platform.machine().encode(), _cpu_flags().encode()])).hexdigest()[:16]


def native_build_id() -> str:
    """The C kernels' build (sources, compiler, flags, CPU) as the cache names it; "none" without a compiler."""
    cc = _compiler()
    return _build_key(cc) if cc else "none"


def _build(cc: str) -> Path:
    target = _cache_root() / _build_key(cc) / "libprefixserve_cpu.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compile to a private name, then rename: concurrent first uses never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", tmp, "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load(path: Path) -> NativeKernels:
    lib = ctypes.CDLL(str(path))
    funcs = []
    for name in ("ps_paged_decode_f32", "ps_paged_decode_bf16"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = DECODE_ARGTYPES, ctypes.c_int64
        funcs.append(fn)
    for name in ("ps_paged_prefill_f32", "ps_paged_prefill_bf16"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = PREFILL_ARGTYPES, ctypes.c_int64
        funcs.append(fn)
    for name in ("ps_linear_f32", "ps_linear_bf16"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = LINEAR_ARGTYPES, None
    elementwise = {}
    for op, argtypes in (("add_rms_norm", RMS_NORM_ARGTYPES), ("silu_mul", SILU_MUL_ARGTYPES),
                         ("rope", ROPE_ARGTYPES)):
        for dtype in ("f32", "bf16"):
            fn = getattr(lib, f"ps_{op}_{dtype}")
            fn.argtypes, fn.restype = argtypes, None
            elementwise[f"{op}_{dtype}"] = fn
    for name in ("ps_max_g", "ps_max_d", "ps_max_bs", "ps_linear_max_rows", "ps_linear_bf16_available",
                 "ps_prefill_max_d", "ps_prefill_d_multiple", "ps_prefill_on_amx"):
        getattr(lib, name).restype = ctypes.c_int64
    linear_bf16 = lib.ps_linear_bf16 if lib.ps_linear_bf16_available() else None
    lib.ps_store_kv.argtypes, lib.ps_store_kv.restype = STORE_KV_ARGTYPES, ctypes.c_int64
    lib.ps_int4_linear.argtypes, lib.ps_int4_linear.restype = INT4_LINEAR_ARGTYPES, ctypes.c_int64
    lib.ps_int4_linear_available.restype = ctypes.c_int64
    int4_linear = lib.ps_int4_linear if lib.ps_int4_linear_available() else None
    lib.ps_int8_linear.argtypes, lib.ps_int8_linear.restype = INT8_LINEAR_ARGTYPES, ctypes.c_int64
    lib.ps_int8_linear_available.restype = ctypes.c_int64
    int8_linear = lib.ps_int8_linear if lib.ps_int8_linear_available() else None
    lib.ps_int4_dequantize.argtypes, lib.ps_int4_dequantize.restype = INT4_DEQUANTIZE_ARGTYPES, ctypes.c_int64
    lib.ps_top_k_top_p.argtypes, lib.ps_top_k_top_p.restype = TOP_P_ARGTYPES, ctypes.c_int64
    lib.ps_race.argtypes, lib.ps_race.restype = RACE_ARGTYPES, None
    lanes, gated = [], []
    for dtype in ("f32", "bf16"):
        fn, available = getattr(lib, f"ps_lanes_linear_{dtype}"), getattr(lib, f"ps_lanes_{dtype}_available")
        fused = getattr(lib, f"ps_lanes_linear_{dtype}_gated")
        fn.argtypes, fn.restype, available.restype = LINEAR_ARGTYPES, None, ctypes.c_int64
        fused.argtypes, fused.restype = LINEAR_ARGTYPES, None
        lanes.append(fn if available() else None)
        gated.append(fused if available() else None)
    lib.ps_amx_linear_available.restype = ctypes.c_int64
    amx = []
    for name in ("ps_amx_linear_bf16", "ps_amx_linear_bf16_gated"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = LINEAR_ARGTYPES, None
        amx.append(fn if lib.ps_amx_linear_available() else None)
    store_fp8, decode_fp8 = {}, {}
    for dtype in ("f32", "bf16"):
        fn = getattr(lib, f"ps_store_kv_fp8_{dtype}")
        fn.argtypes, fn.restype = STORE_KV_FP8_ARGTYPES, ctypes.c_int64
        store_fp8[dtype] = fn
        fn = getattr(lib, f"ps_paged_decode_fp8_{dtype}")
        fn.argtypes, fn.restype = DECODE_FP8_ARGTYPES, ctypes.c_int64
        decode_fp8[dtype] = fn
    return NativeKernels(*funcs, lib.ps_linear_f32, linear_bf16, lib.ps_store_kv, int4_linear, elementwise,
                         lib.ps_linear_max_rows(), lib.ps_max_g(), lib.ps_max_d(), lib.ps_max_bs(),
                         lib.ps_prefill_max_d(), lib.ps_prefill_d_multiple(), path, lib.ps_top_k_top_p, *lanes, lib.ps_race,
                         bool(lib.ps_prefill_on_amx()), *gated, store_kv_fp8=store_fp8, decode_fp8=decode_fp8,
                         int8_linear=int8_linear, amx_bf16=amx[0], amx_gated_bf16=amx[1],
                         int4_dequantize=lib.ps_int4_dequantize)


def _with_fast_calls(kernels: NativeKernels, cc: str) -> NativeKernels:
    """The same entry points called through kernels/cpu/fastcall.py's extension where it builds (a ctypes call
    converts each argument at ~0.27 us; ~300 calls a decode step)."""
    found: dict[str, ctypes._CFuncPtr] = {}
    for field in dataclasses.fields(kernels):
        value = getattr(kernels, field.name)
        for fn in value.values() if isinstance(value, dict) else (value,):
            if isinstance(fn, ctypes._CFuncPtr) and fn.argtypes is not None:
                found[fn.__name__] = fn
    fast = fast_calls(found, cc, kernels.path.parent)
    if not fast:
        return kernels

    def swap(value):
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        return fast.get(value.__name__, value) if isinstance(value, ctypes._CFuncPtr) else value

    return dataclasses.replace(kernels, **{f.name: swap(getattr(kernels, f.name)) for f in dataclasses.fields(kernels)})


@functools.cache
def native_kernels() -> NativeKernels | None:
    """The CPU C kernels, built and loaded on first call; None when unavailable (see module doc)."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    if platform.system() != "Linux":
        return None  # built and tested on Linux (gcc/clang with OpenMP) only
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler found: CPU decode attention and small linears use the torch path (slower)")
        return None
    try:
        return _with_fast_calls(_load(_build(cc)), cc)
    except (OSError, subprocess.CalledProcessError, AttributeError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("building the CPU C kernels failed, using the torch path (slower): %s", detail)
        return None
