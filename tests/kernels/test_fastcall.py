"""The C kernels' fast calls (kernels/cpu/fastcall.py): the generated extension calls the same entry points as
ctypes with the same results, refuses what ctypes would refuse, releases the GIL, and stays out where switched
off."""
from __future__ import annotations

import ctypes
import sysconfig
import threading
import time
from pathlib import Path

import pytest
import torch

from kernels.cpu import fastcall
from kernels.cpu.native import ROPE_ARGTYPES, native_kernels

native = native_kernels()
needs_fast = pytest.mark.skipif(native is None or not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists(),
                                reason="no C kernels or no Python headers here")


def _ctypes_rope():
    lib = ctypes.CDLL(str(native.path))
    fn = lib.ps_rope_f32
    fn.argtypes, fn.restype = ROPE_ARGTYPES, None
    return fn


def _rope_args(x, cos, sin):
    rows, nh, d = x.shape
    return (x.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows, nh, d, x.stride(0), cos.stride(0), 2)


@needs_fast
def test_the_bound_entry_points_are_the_fast_ones_and_compute_what_ctypes_computes():
    assert not isinstance(native.elementwise_for("rope", torch.float32), ctypes._CFuncPtr)
    assert not isinstance(native.decode_for(torch.float32), ctypes._CFuncPtr)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g)
    cos, sin = torch.randn(5, 32, generator=g), torch.randn(5, 32, generator=g)
    a, b = x.clone(), x.clone()
    assert native.elementwise_for("rope", torch.float32)(*_rope_args(a, cos, sin)) is None  # a void entry point
    _ctypes_rope()(*_rope_args(b, cos, sin))
    assert torch.equal(a, b) and not torch.equal(a, x)
    # an int64 result comes back as an int: store_kv refuses a slot outside the pool
    k = torch.randn(1, 3, 64)
    cache = torch.zeros(2, 16, 3, 64)
    slots = torch.tensor([999], dtype=torch.int64)
    assert native.store_kv(k.data_ptr(), k.data_ptr(), cache.data_ptr(), cache.data_ptr(), slots.data_ptr(), 1,
                           3 * 64 * 4, 3 * 64 * 4, 3 * 64 * 4, 3 * 64 * 4, 3 * 64 * 4, 32) == 1


@needs_fast
def test_wrong_arguments_raise_type_errors():
    rope = native.elementwise_for("rope", torch.float32)
    x, cos = torch.zeros(1, 1, 64), torch.zeros(1, 32)
    with pytest.raises(TypeError, match=r"ps_rope_f32\(\) takes 9 arguments \(8 given\)"):
        rope(*_rope_args(x, cos, cos)[:-1])
    with pytest.raises(TypeError):
        rope(x, cos.data_ptr(), cos.data_ptr(), 1, 1, 64, 64, 32, 1)  # a tensor, not its address
    with pytest.raises(TypeError):
        rope(x.data_ptr(), cos.data_ptr(), cos.data_ptr(), 1.5, 1, 64, 64, 32, 1)  # a float for an int


@needs_fast
def test_the_gil_is_released_during_a_call():
    """A long kernel call lets another Python thread run, as a ctypes call does (the server's HTTP thread
    runs while the engine's step computes)."""
    rope = native.elementwise_for("rope", torch.float32)
    x, cos = torch.randn(4000, 32, 128), torch.randn(4000, 64)
    ticks = []
    stop = threading.Event()

    def count():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0)

    t = threading.Thread(target=count)
    t.start()
    time.sleep(0.01)
    try:
        start = time.perf_counter()
        for _ in range(5):
            rope(x.data_ptr(), cos.data_ptr(), cos.data_ptr(), 4000, 32, 128, x.stride(0), cos.stride(0), 1)
        end = time.perf_counter()
    finally:
        stop.set()
        t.join()
    assert end - start > 0.01
    assert sum(start < s < end for s in ticks) > 5


def test_switched_off_or_empty_it_returns_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv(fastcall.ENV_SWITCH, "0")
    fn = ctypes.CDLL(None).getpid
    fn.argtypes, fn.restype = [], ctypes.c_int64
    assert fastcall.fast_calls({"getpid": fn}, "cc", tmp_path) == {}
    monkeypatch.delenv(fastcall.ENV_SWITCH)
    assert fastcall.fast_calls({}, "cc", tmp_path) == {}


def test_a_failed_build_leaves_ctypes(tmp_path, caplog):
    fn = ctypes.CDLL(None).getpid
    fn.argtypes, fn.restype = [], ctypes.c_int64
    assert fastcall.fast_calls({"getpid": fn}, "/nonexistent/cc", tmp_path) == {}


def test_the_source_declares_each_signature():
    src = fastcall.source({"ps_b": ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float], None),
                           "ps_a": ([ctypes.c_void_p], ctypes.c_int64)})
    assert "typedef int64_t (*ps_fn0_t)(void *);" in src  # sorted: ps_a first
    assert "typedef void (*ps_fn1_t)(void *, int64_t, int, float);" in src
    assert '{"ps_b", (PyCFunction)(void (*)(void))ps_w1, METH_FASTCALL, NULL}' in src
