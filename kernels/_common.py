"""Shared helpers for the kernels package: lazy Triton access and argument validation.

Nothing here imports Triton or touches CUDA at import time.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A KV cache holds a float dtype, or float8 e4m3 (kernels/kv_quant.py: the ops then take the model dtype's
# activations and per-tensor scales)
CACHE_DTYPES = FLOAT_DTYPES + (torch.float8_e4m3fn,)

_TRITON_STATE: dict[str, Any] = {}


def interpret_mode() -> bool:
    """True when TRITON_INTERPRET is set to a true value (Triton runs kernels on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def triton_available() -> bool:
    """True when the `triton` package can be imported (imports it on first call)."""
    if "available" not in _TRITON_STATE:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401

            _TRITON_STATE["available"] = True
        except Exception as exc:  # ImportError, or a broken install
            _TRITON_STATE["available"] = False
            _TRITON_STATE["error"] = repr(exc)
    return _TRITON_STATE["available"]


def require_triton() -> None:
    if not triton_available():
        raise RuntimeError(
            "the triton backend needs the `triton` package, which could not be imported "
            f"({_TRITON_STATE.get('error', 'not installed')}); install prefixserve[triton] "
            "or use backend='torch'"
        )


def triton_stdlib_interpreted() -> bool | None:
    """Whether triton's jit'd standard library (tl.zeros, tl.max, ...) was built for the interpreter.

    Triton fixes this when ``triton.language`` is first imported, from TRITON_INTERPRET at that
    moment. None when triton is not importable.
    """
    if not triton_available():
        return None
    from triton.language import standard

    return type(standard.zeros).__name__ == "InterpretedFunction"


def lazy_jit(cache: dict, fn: Callable) -> Any:
    """Return ``triton.jit(fn)``, created on first use.

    The op modules never import triton at import time (so ``import kernels.<op>`` works without
    triton, and cannot fix triton's interpreter mode before TRITON_INTERPRET is set): their kernel
    functions refer to a module global ``tl`` (their annotations are strings) that is bound to
    ``triton.language`` here. The wrapper is cached per interpreter flag.
    """
    key = interpret_mode()
    kernel = cache.get(key)
    if kernel is None:
        require_triton()
        import triton
        import triton.language

        if key and not triton_stdlib_interpreted():
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set after triton was imported; triton's interpreter only works "
                "when the variable is set before the first `import triton` in the process"
            )
        fn.__globals__["tl"] = triton.language
        kernel = triton.jit(fn)
        cache[key] = kernel
    return kernel


def alloc_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialized output buffer of the Triton launchers (tests replace it with a NaN-filled one)."""
    return torch.empty(shape, dtype=dtype, device=device)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# --------------------------------------------------------------------------- validation


def check_cache_pair(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate k_cache/v_cache [num_blocks, block_size, Hkv, D]; return their shape."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{op}: {name} must be 4-D [num_blocks, block_size, num_kv_heads, head_dim], "
                f"got shape {tuple(t.shape)}"
            )
        if t.dtype not in CACHE_DTYPES:
            raise ValueError(f"{op}: {name} dtype must be float32/float16/bfloat16/float8_e4m3fn, got {t.dtype}")
        if t.numel() > 0 and t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} last dim must be contiguous (stride 1), got strides {t.stride()}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{op}: k_cache shape {tuple(k_cache.shape)} != v_cache shape {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{op}: k_cache dtype {k_cache.dtype} != v_cache dtype {v_cache.dtype}")
    if k_cache.device != v_cache.device:
        raise ValueError(f"{op}: k_cache on {k_cache.device} but v_cache on {v_cache.device}")
    nb, bs, hkv, d = k_cache.shape
    return nb, bs, hkv, d


def kv_rows_packed(x: torch.Tensor) -> bool:
    """key / value [T, Hkv, D] with each token's heads contiguous (what the C store kernels read)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def kv_slots_packed(cache: torch.Tensor) -> bool:
    """A cache [NB, BS, Hkv, D] whose slots are evenly spaced with contiguous rows (the C kernels' layout)."""
    nb, bs, hkv, d = cache.shape
    return cache.stride(3) == 1 and cache.stride(2) == d and cache.stride(1) == hkv * d and cache.stride(0) == bs * hkv * d


def activation_dtype(cache_dtype: torch.dtype, x) -> torch.dtype:
    """The dtype an op's query / key / value must have: the cache's, or with an fp8 cache the model dtype
    they come in (any float dtype)."""
    if cache_dtype == torch.float8_e4m3fn and getattr(x, "dtype", None) in FLOAT_DTYPES:
        return x.dtype
    return cache_dtype


def check_float(op: str, name: str, t: torch.Tensor, ndim: int, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{op}: {name} dtype {t.dtype} must match the KV cache dtype {dtype}")
    if t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device} but the KV cache is on {device}")
    if t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(f"{op}: {name} last dim must be contiguous (stride 1), got strides {t.stride()}")


def check_index(
    op: str, name: str, t: torch.Tensor, ndim: int, dtypes: tuple[torch.dtype, ...], device: torch.device
) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = "/".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{op}: {name} dtype must be {names}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device} but the KV cache is on {device}")


def check_triton_device(op: str, device: torch.device) -> None:
    """The Triton launchers need CUDA tensors, or CPU tensors under TRITON_INTERPRET=1."""
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpret_mode():
        return
    if device.type == "cpu":
        raise ValueError(
            f"{op}: the triton kernel got CPU tensors; set TRITON_INTERPRET=1 to run Triton on CPU "
            "(slow, for tests) or use the torch reference"
        )
    raise ValueError(f"{op}: the triton kernel does not support device {device}")
