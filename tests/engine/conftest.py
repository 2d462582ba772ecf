"""Fixtures for engine tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def hf_model_loader():
    cache = {}

    def load(path):
        from transformers import AutoModelForCausalLM

        key = str(path)
        if key not in cache:
            # Eager attention: the one HF path with Gemma's soft caps (SDPA has none).
            cache[key] = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
        return cache[key]

    return load
