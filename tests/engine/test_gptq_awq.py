"""GPTQ and AWQ checkpoints (engine/models/gptq_awq.py), packed here the way AutoGPTQ / GPTQModel and
AutoAWQ pack them (tests/fixtures/gptq_awq_checkpoints.py), against transformers on the dense folder
of the same weights dequantized; the AWQ packing also against compressed-tensors' AutoAWQConverter."""
from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file

from engine import LLM
from engine.models.gguf_weights import UnsupportedQuantizationError
from engine.models.hf_quantized import PROJECTIONS, dense_weight, hf_quantization
from fixtures.gptq_awq_checkpoints import write_awq, write_gptq

from engine_testlib import assert_dequantized_matches_hf, assert_quantized_tracks_hf, linear_weight_bytes

PROMPTS = [[100 + 37 * i + j for j in range(20 + 9 * i)] for i in range(4)]
# Inputs for groups of 128; init_std 0.5 / sqrt(2) keeps std * sqrt(hidden) (the logits' scale, and so
# the bfloat16 kernels' error in nats) as in the default tiny model: at 0.5 measured up to 1.07 nat.
WIDE = dict(hidden_size=128, num_heads=8, head_dim=16, intermediate_size=256, init_std=0.35)
# name -> (writer, its arguments, tiny model arch, model arguments)
VARIANTS = {
    "gptq-w4-g32-sym": (write_gptq, dict(bits=4, group_size=32), "qwen2", {}),
    "gptq_v2-w4-g64-asym": (write_gptq, dict(bits=4, group_size=64, sym=False, checkpoint_format="gptq_v2"),
                            "qwen2", {}),
    "gptq-w4-g128-asym": (write_gptq, dict(bits=4, group_size=128, sym=False), "llama", WIDE),
    "gptq-w4-channel-sym": (write_gptq, dict(bits=4, group_size=-1), "qwen2", {}),
    "gptq-w8-channel-sym": (write_gptq, dict(bits=8, group_size=-1), "qwen2", {}),
    "gptq_v2-w8-g32-asym": (write_gptq, dict(bits=8, group_size=32, sym=False, checkpoint_format="gptq_v2"),
                            "qwen2", {}),
    "awq-w4-g32": (write_awq, dict(group_size=32), "qwen2", {}),
    "awq-w4-g128": (write_awq, dict(group_size=128), "llama", WIDE),
}
ACT_ORDER = dict(bits=4, group_size=32, sym=False, desc_act=True)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tiny_model_factory, tmp_path_factory):
    """(quantized folder, dense dequantized folder, variant name)."""
    writer, args, arch, model_args = VARIANTS[request.param]
    out = tmp_path_factory.mktemp("gptq-awq") / request.param
    return (*writer(tiny_model_factory(arch, **model_args), out, **args), request.param)


@pytest.fixture(scope="module")
def act_order(tiny_model_factory, tmp_path_factory):
    return write_gptq(tiny_model_factory("qwen2"), tmp_path_factory.mktemp("gptq-act") / "act-order", **ACT_ORDER)


def _projection_weights(folder) -> dict[str, torch.Tensor]:
    """The dense folder's projection weights by module name."""
    projections = {t for ts in PROJECTIONS.values() for t in ts}
    state = load_file(str(folder / "model.safetensors"))
    return {k[: -len(".weight")]: v for k, v in state.items() if k.split(".", 3)[-1][: -len(".weight")] in projections}


def test_unpacking_gives_the_libraries_weights_exactly(checkpoint):
    folder, dense, _ = checkpoint
    scheme, packed = hf_quantization(folder), load_file(str(folder / "model.safetensors"))
    for name, w in _projection_weights(dense).items():
        assert torch.equal(dense_weight(packed, name, scheme), w), name


@pytest.mark.parametrize("checkpoint", [n for n in sorted(VARIANTS) if n.startswith("awq")], indirect=True)
def test_awq_packing_is_what_compressed_tensors_reads(checkpoint, tmp_path):
    """compressed-tensors' AutoAWQConverter, an implementation apart from ours, decodes the fixture's
    AWQ tensors to the fixture's dense weights (its dequantizer multiplies in the scales' float16)."""
    folder, dense, _ = checkpoint
    pytest.importorskip("compressed_tensors")
    from fixtures.compressed_tensors_checkpoints import awq_decompressed

    theirs = awq_decompressed(folder, tmp_path / "ct")
    for key, w in _projection_weights(dense).items():
        assert (theirs[f"{key}.weight"] - w).abs().max() <= 1e-3 * w.abs().max(), key


def test_dequantized_matches_transformers_exactly(checkpoint, hf_model_loader):
    folder, dense, _ = checkpoint
    assert_dequantized_matches_hf(folder, hf_model_loader(dense), PROMPTS)


def test_served_quantized_by_default_and_tracks_transformers(checkpoint, hf_model_loader):
    folder, dense, name = checkpoint
    llm = LLM(model=str(folder), num_kv_blocks=64)
    assert llm.model_info.quantization == name.split("-")[0].split("_")[0]  # "gptq" / "awq"
    held, count = linear_weight_bytes(llm)
    bits = 4 if "-w4-" in name else 8
    assert held <= count * (bits / 8) * 1.3  # packed integers plus their scales, not float32
    # bfloat16 activations (and bfloat16 scales and zeros) in the int kernels on a random model with
    # large weights, against transformers' float32 (see test_hf_quantized.py): measured up to 0.45 nat
    # where the integers map exactly, 0.61 for 8-bit groups requantized to int8 rows
    assert_quantized_tracks_hf(llm, hf_model_loader(dense), PROMPTS, bound=0.75)


def test_act_order_is_served_dequantized_with_a_warning(act_order, hf_model_loader, caplog):
    folder, dense = act_order
    g_idx = load_file(str(folder / "model.safetensors"))["model.layers.0.mlp.up_proj.g_idx"]
    assert not torch.equal(g_idx.long(), torch.arange(g_idx.numel()) // 32)  # really act-order
    with caplog.at_level(logging.WARNING, logger="prefixserve"):
        llm = LLM(model=str(folder), num_kv_blocks=64)
    assert llm.model_info.quantization == "none"
    assert any("act-order" in r.getMessage() for r in caplog.records)
    assert_dequantized_matches_hf(folder, hf_model_loader(dense), PROMPTS)


@pytest.mark.parametrize("config, named", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128, "desc_act": False, "sym": True}, "GPTQ 3-bit"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 16, "sym": True}, "group_size 16"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True}, "marlin"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemv"}, "'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "exllama"}, "'exllama'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False, "version": "gemm"}, "zero_point"),
])
def test_unsupported_variants_fail_at_load_naming_the_supported(tiny_model_factory, tmp_path, config, named):
    other = tmp_path / "other"
    shutil.copytree(tiny_model_factory("qwen2"), other)
    full = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**full, "quantization_config": config}))
    with pytest.raises(UnsupportedQuantizationError, match=named) as raised:
        LLM(model=str(other), num_kv_blocks=16)
    assert "supported: " in str(raised.value) and "gptq_v2" in str(raised.value) and "version gemm" in str(raised.value)
