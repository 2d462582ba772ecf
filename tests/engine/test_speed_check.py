"""The start-up speed self-check (engine/speed_check.py): a decode step and a prefill chunk of the loaded model
against this machine's floor, a WARNING naming the op that dominates when far off."""
from __future__ import annotations

import dataclasses
import logging
import time

import pytest

from engine import LLM
from engine.speed_check import check_speed


def _llm(path, **kwargs):
    return LLM(model=str(path), num_kv_blocks=64, max_num_seqs=4, **kwargs)


def test_every_cpu_engine_checks_its_speed_at_start_up(tiny_model_factory, caplog):
    with caplog.at_level(logging.INFO, logger="prefixserve"):
        llm = _llm(tiny_model_factory("llama"))
    report = llm.engine.speed_report
    assert report is not None and report.decode_s > 0 and report.prefill_s > 0 and report.prefill_tokens > 1
    assert report.decode_floor_s > 0 and report.prefill_floor_s > 0
    assert "linear" in report.decode_ops and "lm_head" in report.decode_ops
    for shares in (report.decode_ops, report.prefill_ops):  # the ops, the head and the time between them
        assert abs(sum(shares.values()) - 1) < 0.01 and all(v >= 0 for v in shares.values())
    assert any("speed check:" in r.getMessage() for r in caplog.records)
    assert llm.kv_cache_usage()["num_in_use"] == 0  # the check's KV writes belong to no request
    llm.engine.check_integrity()


def test_a_quantized_models_decode_ops_are_tallied(tmp_path, monkeypatch):
    """A decode-only step runs the op set's decode_ops (the int4 linears' one-digit form): their time is the
    linears', not the Python between the ops."""
    pytest.importorskip("gguf")
    from engine.models.resolve import BUILTIN_MODELS, DEFAULT_MODEL, _builtin_gguf
    from fixtures.gguf_writer import write_tiny_gguf

    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    source = _builtin_gguf(BUILTIN_MODELS[DEFAULT_MODEL])
    path = write_tiny_gguf(tmp_path / "tiny.Q4_0.gguf", source, linear_type="Q4_0")
    llm = _llm(path, quantization="gguf")
    runner = llm.engine.runner
    bound = runner.model.ops
    assert bound.decode_ops is not None
    slow = bound.decode_ops.linear

    def slow_linear(*args, **kwargs):
        time.sleep(0.01)  # 10 ms a call: the decode step is the linears'
        return slow(*args, **kwargs)

    runner.model.ops = dataclasses.replace(bound, decode_ops=dataclasses.replace(bound.decode_ops, linear=slow_linear))
    report = check_speed(runner, llm.engine.dtype, llm.engine.weight_bytes, llm.engine.dispatch.cache_dir)
    assert max(report.decode_ops, key=report.decode_ops.get) == "linear", report.decode_ops
    assert runner.model.ops.decode_ops.linear is slow_linear  # the bound set is put back


def test_a_slow_op_is_named_in_a_warning(tiny_model_factory, caplog):
    llm = _llm(tiny_model_factory("llama"))
    runner = llm.engine.runner
    fast = runner.model.ops

    def slow_rope(*args, **kwargs):
        time.sleep(0.05)  # far above anything else of a tiny model's step, even on a busy machine
        return fast.rope(*args, **kwargs)

    runner.model.ops = dataclasses.replace(fast, rope=slow_rope)
    caplog.clear()  # the start-up check may itself have warned (a busy CI machine)
    with caplog.at_level(logging.WARNING, logger="prefixserve"):
        report = check_speed(runner, llm.engine.dtype, llm.engine.weight_bytes, llm.engine.dispatch.cache_dir)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert report.decode_ops["rope"] > 0.5
    assert warnings and "rope taking" in warnings[0] and "collect-env" in warnings[0]


@pytest.mark.parametrize("where", ["lm_head", "between ops (the Python forward)"])
def test_time_outside_the_ops_is_named_too(tiny_model_factory, caplog, where):
    """Time in the LM head or in the Python between the ops is named as such, not laid on the largest op."""
    llm = _llm(tiny_model_factory("llama"))
    runner = llm.engine.runner
    model = runner.model
    slow, name = ("compute_logits", "lm_head") if where == "lm_head" else ("_embed", where)
    fast = getattr(model, slow)

    def slowed(*args, **kwargs):
        time.sleep(0.2)  # a loaded CI machine once added ~90 ms to a tiny model's step, inside the ops
        return fast(*args, **kwargs)

    setattr(model, slow, slowed)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="prefixserve"):
        report = check_speed(runner, llm.engine.dtype, llm.engine.weight_bytes, llm.engine.dispatch.cache_dir)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    shares = report.decode_ops
    assert max(shares, key=shares.get) == name and abs(sum(shares.values()) - 1) < 0.01
    assert warnings and f"{name} taking" in warnings[0]


def test_the_check_can_be_switched_off(tiny_model_factory, monkeypatch):
    monkeypatch.setenv("PREFIXSERVE_SPEED_CHECK", "0")
    assert _llm(tiny_model_factory("llama")).engine.speed_report is None
    monkeypatch.delenv("PREFIXSERVE_SPEED_CHECK")
    assert _llm(tiny_model_factory("llama"), attention_backend="torch").engine.speed_report is not None


@pytest.mark.parametrize("model", [None, "tiny"])
def test_collect_env_reports_the_machine_and_its_kernel_choices(tiny_model_factory, model, capsys):
    import json

    from app.cli import main

    argv = ["collect-env", "--json"] + (["--model", str(tiny_model_factory("llama"))] if model else [])
    assert main(argv) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["cpu"]["model_name"] and isinstance(facts["cpu"]["os_grants_amx"], bool)
    assert facts["torch"] and facts["onednn"] and facts["onednn_isa"]
    assert facts["memory"]["available_gib"] > 0 and "build" in facts["c_kernels"]
    assert isinstance(facts["kernel_choices"], list)
    if model:
        assert facts["model"]["weight_bytes"] > 0 and facts["model"]["kv_cache_bytes"] > 0
        assert any(c.startswith("linear ") for c in facts["kernel_choices"])
