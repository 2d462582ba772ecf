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
            cache[key] = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
        return cache[key]

    return load
