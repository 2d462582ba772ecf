"""compressed-tensors checkpoints (engine/models/hf_quantized.py), written here with compressed-tensors'
own packing: symmetric int4 against transformers' own decompression of the same folder; int4 with zero
points and int8 channel-wise (which this transformers cannot load) against transformers on the dense
folder of compressed-tensors' own dequantizer."""
from __future__ import annotations

import json
import shutil

import pytest

from engine import LLM
from engine.models.gguf_weights import UnsupportedQuantizationError
from fixtures.compressed_tensors_checkpoints import write_compressed_tensors, write_decompressed

from engine_testlib import assert_dequantized_matches_hf, assert_quantized_tracks_hf, linear_weight_bytes

pytest.importorskip("compressed_tensors")
PROMPTS = [[100 + 37 * i + j for j in range(20 + 9 * i)] for i in range(4)]
VARIANTS = {"w4": dict(bits=4), "w4-zero-points": dict(bits=4, symmetric=False), "w8-channel": dict(bits=8)}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tiny_model_factory, tmp_path_factory):
    """(compressed-tensors folder, the dense folder transformers runs as its reference)."""
    out = tmp_path_factory.mktemp("ct")
    folder = write_compressed_tensors(tiny_model_factory("qwen2"), out / request.param, **VARIANTS[request.param])
    if request.param == "w4":  # transformers decompresses this one itself
        return folder, folder
    return folder, write_decompressed(folder, out / f"{request.param}-dense")


def test_dequantized_matches_transformers_exactly(checkpoint, hf_model_loader):
    folder, reference = checkpoint
    assert_dequantized_matches_hf(folder, hf_model_loader(reference), PROMPTS)


def test_served_quantized_by_default_and_tracks_transformers(checkpoint, hf_model_loader):
    folder, reference = checkpoint
    llm = LLM(model=str(folder), num_kv_blocks=64)
    assert llm.model_info.quantization == "compressed-tensors"
    held, count = linear_weight_bytes(llm)
    bits = 4 if folder.name.startswith("w4") else 8
    assert held <= count * (bits / 8) * 1.3  # packed integers plus their scales, not float32
    # bfloat16 activations in the int kernels on a random model with large weights: measured up to
    # 0.31 nat from transformers' float32 (the dequantized path above matches it exactly); zero points
    # add their bfloat16 rounding (zero = -zp * scale, up to 8 scales): measured 0.51
    bound = 0.75 if "zero-points" in folder.name else 0.5
    assert_quantized_tracks_hf(llm, hf_model_loader(reference), PROMPTS, bound)


@pytest.mark.parametrize("change", [{"quant_method": "bitsandbytes"}, {"format": "float-quantized"}])
def test_other_schemes_fail_naming_the_supported(checkpoint, tmp_path, change):
    folder = tmp_path / "other"
    shutil.copytree(checkpoint[0], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantizationError, match="pack-quantized.*int-quantized"):
        LLM(model=str(folder), num_kv_blocks=16)
