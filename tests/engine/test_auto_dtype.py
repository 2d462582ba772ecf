"""dtype "auto" (the default, engine/auto_dtype.py): bfloat16 only where a quantized GGUF is served in int4 on a CPU
with bfloat16 pair instructions; float32 for everything else; an explicit dtype is kept."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import LLM, EngineConfig
from engine import auto_dtype
from engine.models.resolve import BUILTIN_MODELS, DEFAULT_MODEL, _builtin_gguf, resolve_model
from fixtures.gguf_writer import write_tiny_gguf

pytest.importorskip("gguf")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    mp = pytest.MonkeyPatch()
    mp.setenv("PREFIXSERVE_CACHE_DIR", str(folder / "cache"))
    path = write_tiny_gguf(folder / "tiny.Q4_0.gguf", _builtin_gguf(BUILTIN_MODELS[DEFAULT_MODEL]), linear_type="Q4_0")
    yield path
    mp.undo()


def _resolved(model, **fields) -> str:
    config = EngineConfig(model=str(model), **fields)
    return auto_dtype.resolve_dtype(config, resolve_model(str(model)), fields.get("device_", CPU)).dtype


def test_the_default_is_auto():
    assert EngineConfig().dtype == "auto"


def test_a_quantized_gguf_served_int4_takes_bfloat16_where_the_cpu_has_pairs(tiny_gguf, monkeypatch):
    monkeypatch.setattr(auto_dtype, "cpu_has_bf16_pairs", lambda: True)
    assert _resolved(tiny_gguf) == "bfloat16"
    assert _resolved(tiny_gguf, quantization="gguf") == "bfloat16"
    assert _resolved(tiny_gguf, quantization="none") == "float32"  # dequantized: a dense model
    assert _resolved(tiny_gguf, dtype="float32") == "float32"  # an explicit dtype is kept
    config = EngineConfig(model=str(tiny_gguf))
    assert auto_dtype.resolve_dtype(config, resolve_model(str(tiny_gguf)), torch.device("cuda")).dtype == "float32"
    assert auto_dtype.resolve_dtype(dataclasses.replace(config, tensor_parallel_size=2), resolve_model(str(tiny_gguf)),
                                    CPU).dtype == "float32"
    monkeypatch.setattr(auto_dtype, "cpu_has_bf16_pairs", lambda: False)
    monkeypatch.setattr(auto_dtype, "cpu_has_amx", lambda: False)
    assert _resolved(tiny_gguf) == "float32"  # bfloat16 emulated (AVX2): float32 stays faster


def test_dense_models_stay_float32(tiny_model_factory, monkeypatch):
    monkeypatch.setattr(auto_dtype, "cpu_has_bf16_pairs", lambda: True)
    assert _resolved(tiny_model_factory("llama")) == "float32"


def test_the_engine_runs_and_reports_the_resolved_dtype(tiny_gguf):
    llm = LLM(model=str(tiny_gguf), num_kv_blocks=32, speculative_config=None)
    expected = "bfloat16" if auto_dtype.cpu_has_bf16_pairs() or auto_dtype.cpu_has_amx() else "float32"
    assert llm.engine.config.dtype == expected and llm.model_info.dtype == expected
    assert llm.engine.runner.kv_cache.dtype == getattr(torch, expected)
    llm.engine.check_integrity()


def test_a_bad_dtype_is_refused():
    with pytest.raises(Exception, match="dtype must be one of"):
        EngineConfig(dtype="int3")
