"""Our top-level `kernels` package must not be mistaken for Hugging Face's `kernels` distribution.

transformers (utils/import_utils.py: is_kernels_available) asks importlib.util.find_spec("kernels")
-- which finds *our* package -- and then looks for a version: importlib.metadata.version("kernels"),
then the distributions that packages_distributions() maps "kernels" to -- our `prefixserve`
distribution, whose top_level.txt lists `kernels` (editable and regular installs alike). So it
reads prefixserve's version and calls hub kernels "available" iff that version lies in
[KERNELS_MIN_VERSION, KERNELS_MAX_VERSION) (0.18.2 <= v < 0.19.0 for transformers 5.23). It does
not today (prefixserve is 0.1.0). If it ever did, `import transformers`' model code would run
`from kernels import LayerRepository, ...` against our package and fail with ImportError. These
tests run in a clean interpreter with our packages imported first and pin that down.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

PRELUDE = textwrap.dedent(
    """
    import importlib.metadata, importlib.util, pathlib, sys
    import kernels, engine, prefix_cache  # ours, imported first
    assert pathlib.Path(kernels.__file__).parent.parent == pathlib.Path({root!r}), kernels.__file__
    import torch
    from transformers.utils import import_utils
    exists, version = import_utils._is_package_available("kernels", return_version=True)
    available = import_utils.is_kernels_available()
    print(f"find_spec(kernels)={{exists}} version_seen={{version}} is_kernels_available={{available}}")
    assert available is False, (
        f"transformers believes Hugging Face `kernels` {{version}} is installed: our `kernels` package "
        f"(prefixserve {{importlib.metadata.version('prefixserve')}}) is within "
        f"[{{import_utils.KERNELS_MIN_VERSION}}, {{import_utils.KERNELS_MAX_VERSION}})"
    )
    """
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_clean(body: str, timeout: float = 300) -> str:
    code = PRELUDE.format(root=ROOT) + textwrap.dedent(body)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-6000:]}"
    return result.stdout


def test_tiny_random_llama_loads_with_our_kernels_imported(tmp_path):
    out = run_clean(
        f"""
        from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
        LlamaForCausalLM(config).save_pretrained({str(tmp_path)!r})
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
        with torch.no_grad():
            logits = model(torch.tensor([[1, 2, 3, 4]])).logits
        assert logits.shape == (1, 4, 256) and torch.isfinite(logits).all()
        print("tiny ok")
        """
    )
    assert "tiny ok" in out


@pytest.mark.real_model
def test_gguf_loads_with_our_kernels_imported():
    from engine.models import resolve as R

    gguf = R._builtin_gguf(R.BUILTIN_MODELS[R.DEFAULT_MODEL])
    out = run_clean(
        f"""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        path = pathlib.Path({str(gguf)!r})
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        ids = tok("The capital of France is", return_tensors="pt").input_ids
        with torch.no_grad():
            logits = model(ids).logits
        assert logits.shape == (1, ids.shape[1], 49152) and torch.isfinite(logits).all()
        print("gguf ok")
        """
    )
    assert "gguf ok" in out
